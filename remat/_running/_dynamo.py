"""A checkpointed function met by `torch.compile`: remat's decisions, as the partitioner's recompute tags.

See NOTE [checkpoints inside torch.compile].
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from .. import _quirks
from .._core._calls import Call, Decision
from .._core._pytree import _is_static, flatten_args
from .._eager._nodes import is_free_op
from .._torch import (
    RELEASE,
    SAC_BYPASSES_HOOKS,
    disable_current_modes,
    guard_scalar,
    op_schema,
    overload_name,
    unset_fake_temporarily,
)
from .._tracing._errors import TraceError


class Checkpointed(Protocol):
    """What this module needs of a checkpointed function (`remat.Checkpointed`, which calls into here)."""

    __wrapped__: Any
    _compile_key: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def _lookup(self, flat: Any, tried: Sequence[Any] = ()) -> tuple[Any, Any, list[torch.Tensor], bool]: ...


__all__ = ["call_under_dynamo", "register"]

# NOTE [checkpoints inside torch.compile]
# Dynamo cannot trace remat's own tracing (make_fx inside a frame it compiles),
# so while Dynamo traces a model, a checkpointed call becomes a call of
# `torch.utils.checkpoint.checkpoint` on the wrapped function, which Dynamo
# turns into its activation-checkpoint region and AOTAutograd traces with a
# selective-checkpoint context. That context asks us about every aten call of
# the region, in order, as AOTAutograd records it: we answer MUST_SAVE or
# MUST_RECOMPUTE with remat's decision for the same call, and the min-cut
# partitioner obeys both. remat's decisions come from its ordinary trace of
# the wrapped function, made at that moment on empty tensors of the
# signature Dynamo saw (shapes are specialized), outside every tracing mode:
# the same trace and the same decisions as the eager call, cached with it.
# The two op sequences are matched call by call, views and aliases left
# aside as a Trace leaves them; if they ever differ, the region is not
# guessed at: tracing stops with an error.

# NOTE [offload inside torch.compile]
# The compiler's selective checkpointing has offload decisions (`MUST_CPU_OFFLOAD`), but
# the min-cut partitioner treats them as recompute, and its own offloading pass runs only
# under a configuration flag torch marks as for testing, on nodes nothing marks (checked on
# torch 2.13 and 2.15). Rather than replay a value the policy wants kept, remat answers
# MUST_SAVE for an OFFLOAD call (and a PACK or compressed one: the region has no storage but
# the device): inside a compiled model it stays on the device, and the compiled region keeps it
# as SAVE would. Outside a compiled model (and with `compile=` on remat's own programs), every
# storage works as in eager.

_CHECKPOINTED: weakref.WeakValueDictionary[str, Checkpointed] = weakref.WeakValueDictionary()
_keys = itertools.count()


def register(checkpointed: Checkpointed) -> str:
    """A key under which the selective-checkpoint context finds `checkpointed` again: a string, which
    Dynamo keeps a constant (an int attribute becomes symbolic under `dynamic=True`)."""
    key = f"remat-{next(_keys)}"
    _CHECKPOINTED[key] = checkpointed
    return key


def call_under_dynamo(checkpointed: Checkpointed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What Dynamo traces in place of a checkpointed call. See NOTE [checkpoints inside torch.compile]."""
    signature = _signature((args, kwargs))
    if signature is None:  # a container Dynamo cannot hand over as constants: run remat outside the graph
        return _outside_the_graph(checkpointed, *args, **kwargs)
    fn = checkpointed.__wrapped__

    def region(*positional: Any) -> Any:
        return fn(*positional, **kwargs)

    context_fn = functools.partial(_selective_contexts, checkpointed._compile_key, signature)
    return torch.utils.checkpoint.checkpoint(
        region, *args, use_reentrant=False, context_fn=context_fn, **SAC_BYPASSES_HOOKS
    )


@torch.compiler.disable
def _outside_the_graph(checkpointed: Checkpointed, *args: Any, **kwargs: Any) -> Any:
    return checkpointed(*args, **kwargs)


