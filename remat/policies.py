"""Built-in policies: what to save, per call, and combinators to build new ones.

A policy is any callable `policy(call: remat.Call) -> remat.Decision | bool`
(`True` means SAVE), or a planner: an object with
`plan(trace: remat.Trace) -> Sequence[remat.Decision]`. The built-ins are
small immutable, hashable values; `|`, `&` and `~` combine them.

>>> import torch, remat
>>> from remat import policies
>>> policy = policies.save_ops(torch.ops.aten.mm) | policies.save_calls(0)
>>> policy
save_any_of(save_ops(aten.mm), save_calls(0))
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ._core._calls import Call, Decision, Trace, op_name
from ._core._deprecated import renamed, warn_renamed
from ._deciding._budget_policy import Budget, budget
from ._deciding._policy import (
    Planner,
    Policy,
    PolicyLike,
    compress,
    offload,
    pack,
    save_all_of,
    save_any_of,
    save_unless,
)
from ._deciding._policy import offload as _offload_policy  # `offload` is also an argument name below
from ._deciding._sac import from_sac
from ._torch import HigherOrderOperator, OpOverload, OpOverloadPacket
from .costs import DEVICES, MATMUL_OPS, Device, estimate_seconds, resolve_device

if TYPE_CHECKING:  # highspy, which solving needs, is imported on first use
    pass

__all__ = [
    "Budget",
    "Planner",
    "Policy",
    "PolicyLike",
    "budget",
    "compress",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "from_sac",
    "offload",
    "offload_dots",
    "offload_dots_with_no_batch_dims",
    "offload_tagged",
    "pack",
    "pack_everything",
    "save_all_of",
    "save_and_offload_tagged",
    "save_any_of",
    "save_by_cost",
    "save_calls",
    "save_everything",
    "save_modules",
    "save_nothing",
    "save_ops",
    "save_scopes",
    "save_tagged",
    "save_tagged_except",
    "save_unless",
]


@dataclasses.dataclass(frozen=True, repr=False)
class _Constant(Policy):
    decision: Decision
    name: str

    def _decide(self, call: Call) -> Decision:
        return self.decision

    def __repr__(self) -> str:
        return self.name


save_nothing: Policy = _Constant(Decision.RECOMPUTE, "save_nothing")
"""Keep no activation; replay whatever backward needs (the default).

>>> import torch, remat
>>> remat.report(lambda x: x.sin().sin(), torch.ones(4, requires_grad=True)).saved_bytes
0
"""

save_everything: Policy = _Constant(Decision.SAVE, "save_everything")
"""Keep every activation backward reads, like running without a checkpoint.

