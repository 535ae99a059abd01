"""Offloading kept values to host memory, side by side with its peers, on a GPT-2-style stack.

    python -m benchmarks.offload [--device cpu|cuda] [--layers 4] [--d 512] [--heads 8] [--batch 2]
                                 [--seq 1024] [--repeats 10] [--threads N] [--keep-freed-memory]

Rows, each a training step (forward, backward) of the same stack on the same input, every block
checkpointed with `remat.checkpoint_modules` for the remat rows:

- eager: no checkpointing; `save_on_cpu`: eager under `torch.autograd.graph.save_on_cpu` (every
  saved tensor to host memory, pinned on CUDA);
- remat `save_nothing`, `dots_saveable` (kept on the device), `offload_dots` (the same values in host
  memory), `budget(offload)`: `budget(fraction=0.25, cost="roofline:h100", offload=True)`, the
  planner choosing per value among device, host and replay;
- torch.compile offload (CUDA): inductor with `torch._functorch.config.enable_activation_offloading`
  on a separate stream, the matmul outputs marked for offloading by a joint-graph pass.

Columns: device bytes kept after forward and the peak of the step (CUDA: the allocator's counters;
CPU: remat's predictions, since host and device memory are one there), host bytes and the predicted
copy time each way over an H100's host link (remat's report), the median step time, and the largest
difference of any gradient from eager's (remat's offloaded rows must equal their SAVE twin bit for
bit, which is checked). On CPU the copies are elided (a CPU tensor is its own host copy), so the CPU
times say nothing about overlap: they show the bookkeeping costs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat import policies

from .harness import describe, environment
from .heap import DEFAULT, keep_freed_memory
from .workloads import MatmulAttentionBlock, matmul_attention_stack, stack_input

RESULTS = Path(__file__).parent / "results"

POLICIES: dict[str, Any] = {
    "remat save_nothing": policies.save_nothing,
    "remat dots_saveable": policies.dots_saveable,
    "remat offload_dots": policies.offload_dots,
    "remat budget(offload)": policies.budget(fraction=0.25, cost="roofline:h100", offload=True),
}
TWINS = {"remat offload_dots": "remat dots_saveable"}  # offloaded row -> the row keeping the same on the device


@dataclasses.dataclass(frozen=True)
class Method:
    """A model to step, and the context its forward and backward run in."""

    model: nn.Module | Callable[[torch.Tensor], torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def step(self, x: torch.Tensor, measure: torch.device | None = None) -> tuple[list[torch.Tensor], int | None]:
        """One training step: the parameters' gradients, and (on a CUDA `measure`) the bytes the
        forward leaves alive."""
        parameters = list(_parameters(self.model))
        for p in parameters:
            p.grad = None
        alive = None
        with self.context():
            before = _allocated(measure)
            loss = self.model(x).square().mean()
            if measure is not None:
                alive = _allocated(measure) - before
            loss.backward()
        return [p.grad for p in parameters], alive  # type: ignore[misc]


def _parameters(model: Any) -> Iterator[nn.Parameter]:
    return (model._orig_mod if hasattr(model, "_orig_mod") else model).parameters()


def _allocated(device: torch.device | None) -> int:
    if device is None:
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


@contextlib.contextmanager
def _compile_offloading() -> Iterator[None]:
    """torch.compile's own activation offloading, with the matmul outputs marked for it (nothing in
    torch marks nodes by itself: see NOTE [offload inside torch.compile] in remat/_running/_dynamo.py)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def mark(graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function" and node.target in matmuls:
                node.meta["should_offload"] = True

    settings = {"enable_activation_offloading": True, "activation_offload_separate_stream": True}
    with functorch_config.patch(settings), inductor_config.patch({"joint_custom_pre_pass": mark}):
        yield


def methods(model: nn.Module, device: torch.device) -> dict[str, Method]:
    pin = device.type == "cuda"
    found = {
        "eager": Method(model),
        "save_on_cpu": Method(model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)),
    }
    for name, policy in POLICIES.items():
        checkpointed = copy.deepcopy(model)
        remat.checkpoint_modules(checkpointed, MatmulAttentionBlock, policy=policy)
        found[name] = Method(checkpointed)
    if device.type == "cuda":
        found["torch.compile offload"] = Method(torch.compile(copy.deepcopy(model)), _compile_offloading)
    return found


