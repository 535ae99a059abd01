"""A checkpointed function: each call routed (no grad, under torch.compile, nested, forward mode) or run
from its cache of traces, one per input signature, with the traces identical blocks share."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, cast

import optree
import torch

from .._core import _rng
from .._core._cache import CacheInfo, LRUCache, SignatureKey, ambient_key, tensor_key
from .._core._contexts import cast_once
from .._core._pytree import FlatArgs, flatten_args
from .._eager._capture import ModuleRoots, find_module_roots
from .._eager._specialize import ValuesChanged
from .._memory import _step
from .._partitioning._log import describe_signature, explain_retrace, log_trace, logger
from .._partitioning._value_graph import with_value_graph
from .._running._active_transforms import forward_mode_active, nested_forward_mode
from .._running._compiled import compile_options
from .._running._dynamo import call_under_dynamo, register
from .._running._executable import Executable
from .._running._execute import run
from .._torch import functorch_active, grad_transform_active
from .._tracing._errors import TraceError
from .._tracing._joint import JointGraph, joint_graph_of
from .._tracing._nesting import is_tracing, nested_checkpoint
from ._build import build_executable
from ._sharing import SharedTraces, rebase, recording_attribute_reads, structure_of

__all__ = ["DEFAULT_CACHE_SIZE", "BindsAsMethod", "Checkpointed", "DelegatesToCheckpointed", "traced"]

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_CACHE_SIZE = 64
_VARIANTS_PER_KEY = 4


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One traced signature, valid while its guard holds."""

    joint: JointGraph
    executable: Executable
    guard: tuple[Any, ...]  # see _guard

    def fetch_if_valid(self, flat: FlatArgs) -> list[torch.Tensor] | None:
        """The closed-over tensors to call with, or None if the trace no longer fits them or `flat`'s
        tensors (or, where it depends on it, whether a torch.func transform runs: see NOTE [dropout under
        torch.func])."""
        if self.joint.under_functorch not in (None, functorch_active()):
            return None
        if self.joint.backward_in_grad_mode != grad_transform_active():  # NOTE [a backward traced as it will run]
            return None
        if self.joint.cast_once is not None and self.joint.cast_once != tuple(map(cast_once, flat.tensors)):
            return None  # NOTE [autocast's cache of casts]
        lifted = [slot.fetch() for slot in self.joint.lifted]
        return lifted if _guard(self.joint, lifted) == self.guard else None


def _guard(joint: JointGraph, lifted: list[torch.Tensor]) -> tuple[Any, ...]:
    """What the cache key cannot see before tracing: the closed-over tensors' metadata,
    and the `training` flags of modules that ran but are not reachable from `fn` itself."""
    return (tuple(map(tensor_key, lifted)), tuple(module.training for module in joint.reached_modules))


