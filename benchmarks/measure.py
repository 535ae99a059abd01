"""Measurements: bytes kept after forward, peak bytes of a training step, step time, call overhead.

See docs/benchmarks.md for what each number means and how it is taken.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.utils.checkpoint
from torch.distributed._tools.mem_tracker import MemTracker

import remat

from .workloads import Workload

Unit = Callable[[torch.Tensor], torch.Tensor]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _external(workload: Workload) -> list[torch.Tensor]:
    tensors = [*workload.model.parameters(), *workload.model.buffers(), workload.x]
    return tensors if workload.targets is None else [*tensors, workload.targets]


def saved_bytes(workload: Workload, units: list[Unit]) -> int:
    """Bytes of the distinct storages an outer `saved_tensors_hooks` sees during forward.

    Inputs, parameters and buffers are excluded: keeping them costs nothing new. Checkpointing
    methods that install their own saved-tensor hooks (torch.utils.checkpoint, SAC, torch_remat)
    hide what they keep from an outer hook (the innermost hook wins), so this figure is only
    comparable between remat and eager; `live_bytes` below is the one to compare across methods.
    """
    workload.zero_grad()
    return kept_for_backward(lambda: workload.step(units), _external(workload))


def kept_for_backward(forward: Callable[[], torch.Tensor], exclude: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `forward()` runs (then
    backpropagated from its result), other than those of `exclude`."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.sum().backward()  # the saved tensors were alive until here: their addresses were distinct
    return sum(storages.values())


def _tracked_total(tracker: MemTracker, device: torch.device) -> int:
    return int(tracker.get_tracker_snapshot("current")[device]["Total"])


def memory(workload: Workload, units: list[Unit], device: torch.device) -> tuple[int, int]:
    """(bytes live after forward, peak bytes during forward+backward), both above what was live before.

    "Live after forward" counts every tensor still alive once the loss is computed (activations
    kept for backward, the loss itself, and whatever a method keeps on the side, such as the
    inputs of each checkpointed unit). The peak includes the parameter gradients, which are the same
    for every method.

    CUDA: the caching allocator's own counters. CPU: `MemTracker` (torch.distributed._tools), a
    `TorchDispatchMode` that sees every tensor allocated and tracks storages through weak
    references; it is entered after the method's first calls, so that remat's tracing (which
    runs on fake tensors) happens outside it.
    """
    workload.zero_grad()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        loss = workload.step(units)
        synchronize(device)
        live = torch.cuda.memory_allocated(device) - before
        loss.backward()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del loss
        return live, peak
    tracker = MemTracker()
    tracker.track_external(*_external(workload))
    with tracker:
        before = _tracked_total(tracker, device)
        loss = workload.step(units)
        live = _tracked_total(tracker, device) - before
        loss.backward()
        del loss
    peak = int(tracker.get_tracker_snapshot("peak")[device]["Total"]) - before
    return live, peak


def step_seconds(workload: Workload, units: list[Unit], device: torch.device) -> float:
    """Seconds of one forward+backward (gradients cleared before, outside the timing)."""
    return forward_and_step_seconds(workload, units, device)[1]


def forward_and_step_seconds(workload: Workload, units: list[Unit], device: torch.device) -> tuple[float, float]:
    """Seconds of the forward, and of the forward+backward, of one step."""
    workload.zero_grad()
    synchronize(device)
    start = time.perf_counter()
    loss = workload.step(units)
    synchronize(device)
    forward = time.perf_counter() - start
    loss.backward()
    synchronize(device)
    return forward, time.perf_counter() - start


def call_overhead_us(device: torch.device, iterations: int) -> dict[str, float]:
    """Median microseconds of one cached forward call of `x.sin()` on 4 floats, per method."""

    def sin(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    tiny = torch.randn(4, device=device, requires_grad=True)
    callables: dict[str, Unit] = {
        "plain": sin,
        "remat": remat.checkpoint(sin),
        "checkpoint": lambda x: torch.utils.checkpoint.checkpoint(sin, x, use_reentrant=False),
    }
    samples: dict[str, list[float]] = {name: [] for name in callables}
    for fn in callables.values():
        fn(tiny)
    for _ in range(iterations):
        for name, fn in callables.items():  # interleaved
            synchronize(device)
            start = time.perf_counter()
            fn(tiny)
            synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}