>>> import torch, remat
>>> x = torch.ones(4, requires_grad=True)
>>> remat.report(lambda x: x.sin().sin(), x, policy=remat.policies.save_everything).saved_bytes
16
"""


@dataclasses.dataclass(frozen=True, repr=False)
class _SaveOps(Policy):
    ops: tuple[Any, ...]

    def _decide(self, call: Call) -> Decision:
        packet = getattr(call.op, "overloadpacket", None)
        return Decision.SAVE if any(op is call.op or op is packet for op in self.ops) else Decision.RECOMPUTE

    def __repr__(self) -> str:
        return f"save_ops({', '.join(_op_repr(op) for op in self.ops)})"


def _op_repr(op: Any) -> str:
    if isinstance(op, OpOverloadPacket):
        return str(op).replace("::", ".").removeprefix("<OpOverloadPacket(op='").removesuffix("')>")
    return op_name(op)


def save_ops(*ops: Any) -> Policy:
    """Save every call of the given ops.

    An `OpOverload` (`torch.ops.aten.mm.default`) matches that overload only;
    an `OpOverloadPacket` (`torch.ops.aten.mm`) matches all its overloads.

    Args:
        *ops: aten (or other `torch.ops`) operators.

    Returns:
        A policy.

    >>> import torch, remat
    >>> policy = remat.policies.save_ops(torch.ops.aten.mm, torch.ops.aten.addmm)
    >>> policy
    save_ops(aten.mm, aten.addmm)
    """
    for op in ops:
        if not isinstance(op, (OpOverload, OpOverloadPacket, HigherOrderOperator)):
            hint = f" such as `torch.ops.aten.{op.__name__}`" if callable(op) and hasattr(op, "__name__") else ""
            raise TypeError(
                f"remat.policies.save_ops: expected operators from `torch.ops` (an OpOverload or "
                f"OpOverloadPacket{hint}), but got {op!r} of type {type(op).__qualname__}."
            )
    return _SaveOps(tuple(ops))


@dataclasses.dataclass(frozen=True, repr=False)
class _SaveCalls(Policy):
    indices: tuple[int, ...]

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        for index in self.indices:
            if not -len(trace) <= index < len(trace):
                raise IndexError(
                    f"remat.policies.save_calls: index {index} is out of range for a trace of {len(trace)} calls "
                    f"(valid: {-len(trace)} to {len(trace) - 1}). Print `remat.trace(fn, *args)` to see the calls."
                )
        chosen = {index % len(trace) for index in self.indices}
        return tuple(Decision.SAVE if call.index in chosen else Decision.RECOMPUTE for call in trace)

    def _decide(self, call: Call) -> Decision:
        return Decision.SAVE if call.index in self.indices else Decision.RECOMPUTE

    def __repr__(self) -> str:
        return f"save_calls({', '.join(map(str, self.indices))})"


def save_calls(*indices: int) -> Policy:
    """Save the calls at the given positions of the trace (`Call.index`; negative counts from the end).

    Args:
        *indices: call indices, as shown by `remat.trace(fn, *args)`.

    Returns:
        A policy; applying it to a trace with fewer calls raises `IndexError`.

    >>> import torch, remat
    >>> x = torch.ones(4, requires_grad=True)
    >>> remat.report(lambda x: x.sin().sin(), x, policy=remat.policies.save_calls(0)).saved_bytes
    16
    """
    for index in indices:
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"remat.policies.save_calls: expected integer call indices, but got {index!r}.")
    return _SaveCalls(tuple(indices))


@dataclasses.dataclass(frozen=True, repr=False)
class _SaveScopes(Policy):
    patterns: tuple[str, ...]

    def _decide(self, call: Call) -> Decision:
        if call.scope is not None:
            for name in call.scope.split("/"):
                if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns):
                    return Decision.SAVE
        return Decision.RECOMPUTE

    def __repr__(self) -> str:
        return f"save_scopes({', '.join(map(repr, self.patterns))})"


def save_scopes(*names: str) -> Policy:
    """Save every call made inside the named custom `autograd.Function`s or custom ops.

    A custom `torch.autograd.Function`'s forward traces into several aten calls;
    they all carry the Function's class name as `Call.scope` (nested Functions
    give `Outer/Inner`), so this saves or recomputes a whole application as one
    unit. A `torch.library.custom_op` is a single call whose scope is its
    qualified name (`mylib::attention`). Names may be glob patterns.

    Args:
        *names: Function class names or custom op names, or glob patterns of them.

    Returns:
        A policy. To save one application of a Function but not another, combine
        with `save_calls` or write a policy that also looks at `Call.index`.

    >>> import torch, remat
    >>> class Square(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x * x
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         (x,) = ctx.saved_tensors
    ...         return 2 * x * grad
    >>> trace = remat.trace(lambda x: Square.apply(x.sin()), torch.ones(3, requires_grad=True))
    >>> [(call.name, call.scope) for call in trace]
    [('aten.sin.default', None), ('aten.mul.Tensor', 'Square')]
    >>> remat.policies.save_scopes("Square")
    save_scopes('Square')
    """
    expected = "names of custom autograd.Functions or custom ops as strings (`save_scopes('Square')` for a Function class `Square`)"
    return _SaveScopes(_strings("save_scopes", names, expected))


@dataclasses.dataclass(frozen=True, repr=False)
class _SaveOpKinds(Policy):
    kinds: tuple[str, ...]
    name: str

    def _decide(self, call: Call) -> Decision:
        packet = getattr(call.op, "overloadpacket", None)
        return Decision.SAVE if any(packet in MATMUL_OPS[kind] for kind in self.kinds) else Decision.RECOMPUTE

    def __repr__(self) -> str:
        return self.name


dots_saveable: Policy = _SaveOpKinds(("unbatched", "batched", "convolution", "attention"), "dots_saveable")
"""Save every matrix-multiply-like call (JAX's `dots_saveable`): `mm`, `addmm`, `bmm`, `baddbmm`,
the other products in `remat.costs.MATMUL_OPS` (what `linear`, `matmul` and `einsum` trace
to), convolutions, and the scaled-dot-product-attention kernels. Pointwise calls,
normalizations and softmaxes between them are replayed: cheap in FLOPs, costly in bytes.

>>> import torch, remat
>>> trace = remat.trace(lambda a, b: (a @ b).relu(), torch.ones(2, 3), torch.ones(3, 4))
>>> [remat.policies.dots_saveable(call) for call in trace]
[remat.SAVE, remat.RECOMPUTE]
"""

dots_with_no_batch_dims_saveable: Policy = _SaveOpKinds(("unbatched",), "dots_with_no_batch_dims_saveable")
"""Save matrix products without batch dimensions (JAX's `dots_with_no_batch_dims_saveable`): the
projections of a transformer (`mm`, `addmm`: a linear layer on `[batch, seq, dim]` inputs
traces to one), not the batched products of attention (`bmm`, the attention kernels),
nor convolutions.

>>> import torch, remat
>>> trace = remat.trace(lambda q, k: (q @ k.mT) @ q, torch.ones(2, 3, 4), torch.ones(2, 3, 4))
>>> [(call.name, remat.policies.dots_with_no_batch_dims_saveable(call)) for call in trace]
[('aten.bmm.default', remat.RECOMPUTE), ('aten.bmm.default', remat.RECOMPUTE)]
"""


pack_everything: Policy = pack(save_everything)
"""Keep every call's outputs, packed where that is exact (`remat.PACK`: booleans, dropout's masks and values read
only through a test as bits, exactly; docs/storage.md), as they are elsewhere.

>>> import torch, remat
>>> f = lambda x: torch.where(x > 0, x.sin(), 0.0).sum()
>>> [(row.call.name, row.storage) for row in remat.report(f, torch.ones(64), policy=remat.policies.pack_everything).rows][:2]
[('aten.gt.Scalar', 'bits'), ('aten.sin.default', 'device')]
"""

offload_dots: Policy = offload(dots_saveable)
"""Offload the output of every matrix-multiply-like call (`dots_saveable`'s calls) to host memory;
replay the rest. Each product is copied to the host as forward makes it and back before backward
reads it: device memory of `save_nothing` plus the inputs of replays, compute of `dots_saveable`.

>>> import torch, remat
>>> trace = remat.trace(lambda a, b: (a @ b).relu(), torch.ones(2, 3), torch.ones(3, 4))
>>> [remat.policies.offload_dots(call) for call in trace]
[remat.OFFLOAD, remat.RECOMPUTE]
"""

offload_dots_with_no_batch_dims: Policy = offload(dots_with_no_batch_dims_saveable)
"""Offload the outputs of matrix products without batch dimensions (JAX's
`offload_dot_with_no_batch_dims`): a transformer's projections, not attention's batched products.

>>> import torch, remat
>>> trace = remat.trace(lambda x, w: (x @ w).relu(), torch.ones(2, 3), torch.ones(3, 4))
>>> remat.policies.offload_dots_with_no_batch_dims.plan(trace)
(remat.OFFLOAD, remat.RECOMPUTE)
"""


@dataclasses.dataclass(frozen=True, repr=False)
class _SaveTagged(Policy):
    names: frozenset[str]
    all_but: bool

    def _decide(self, call: Call) -> Decision:
        chosen = call.tags - self.names if self.all_but else call.tags & self.names
        return Decision.SAVE if chosen else Decision.RECOMPUTE

    def __repr__(self) -> str:
        name = "save_tagged_except" if self.all_but else "save_tagged"
        return f"{name}({', '.join(map(repr, sorted(self.names)))})"


def _strings(api: str, values: tuple[Any, ...], expected: str, *, non_empty: bool = False) -> tuple[str, ...]:
    """`values`, refused with a TypeError naming `api` and what it `expected` unless each is a string
    (a non-empty one, with `non_empty`)."""
    for value in values:
        if not isinstance(value, str) or (non_empty and not value):
            raise TypeError(f"remat.policies.{api}: expected {expected}, but got {value!r}.")
    return values


def _check_names(api: str, names: tuple[Any, ...]) -> frozenset[str]:
    expected = "the names given with `remat.tag(x, name)` as non-empty strings"
    return frozenset(_strings(api, names, expected, non_empty=True))


def save_tagged(*names: str) -> Policy:
    """Save the calls whose outputs were named with `remat.tag(x, name)`, for any of `names`
    (JAX's `save_only_these_names`). Untagged calls are replayed.

    >>> import torch, remat
    >>> def f(x):
    ...     return remat.tag(x.sin(), "h").cos()
    >>> x = torch.ones(4, requires_grad=True)
    >>> remat.report(f, x, policy=remat.policies.save_tagged("h")).saved_bytes  # sin's output
    16
    """
    return _SaveTagged(_check_names("save_tagged", names), all_but=False)


def save_tagged_except(*names: str) -> Policy:
    """Save every tagged call except those tagged only with `names` (JAX's
    `save_any_names_but_these`). Untagged calls are replayed; a call with
    several tags is saved if one of them is not in `names`.

    >>> import torch, remat
    >>> def f(x):
    ...     return remat.tag(remat.tag(x.sin(), "a").cos(), "b").exp()
    >>> remat.policies.save_tagged_except("a").plan(remat.trace(f, torch.ones(2)))
    (remat.RECOMPUTE, remat.SAVE, remat.RECOMPUTE)
    """
    return _SaveTagged(_check_names("save_tagged_except", names), all_but=True)


save_all_but_tagged = renamed(
    "remat.policies.save_all_but_tagged", "remat.policies.save_tagged_except", save_tagged_except
)


def offload_tagged(*names: str) -> Policy:
    """Offload the calls whose outputs were named with `remat.tag(x, name)`, for any of `names`,
    to host memory; replay the rest. `offload(save_tagged(*names))`.

    >>> import torch, remat
    >>> def f(x):
    ...     return remat.tag(x.sin(), "h").cos()
    >>> remat.policies.offload_tagged("h").plan(remat.trace(f, torch.ones(4)))
    (remat.OFFLOAD, remat.RECOMPUTE)
    """
    return offload(_SaveTagged(_check_names("offload_tagged", names), all_but=False))


def save_and_offload_tagged(*, save: Iterable[str] = (), offload: Iterable[str] = ()) -> Policy:
    """Keep the calls tagged with a name in `save` on the device and offload those tagged with a
    name in `offload` to host memory (JAX's `save_and_offload_only_these_names`); replay the rest.
    A call tagged with names of both is saved.

    Args:
        save: tag names whose calls are saved.
        offload: tag names whose calls are offloaded.

    Returns:
        `save_tagged(*save) | offload_tagged(*offload)`.

    >>> import torch, remat
    >>> def f(x):
    ...     q = remat.tag(x.sin(), "q")
    ...     return remat.tag(q.cos(), "kv").exp()
    >>> remat.policies.save_and_offload_tagged(save=["q"], offload=["kv"]).plan(remat.trace(f, torch.ones(4)))
    (remat.SAVE, remat.OFFLOAD, remat.RECOMPUTE)
    """
    for argument, names in (("save", save), ("offload", offload)):
        if isinstance(names, str):
            raise TypeError(
                f"remat.policies.save_and_offload_tagged: `{argument}` takes a list of tag names, but got the "
                f"string {names!r}; write {argument}=[{names!r}]."
            )
    saved = _SaveTagged(_check_names("save_and_offload_tagged", tuple(save)), all_but=False)
    offloaded = _SaveTagged(_check_names("save_and_offload_tagged", tuple(offload)), all_but=False)
    return save_any_of(saved, _offload_policy(offloaded))


@dataclasses.dataclass(frozen=True, repr=False)
class _SaveModules(Policy):
    patterns: tuple[str, ...]

    def _decide(self, call: Call) -> Decision:
        if call.module is None:
            return Decision.RECOMPUTE
        paths = _with_ancestors(call.module)
        matches = any(fnmatch.fnmatchcase(path, pattern) for path in paths for pattern in self.patterns)
        return Decision.SAVE if matches else Decision.RECOMPUTE

    def __repr__(self) -> str:
        return f"save_modules({', '.join(map(repr, self.patterns))})"


def _with_ancestors(path: str) -> list[str]:
    """A module path and its ancestors' (`""` is the root)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:n]) for n in range(len(parts) + 1)]


def _parts(policy: Any) -> Iterable[Any]:
    """`policy` and the policies it is made of (a combination's, a negation's, a storage's)."""
    yield policy
    if isinstance(policy, Policy) and dataclasses.is_dataclass(policy):
        for field in dataclasses.fields(policy):
            value = getattr(policy, field.name)
            for inner in value if isinstance(value, tuple) else (value,):
                if isinstance(inner, Policy):
                    yield from _parts(inner)


# NOTE [module patterns that match nothing]
# A `save_modules` pattern that matches no module saves nothing, silently: a
# typo, or a path written from the model's root for a block whose calls' paths
# are relative to the block (`layers.*.attn` where they read `attn.q_proj`).
# remat warns of it once per trace, naming the paths the trace's calls have;
# under `checkpoint_modules`, once, when the blocks are checkpointed, and only
# if the pattern matches a module of no block (blocks of a model may differ:
# dense and mixture-of-experts layers).


def warn_of_unmatched_module_patterns(policy: Any, paths: Iterable[str | None], api: str, where: str) -> None:
    """Warn of each `save_modules` pattern of `policy` that matches none of the module `paths` (nor an
    ancestor of one): NOTE [module patterns that match nothing]."""
    patterns = [pattern for part in _parts(policy) if isinstance(part, _SaveModules) for pattern in part.patterns]
    if not patterns:
        return
    known = {ancestor for path in paths if path is not None for ancestor in _with_ancestors(path)}
    for pattern in dict.fromkeys(patterns):
        if not any(fnmatch.fnmatchcase(path, pattern) for path in known):
            some = ", ".join(repr(path) for path in sorted(known - {""})[:6]) or "none"
            warnings.warn(
                f"{api}: the save_modules pattern {pattern!r} matches no module {where}, so it saves nothing. "
                f"Module paths there are relative to the checkpointed module, e.g. {some} (see "
                "remat.policies.save_modules).",
                UserWarning,
                stacklevel=4,
            )


def save_modules(*patterns: str) -> Policy:
    """Save every call issued inside the modules whose qualified names match `patterns`.

    A call's module path (`Call.module`) is the qualified name of the innermost
    `nn.Module` whose forward issued it. For the module passed to
    `remat.checkpoint` (or whose method is), it is the name in
    `module.named_modules()` (`layers.0.attn.q_proj`; the module itself is
    `""`); for a module the function reaches through a closure variable or a
    global, the name starts with that variable's (`model.layers.0.attn.q_proj`
    in `lambda x: model(x)`). Calls of the function itself, and of modules
    reachable neither way, have no path (`None`) and are never saved by this
    policy. A pattern (a glob: `*` matches across dots) selects the modules it
    matches and everything inside them: `"layers.0.attn"` saves the calls of
    `layers.0.attn.q_proj` too. A pattern that matches no module warns, once per
    trace (under `remat.checkpoint_modules`, once, if it matches in no block).

    >>> import torch, remat
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> trace = remat.trace(model, torch.ones(2, 4))
    >>> [(call.module, remat.policies.save_modules("1", "2")(call)) for call in trace]
    [('0', remat.RECOMPUTE), ('1', remat.SAVE), ('2', remat.SAVE)]
    """
    expected = "qualified module names or glob patterns as strings (like 'layers.*.attn')"
    return _SaveModules(_strings("save_modules", patterns, expected))


@dataclasses.dataclass(frozen=True, repr=False)
class _SaveByCost(Policy):
    seconds_per_byte: float
    device: Device

    def _decide(self, call: Call) -> Decision:
        seconds = estimate_seconds(call, self.device)
        return Decision.SAVE if seconds >= self.seconds_per_byte * max(call.nbytes, 1) else Decision.RECOMPUTE

    def __repr__(self) -> str:
        named = DEVICES.get(self.device.name) == self.device
        cost = repr(f"roofline:{self.device.name}") if named else repr(self.device)
        return f"save_by_cost({self.seconds_per_byte!r}, cost={cost})"


def save_by_cost(seconds_per_byte: float, cost: str | Device = "roofline:h100", *, device: Any = None) -> Policy:
    """Save the calls that would take longest to replay for the memory their outputs hold.

    A call is saved when its replay time (`remat.costs.estimate_seconds`, a
    roofline bound on the device `cost` names) per byte of its outputs is at least
    `seconds_per_byte`. On an H100, large matmuls cost around 1e-12 s per byte of
    output (more for a larger inner dimension); pointwise ops around 1e-12 to
    1e-13 (they read and write bytes at the memory bandwidth, ~3e-13 s/byte).

    Args:
        seconds_per_byte: the threshold; positive.
        cost: the cost model, spelled as for `budget` and `remat.fit`: `"roofline:<device>"` with a
            device of `remat.costs.DEVICES`, or a `remat.costs.Device` (a roofline on it).
        device: deprecated, the device alone (`"h100"`): use `cost="roofline:h100"`.

    >>> import torch, remat
    >>> a, b = torch.ones(512, 2048), torch.ones(2048, 512)
    >>> trace = remat.trace(lambda a, b: (a @ b).relu(), a, b)
    >>> [remat.policies.save_by_cost(1e-12, "roofline:h100")(call) for call in trace]
    [remat.SAVE, remat.RECOMPUTE]
    """
    if device is not None:
        warn_renamed("save_by_cost(..., device=...)", "save_by_cost(..., cost='roofline:<device>')", stacklevel=2)
        cost = device if isinstance(device, Device) else f"roofline:{device}"
    elif isinstance(cost, str) and not cost.startswith("roofline:") and cost in DEVICES:
        warn_renamed(
            "save_by_cost(threshold, '<device>')", "save_by_cost(threshold, 'roofline:<device>')", stacklevel=2
        )
        cost = f"roofline:{cost}"
    if isinstance(cost, str):
        if not cost.startswith("roofline:"):
            raise ValueError(
                "remat.policies.save_by_cost: `cost` is a roofline on a device, 'roofline:<device>' (one of "
                f"{', '.join(repr('roofline:' + name) for name in DEVICES)}) or a remat.costs.Device, but got "
                f"{cost!r}."
            )
        cost = cost.removeprefix("roofline:")
    if (
        isinstance(seconds_per_byte, bool)
        or not isinstance(seconds_per_byte, (int, float))
        or not 0 < seconds_per_byte < math.inf
    ):
        raise ValueError(
            f"remat.policies.save_by_cost: expected a positive, finite threshold in seconds per byte kept (around 1e-12 "
            f"on an H100), but got {seconds_per_byte!r}."
        )
    return _SaveByCost(float(seconds_per_byte), resolve_device(cost))
