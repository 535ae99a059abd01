"""The budget planner against torch.compile's memory-budget partitioner, on GPT-2-style stacks.

    python -m benchmarks.planner [--layers 1 4 12] [--out benchmarks/results/planner-cpu.json]

For each stack depth and each budget (a fraction of what `save_everything` keeps), it records:

- remat's fast planner (`budget(fraction=f)`) and exact planner (`budget(fraction=f, exact=True)`):
  replay FLOPs (`plan.cost`), bytes kept (`plan.saved_bytes`, confirmed by `remat.report`), solve
  time (`plan.seconds`, each on a fresh `remat.trace`, so no cached plan), and the fast planner's
  gap to the exact optimum;
- torch.compile's min-cut partitioner with `torch._functorch.config.activation_memory_budget` at the
  same fraction (an `aot_eager_decomp_partition`-style backend that records the partitioned graphs):
  the bytes its forward saves for backward, and the FLOPs its backward spends recomputing forward ops;
- remat's exact planner given torch.compile's saved bytes as its budget, counted the same way.

It writes the results as JSON and a markdown table, and the Pareto curve of one block as a PNG.
Timings are wall clock on whatever machine runs it; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

import remat
from remat.costs import estimate_flops

from . import aot_graphs
from .harness import describe, environment
from .workloads import matmul_attention_stack, stack_input

DEFAULT_LAYERS = (1, 4, 12)
DEFAULT_FRACTIONS = (0.10, 0.25, 0.50, 0.75)
RESULTS = Path(__file__).parent / "results"
DOCS = Path(__file__).parent.parent / "docs"

# The CPU attention kernels torch's FLOP counter has no formula for (remat counts them like the
# CUDA ones); this stack spells attention out, so these only matter for other models.
_MATMUL_ALIASES = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_attention_math,
}


# --- FLOP counting shared by both sides -----------------------------------------------------------
#
# Two counts. "All ops" is `remat.costs.estimate_flops`, the count remat's planner minimizes
# (torch's formulas for matmul-like ops, one FLOP per output element otherwise). "Matmul" keeps
# only the ops torch's FLOP counter has a formula for (here addmm, mm, bmm), which is what
# `torch.utils.flop_counter.FlopCounterMode` counts. torch.compile's graph is decomposed
# (GELU into eight pointwise ops, LayerNorm into its parts), so its all-ops count of the same
# recomputation is larger than remat's; the matmul count is the like-for-like one and the
# targets use it.


def is_matmul(op: Any) -> bool:
    """Whether torch's FLOP counter has a formula for `op` (the ops `FlopCounterMode` counts)."""
    return op in _MATMUL_ALIASES or getattr(op, "overloadpacket", None) in flop_registry


def _node_flops(node: torch.fx.Node) -> int:
    def value(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    return estimate_flops(node.target, args, kwargs, node.meta.get("val"))  # type: ignore[arg-type]


# --- remat ----------------------------------------------------------------------------------------


def remat_point(model: nn.Module, x: torch.Tensor, policy: Any) -> dict[str, Any]:
    """Solve `policy` on a fresh trace of `model`, and confirm its bytes with `remat.report`."""
    plan = policy.solve(remat.trace(model, x))
    report = remat.report(model, x, policy=policy)
    matmul_flops = sum(report.trace[c].flops for c in report.replayed_calls if is_matmul(report.trace[c].op))
    return {
        "flops": plan.cost,
        "saved_bytes": plan.saved_bytes,
        "seconds": plan.seconds,
        "lower_bound": plan.lower_bound,
        "reported_gap": plan.gap,
        "report_saved_bytes": report.saved_bytes,
        "report_flops": report.recompute_flops,
        "matmul_flops": matmul_flops,
        "replayed_calls": len(report.replayed_calls),
    }


# --- torch.compile --------------------------------------------------------------------------------


def _compiled_graphs(model: nn.Module, x: torch.Tensor, partition_fn: Callable[..., Any], budget: float) -> Any:
    """Compile model's forward and backward afresh under `activation_memory_budget=budget`."""
    import torch._dynamo
    import torch._functorch.config

    graphs: dict[str, torch.fx.GraphModule] = {}
    torch._dynamo.reset()  # no graph reused from an earlier budget
    with (
        torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False),
        torch._dynamo.config.patch(cache_size_limit=64),
        aot_graphs.expected_compile_warnings(),
    ):
        compiled = torch.compile(model, backend=aot_graphs.recording_backend(partition_fn, graphs))
        compiled(x.detach().requires_grad_(True)).sum().backward()
    torch._dynamo.reset()
    return graphs["forward"], graphs["backward"]