def predicted(block: nn.Module, x: torch.Tensor, policy: Any, layers: int) -> dict[str, float]:
    report = remat.report(block, x, policy=policy)
    return {
        "device_bytes": layers * report.saved_bytes,
        "host_bytes": layers * report.offloaded_bytes,
        "copy_seconds_h100": layers * report.copy_seconds("h100"),
        "block_peak_bytes": report.peak_bytes,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = matmul_attention_stack(args.layers, args.d, args.heads).to(device)
    x = stack_input(args.batch, args.seq, args.d).to(device).detach().requires_grad_()
    steps = methods(model, device)
    measure = device if device.type == "cuda" else None
    rows: dict[str, dict[str, Any]] = {name: {"method": name} for name in steps}
    grads: dict[str, list[torch.Tensor]] = {}
    for name, method in steps.items():  # warm-up (traces, compiles), memory, the gradients compared
        try:
            method.step(x)
            if measure is not None:
                torch.cuda.reset_peak_memory_stats(device)
            before = _allocated(measure)
            step_grads, alive = method.step(x, measure)
            grads[name] = [g.clone() for g in step_grads]
        except Exception as error:  # a peer that does not run here says why in its row
            rows[name]["skipped"] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            continue
        if measure is not None:
            rows[name]["alive_after_forward_bytes"] = alive
            rows[name]["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    running = [name for name in steps if name in grads]
    for name in running:
        differences = (float((a - b).abs().max()) for a, b in zip(grads[name], grads["eager"], strict=True))
        rows[name]["max_grad_difference"] = max(differences)
    for offloaded, twin in TWINS.items():
        if offloaded in grads and twin in grads:
            same = all(torch.equal(a, b) for a, b in zip(grads[offloaded], grads[twin], strict=True))
            rows[offloaded]["bit_identical_to"] = twin if same else None
    block = model[0]
    for name, policy in POLICIES.items():
        rows[name].update(predicted(block, x, policy, args.layers))
    times: dict[str, list[float]] = {name: [] for name in running}
    order, shuffle = list(running), random.Random(0).shuffle  # no method always follows the same one
    for _ in range(args.repeats):
        shuffle(order)
        for name in order:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            steps[name].step(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - started)
    for name in running:
        rows[name]["times_s"] = times[name]
        rows[name]["step_s"] = statistics.median(times[name])
    return {
        "config": vars(args) | {"out": str(args.out)},
        **environment(device, args.heap),
        "rows": list(rows.values()),
    }


_BYTES = ("device_bytes", "host_bytes", "alive_after_forward_bytes", "peak_bytes")


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]
    mib = 2**20
    eager = next(row for row in results["rows"] if row["method"] == "eager")
    lines = [
        f"# Offload: {config['layers']} GPT-2 blocks on `{results['device']}`",
        "",
        f"d={config['d']}, {config['heads']} heads, batch {config['batch']} x {config['seq']} tokens, float32; "
        f"{describe(results)}; median of {config['repeats']} "
        "interleaved steps (a new order each round). Device and host bytes of the remat rows are remat's report (per block, times the "
        "blocks); alive and peak are measured on CUDA only.",
        "",
        "| method | device kept (MiB) | host kept (MiB) | copy each way, h100 (ms) | alive after fwd (MiB) | peak (MiB) | step (ms) | vs eager | max grad diff | |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in results["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['method']} | skipped: {row['skipped']} | | | | | | | | |")
            continue
        size = {key: f"{row[key] / mib:.2f}" if key in row else "—" for key in _BYTES}
        copy_ms = f"{row['copy_seconds_h100'] * 1e3:.2f}" if "copy_seconds_h100" in row else "—"
        note = f"bit-identical to {row['bit_identical_to']}" if row.get("bit_identical_to") else ""
        lines.append(
            f"| {row['method']} | {size['device_bytes']} | {size['host_bytes']} | {copy_ms} | "
            f"{size['alive_after_forward_bytes']} | {size['peak_bytes']} | {row['step_s'] * 1e3:.1f} | "
            f"{row['step_s'] / eager['step_s']:.3f}x | {row['max_grad_difference']:.1e} | {note} |"
        )
    if results["device"] == "cpu":
        lines += [
            "",
            "On the CPU a tensor is its own host copy: the offload rows copy nothing and keep their values "
            "where SAVE does, so their times show what the bookkeeping costs, not the overlap of copies.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--keep-freed-memory", action="store_true", help="CPU: glibc keeps freed memory")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/offload-<device>.json")
    args = parser.parse_args(argv)
    args.heap = keep_freed_memory() if args.keep_freed_memory else DEFAULT
    args.out = args.out or RESULTS / f"offload-{args.device}.json"
    results = run(args)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
