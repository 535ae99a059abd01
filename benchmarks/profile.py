"""Where the time of a fwd+bwd step goes, per aten op, for two methods side by side.

    python -m benchmarks.profile --workload mlp --methods checkpoint "remat save_nothing" [--steps 5]

Runs each method's step under `torch.profiler` (after two warm-up steps) and prints, for the ops
that take the most self CPU time summed over both, the milliseconds per step and call counts of
each method, and the minor page faults per step: the profile behind a missed target in
docs/benchmarks.md. The methods run in the order A, B, B, A and each one's times are the mean of its
two runs: whichever runs second meets the heap the first left, and its fresh buffers can cost page
faults the first did not pay (docs/benchmarks.md, "Where remat misses a target").
"""

from __future__ import annotations

import argparse
import collections
import resource
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from .heap import DEFAULT, keep_freed_memory
from .measure import Unit
from .methods import METHODS
from .workloads import Workload, gpt2_block, gpt2_model, mlp, resnet

WORKLOADS = {
    "mlp": lambda: mlp(torch.device("cpu"), width=1024, layers=4, batch=256),
    "block": lambda: gpt2_block(torch.device("cpu"), dim=768, heads=12, batch=4, length=128),
    "resnet": lambda: resnet(torch.device("cpu"), channels=64, blocks=8, batch=16, size=32),
    "gpt2-12l": lambda: gpt2_model(torch.device("cpu"), dim=768, heads=12, layers=12, vocab=1024, batch=2, length=128),
}


def minor_faults() -> int:
    """Minor page faults this process has taken so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `workload_and_units` reads, beside `--workload` and `--methods`."""
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--keep-freed-memory", action="store_true", help="glibc keeps freed memory: no page faults (benchmarks/heap.py)"
    )


def workload_and_units(args: argparse.Namespace) -> tuple[Workload, dict[str, list[Unit]]]:
    """The workload `args.workload` (seeded) and, for each of `args.methods`, its units wrapped by that
    method, with torch on `args.threads` threads; `args.heap` is set to the heap in use."""
    args.heap = keep_freed_memory() if args.keep_freed_memory else DEFAULT
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    workload = WORKLOADS[args.workload]()
    by_name = {method.name: method for method in METHODS}
    return workload, {name: [by_name[name].wrap(unit, workload) for unit in workload.units] for name in args.methods}


def op_times(workload: Workload, units: list[Unit], steps: int) -> tuple[dict[str, float], dict[str, int], float]:
    """Self CPU milliseconds per step and calls per step of each op, and minor page faults per step,
    over `steps` steps."""
    for _ in range(2):
        workload.zero_grad()
        workload.step(units).backward()
    faults = minor_faults()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            workload.zero_grad()
            workload.step(units).backward()
    faults = minor_faults() - faults
    times: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.key_averages():
        times[event.key] += event.self_cpu_time_total / 1e3 / steps
        counts[event.key] += event.count // steps
    return times, counts, faults / steps


def _mean(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
    return {op: (first.get(op, 0.0) + second.get(op, 0.0)) / 2 for op in set(first) | set(second)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--methods", nargs=2, default=["checkpoint", "remat save_nothing"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    workload, units = workload_and_units(args)
    a, b = args.methods
    runs: dict[str, list[tuple[dict[str, float], dict[str, int], float]]] = {name: [] for name in args.methods}
    for name in (a, b, b, a):
        runs[name].append(op_times(workload, units[name], args.steps))
    (times_a, counts_a, faults_a), (times_b, counts_b, faults_b) = (
        (_mean(runs[name][0][0], runs[name][1][0]), runs[name][0][1], (runs[name][0][2] + runs[name][1][2]) / 2)
        for name in (a, b)
    )
    ops = sorted(set(times_a) | set(times_b), key=lambda op: -(times_a.get(op, 0) + times_b.get(op, 0)))
    print(
        f"{workload.name}: self CPU ms per step (calls per step), {args.steps} steps run in the order A B B A, "
        f"{args.threads} thread(s), heap: {args.heap}"
    )
    print(f"{'op':<48} {a:>22} {b:>22} {'difference':>11}")
    for op in ops[: args.top]:
        ta, tb = times_a.get(op, 0.0), times_b.get(op, 0.0)
        print(
            f"{op[:48]:<48} {ta:>14.2f} ({counts_a.get(op, 0):>5}) {tb:>14.2f} ({counts_b.get(op, 0):>5}) {tb - ta:>+11.2f}"
        )
    total_a, total_b = sum(times_a.values()), sum(times_b.values())
    print(f"{'total':<48} {total_a:>22.2f} {total_b:>22.2f} {total_b - total_a:>+11.2f}")
    print(f"{'minor page faults per step':<48} {faults_a:>22.0f} {faults_b:>22.0f} {faults_b - faults_a:>+11.0f}")


if __name__ == "__main__":
    main()
