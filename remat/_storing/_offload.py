"""Offload: kept values copied to host memory in forward and back to their device in backward.

See NOTE [offloading kept values]. The programs call `to_host`, `start_reload`, `finish_reload` and
`reload_now`, as the storage `_storage.HOST`'s functions (NOTE [kinds of storage]).
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import warnings
import weakref

import torch

from .._torch import functorch_active, is_functorch_wrapped

__all__ = [
    "CPU_COPIES",
    "PREFETCH",
    "Reload",
    "finish_reload",
    "limit_pinned_memory",
    "pinned_bytes_in_use",
    "reload_now",
    "start_reload",
    "to_host",
]

# NOTE [offloading kept values]
# A call the policy OFFLOADs is kept as a SAVEd one is, but in host memory. The
# forward program copies each of its kept outputs to the host right after the
# call makes it (`to_host`), so the device tensor is freed at its last use in
# forward; the Function returns and saves the host copy, which is what a
# user's `saved_tensors_hooks` see. The backward program starts copying it back
# (`start_reload`) `PREFETCH` reloads ahead of the gradient formula that first
# reads it, in the order backward reads them, and waits for it
# (`finish_reload`) just before that formula.
#
# On CUDA the copies run on one side stream per device, and the host never
# waits for the device:
# - `to_host`: the side stream waits for the compute stream (the value is
#   made), copies into pinned memory, and the device tensor is marked as used
#   by the side stream (`record_stream`), so that the allocator does not reuse
#   its memory before the copy ends;
# - `start_reload`: a device buffer is allocated on the compute stream; the
#   side stream waits for the compute stream (the buffer's earlier users),
#   copies into it and records an event;
# - `finish_reload`: the compute stream waits for that event.
# Offloads and reloads share the side stream, so a reload never reads a host
# buffer before the offload that fills it has ended. Pinned buffers come from
# torch's caching host allocator, which keeps freed pinned blocks for the next
# steps (a pool); `limit_pinned_memory` caps the pinned bytes offloaded values
# hold at once, and past the cap a value goes to pageable memory, whose copies
# make the host wait.
#
# Everywhere else the copies are plain `to()` calls: for tensors of other
# devices and under torch.func transforms (whose wrapped tensors have no
# streams to follow). A CPU tensor is its own host copy: nothing is copied,
# unless `CPU_COPIES` asks for real copies, so that tests on any machine
# follow the same bookkeeping (the device copy freed, the host copy saved).

PREFETCH = 2  # reloads in flight ahead of the one backward waits for

_HOST = torch.device("cpu")


@dataclasses.dataclass
class _Limits:
    max_pinned_bytes: int | None = None
    pinned_bytes: int = 0
    warned: bool = False


_limits = _Limits()
_lock = threading.Lock()
_side_streams: dict[torch.device, torch.cuda.Stream] = {}

# Whether CPU tensors are copied for real: set only by `remat.testing.offloading_on_cpu()`, for the
# context (thread) that enters it; nothing in the library sets it.
CPU_COPIES: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_offload_cpu_copies", default=False)


def limit_pinned_memory(max_bytes: int | None) -> int | None:
    """Cap the pinned host memory that offloaded values hold at once; returns the previous cap.

    Offloaded values are copied into pinned (page-locked) host memory, which the device
    copies to and from without the host waiting. Pinned memory cannot be swapped out, so
    taking too much of it starves the rest of the machine: past `max_bytes`, further values
    go to ordinary pageable memory, whose copies make the host wait for them (remat warns
    once). Pinned blocks freed after backward are kept by torch's caching host allocator and
    reused by the next step's offloads. `None` (the default) sets no cap.

    Args:
        max_bytes: the most pinned bytes held by offloaded values at once, or None.

    >>> import remat
    >>> previous = remat.limit_pinned_memory(8 * 2**30)
    >>> remat.limit_pinned_memory(previous)
    8589934592
    """
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
        raise ValueError(f"remat.limit_pinned_memory: expected a number of bytes >= 0 or None, got {max_bytes!r}.")
    with _lock:
        previous, _limits.max_pinned_bytes, _limits.warned = _limits.max_pinned_bytes, max_bytes, False
    return previous


def pinned_bytes_in_use() -> int:
    """Pinned host bytes offloaded values hold now."""
    return _limits.pinned_bytes


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`, started now (see NOTE [offloading kept values])."""
    if tensor.device.type == "cpu":
        return tensor.clone() if CPU_COPIES.get() else tensor
    if tensor.device.type != "cuda" or _wrapped(tensor):
        return tensor.to(_HOST)
    nbytes = tensor.numel() * tensor.element_size()
    pinned = _take_pinned(nbytes)
    host = torch.empty_like(tensor, device=_HOST, pin_memory=pinned)
    if not pinned:
        return host.copy_(tensor)
    weakref.finalize(host.untyped_storage(), _give_back_pinned, nbytes)  # when the host copy is freed
    compute, side = torch.cuda.current_stream(tensor.device), _side_stream(tensor.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        host.copy_(tensor, non_blocking=True)
    tensor.record_stream(side)
    return host


@dataclasses.dataclass(frozen=True)
class Reload:
    """A copy back to the device, started; `finish_reload` waits for it."""

    tensor: torch.Tensor
    done: torch.cuda.Event | None


def start_reload(host: torch.Tensor, device: torch.device) -> Reload:
    """Start copying `host` back to `device` (see NOTE [offloading kept values])."""
    if device.type == "cpu":
        return Reload(host.clone() if CPU_COPIES.get() else host, None)
    if device.type != "cuda" or _wrapped(host) or not host.is_pinned():
        return Reload(host.to(device), None)
    buffer = torch.empty_like(host, device=device)  # on the compute stream, which frees it after use
    compute, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        buffer.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    return Reload(buffer, done)


def finish_reload(reload: Reload) -> torch.Tensor:
    """The reloaded tensor, once the compute stream may read it."""
    if reload.done is not None:
        torch.cuda.current_stream(reload.tensor.device).wait_event(reload.done)
    return reload.tensor


def reload_now(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, differentiably (the pure forward: see NOTE [differentiating the forward again])."""
    if device.type == "cpu":
        return host
    if device.type == "cuda" and not _wrapped(host) and host.is_pinned():
        # The offload that filled `host` ran on the side stream: wait for it there, not on the host.
        torch.cuda.current_stream(device).wait_stream(_side_stream(device))
        return host.to(device, non_blocking=True)  # the caching host allocator keeps `host` until it is read
    return host.to(device)


def _wrapped(tensor: torch.Tensor) -> bool:
    return functorch_active() and is_functorch_wrapped(tensor)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    with _lock:
        stream = _side_streams.get(device)
        if stream is None:
            stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def _take_pinned(nbytes: int) -> bool:
    """Whether `nbytes` more pinned bytes fit under the cap (and if so, count them)."""
    with _lock:
        cap = _limits.max_pinned_bytes
        if cap is None or _limits.pinned_bytes + nbytes <= cap:
            _limits.pinned_bytes += nbytes
            return True
        warn, _limits.warned = not _limits.warned, True
    if warn:
        warnings.warn(
            f"remat: offloaded values hold {_limits.pinned_bytes:,} pinned bytes, and {nbytes:,} more would pass "
            f"the cap of {cap:,} set by remat.limit_pinned_memory; they go to pageable memory, whose copies make "
            "the host wait. Raise the cap, or offload fewer calls.",
            stacklevel=2,
        )
    return False


def _give_back_pinned(nbytes: int) -> None:
    with _lock:
        _limits.pinned_bytes -= nbytes
