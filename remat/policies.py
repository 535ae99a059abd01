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
from collections.abc import Callable
from typing import Any, Union

import torch

from ._calls import Call, Decision, Trace, op_name

__all__ = [
    "Policy",
    "save_all_of",
    "save_any_of",
    "save_calls",
    "save_everything",
    "save_nothing",
    "save_ops",
    "save_scopes",
    "save_unless",
]

PolicyLike = Union[Callable[[Call], Decision | bool], "Policy", None]


class Policy:
    """Base of the built-in policies: a planner that combines with `|`, `&` and `~`."""

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        """One decision per call of `trace`."""
        return tuple(self._decide(call) for call in trace)

    def _decide(self, call: Call) -> Decision:
        raise NotImplementedError

    def __call__(self, call: Call) -> Decision:
        return self._decide(call)

    def __or__(self, other: PolicyLike) -> Policy:
        return save_any_of(self, other)

    def __and__(self, other: PolicyLike) -> Policy:
        return save_all_of(self, other)

    def __invert__(self) -> Policy:
        return _Not(self)


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
    if isinstance(op, torch._ops.OpOverloadPacket):
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
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
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
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"remat.policies.save_scopes: expected names of custom autograd.Functions or custom ops as strings "
                f"(e.g. `save_scopes({type(name).__name__!r})` for a Function class), but got {name!r}."
            )
    return _SaveScopes(tuple(names))


@dataclasses.dataclass(frozen=True, repr=False)
class _Combined(Policy):
    policies: tuple[Any, ...]
    require_all: bool

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        from ._decide import decide

        plans = [decide(policy, trace) for policy in self.policies]
        combine = all if self.require_all else any
        return tuple(
            Decision.SAVE if combine(plan[i] is Decision.SAVE for plan in plans) else Decision.RECOMPUTE
            for i in range(len(trace))
        )

    def __repr__(self) -> str:
        name = "save_all_of" if self.require_all else "save_any_of"
        return f"{name}({', '.join(map(repr, self.policies))})"


def save_any_of(*policies: PolicyLike) -> Policy:
    """Save a call if any of `policies` saves it (JAX's `save_from_both_policies`); also `p | q`.

    >>> import torch, remat
    >>> from remat.policies import save_ops, save_any_of
    >>> save_any_of(save_ops(torch.ops.aten.mm), save_ops(torch.ops.aten.bmm))
    save_any_of(save_ops(aten.mm), save_ops(aten.bmm))
    """
    return _Combined(tuple(policies), require_all=False)


def save_all_of(*policies: PolicyLike) -> Policy:
    """Save a call only if every one of `policies` saves it; also `p & q`.

    >>> import torch, remat
    >>> from remat.policies import save_ops, save_calls
    >>> save_ops(torch.ops.aten.mm) & save_calls(0, 1)
    save_all_of(save_ops(aten.mm), save_calls(0, 1))
    """
    return _Combined(tuple(policies), require_all=True)


@dataclasses.dataclass(frozen=True, repr=False)
class _Not(Policy):
    policy: Any

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        from ._decide import decide

        return tuple(Decision.RECOMPUTE if d is Decision.SAVE else Decision.SAVE for d in decide(self.policy, trace))

    def __repr__(self) -> str:
        return f"~{self.policy!r}"


def save_unless(policy: PolicyLike, unless: PolicyLike) -> Policy:
    """Save what `policy` saves, except the calls `unless` saves; also `policy & ~unless`.

    >>> import torch, remat
    >>> from remat.policies import save_everything, save_ops, save_unless
    >>> save_unless(save_everything, save_ops(torch.ops.aten.mm))
    save_all_of(save_everything, ~save_ops(aten.mm))
    """
    return save_all_of(policy, _Not(unless))
