"""Cache keys and the bounded cache of traced signatures."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from .._memory._gpu import assumed_gpu
from .._torch import any_autocast_enabled, grad_dtype_override, is_functorch_wrapped, unwrap_level
from ._contexts import AUTOCAST_DEVICES

__all__ = ["CacheInfo", "LRUCache", "ambient_key", "requires_grad_at_any_level", "tensor_key"]

V = TypeVar("V")


class CacheInfo(NamedTuple):
    """Statistics of a checkpointed function's trace cache.

    `hits` and `misses` count calls; `traces` counts traces (a miss, or a hit
    whose closed-over tensors changed shape, dtype, device or requires_grad);
    `shared` counts misses served by the trace of an identical block instead
    (see `remat.checkpoint_modules`).

    >>> import torch, remat
    >>> f = remat.checkpoint(lambda x: x.sin().sum())
    >>> x = torch.ones(3, requires_grad=True)
    >>> _ = f(x), f(x), f(torch.ones(5, requires_grad=True))  # the third call has a new shape
    >>> f.cache_info()
    CacheInfo(hits=1, misses=2, traces=2, size=2, maxsize=64, shared=0)
    """

    hits: int
    misses: int
    traces: int
    size: int
    maxsize: int
    shared: int = 0


def tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Everything about a tensor but its values that can change a trace."""
    return (
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        requires_grad_at_any_level(tensor),
        tensor.layout,
        grad_dtype_override(tensor),
    )


def requires_grad_at_any_level(tensor: torch.Tensor) -> bool:
    """Whether `tensor` requires grad at this level or at any level of torch.func transforms
    below it: a checkpointed function's gradient formulas serve every level that runs it."""
    while not tensor.requires_grad:
        if not is_functorch_wrapped(tensor):
            return False
        tensor = unwrap_level(tensor)
    return True


class AmbientKey(NamedTuple):
    """State outside the arguments that changes a trace."""

    autocast: tuple[tuple[bool, torch.dtype | None], ...]  # (enabled, dtype if enabled) on CPU, then CUDA
    autocast_cache: bool  # (True where autocast is off: the cache only holds autocast's casts)
    training: tuple[bool, ...]  # the `training` flags of the modules found in the function
    gpu: Any  # the GPU assumed where there is none (`remat.assume_gpu`): it chooses CUDA kernels


class SignatureKey(NamedTuple):
    """What a `remat.Checkpointed` caches a trace under: everything tracing depends on but values."""

    static: Any  # the argument structure and non-tensor leaves (`FlatArgs.static_key()`)
    tensors: tuple[Any, ...]  # one `tensor_key` per tensor argument
    ambient: AmbientKey
    forward_mode: bool  # traced for forward-mode AD too


_AUTOCAST_OFF: tuple[tuple[bool, torch.dtype | None], ...] = tuple((False, None) for _ in AUTOCAST_DEVICES)


def ambient_key(modules: Sequence[torch.nn.Module]) -> AmbientKey:
    """State outside the arguments that changes a trace: autocast and `training` flags, the assumed GPU."""
    autocast, cache = _AUTOCAST_OFF, True  # the common case, asked in one call (this runs on every call)
    if any_autocast_enabled():
        autocast = tuple(
            (True, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else (False, None)
            for device in AUTOCAST_DEVICES
        )
        cache = torch.is_autocast_cache_enabled()
    return AmbientKey(autocast, cache, tuple(module.training for module in modules), assumed_gpu())


class LRUCache(Generic[V]):
    """A dict bounded to `maxsize` entries that drops the least recently used; safe to share
    between threads."""

    def __init__(self, maxsize: int):
        if not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"remat.checkpoint: `cache_size` must be a positive integer, but got {maxsize!r}.")
        self.maxsize = maxsize
        self._entries: collections.OrderedDict[Any, V] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.traces = self.shared = 0

    def get(self, key: Any) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
            else:
                self.hits += 1
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Any, entry: V, *, shared: bool = False) -> None:
        """Store `entry`, a new trace (or, with `shared`, another block's)."""
        with self._lock:
            if shared:
                self.shared += 1
            else:
                self.traces += 1
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def update(self, key: Any, change: Callable[[V], V]) -> None:
        """Replace the entry of `key`, if there is one, with `change(entry)` (not a new trace)."""
        with self._lock:
            if key in self._entries:
                self._entries[key] = change(self._entries[key])

    def items(self) -> list[tuple[Any, V]]:
        """The keys and entries, least recently used first (a copy)."""
        with self._lock:
            return list(self._entries.items())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = self.traces = self.shared = 0

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, self.traces, len(self._entries), self.maxsize, self.shared)