def compile_point(model: nn.Module, x: torch.Tensor, fraction: float, forward_names: set[str]) -> dict[str, Any]:
    """What torch.compile's partitioner saves and recomputes at `activation_memory_budget=fraction`.

    Saved: the backward graph's inputs other than the tangents are the forward's saved values
    (the forward graph's outputs beyond the user outputs); graph inputs among them (parameters,
    `x`) are excluded, as remat excludes inputs. Bytes are `numel * element_size` of each value's
    `meta["val"]`. Recomputed: backward-graph nodes that are forward nodes (`forward_names`, the
    node names of the forward graph under the default, save-everything partition; names come from
    the one joint graph, so a forward name in backward is a recomputation), views excluded.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    started = time.perf_counter()
    forward, backward = _compiled_graphs(model, x, partition, fraction)
    seconds = time.perf_counter() - started
    forward_nodes = {node.name: node for node in forward.graph.nodes}
    saved_bytes = 0
    saved_values = 0
    for node in backward.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        source = forward_nodes[node.name]
        value = source.meta.get("val")
        if source.op == "placeholder" or not isinstance(value, torch.Tensor):
            continue
        saved_bytes += value.numel() * value.element_size()
        saved_values += 1
    recomputed = [
        node
        for node in backward.graph.nodes
        if node.op == "call_function" and node.name in forward_names and not aot_graphs.is_view(node)
    ]
    return {
        "flops": sum(_node_flops(node) for node in recomputed),
        "matmul_flops": sum(_node_flops(node) for node in recomputed if is_matmul(node.target)),
        "saved_bytes": saved_bytes,
        "saved_values": saved_values,
        "recomputed_ops": len(recomputed),
        "recomputed_matmuls": sorted(node.name for node in recomputed if is_matmul(node.target)),
        "compile_seconds": seconds,
    }


def forward_node_names(model: nn.Module, x: torch.Tensor) -> set[str]:
    """Names of the forward nodes of the joint graph: the forward graph of the default partition."""
    from torch._functorch.partitioners import default_partition

    forward, _ = _compiled_graphs(model, x, default_partition, 1.0)
    return {node.name for node in forward.graph.nodes if node.op == "call_function"}


# --- the run --------------------------------------------------------------------------------------


def run_layers(
    layers: int, fractions: Sequence[float], *, d: int, heads: int, seq: int, batch: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Every budget on one stack depth."""
    model = matmul_attention_stack(layers, d, heads)
    x = stack_input(batch, seq, d)
    everything = remat.report(model, x, policy=remat.policies.save_everything).saved_bytes
    calls = len(remat.trace(model, x))
    log(f"{layers} layer(s): {calls} calls, save_everything keeps {everything:,} bytes")
    compile_error = None
    forward_names: set[str] = set()
    try:
        forward_names = forward_node_names(model, x)
    except Exception as error:  # recorded, and the remat columns still run
        compile_error = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"
        log(f"  torch.compile failed: {type(error).__name__}: {error}")
    points = []
    for fraction in fractions:
        fast = remat_point(model, x, remat.policies.budget(fraction=fraction))
        exact = remat_point(model, x, remat.policies.budget(fraction=fraction, exact=True))
        gap = (fast["flops"] - exact["flops"]) / exact["flops"] if exact["flops"] else float(fast["flops"] > 0)
        point: dict[str, Any] = {
            "fraction": fraction,
            "budget_bytes": math.floor(fraction * everything),
            "remat_fast": fast,
            "remat_exact": exact,
            "fast_gap": gap,
        }
        log(
            f"  {fraction:.0%}: fast {fast['flops']:,.0f} FLOPs {fast['saved_bytes']:,} B {fast['seconds']:.3f} s; "
            f"exact {exact['flops']:,.0f} FLOPs {exact['saved_bytes']:,} B {exact['seconds']:.3f} s; gap {gap:.2%}"
        )
        if compile_error is None:
            try:
                compiled = compile_point(model, x, fraction, forward_names)
            except Exception as error:
                point["torch_compile"] = {"error": f"{type(error).__name__}: {error}"}
                log(f"  torch.compile failed: {type(error).__name__}: {error}")
            else:
                point["torch_compile"] = compiled
                point["remat_at_compile_bytes"] = _remat_at(model, x, compiled["saved_bytes"])
                log(
                    f"  {fraction:.0%}: torch.compile {compiled['flops']:,} FLOPs "
                    f"({compiled['matmul_flops']:,} matmul) {compiled['saved_bytes']:,} B; "
                    f"remat exact within those bytes: {_describe(point['remat_at_compile_bytes'])}"
                )
        else:
            point["torch_compile"] = {"error": compile_error}
        points.append(point)
    return {"layers": layers, "calls": calls, "save_everything_bytes": everything, "points": points}


