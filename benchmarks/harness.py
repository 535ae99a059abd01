"""Run a suite: every workload under every method, interleaved repeats, results to JSON, markdown, PNG."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from . import heap as heap_module
from . import measure, render
from .methods import METHODS
from .workloads import SUITES, Workload

DEFAULT_OUT = Path(__file__).parent / "results"
CALL_OVERHEAD_ITERATIONS = {"smoke": 200, "cpu": 2000, "cuda": 2000}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str = "cpu", heap: str = heap_module.DEFAULT) -> dict[str, Any]:
    """Where and with what a benchmark's numbers were taken: every benchmark records this."""
    device = torch.device(device)
    return {
        "device": str(device),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "remat": _version("remat"),
        "torch_remat": _version("torch-remat"),
        "transformers": _version("transformers"),
        "heap": heap,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def describe(env: dict[str, Any]) -> str:
    """`environment(...)` in the one line a benchmark's markdown opens with."""
    return (
        f"{env['date']}; torch {env['torch']} ({env['torch_threads']} thread(s)), remat {env['remat']}; "
        f"{env['gpu'] or env['cpu']}; {env['platform']}; heap: {env['heap']}"
    )


def _run_workload(
    workload: Workload, device: torch.device, repeats: int, log: Callable[[str], None], started: float
) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    wrapped: dict[str, list[measure.Unit]] = {}
    for method in METHODS:
        row: dict[str, Any] = {
            "method": method.name,
            "description": method.describe(workload),
            "is_remat": method.is_remat,
        }
        rows[method.name] = row
        reason = method.skip(workload)
        if reason is not None:
            row["skipped"] = reason
            log(f"[{time.perf_counter() - started:7.1f} s] {workload.name} / {method.name}: skipped ({reason})")
            continue
        units = [method.wrap(unit, workload) for unit in workload.units]
        # The first call traces (remat); the second is cached and warms the allocator.
        row["first_forward_s"], row["first_call_s"] = measure.forward_and_step_seconds(workload, units, device)
        row["second_forward_s"], row["second_call_s"] = measure.forward_and_step_seconds(workload, units, device)
        row["saved_bytes"] = measure.saved_bytes(workload, units)
        row["live_bytes"], row["peak_bytes"] = measure.memory(workload, units, device)
        wrapped[method.name] = units

    samples: dict[str, list[float]] = {name: [] for name in wrapped}
    # Interleaved, so that machine noise hits every method alike, in a new order each round: a step's
    # time depends on the heap the step before it left (the page faults of fresh buffers cost the MLP
    # 6% of its step), so no method may always follow the same one.
    order, shuffle = list(wrapped), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for name in order:
            samples[name].append(measure.step_seconds(workload, wrapped[name], device))
    eager = statistics.median(samples["eager"])
    for name, times in samples.items():
        row = rows[name]
        row["times_s"] = times
        row["median_s"] = statistics.median(times)
        row["ratio_to_eager"] = row["median_s"] / eager
        # NOTE [trace time]: remat traces in the forward, so the trace time is the first call's forward
        # minus the cached call's forward right after it. First step minus the median step came out
        # negative on a loaded machine: whole-step times drift by more than a trace costs, while a
        # forward is shorter and adjacent calls see about the same load.
        row["trace_s"] = row["first_forward_s"] - row["second_forward_s"] if row["is_remat"] else None
        log(
            f"[{time.perf_counter() - started:7.1f} s] {workload.name} / {name}: "
            f"{row['median_s'] * 1e3:.1f} ms ({row['ratio_to_eager']:.2f}x eager), "
            f"live {row['live_bytes'] / 2**20:.2f} MiB, peak {row['peak_bytes'] / 2**20:.2f} MiB"
        )
    return list(rows.values())


def run(
    suite: str,
    device: str = "cpu",
    repeats: int = 5,
    out: str | os.PathLike[str] = DEFAULT_OUT,
    log: Callable[[str], None] = print,
    threads: int | None = None,
    heap: str = heap_module.DEFAULT,
) -> Path:
    """Run `suite` on `device`; write `<suite>-<device>.json`, `.md` and `.png` under `out`.

    `threads` sets `torch.set_num_threads` for the run (restored after); on a machine where other
    jobs hold cores, fewer threads than cores avoids OpenMP threads waiting on a busy core. `heap`
    describes the C heap the process runs on (`heap.keep_freed_memory` returns it), for the record.
    Returns the path of the JSON file.
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(suite, device, repeats, Path(out), log, heap)
    finally:
        torch.set_num_threads(previous_threads)


def _run(suite: str, device: str, repeats: int, out_dir: Path, log: Callable[[str], None], heap: str) -> Path:
    if suite not in SUITES:
        raise ValueError(f"benchmarks: unknown suite {suite!r}; expected one of {sorted(SUITES)}")
    if repeats < 1:
        raise ValueError(f"benchmarks: --repeats must be at least 1, got {repeats}")
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("benchmarks: --device cuda, but torch.cuda.is_available() is False")
    started = time.perf_counter()
    result: dict[str, Any] = {
        "suite": suite,
        "device": device,
        "repeats": repeats,
        **environment(torch_device, heap),
    }
    log(f"suite {suite} on {device}: torch {result['torch']}, {result['torch_threads']} threads, {result['cpu']}")

    # First, because it also pays the one-time costs (imports, the first make_fx) before any workload.
    result["call_overhead_us"] = measure.call_overhead_us(torch_device, CALL_OVERHEAD_ITERATIONS[suite])
    log(
        f"[{time.perf_counter() - started:7.1f} s] cached call of x.sin() on 4 floats: "
        + ", ".join(f"{name} {us:.1f} us" for name, us in result["call_overhead_us"].items())
    )

    result["workloads"] = []
    for build in SUITES[suite]:
        torch.manual_seed(0)
        workload = build(torch_device)
        log(f"[{time.perf_counter() - started:7.1f} s] {workload.name}: {workload.description}")
        rows = _run_workload(workload, torch_device, repeats, log, started)
        result["workloads"].append({"name": workload.name, "description": workload.description, "methods": rows})
        del workload
    result["total_s"] = time.perf_counter() - started

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{suite}-{device}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    for line in render.write(json_path):
        log(line)
    log(f"[{time.perf_counter() - started:7.1f} s] wrote {json_path}")
    return json_path
