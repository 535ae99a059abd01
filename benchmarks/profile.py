"""Where the time of a fwd+bwd step goes, per aten op, for two methods side by side.

    python -m benchmarks.profile --workload mlp --methods checkpoint "remat save_nothing" [--steps 5]

Runs each method's step under `torch.profiler` (after two warm-up steps) and prints, for the ops
that take the most self CPU time summed over both, the milliseconds per step and call counts of
each method: the profile behind a missed target in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from .measure import Unit
from .methods import METHODS
from .workloads import Workload, gpt2_block, mlp, resnet

WORKLOADS = {
    "mlp": lambda: mlp(torch.device("cpu"), width=1024, layers=4, batch=256),
    "block": lambda: gpt2_block(torch.device("cpu"), dim=768, heads=12, batch=4, length=128),
    "resnet": lambda: resnet(torch.device("cpu"), channels=64, blocks=8, batch=16, size=32),
}


def op_times(workload: Workload, units: list[Unit], steps: int) -> tuple[dict[str, float], dict[str, int]]:
    """Self CPU milliseconds per step, and calls per step, of each op over `steps` steps."""
    for _ in range(2):
        workload.zero_grad()
        workload.step(units).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            workload.zero_grad()
            workload.step(units).backward()
    times: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.key_averages():
        times[event.key] += event.self_cpu_time_total / 1e3 / steps
        counts[event.key] += event.count // steps
    return times, counts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--methods", nargs=2, default=["checkpoint", "remat save_nothing"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    workload = WORKLOADS[args.workload]()
    by_name = {method.name: method for method in METHODS}
    results = []
    for name in args.methods:
        units = [by_name[name].wrap(unit, workload) for unit in workload.units]
        results.append(op_times(workload, units, args.steps))
    (times_a, counts_a), (times_b, counts_b) = results
    ops = sorted(set(times_a) | set(times_b), key=lambda op: -(times_a.get(op, 0) + times_b.get(op, 0)))
    a, b = args.methods
    print(f"{workload.name}: self CPU ms per step (calls per step), {args.steps} steps, {args.threads} thread(s)")
    print(f"{'op':<48} {a:>22} {b:>22} {'difference':>11}")
    for op in ops[: args.top]:
        ta, tb = times_a.get(op, 0.0), times_b.get(op, 0.0)
        print(
            f"{op[:48]:<48} {ta:>14.2f} ({counts_a.get(op, 0):>5}) {tb:>14.2f} ({counts_b.get(op, 0):>5}) {tb - ta:>+11.2f}"
        )
    total_a, total_b = sum(times_a.values()), sum(times_b.values())
    print(f"{'total':<48} {total_a:>22.2f} {total_b:>22.2f} {total_b - total_a:>+11.2f}")


if __name__ == "__main__":
    main()