def _remat_at(model: nn.Module, x: torch.Tensor, max_bytes: int) -> dict[str, Any]:
    try:
        return remat_point(model, x, remat.policies.budget(max_bytes=max_bytes, exact=True))
    except ValueError as error:  # below what any decisions keep
        return {"error": str(error)}


def _describe(point: dict[str, Any]) -> str:
    if "error" in point:
        return "infeasible"
    return f"{point['flops']:,.0f} FLOPs ({point['matmul_flops']:,} matmul) {point['saved_bytes']:,} B"


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The four targets, each with PASS/MISS and the numbers behind it."""
    points = [p for run in result["runs"] for p in run["points"]]
    largest = max(result["runs"], key=lambda run: run["layers"])
    worst_gap = max(p["fast_gap"] for p in points)
    fast_seconds = max(p["remat_fast"]["seconds"] for p in largest["points"])
    exact_seconds = max(p["remat_exact"]["seconds"] for p in largest["points"])
    compared = [p for p in points if "error" not in p.get("torch_compile", {"error": ""})]
    losses = [
        f"{run['layers']} layers at {p['fraction']:.0%}"
        for run in result["runs"]
        for p in run["points"]
        if p in compared
        and (
            "error" in p["remat_at_compile_bytes"]
            or p["remat_at_compile_bytes"]["matmul_flops"] > p["torch_compile"]["matmul_flops"]
        )
    ]
    where = f"the {largest['layers']}-layer trace ({largest['calls']} calls)"
    rows = [
        {
            "target": "fast planner within 2% of the exact optimum on every point",
            "pass": worst_gap <= 0.02,
            "detail": f"worst gap {worst_gap:.2%}",
        },
        {
            "target": f"fast solve under 1 s on {where}",
            "pass": fast_seconds < 1.0,
            "detail": f"slowest {fast_seconds:.3f} s",
        },
        {
            "target": f"exact solve under 60 s on {where}",
            "pass": exact_seconds < 60.0,
            "detail": f"slowest {exact_seconds:.3f} s",
        },
    ]
    if compared:
        rows.append(
            {
                "target": "remat (exact, within torch.compile's saved bytes) replays no more matmul FLOPs than "
                "torch.compile",
                "pass": not losses,
                "detail": f"{len(compared) - len(losses)}/{len(compared)} points"
                + (f"; misses: {', '.join(losses)}" if losses else ""),
            }
        )
    else:
        rows.append({"target": "remat vs torch.compile", "pass": False, "detail": "torch.compile did not run"})
    if largest["layers"] < 12:
        for row in rows[1:3]:
            row["detail"] += " (no 12-layer run: measured on the largest)"
    return rows


def render(result: dict[str, Any]) -> str:
    """The markdown table and the targets."""
    lines = [
        "# Budget planner vs torch.compile's memory budget",
        "",
        f"{describe(result)}. "
        f"GPT-2-style blocks d={result['config']['d']}, {result['config']['heads']} heads, "
        f"T={result['config']['seq']}, B={result['config']['batch']}, float32.",
        "",
        "Budget: fraction of what `save_everything` keeps (remat) and `activation_memory_budget` (torch.compile). "
        "FLOPs are replay FLOPs: remat's `plan.cost` (all ops), and matmul-only (`mm`/`addmm`/`bmm`) for the "
        "comparison with torch.compile, whose graph is decomposed. Bytes exclude inputs and parameters. "
        "Times are solve times on a shared CPU.",
        "",
        "| layers | budget | fast FLOPs | fast bytes | fast s | exact FLOPs | exact bytes | exact s | fast gap "
        "| torch.compile FLOPs (matmul) | torch.compile bytes | remat exact at torch.compile bytes: FLOPs (matmul) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        for p in run["points"]:
            fast, exact, compiled = p["remat_fast"], p["remat_exact"], p.get("torch_compile", {})
            if "error" in compiled:
                compile_cells = "error | error | —"
            else:
                at = p["remat_at_compile_bytes"]
                at_cell = "infeasible" if "error" in at else f"{at['flops']:,.0f} ({at['matmul_flops']:,})"
                compile_cells = f"{compiled['flops']:,} ({compiled['matmul_flops']:,}) | {compiled['saved_bytes']:,} | "
                compile_cells += at_cell
            lines.append(
                f"| {run['layers']} | {p['fraction']:.0%} | {fast['flops']:,.0f} | {fast['saved_bytes']:,} | "
                f"{fast['seconds']:.3f} | {exact['flops']:,.0f} | {exact['saved_bytes']:,} | {exact['seconds']:.3f} | "
                f"{p['fast_gap']:.2%} | {compile_cells} |"
            )
    lines += ["", "## Targets", ""]
    for row in result["targets"]:
        lines.append(f"- **{'PASS' if row['pass'] else 'MISS'}**: {row['target']} ({row['detail']})")
    errors = [
        f"- {run['layers']} layers at {p['fraction']:.0%}: {p['torch_compile']['error'].splitlines()[0]}"
        for run in result["runs"]
        for p in run["points"]
        if "error" in p.get("torch_compile", {})
    ]
    if errors:
        lines += ["", "## torch.compile errors", "", *errors]
    return "\n".join(lines) + "\n"


def plot_block(path: Path, *, d: int, heads: int, seq: int, batch: int) -> None:
    """The Pareto curve of one block, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = remat.pareto(matmul_attention_stack(1, d, heads)[0], stack_input(batch, seq, d)).plot()
    figure.axes[0].set_title(f"one GPT-2 block, d={d}, T={seq}, B={batch}, float32")
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _warm_up() -> None:
    """Import highspy and run HiGHS once, so the first timed solve does not pay for it."""
    policy: Any = remat.policies.budget(fraction=0.5)  # typed `Policy`, which does not declare `.solve`
    policy.solve(remat.trace(lambda t: t.sin().sin().sum(), torch.ones(4)))


def main(argv: Sequence[str] | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark, write the JSON and markdown (and the plot), and return the result."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS))
    parser.add_argument("--fractions", type=float, nargs="+", default=list(DEFAULT_FRACTIONS))
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "planner-cpu.json")
    parser.add_argument("--plot", type=Path, default=DOCS / "pareto-gpt2-block.png", help="'' for no plot")
    args = parser.parse_args(argv)
    config = {"d": args.d, "heads": args.heads, "seq": args.seq, "batch": args.batch}
    _warm_up()
    result: dict[str, Any] = {
        **environment(),
        "config": {**config, "layers": args.layers, "fractions": args.fractions},
        "runs": [run_layers(layers, args.fractions, **config, log=log) for layers in args.layers],
    }
    result["targets"] = targets(result)
    for row in result["targets"]:
        log(f"{'PASS' if row['pass'] else 'MISS'}: {row['target']} ({row['detail']})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    log(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    if str(args.plot) not in ("", "."):
        plot_block(args.plot, **config)
        log(f"wrote {args.plot}")
    return result


if __name__ == "__main__":
    main()