class Checkpointed(Generic[P, T]):
    """A function wrapped by `remat.checkpoint`; call it like the original.

    It traces the wrapped function once per signature (cached), and exposes
    `cache_info()` and `cache_clear()` like `functools.lru_cache`.

    >>> import torch, remat
    >>> f = remat.checkpoint(lambda x: x.sin().cos().sum(), policy=remat.policies.save_everything)
    >>> f
    remat.checkpoint(<lambda>, policy=save_everything)
    >>> f(torch.ones(3, requires_grad=True)).backward()
    >>> f.cache_info().traces
    1
    """

    def __init__(
        self, fn: Callable[P, T], policy: Any, cache_size: int, compile: Any = False, shared: SharedTraces | None = None
    ):
        self.__wrapped__ = fn
        self.policy = policy
        self.compile = compile
        self._compile_options = compile_options(compile)
        self._cache: LRUCache[list[_Entry]] = LRUCache(cache_size)
        self._roots: ModuleRoots | None = None
        self._last_key: SignatureKey | None = None  # the signature last traced, to explain a retrace
        self._shared = shared  # traces of identical blocks: see NOTE [sharing traces between identical blocks]
        self._compile_key = register(self)
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> T:
        if not torch.is_grad_enabled():
            return self.__wrapped__(*args, **kwargs)
        if torch.compiler.is_dynamo_compiling():  # see NOTE [checkpoints inside torch.compile]
            return cast(T, call_under_dynamo(self, args, kwargs))
        if nested_forward_mode():  # NOTE [forward mode over forward mode]
            return self.__wrapped__(*args, **kwargs)
        if is_tracing():  # inside another checkpointed function: see NOTE [nested checkpoints]
            with nested_checkpoint(self.policy):
                return self.__wrapped__(*args, **kwargs)
        flat = flatten_args("remat.checkpoint", args, kwargs)
        tried: list[_Entry] = []  # traces whose checks of values failed on these arguments
        while True:
            key, entry, lifted, traced = self._lookup(flat, tried)
            if _step.recorder is not None:  # a probe step of `remat.fit`: see NOTE [a step's timeline]
                _step.recorder.forward_traced(entry.joint)
            if not entry.joint.value_checks:
                outputs = run(entry.executable, [*flat.tensors, *lifted])
                break
            restore_streams = _rng.snapshot(entry.joint.generators)  # See NOTE [values Python reads].
            try:
                outputs = run(entry.executable, [*flat.tensors, *lifted])
                self._prefer(key, entry)
                break
            except ValuesChanged as changed:
                restore_streams()
                if traced:
                    raise _values_differ_between_runs(self, changed) from changed
                logger.info("retrying %s: a value it read in Python changed (%s)", self, changed)
                tried.append(entry)
        return cast(T, optree.tree_unflatten(entry.joint.output_spec, list(outputs)))

    def __repr__(self) -> str:
        name = getattr(self.__wrapped__, "__qualname__", type(self.__wrapped__).__name__)
        compiled = "" if self._compile_options is None else f", compile={self.compile!r}"
        return f"remat.checkpoint({name}, policy={self.policy!r}{compiled})"

    def cache_info(self) -> CacheInfo:
        """Hits, misses, traces and size of the trace cache."""
        return self._cache.info()

    def cache_clear(self) -> None:
        """Forget every trace (and the modules found in the wrapped function), and the traces
        identical blocks would take from one another."""
        self._cache.clear()
        self._roots = None
        if self._shared is not None:
            self._shared.clear()

    @property
    def roots(self) -> ModuleRoots:
        if self._roots is None:
            self._roots = find_module_roots(self.__wrapped__)
        return self._roots

    def _lookup(
        self, flat: FlatArgs, tried: Sequence[_Entry] = ()
    ) -> tuple[SignatureKey, _Entry, list[torch.Tensor], bool]:
        """The cache key of `flat`, a trace for it (not one of `tried`), the closed-over tensors to
        call it with, and whether it was traced just now."""
        roots_known = self._roots is not None
        roots = self.roots
        forward_mode = forward_mode_active()
        key = SignatureKey(
            flat.static_key(), tuple(map(tensor_key, flat.tensors)), ambient_key(roots.modules), forward_mode
        )
        entries = self._cache.get(key) or []
        for entry in entries:
            lifted = entry.fetch_if_valid(flat)
            if lifted is not None and entry not in tried:
                return key, entry, lifted, False
        if self._last_key is not None and logger.isEnabledFor(logging.INFO):
            logger.info("retracing %s: %s", self, "; ".join(explain_retrace(self._last_key, key, flat)))
        started = time.perf_counter()
        if roots_known:
            # Parameters may have been replaced since the last trace (`load_state_dict(assign=True)`):
            # find where each tensor lives anew, so no stale id points at a freed tensor's slot.
            self._roots = roots = find_module_roots(self.__wrapped__)
        structure = None if self._shared is None else structure_of(self.__wrapped__, roots)
        shared_key = (structure, key)
        if structure is not None:
            taken = self._take_shared(shared_key, roots, flat, tried)
            if taken is not None:
                entry, lifted = taken
                logger.debug("%s takes the trace of an identical block", self)
                self._last_key = key
                self._cache.put(key, [entry, *entries][:_VARIANTS_PER_KEY], shared=True)
                return key, entry, lifted, False
        recording = (
            contextlib.nullcontext(lambda: None) if structure is None else recording_attribute_reads(roots.modules)
        )
        with recording as attribute_reads:
            joint = with_value_graph(joint_graph_of(self.__wrapped__, flat, roots, forward_mode=forward_mode))
        lifted = [slot.fetch() for slot in joint.lifted]
        executable = build_executable(joint, self.policy, forward_mode, self._compile_options, self._shared)
        entry = _Entry(joint, executable, _guard(joint, lifted))
        if logger.isEnabledFor(logging.DEBUG):
            signature = describe_signature(flat, key.tensors)
            log_trace(repr(self), signature, time.perf_counter() - started, joint.trace, executable.programs.decisions)
        self._last_key = key
        # A few variants per key (say, a closed-over module in train and eval mode); the oldest goes first.
        self._cache.put(key, [entry, *entries][:_VARIANTS_PER_KEY])
        reads = attribute_reads()
        if self._shared is not None and reads is not None:
            self._shared.publish(shared_key, entry, roots, reads, self.policy)
        return key, entry, lifted, True

    def _take_shared(
        self, key: Hashable, roots: ModuleRoots, flat: FlatArgs, tried: Sequence[_Entry]
    ) -> tuple[_Entry, list[torch.Tensor]] | None:
        """An identical block's trace at `key` (not one of `tried`), on this block's tensors and modules,
        with the closed-over tensors to call it with; None if there is none."""
        assert self._shared is not None
        refused = {id(entry.executable) for entry in tried}
        for shared in self._shared.find(key, roots.modules, skip=lambda entry: id(entry.executable) in refused):
            moved = {id(theirs): ours for theirs, ours in zip(shared.modules, roots.modules, strict=True)}
            joint = dataclasses.replace(
                shared.entry.joint,
                lifted=tuple(rebase(slot, moved) for slot in shared.entry.joint.lifted),
                reached_modules=tuple(moved.get(id(module), module) for module in shared.entry.joint.reached_modules),
            )
            executable = shared.entry.executable
            if shared.policy is not self.policy:  # blocks `remat.fit` planned apart
                executable = self._rebuilt(joint, executable)
            entry = _Entry(joint, executable, shared.entry.guard)
            lifted = entry.fetch_if_valid(flat)  # the same metadata and `training` flags as the block that traced
            if lifted is not None:
                return entry, lifted
        return None

    def replan(self) -> None:
        """Build the programs of every cached trace again, from what the policy decides now (a planner
        whose decisions changed: `remat.fit`)."""

        def rebuilt(entries: list[_Entry]) -> list[_Entry]:
            return [dataclasses.replace(e, executable=self._rebuilt(e.joint, e.executable)) for e in entries]

        for key, _ in self._cache.items():
            self._cache.update(key, rebuilt)

    def _rebuilt(self, joint: JointGraph, executable: Executable) -> Executable:
        """The programs of `joint` under this checkpoint's policy, for the mode `executable` was built for."""
        forward_mode = executable.programs.traced_for_forward_mode
        return build_executable(joint, self.policy, forward_mode, self._compile_options, self._shared)

    def _prefer(self, key: SignatureKey, entry: _Entry) -> None:
        """Try `entry` first for `key` from now on (it is a trace specialized on values that held)."""
        self._cache.update(key, lambda entries: [entry, *(e for e in entries if e is not entry)])


