"""python -m benchmarks: the one entry point of every benchmark.

python -m benchmarks --suite cpu --device cpu --repeats 15 --threads 1 --keep-freed-memory
python -m benchmarks --suite smoke            # seconds; checks that the harness works
python -m benchmarks list                     # the other benchmarks, a line each
python -m benchmarks fit --small --repeats 1  # any of them: its name, then its own options (--help)

Without a name it runs a suite (every workload under every method) and writes its results (JSON, markdown,
PNG); `python -m benchmarks <name>` runs `benchmarks/<name>.py` as `python -m benchmarks.<name>` would.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .harness import DEFAULT_OUT, run
from .heap import DEFAULT, keep_freed_memory
from .workloads import SUITES

# name -> the module whose `main(argv)` runs it, in the order docs/benchmarks.md shows them
BENCHMARKS = {
    "fit": "benchmarks.fit",
    "gpu-step": "benchmarks.gpu_step",
    "workspaces": "benchmarks.workspaces",
    "planner": "benchmarks.planner",
    "compiled": "benchmarks.compiled",
    "offload": "benchmarks.offload",
    "fp8-scales": "benchmarks.fp8_scales",
    "lossy-training": "benchmarks.lossy_training",
    "compression": "benchmarks.compression",
    "fsdp": "benchmarks.fsdp",
    "startup": "benchmarks.startup",
    "models": "benchmarks.models",
    "torch-func": "benchmarks.transform_table",
    "faults": "benchmarks.faults",
    "profile": "benchmarks.profile",
    "backward": "benchmarks.backward",
    "second-order": "benchmarks.second_order",
    "render": "benchmarks.render",
}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "list":
        for name, module in BENCHMARKS.items():
            summary = (importlib.import_module(module).__doc__ or "").strip().splitlines()[0]
            print(f"{name:<12} {summary}")
        return
    if argv and argv[0] in BENCHMARKS:
        importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
        return
    _suite(argv)


def _suite(argv: Sequence[str]) -> None:
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
    main()
