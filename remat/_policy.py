"""The algebra of policies: `Policy`, the base of the built-in ones, and its combinators.

`remat.policies` builds on it (and re-exports it), and so does the SAC bridge (`_sac`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Union

from ._calls import Call, Decision, Trace
from ._decide import decide, decide_call

__all__ = ["Policy", "PolicyLike", "save_all_of", "save_any_of", "save_unless"]

PolicyLike = Union[Callable[[Call], Decision | bool], "Policy", None]


class Policy:
    """Base of the built-in policies: a planner that combines with `|`, `&` and `~`.

    >>> import torch, remat
    >>> policy = remat.policies.save_ops(torch.ops.aten.mm) | remat.policies.save_calls(1)
    >>> isinstance(policy, remat.policies.Policy)
    True
    >>> policy.plan(remat.trace(lambda a, b: (a @ b).relu().sin(), torch.ones(2, 3), torch.ones(3, 4)))
    (remat.SAVE, remat.SAVE, remat.RECOMPUTE)
    """

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
class _Combined(Policy):
    policies: tuple[Any, ...]
    require_all: bool

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        plans = [decide(policy, trace) for policy in self.policies]
        combine = all if self.require_all else any
        return tuple(
            Decision.SAVE if combine(plan[i] is Decision.SAVE for plan in plans) else Decision.RECOMPUTE
            for i in range(len(trace))
        )

    def _decide(self, call: Call) -> Decision:
        combine = all if self.require_all else any
        saves = combine(decide_call(policy, call) is Decision.SAVE for policy in self.policies)
        return Decision.SAVE if saves else Decision.RECOMPUTE

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
        return tuple(Decision.RECOMPUTE if d is Decision.SAVE else Decision.SAVE for d in decide(self.policy, trace))

    def _decide(self, call: Call) -> Decision:
        return Decision.RECOMPUTE if decide_call(self.policy, call) is Decision.SAVE else Decision.SAVE

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