def _values_differ_between_runs(checkpointed: Checkpointed[Any, Any], changed: ValuesChanged) -> TraceError:
    return TraceError(
        f"{checkpointed!r} reads the value of a tensor in Python, and the value differs between two runs on "
        f"the same arguments ({changed}): a random draw, or state outside the function. remat traces such "
        "code for the values it reads, and checks them on every call; compute the value outside the "
        "function and pass it as an argument (a non-tensor argument is part of the cache key)."
    )


def traced(checkpointed: Checkpointed[Any, Any], flat: FlatArgs) -> tuple[JointGraph, Executable]:
    """The trace `checkpointed` runs on the arguments `flat` (traced now if its cache has none), and its
    programs under its policy."""
    _, entry, _, _ = checkpointed._lookup(flat)
    return entry.joint, entry.executable


class BindsAsMethod(Checkpointed[P, T]):
    """A checkpointed Python function, which binds like one: decorating a method checkpoints each
    instance's bound method, with a trace cache per instance.

    Only functions get `__get__`: Dynamo before torch 2.12 takes any attribute whose value defines
    `__get__` for a descriptor of the class, and cannot compile a module that keeps a checkpointed
    module or bound method as an instance attribute (`CheckpointedModule`, `checkpoint_modules`)."""

    def __init__(self, fn: Callable[P, T], policy: Any, cache_size: int, compile: Any = False):
        super().__init__(fn, policy, cache_size, compile)
        self._bound: weakref.WeakKeyDictionary[Any, Checkpointed[Any, Any]] = weakref.WeakKeyDictionary()

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # Decorating a method: bind it, with one cache per instance.
        if instance is None:
            return self
        bound = self._bound.get(instance)
        if bound is None:
            method = self.__wrapped__.__get__(instance, owner)  # type: ignore[attr-defined]
            bound = Checkpointed(method, self.policy, self._cache.maxsize, self.compile)
            self._bound[instance] = bound
        return bound


class DelegatesToCheckpointed:
    """`policy`, `cache_info()` and `cache_clear()` of a wrapper whose `checkpointed` does the work
    (a `CheckpointedModule`, the `forward` that `checkpoint_modules` installs)."""

    checkpointed: Checkpointed[..., Any]

    @property
    def policy(self) -> Any:
        """The policy this was checkpointed with."""
        return self.checkpointed.policy

    def cache_info(self) -> CacheInfo:
        """Hits, misses, traces and size of the trace cache."""
        return self.checkpointed.cache_info()

    def cache_clear(self) -> None:
        """Forget every trace."""
        self.checkpointed.cache_clear()