def _signature(tree: Any) -> tuple[Any, ...] | None:
    """`tree` as nested tuples of constants (tensors by their metadata), or None if it holds
    something else. Traced by Dynamo: every size is specialized to an int, also where Dynamo made
    it symbolic (`dynamic=True`, or automatically once a second shape is seen), with a guard on it,
    so that each shape compiles its own region (the context function must be a constant)."""
    if isinstance(tree, torch.Tensor):
        return (
            "tensor",
            tuple(guard_scalar(s) for s in tree.shape),
            tuple(guard_scalar(s) for s in tree.stride()),
            tree.dtype,
            str(tree.device),
            tree.requires_grad,
        )
    if isinstance(tree, list):
        return _sequence_signature("list", tree)
    if type(tree) is tuple:
        return _sequence_signature("tuple", tree)
    if type(tree) is dict:
        items = []
        for name, value in tree.items():
            item = _signature(value)
            if item is None or not isinstance(name, str):
                return None
            items.append((name, item))
        return ("dict", tuple(items))
    if _is_static(tree):
        return ("static", tree)
    return None


def _sequence_signature(kind: str, values: Sequence[Any]) -> tuple[Any, ...] | None:
    items = []
    for value in values:
        item = _signature(value)
        if item is None:
            return None
        items.append(item)
    return (kind, tuple(items))


def _example(signature: tuple[Any, ...]) -> Any:
    """A value of this signature: tensors of zeros, the same static values."""
    kind, *rest = signature
    if kind == "tensor":
        shape, stride, dtype, device, requires_grad = rest
        # Zeros, not uninitialized memory: a function that reads values traces the same path every time.
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_().requires_grad_(requires_grad)
    if kind == "list":
        return [_example(item) for item in rest[0]]
    if kind == "tuple":
        return tuple(_example(item) for item in rest[0])
    if kind == "dict":
        return {name: _example(item) for name, item in rest[0]}
    return rest[0]


def _selective_contexts(key: str, signature: tuple[Any, ...]) -> tuple[Any, Any]:
    """Called by torch's checkpoint while AOTAutograd traces the region."""
    checkpointed = _CHECKPOINTED.get(key)
    if checkpointed is None:
        raise RuntimeError("remat: a checkpointed function was garbage collected while torch.compile traced it.")
    # Out of AOTAutograd's fake, functional and proxy modes: the trace is remat's own.
    with disable_current_modes(), unset_fake_temporarily(), torch.enable_grad():
        args, kwargs = _example(signature)
        _, entry, _, _ = checkpointed._lookup(flatten_args("remat.checkpoint", args, kwargs))
    if entry.joint.value_checks:  # traced for the values of made-up example inputs: NOTE [values Python reads]
        raise TraceError(
            f"{checkpointed!r} under torch.compile: the function reads the value of a tensor in Python, which "
            "remat traces for the values it reads, and inside a compiled model it sees no values. Wrap the "
            "checkpointed function in `torch.compiler.disable` (a graph break: the compiled model calls it "
            "eagerly, where remat traces and checks values as usual), or leave the model uncompiled."
        )
    defers_errors = _quirks.SAC_ERRORS_LEAVE_MODES_PUSHED.applies(RELEASE)
    tags = _RecomputeTags(checkpointed, tuple(entry.joint.trace), entry.executable.programs.decisions, defers_errors)
    forward, recompute = create_selective_checkpoint_contexts(tags)
    return (_raising_on_leaving(forward, tags) if defers_errors else forward), recompute


# NOTE [a region's error raised where torch can unwind]
# A policy function that raises inside a selective-checkpoint region leaves the
# region's dispatch modes pushed on torch 2.10 to 2.12 until the error is
# garbage collected (`_quirks.SAC_ERRORS_LEAVE_MODES_PUSHED`: its checkpoint
# does not throw the error into the generator that holds them): every op run
# meanwhile, in any later code, would reach remat's policy. There the policy
# notes where the region parts ways with remat's trace and answers on, and the
# error is raised as the region's forward context is left, after torch has
# left its own.


def _raising_on_leaving(context: Any, tags: _RecomputeTags) -> Any:
    """The selective-checkpoint forward `context`, made to raise the error `tags` noted once torch has left
    it. Its class is swapped for a subclass, not wrapped: torch checks that it is a dispatch mode, and
    sets attributes on it (2.12: the region's graph id)."""
    base = type(context)

    class RaisesOnLeaving(base):  # type: ignore[valid-type, misc]
        def __exit__(self, *exc_info: Any) -> Any:
            suppressed = super().__exit__(*exc_info)
            if exc_info[0] is None and tags.error is not None:
                raise tags.error
            return suppressed

    context.__class__ = RaisesOnLeaving
    return context


