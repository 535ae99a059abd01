"""remat and torch.compile, side by side on GPT-2-style stacks, in one process.

    python -m benchmarks.compiled [--layers 4 12] [--d 256] [--heads 4] [--batch 4] [--seq 256]
                                  [--policy dots_saveable] [--repeats 15] [--threads N]
                                  [--out benchmarks/results/compiled-cpu.json]

For each depth in `--layers`, rows, each a training step (forward, backward) of the same stack on
the same input:

- eager: no checkpointing; torch.compile: inductor, default partitioner, no checkpointing;
- remat eager: every block checkpointed with `--policy` (`checkpoint_modules`);
- remat compile=True: the same, with each block's forward and backward programs compiled by inductor;
- torch.compile(remat): the remat-checkpointed stack compiled whole by inductor (remat's decisions
  as the partitioner's recompute tags);
- torch.compile budget=b: inductor with `torch._functorch.config.activation_memory_budget=b`,
  with b the largest (found by bisection) at which the compiled step keeps no more than remat;
- torch.compile(remat budget per block): every block checkpointed with
  `remat.policies.budget(max_bytes=m)`, the stack compiled whole, with m the bytes the compiler's
  own partitioner keeps at b, less what the stack keeps outside its blocks, shared equally between
  the blocks (`per_block_budget`), and lowered by any excess until the stack keeps no more;
- torch.compile(remat budget whole stack): the stack checkpointed as one function with
  `budget(max_bytes=...)` at the compiler's bytes (the planner sees the graph the partitioner sees).

Saved bytes are those a `saved_tensors_hooks` sees kept for backward (distinct storages, the
parameters and the input excluded). Every variant is built, compiled and warmed up first; then
`--repeats` rounds each time one step of every variant in turn (interleaved, so that a slow spell of
a shared machine falls on all of them), and a row's time is its median step. Nothing here asserts on
timings.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import operator
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat

from . import aot_graphs
from .harness import describe, environment
from .workloads import MatmulAttentionBlock, matmul_attention_stack, stack_input

RESULTS = Path(__file__).parent / "results"
BISECTION_STEPS = 6
FIT_ATTEMPTS = 3  # tries to fit remat's budget rows within the compiler's bytes

Step = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Variant:
    """One row: a model and the step that runs it, with what was measured while building it."""

    method: str
    model: nn.Module
    step: Step
    first_step_s: float
    saved_bytes: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: list[float] = dataclasses.field(default_factory=list)


def kept_tensors(step: Step, x: torch.Tensor, model: nn.Module) -> tuple[int, dict[str, int]]:
    """Bytes of the distinct storages autograd keeps for backward during one step, and what they are.

    As `benchmarks.measure.kept_for_backward`, the input and the parameters left out, with each
    storage also described by the first tensor saved on it (`float32[16,256,256]`), counted.
    """
    excluded = {t.untyped_storage().data_ptr() for t in [x, *model.parameters()]}
    storages: dict[int, tuple[int, str]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded and storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = (storage.nbytes(), _describe(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(x)
    loss.sum().backward()  # the saved tensors were alive until here: their addresses were distinct
    model.zero_grad(set_to_none=True)
    described = collections.Counter(description for _, description in storages.values())
    return sum(nbytes for nbytes, _ in storages.values()), dict(sorted(described.items()))


def one_step(step: Step, x: torch.Tensor, model: nn.Module) -> float:
    """Seconds of one forward and backward (the gradients are then dropped, outside the timing)."""
    started = time.perf_counter()
    step(x).sum().backward()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def inductor(budget: float | None = None, **settings: Any) -> Callable[..., Any]:
    """A backend of its own for one compiled variant: inductor, at `activation_memory_budget=budget`
    and with any other `torch._functorch.config` `settings`.

    Dynamo keeps one cache per code object, and with `inline_inbuilt_nn_modules` two instances of
    the same model share compiled code: a stack compiled at one budget would run, uncompiled
    again, the graph compiled for another. Its cache entries are guarded on the backend, so a
    distinct backend per variant keeps each variant on its own graph. The autograd cache is off
    so that no partition is reused across budgets.
    """
    from torch._inductor.compile_fx import compile_fx

    settings = {"enable_autograd_cache": False, **settings}
    if budget is not None:
        settings["activation_memory_budget"] = budget

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        with torch._functorch.config.patch(**settings):
            return compile_fx(graph, example_inputs)

    return backend


def partitioned(model: nn.Module, x: torch.Tensor, budget: float | None = None) -> dict[str, dict[str, int]]:
    """What the compiler's partitioner keeps for backward and what backward recomputes, read off its graphs.

    The model is compiled once more with a backend that records the partitioned forward and backward
    graphs (inductor's decompositions and partitioner, nothing compiled): `kept` counts the forward
    values the backward graph takes in (`aten.bmm.default float32[16,256,256]`), `recomputed` the
    backward-graph nodes that are forward nodes (views left out), by op.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: dict[str, torch.fx.GraphModule] = {}
    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    settings: dict[str, Any] = {"enable_autograd_cache": False}
    if budget is not None:
        settings["activation_memory_budget"] = budget
    with torch._functorch.config.patch(**settings), aot_graphs.expected_compile_warnings():
        torch.compile(model, backend=aot_graphs.recording_backend(partition, graphs))(x).sum().backward()
    model.zero_grad(set_to_none=True)
    forward = {node.name: node for node in graphs["forward"].graph.nodes}
    kept: collections.Counter[str] = collections.Counter()
    recomputed: collections.Counter[str] = collections.Counter()
    for node in graphs["backward"].graph.nodes:
        if node.op == "placeholder" and not node.name.startswith("tangents"):
            source = forward[node.name]
            value = source.meta.get("val")
            if source.op != "placeholder" and isinstance(value, torch.Tensor):
                kept[f"{_op(source)} {_describe(value)}"] += 1
        elif node.op == "call_function" and node.name in forward and not aot_graphs.is_view(node):
            recomputed[_op(node)] += 1
    return {"kept": dict(sorted(kept.items())), "recomputed": dict(sorted(recomputed.items()))}


def _op(node: torch.fx.Node) -> str:
    if node.target is operator.getitem:
        producer = node.args[0]
        return f"{producer.target}[{node.args[1]}]" if isinstance(producer, torch.fx.Node) else "getitem"
    return str(node.target)


def _describe(tensor: torch.Tensor) -> str:
    """`float32[16,256,256]`."""
    return f"{str(tensor.dtype).removeprefix('torch.')}[{','.join(str(size) for size in tensor.shape)}]"


def per_block_budget(total_bytes: int, outside_bytes: int, layers: int) -> int:
    """The `budget(max_bytes=...)` of each of `layers` checkpointed blocks for a stack keeping `total_bytes`.

    remat's budget is per checkpointed block and counts what `remat.report` counts: the bytes the
    block keeps, its inputs excluded (they are always available). The benchmark's `saved_bytes`
    counts the whole stack, its input excluded, so it also sees each later block's input kept for
    that block's backward (its first LayerNorm reads it), and inside a compiled model any value the
    compiler merged across blocks. `outside_bytes` is that difference, measured on a checkpointed
    stack (its saved bytes less `layers` times its block's `remat.report` bytes), and the blocks
    share what is left.

    >>> per_block_budget(total_bytes=54 * 2**20, outside_bytes=3 * 2**20, layers=4) / 2**20
    12.75
    """
    return (total_bytes - outside_bytes) // layers


def decisions(fn: Any, x: torch.Tensor, policy: Any) -> dict[str, list[str]]:
    """The calls whose outputs `policy` keeps for `fn(x)`, and those backward replays, as `index name`."""
    report = remat.report(fn, x, policy=policy)
    return {
        "kept": [f"{row.call.index} {row.call.name}" for row in report.rows if row.saved],
        "replayed": [f"{row.call.index} {row.call.name}" for row in report.rows if row.replayed],
    }


def run_layers(args: argparse.Namespace, layers: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every row of one stack depth."""
    torch.manual_seed(0)
    x = stack_input(args.batch, args.seq, args.d)
    policy = getattr(remat.policies, args.policy)

    def fresh() -> nn.Module:
        return matmul_attention_stack(layers, args.d, args.heads)

    variants: list[Variant] = []

    def build(method: str, model: nn.Module, step: Step, **extra: Any) -> Variant:
        started = time.perf_counter()
        step(x).sum().backward()
        first = time.perf_counter() - started
        model.zero_grad(set_to_none=True)
        one_step(step, x, model)  # a second warm-up step
        kept, tensors = kept_tensors(step, x, model)
        variant = Variant(method, model, step, first, kept, {**extra, "kept_tensors": tensors})
        log(f"  {method:<60} saved {kept / 2**20:8.2f} MiB  first step {first:6.1f} s")
        return variant

    def compiled(model: nn.Module, budget: float | None = None, **settings: Any) -> Step:
        return torch.compile(model, backend=inductor(budget, **settings))  # type: ignore[return-value]

    def checkpointed(model: nn.Module, block_policy: Any, compile: Any = False) -> nn.Module:
        return remat.checkpoint_modules(model, MatmulAttentionBlock, policy=block_policy, compile=compile)

    model = fresh()
    variants.append(build("eager", model, model))
    model = fresh()
    variants.append(build("torch.compile", model, compiled(model)))
    model = checkpointed(fresh(), policy)
    variants.append(build(f"remat {args.policy}", model, model))
    target = variants[-1].saved_bytes
    model = checkpointed(fresh(), policy, compile=True)
    variants.append(build(f"remat {args.policy}, compile=True", model, model))
    model = checkpointed(fresh(), policy)
    variants.append(build(f"torch.compile(remat {args.policy})", model, compiled(model)))
    block = matmul_attention_stack(1, args.d, args.heads)[0]  # one block, to plan and report on
    outside = variants[-1].saved_bytes - layers * remat.report(block, x, policy=policy).saved_bytes

    # The largest activation_memory_budget whose compiled step keeps no more than remat does.
    low, high, best = 0.0, 1.0, None
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        model = fresh()
        kept, _ = kept_tensors(compiled(model, middle), x, model)
        log(f"    activation_memory_budget={middle:.4f}: saved {kept / 2**20:.2f} MiB (remat {target / 2**20:.2f} MiB)")
        if kept <= target:
            low, best = middle, middle
        else:
            high = middle
    if best is None:
        raise RuntimeError(f"no activation_memory_budget keeps at most {target} bytes")
    model = fresh()
    variants.append(
        build(f"torch.compile budget={best:.4f}", model, compiled(model, best), activation_memory_budget=best)
    )
    compiler = variants[-1]

    def fit(method: str, make: Callable[[int], tuple[Any, dict[str, Any]]], budget_bytes: int, **extra: Any) -> Variant:
        """Build `make(budget_bytes)` compiled, lowering the budget until the stack keeps no more than the compiler."""
        for _ in range(FIT_ATTEMPTS):
            model, planned = make(budget_bytes)
            variant = build(method, model, compiled(model), max_bytes=budget_bytes, **extra, **planned)
            excess = variant.saved_bytes - compiler.saved_bytes
            if excess <= 0:
                break
            log(f"    {excess:,} bytes above the compiler's: lowering max_bytes from {budget_bytes:,}")
            budget_bytes -= excess
        return variant  # the last try, as it is: the table shows its bytes

    def per_block(max_bytes: int) -> tuple[Any, dict[str, Any]]:
        block_policy = remat.policies.budget(max_bytes=max_bytes)
        return checkpointed(fresh(), block_policy), {"block": decisions(block, x, block_policy)}

    def whole_stack(max_bytes: int) -> tuple[Any, dict[str, Any]]:
        stack_policy = remat.policies.budget(max_bytes=max_bytes)
        planned = decisions(fresh(), x, stack_policy)
        counts = {key: _count_ops(names) for key, names in planned.items()}
        return remat.checkpoint(fresh(), policy=stack_policy), {"stack": counts}

    block_budget = per_block_budget(compiler.saved_bytes, outside, layers)
    remat_budgets = [
        fit("torch.compile(remat budget per block)", per_block, block_budget, outside_bytes=outside),
        fit("torch.compile(remat budget whole stack)", whole_stack, compiler.saved_bytes),
    ]
    variants += remat_budgets

    log(f"  timing {len(variants)} variants, {args.repeats} interleaved rounds")
    for round_ in range(args.repeats):
        for i in range(len(variants)):
            variant = variants[(i + round_) % len(variants)]
            variant.seconds.append(one_step(variant.step, x, variant.model))
    for variant in variants:  # each variant still runs its own graph
        again, _ = kept_tensors(variant.step, x, variant.model)
        if again != variant.saved_bytes:
            raise RuntimeError(f"{variant.method}: kept {again} bytes after timing, {variant.saved_bytes} before")
    # Which values each keeps and recomputes, for the rows at the compiler's bytes (after the timing:
    # these are more compilations).
    compiler.extra["partition"] = partitioned(compiler.model, x, compiler.extra["activation_memory_budget"])
    for variant in remat_budgets:
        variant.extra["partition"] = partitioned(variant.model, x)

    rows = []
    eager_step = statistics.median(variants[0].seconds)
    compiler_step = statistics.median(compiler.seconds)
    for variant in variants:
        step = statistics.median(variant.seconds)
        rows.append(
            {
                "method": variant.method,
                "saved_bytes": variant.saved_bytes,
                "first_step_s": variant.first_step_s,
                "step_s": step,
                "times_s": variant.seconds,
                "time_vs_eager": step / eager_step,
                "time_vs_compiler_budget": step / compiler_step,
                **variant.extra,
            }
        )
        log(f"  {variant.method:<60} step {step * 1e3:8.1f} ms  {step / eager_step:.2f}x eager  "
            f"{step / compiler_step:.3f}x the compiler's budget")  # fmt: skip
    return {"layers": layers, "outside_bytes": outside, "rows": rows}


def _count_ops(names: list[str]) -> dict[str, int]:
    """How many of `names` (`index name`) each op accounts for."""
    return dict(collections.Counter(name.split(" ", 1)[1] for name in names))


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    # Every compilation cold (inductor's on-disk graph cache off), so that "first step" is a compile.
    with torch._dynamo.config.patch(recompile_limit=64), torch._inductor.config.patch(fx_graph_cache=False):
        for layers in args.layers:
            log(f"{layers} layers")
            torch._dynamo.reset()
            runs.append(run_layers(args, layers, log))
    return {
        **environment(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
    }


def markdown(results: dict[str, Any]) -> str:
    """Per depth: every row; the like-for-like comparison with the compiler's budget partitioner."""
    config = results["config"]
    lines = []
    for run_ in results["runs"]:
        rows = run_["rows"]
        lines += [
            f"## {run_['layers']} blocks",
            "",
            f"GPT-2-style stack: {run_['layers']} blocks, d={config['d']}, heads={config['heads']}, "
            f"batch {config['batch']} x {config['seq']} tokens, float32; {describe(results)}; "
            f"median of {config['repeats']} interleaved steps.",
            "",
            "| method | saved for backward (MiB) | step (ms) | time vs eager | first step (s) |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in rows:
            lines.append(
                f"| {row['method']} | {row['saved_bytes'] / 2**20:.2f} | {row['step_s'] * 1e3:.1f} | "
                f"{row['time_vs_eager']:.2f}x | {row['first_step_s']:.1f} |"
            )
        lines += [
            "",
            "At the compiler's bytes:",
            "",
            "| method | budget | saved for backward (MiB) | step (ms) | time vs the compiler's budget |",
            "|---|---|---:|---:|---:|",
        ]
        for row in rows:
            if "activation_memory_budget" in row:
                budget = f"activation_memory_budget={row['activation_memory_budget']:.4f}"
            elif "max_bytes" in row:
                per = " per block" if "block" in row else ""
                budget = f"max_bytes={row['max_bytes'] / 2**20:.2f} MiB{per}"
            else:
                continue
            lines.append(
                f"| {row['method']} | {budget} | {row['saved_bytes'] / 2**20:.2f} | {row['step_s'] * 1e3:.1f} | "
                f"{row['time_vs_compiler_budget']:.3f}x |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--policy", default="dots_saveable", help="a name in remat.policies")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS / "compiled-cpu.json")
    args = parser.parse_args(argv)
    if not hasattr(remat.policies, args.policy):
        parser.error(f"--policy {args.policy!r} is not a name in remat.policies")
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
