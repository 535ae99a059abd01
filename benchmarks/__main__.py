"""python -m benchmarks: run a benchmark suite and write its results (JSON, markdown, PNG).

python -m benchmarks --suite cpu --device cpu --repeats 15 --threads 1 --keep-freed-memory
python -m benchmarks --suite smoke            # seconds; checks that the harness works
python -m benchmarks.render benchmarks/results/cpu-cpu.json   # re-render from the JSON
"""

from __future__ import annotations

import argparse
import sys

from .harness import DEFAULT_OUT, run
from .heap import DEFAULT, keep_freed_memory
from .workloads import SUITES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per method, interleaved")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="folder for <suite>-<device>.json/.md/.png")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="CPU: glibc keeps the memory it is given, so that no method's step pays page faults "
        "for a heap another trimmed (see benchmarks/heap.py)",
    )
    options = parser.parse_args(argv)
    heap_in_use = keep_freed_memory() if options.keep_freed_memory else DEFAULT
    run(
        options.suite,
        options.device,
        options.repeats,
        options.out,
        log=lambda line: print(line, flush=True),
        threads=options.threads,
        heap=heap_in_use,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
