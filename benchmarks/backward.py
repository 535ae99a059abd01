"""First-order backward time of a checkpointed GPT-2 block, for two checkouts of remat side by side.

    python -m benchmarks backward OTHER_CHECKOUT [--rounds 10] [--repeats 60] [--threads 1]
                                  [--out benchmarks/results/backward-cpu.json]

What a change to how backward runs costs a plain `.backward()`: each round runs this checkout's remat
and then `OTHER_CHECKOUT`'s (a path to another clone or `git worktree` of the repository, say the commit
before the change), each in a fresh process, on `tests/models.GPT2Block` (d=32, batch 8 x 128 tokens,
`save_nothing`, one CPU thread), and takes the median of `--repeats` backward passes after a warm-up.
The rounds alternate so that both meet the same noise; the report gives the median and the minimum over
rounds of each, and their ratios. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent.parent

# Run in a fresh process with `sys.argv[1]` (a checkout) first on the path: prints the median in ms.
_ONE_RUN = """
import statistics, sys, time
checkout, repeats, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path[:0] = [checkout, checkout + "/tests"]
import torch
import models
import remat
assert remat.__file__.startswith(checkout), remat.__file__
torch.set_num_threads(threads)
torch.manual_seed(0)
block = models.GPT2Block(attention="sdpa")
x = models.gpt2_input(batch=8, seq=128)
checkpointed = remat.checkpoint(block, policy=remat.policies.save_nothing)
for _ in range(5):
    checkpointed(x).sum().backward()
times = []
for _ in range(repeats):
    loss = checkpointed(x).sum()
    start = time.perf_counter()
    loss.backward()
    times.append(time.perf_counter() - start)
print(statistics.median(times) * 1e3)
"""


def _median_ms(checkout: pathlib.Path, repeats: int, threads: int) -> float:
    run = [sys.executable, "-c", _ONE_RUN, str(checkout), str(repeats), str(threads)]
    return float(subprocess.run(run, check=True, capture_output=True, text=True).stdout.split()[-1])


def _commit(checkout: pathlib.Path) -> str:
    run = ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"]
    return subprocess.run(run, check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks backward", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("other", type=pathlib.Path, help="another checkout of remat (the baseline)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"this": [], "other": []}
    for _ in range(args.rounds):
        times["this"].append(_median_ms(HERE, args.repeats, args.threads))
        times["other"].append(_median_ms(args.other.resolve(), args.repeats, args.threads))
    summary = {
        name: {"median_ms": statistics.median(values), "min_ms": min(values), "rounds": values}
        for name, values in times.items()
    }
    summary["commits"] = {"this": _commit(HERE), "other": _commit(args.other)}
    summary["ratio"] = {
        "median": summary["this"]["median_ms"] / summary["other"]["median_ms"],
        "min": summary["this"]["min_ms"] / summary["other"]["min_ms"],
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
