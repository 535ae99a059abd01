"""Forward and backward time and page faults, step by step, for two methods in alternating order.

    python -m benchmarks.faults --workload gpt2-12l --methods eager "remat save_everything" [--steps 8]

On CPU a step's time moves with the minor page faults it takes: glibc gives freed memory back to the
OS when the top of its heap is free, and the next buffers written there fault again, page by page. This
prints every step (after two warm-up steps of each method) with its forward and backward seconds and
faults, then the medians, so that a gap between two methods can be split into faults and the rest.
Run it with `--keep-freed-memory` (glibc keeps every byte it gets; benchmarks/heap.py) to see the
methods without faults.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from .measure import Unit
from .profile import WORKLOADS, add_run_arguments, minor_faults, workload_and_units
from .workloads import Workload


def timed_step(workload: Workload, units: list[Unit]) -> tuple[float, float, int, int]:
    """Forward seconds, backward seconds, forward faults, backward faults of one step."""
    workload.zero_grad()
    faults, started = minor_faults(), time.perf_counter()
    loss = workload.step(units)
    forward_faults, forward_s = minor_faults() - faults, time.perf_counter() - started
    faults, started = minor_faults(), time.perf_counter()
    loss.backward()
    return forward_s, time.perf_counter() - started, forward_faults, minor_faults() - faults


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2-12l")
    parser.add_argument("--methods", nargs=2, default=["eager", "remat save_everything"])
    parser.add_argument("--steps", type=int, default=8, help="steps of each method")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    workload, units = workload_and_units(args)
    for name in args.methods:
        for _ in range(2):
            timed_step(workload, units[name])
    steps: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name in args.methods}
    print(f"{workload.name}, {args.threads} thread(s), heap: {args.heap}")
    print("each step's forward and backward, ms (minor page faults)")
    for round_ in range(args.steps):
        for name in args.methods if round_ % 2 == 0 else args.methods[::-1]:
            step = timed_step(workload, units[name])
            steps[name].append(step)
            print(
                f"{name:<24} forward {step[0] * 1e3:8.1f} ({step[2]:6d})   backward {step[1] * 1e3:8.1f} ({step[3]:6d})"
            )
    print("medians:")
    for name, rows in steps.items():
        total = statistics.median(forward + backward for forward, backward, _, _ in rows)
        faults = statistics.median(forward + backward for _, _, forward, backward in rows)
        print(f"{name:<24} step {total * 1e3:8.1f} ms, {faults:8.0f} faults")


if __name__ == "__main__":
    main()
