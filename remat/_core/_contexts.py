"""The ambient state around tracing and running: autocast, saved-tensor hooks, torch.func."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .._torch import (
    functorch_active,
    inplace_requires_grad_allowed,
    preserved_dispatch_keys,
    saved_tensors_hooks_tracing,
    temporarily_clear_interpreter_stack,
)

__all__ = [
    "AUTOCAST_DEVICES",
    "autocast_cache_enabled",
    "autocast_disabled",
    "cast_once",
    "dispatch_keys_put_back",
    "outside_functorch",
    "without_saved_tensors_hooks",
]

# The device types whose autocast state a trace depends on (and programs run with turned off).
AUTOCAST_DEVICES = ("cpu", "cuda")


# NOTE [autocast's cache of casts]
# Within a `torch.autocast` region, autocast casts a float32 tensor that is a
# leaf requiring grad (a parameter, an input leaf; not a view) to the region's
# low precision once, and hands every later op of the region that cast again,
# until the outermost region exits. A weight used twice in a region (a layer
# applied twice, a recurrent cell's steps, tied weights) has one low-precision
# copy, whose gradient sums both uses in low precision before it is cast back.
# make_fx turns the cache off while tracing (so that casts made before the trace
# do not become its constants); remat turns it back on, as the caller had it,
# while `fn` runs in the trace. The trace's inputs mirror the real tensors'
# leaf-ness (fake tensors keep it), so autocast caches exactly the casts it
# caches in eager. A trace in which autocast was on somewhere fits only calls
# whose arguments autocast would cache alike (`cast_once`, checked by the cache
# entry); others need no such check. Eager's cache is not shared across the
# checkpoint's boundary: a weight used both inside a checkpointed function and
# outside it (or in two of its calls) within one region is cast in each, and
# the same tensor passed as two arguments is cast for each (docs/torch-func.md).
def cast_once(tensor: torch.Tensor) -> bool:
    """Whether autocast casts `tensor` once per region (a float32 leaf that requires grad, not a view):
    NOTE [autocast's cache of casts]."""
    return tensor.dtype == torch.float32 and tensor.requires_grad and tensor.is_leaf and not tensor._is_view()


@contextmanager
def autocast_cache_enabled(enabled: bool) -> Iterator[None]:
    """Autocast's cache of casts on (or off) for the duration: NOTE [autocast's cache of casts]."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


# NOTE [autocast is traced, not re-applied]
# Under autocast, the forward of `fn` is traced with autocast on, so the casts
# it inserts become explicit `_to_copy` calls of the graph; the backward is
# traced with autocast off, as the autograd engine runs eager backward formulas.
# The programs then run with autocast off: their casts are already in them.
class autocast_disabled:
    """Turn autocast off on every device type where it is on, for the duration."""

    __slots__ = ("enabled",)

    def __enter__(self) -> None:
        self.enabled = [device for device in AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]
        for device in self.enabled:
            torch.set_autocast_enabled(device, False)

    def __exit__(self, *exc: object) -> None:
        for device in self.enabled:
            torch.set_autocast_enabled(device, True)


# NOTE [a failed trace leaves the thread's dispatch keys as it found them]
# A trace that fails inside torch's own error handling can leave behind, in the
# frames of its exception, a context of torch's that changes this thread's
# dispatch keys when those frames are freed: on torch 2.13, `torch.quantile`
# traced for forward mode fails in the meta kernel of `lerp_`, whose error
# message prints a dual tensor, which raises from C++; once the exception is
# collected, the Python dispatch key is left excluded, and every later trace in
# the thread fails ("you set no_dispatch() before calling into this function"),
# whatever it traces. So a failed trace frees its exception's frames at once
# (their local variables: the traceback still names every line) inside a guard
# that then puts the thread's dispatch keys back as they were before the trace.
@contextmanager
def dispatch_keys_put_back() -> Iterator[None]:
    """Put this thread's dispatch keys back as they are now, however the body ends; if it raises,
    after freeing what the frames of the exception (and of its causes) hold."""
    with preserved_dispatch_keys():
        try:
            yield
        except BaseException as error:
            seen: set[int] = set()
            cause: BaseException | None = error
            while cause is not None and id(cause) not in seen:
                seen.add(id(cause))
                traceback.clear_frames(cause.__traceback__)
                cause = cause.__cause__ or cause.__context__
            raise


@contextmanager
def without_saved_tensors_hooks() -> Iterator[None]:
    """Keep a user's `saved_tensors_hooks` (e.g. CPU offloading) away from the fake
    tensors that tracing's autograd saves; they apply to what the programs keep."""
    with saved_tensors_hooks_tracing():
        yield


# NOTE [tracing under torch.func]
# Inside a torch.func transform (grad, vmap, jvp, ...) the arguments are
# wrapped tensors whose metadata is the logical, per-example one. Tracing runs
# with the functorch interpreter stack set aside, on fake tensors made from that
# logical metadata: the graph is the same one traced outside any transform (so
# the two share a cache entry), and the autograd.Function that runs it takes
# part in the transforms through its `backward`, `jvp` and generated vmap rule.
# The same Function runs at every level of a nested transform, so the graph
# differentiates every floating input that requires grad at any level.
@contextmanager
def outside_functorch() -> Iterator[None]:
    if not functorch_active():
        yield
        return
    # Tracing marks fake inputs as requiring grad.
    with inplace_requires_grad_allowed(), temporarily_clear_interpreter_stack():
        yield