class _RecomputeTags:
    """The selective-checkpoint policy that answers with remat's decision for each call."""

    def __init__(self, checkpointed: Any, calls: Sequence[Call], decisions: Sequence[Decision], defers_errors: bool):
        self.checkpointed = checkpointed
        self.calls = calls
        self.decisions = decisions
        # Where the region's forward is, and where its recomputation is: some releases ask the policy
        # again for each op they recompute (`_quirks.SAC_ASKS_AGAIN_WHILE_RECOMPUTING`).
        self.positions = {False: 0, True: 0}
        self.defers_errors = defers_errors  # NOTE [a region's error raised where torch can unwind]
        self.error: TraceError | None = None  # where the region parted ways with the trace, if it defers errors

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.error is not None or op in SAC_IGNORED_OPS or is_free_op(op):
            return CheckpointPolicy.PREFER_RECOMPUTE  # a view follows its base, as in a Trace
        recompute = bool(getattr(ctx, "is_recompute", False))
        position = self.positions[recompute]
        if recompute and position == len(self.calls):
            position = 0  # a second recomputation
        if position >= len(self.calls) or _functional(self.calls[position].op) != _functional(op):
            if op in _NOT_IN_THE_TRACE:
                return CheckpointPolicy.PREFER_RECOMPUTE
            expected = self.calls[position].name if position < len(self.calls) else "the end of the trace"
            self.error = TraceError(  # each way out named here is tested: see NOTE [regions that differ from the trace]
                f"{self.checkpointed!r} under torch.compile: call {position} of the compiled region is {op}, "
                f"but remat's trace of the function has {expected} there, so remat cannot tell the compiler which "
                "calls to save. The function runs other calls while torch.compile traces it than when remat "
                "does (a branch on `torch.compiler.is_dynamo_compiling()`, say): make it run the same calls in "
                "both. Or keep this checkpoint out of the compiled graph: wrap the checkpointed function in "
                "`torch.compiler.disable` (a graph break, so not with `fullgraph=True`), or leave the model "
                "uncompiled and compile only remat's programs with `compile=True` on `remat.checkpoint` or "
                "`remat.checkpoint_modules`. Inside a compiled model `compile=True` changes nothing: the model's "
                "compilation takes over."
            )
            if not self.defers_errors:
                raise self.error
            return CheckpointPolicy.PREFER_RECOMPUTE
        decision = self.decisions[position]
        self.positions[recompute] = position + 1
        # A kept value stays on the device here, whatever its storage: see NOTE [offload inside torch.compile].
        return CheckpointPolicy.MUST_SAVE if decision.keeps else CheckpointPolicy.MUST_RECOMPUTE


# NOTE [regions that differ from the trace]
# When the compiled region's calls and remat's trace part ways, remat refuses
# to guess, and the error names only ways out that work, each tested in
# tests/test_compile.py: making the function run the same calls in both; a
# `torch.compiler.disable` around the checkpointed function (Dynamo leaves the
# call to eager execution, where remat traces and runs it as usual, so the
# model compiles around it unless `fullgraph=True`); or an uncompiled model
# whose checkpoints compile remat's own programs (`compile=True`), where
# Dynamo sees remat's graphs, never the function. A `compile=` argument on a
# checkpoint inside a compiled model is not a way out: while Dynamo traces the
# model, the checkpoint becomes a region of the model's graph (see NOTE
# [checkpoints inside torch.compile]) and its own compilation never runs.


# Calls a region makes that remat's trace of the function has no counterpart of: see
# `_quirks.REGIONS_ALLOCATE_FOR_IN_PLACE_OPS`.
_NOT_IN_THE_TRACE = _quirks.REGIONS_ALLOCATE_FOR_IN_PLACE_OPS.table


def _functional(op: Any) -> tuple[str, str]:
    """An op's name with in-place and mutating ops named as their functional form: the region is seen
    before functionalization (`relu_`, `_native_batch_norm_legit`), remat's trace after it (`relu`,
    `_native_batch_norm_legit_functional`)."""
    name, overload = op_schema(op).name, overload_name(op)
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    name = name.removesuffix("_functional")
    return name, overload
