"""remat and torch.compile, side by side on one GPT-2-style stack, in one process.

    python -m benchmarks.compiled [--layers 4] [--d 256] [--heads 4] [--batch 4] [--seq 256]
                                  [--policy dots_saveable] [--repeats 5] [--threads N]
                                  [--out benchmarks/results/compiled-cpu.json]

Rows, each a training step (forward, backward) of the same stack on the same input:

- eager: no checkpointing; torch.compile: inductor, default partitioner, no checkpointing;
- remat eager: every block checkpointed with `--policy` (`checkpoint_modules`);
- remat compile=True: the same, with each block's forward and backward programs compiled by inductor;
- torch.compile(remat): the remat-checkpointed stack compiled whole by inductor (remat's decisions
  as the partitioner's recompute tags);
- torch.compile budget=b: inductor with `torch._functorch.config.activation_memory_budget=b`,
  with b the largest (found by bisection) at which the compiled step keeps no more than remat.

Saved bytes are those a `saved_tensors_hooks` sees kept for backward (distinct storages, the
parameters and the input excluded). Time is the median step over `--repeats` after two warm-up
steps (compilation excluded, reported separately). Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat

from .measure import kept_for_backward
from .planner import GPT2Block, gpt2_stack, stack_input

RESULTS = Path(__file__).parent / "results"
BISECTION_STEPS = 6


def saved_bytes(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, model: nn.Module) -> int:
    """Bytes of the distinct storages autograd keeps for backward during one step."""
    kept = kept_for_backward(lambda: step(x), [x, *model.parameters()])
    model.zero_grad(set_to_none=True)
    return kept


def timed(
    step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, model: nn.Module, repeats: int
) -> dict[str, float]:
    """First-step seconds (compilation included), then the median of `repeats` steps after warm-up."""
    started = time.perf_counter()
    step(x).sum().backward()
    first = time.perf_counter() - started
    step(x).sum().backward()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        step(x).sum().backward()
        seconds.append(time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return {"first_step_s": first, "step_s": statistics.median(seconds)}


def _policy(name: str) -> Any:
    return getattr(remat.policies, name)


def _checkpointed(model: nn.Module, policy: Any, compile: Any = False) -> nn.Module:
    return remat.checkpoint_modules(model, GPT2Block, policy=policy, compile=compile)


def _budget_step(model: nn.Module, budget: float) -> Callable[[torch.Tensor], torch.Tensor]:
    compiled = torch.compile(model)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
            return compiled(x)

    return step


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    x = stack_input(args.batch, args.seq, args.d)
    policy = _policy(args.policy)

    def fresh() -> nn.Module:
        return gpt2_stack(args.layers, args.d, args.heads)

    rows: list[dict[str, Any]] = []

    def measure(method: str, model: nn.Module, step: Callable[[torch.Tensor], torch.Tensor], **extra: Any) -> None:
        torch._dynamo.reset()
        timing = timed(step, x, model, args.repeats)
        row = {"method": method, "saved_bytes": saved_bytes(step, x, model), **timing, **extra}
        rows.append(row)
        log(f"{method:<28} saved {row['saved_bytes'] / 2**20:8.2f} MiB  step {row['step_s'] * 1e3:8.1f} ms  "
            f"first step {row['first_step_s']:6.1f} s")  # fmt: skip

    eager = fresh()
    measure("eager", eager, eager)
    compiled = fresh()
    measure("torch.compile", compiled, torch.compile(compiled))
    model = _checkpointed(fresh(), policy)
    measure(f"remat {args.policy}", model, model)
    target = rows[-1]["saved_bytes"]
    model = _checkpointed(fresh(), policy, compile=True)
    measure(f"remat {args.policy}, compile=True", model, model)
    model = _checkpointed(fresh(), policy)
    measure(f"torch.compile(remat {args.policy})", model, torch.compile(model))

    # The largest activation_memory_budget whose compiled step keeps no more than remat does.
    low, high, best = 0.0, 1.0, None
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        model = fresh()
        torch._dynamo.reset()
        kept = saved_bytes(_budget_step(model, middle), x, model)
        log(f"  activation_memory_budget={middle:.4f}: saved {kept / 2**20:.2f} MiB (remat {target / 2**20:.2f} MiB)")
        if kept <= target:
            low, best = middle, middle
        else:
            high = middle
    if best is not None:
        model = fresh()
        measure(f"torch.compile budget={best:.4f}", model, _budget_step(model, best), activation_memory_budget=best)

    eager_step = rows[0]["step_s"]
    for row in rows:
        row["time_vs_eager"] = row["step_s"] / eager_step
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]
    lines = [
        f"GPT-2-style stack: {config['layers']} blocks, d={config['d']}, heads={config['heads']}, "
        f"batch {config['batch']} x {config['seq']} tokens, float32, CPU, {results['threads']} threads, "
        f"torch {results['torch']}, {results['date']}.",
        "",
        "| method | saved for backward (MiB) | step (ms) | time vs eager | first step (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['method']} | {row['saved_bytes'] / 2**20:.2f} | {row['step_s'] * 1e3:.1f} | "
            f"{row['time_vs_eager']:.2f}x | {row['first_step_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--policy", default="dots_saveable", help="a name in remat.policies")
    parser.add_argument("--repeats", type=int, default=5)
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
