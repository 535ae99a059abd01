"""Decide: a policy and a trace -> one `Decision` per call."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .._core._calls import Call, Decision, Trace
from .._torch import COLLECTIVE_NAMESPACES

__all__ = ["decide", "decide_call", "decide_nested"]


def decide(policy: Any, trace: Trace) -> tuple[Decision, ...]:
    """Ask `policy` (None, a per-call callable, or a planner) for every call of `trace`."""
    if policy is None:
        return (Decision.RECOMPUTE,) * len(trace)
    plan = getattr(policy, "plan", None)
    if callable(plan):
        decisions = list(plan(trace))
        if len(decisions) != len(trace):
            raise ValueError(
                f"remat.checkpoint: the planner {policy!r} returned {len(decisions)} decisions for a trace of "
                f"{len(trace)} calls; `plan(trace)` must return exactly one decision per call."
            )
        return tuple(_as_decision(policy, call, d) for call, d in zip(trace, decisions, strict=False))
    if callable(policy):
        return tuple(_as_decision(policy, call, policy(call)) for call in trace)
    raise TypeError(
        f"remat.checkpoint: `policy` must be None, a callable `policy(call) -> remat.Decision | bool`, or a "
        f"planner with a `plan(trace)` method, but got {policy!r} of type {type(policy).__qualname__}."
    )


def decide_call(policy: Any, call: Call) -> Decision:
    """Ask a per-call `policy` (None, or a callable) about one call."""
    if policy is None:
        return Decision.RECOMPUTE
    if not callable(policy):
        raise TypeError(
            f"remat.checkpoint: `policy` must be None, a callable `policy(call) -> remat.Decision | bool`, or a "
            f"planner with a `plan(trace)` method, but got {policy!r} of type {type(policy).__qualname__}."
        )
    return _as_decision(policy, call, policy(call))


def _as_decision(policy: Any, call: Any, value: Any) -> Decision:
    if isinstance(value, Decision):
        return value
    if isinstance(value, bool):
        return Decision.SAVE if value else Decision.RECOMPUTE
    raise TypeError(
        f"remat.checkpoint: the policy {policy!r} returned {value!r} (of type {type(value).__qualname__}) for call "
        f"{call}; a policy must return remat.SAVE, remat.PACK, remat.OFFLOAD, remat.RECOMPUTE, True (save) or False (recompute)."
    )


def decide_nested(policy: Any, trace: Trace, regions: Sequence[tuple[Any, Sequence[int]]]) -> tuple[Decision, ...]:
    """Decide with `policy`, except for the calls of nested checkpoints, which their own
    policies decide (innermost last, so it wins). See NOTE [nested checkpoints]."""
    decisions = list(decide(policy, trace))
    for inner_policy, indices in regions:
        calls = [trace[i] for i in indices]
        inner = Trace(
            [
                dataclasses.replace(call, index=k, occurrence=sum(other.op is call.op for other in calls[:k]))
                for k, call in enumerate(calls)
            ]
        )
        for i, decision in zip(indices, decide(inner_policy, inner), strict=True):
            decisions[i] = decision
    for call in trace:  # See NOTE [collectives are never replayed].
        if is_collective(call):
            decisions[call.index] = Decision.SAVE
    return tuple(decisions)


# NOTE [collectives are never replayed]
# A collective (all_reduce, all_gather, ...) replayed in backward would run once more on every
# rank, out of step with the collectives the ranks issue in their own backward (and cost a round
# of communication). Whatever the policy says, remat saves every collective call (and its wait),
# so backward reads their results instead.


def is_collective(call: Call) -> bool:
    """Whether `call` communicates with other ranks (a functional collective or its wait)."""
    return getattr(call.op, "namespace", None) in COLLECTIVE_NAMESPACES
