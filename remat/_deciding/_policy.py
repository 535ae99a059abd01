"""The algebra of policies: `Policy`, the base of the built-in ones, and its combinators.

`remat.policies` builds on it (and re-exports it), and so does the SAC bridge (`_sac`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, Union

from .._core._calls import Call, Decision, Trace
from ._decide import decide, decide_call

__all__ = [
    "Planner",
    "Policy",
    "PolicyLike",
    "compress",
    "offload",
    "pack",
    "save_all_of",
    "save_any_of",
    "save_unless",
]


class Planner(Protocol):
    """A whole-trace policy: one decision per call of a trace (a memory budget, say)."""

    def plan(self, trace: Trace) -> Sequence[Decision]: ...


PolicyLike = Union[Callable[[Call], Decision | bool], "Policy", Planner, None]
"""What a `policy=` argument takes: a function of a call (a `Decision`, or True to save), a planner, or
None (replay everything)."""


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


# SAVE > PACK > OFFLOAD > FLOAT16 > BFLOAT16 > FP8 > RECOMPUTE, exact before approximate: `|` takes the higher
# of two decisions, `&` the lower.
_ORDER = (
    Decision.RECOMPUTE,
    Decision.FP8,
    Decision.BFLOAT16,
    Decision.FLOAT16,
    Decision.OFFLOAD,
    Decision.PACK,
    Decision.SAVE,
)
_RANK = {decision: rank for rank, decision in enumerate(_ORDER)}


def _combine(decisions: Iterable[Decision], require_all: bool) -> Decision:
    return (min if require_all else max)(decisions, key=_RANK.__getitem__)


@dataclasses.dataclass(frozen=True, repr=False)
class _Combined(Policy):
    policies: tuple[Any, ...]
    require_all: bool

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        plans = [decide(policy, trace) for policy in self.policies]
        if not plans:
            return (Decision.SAVE if self.require_all else Decision.RECOMPUTE,) * len(trace)
        return tuple(_combine((plan[i] for plan in plans), self.require_all) for i in range(len(trace)))

    def _decide(self, call: Call) -> Decision:
        if not self.policies:
            return Decision.SAVE if self.require_all else Decision.RECOMPUTE
        return _combine((decide_call(policy, call) for policy in self.policies), self.require_all)

    def __repr__(self) -> str:
        name = "save_all_of" if self.require_all else "save_any_of"
        return f"{name}({', '.join(map(repr, self.policies))})"


def save_any_of(*policies: PolicyLike) -> Policy:
    """Save a call if any of `policies` saves it (JAX's `save_from_both_policies`); also `p | q`.

    Otherwise pack it if any of them packs it, offload it if any offloads it, and recompute it if none
    keeps it.

    >>> import torch, remat
    >>> from remat.policies import save_ops, save_any_of
    >>> save_any_of(save_ops(torch.ops.aten.mm), save_ops(torch.ops.aten.bmm))
    save_any_of(save_ops(aten.mm), save_ops(aten.bmm))
    """
    return _Combined(tuple(policies), require_all=False)


def save_all_of(*policies: PolicyLike) -> Policy:
    """Save a call only if every one of `policies` saves it; also `p & q`.

    Recompute it if any of them recomputes it; otherwise offload it if any offloads it, and pack it if
    any packs it.

    >>> import torch, remat
    >>> from remat.policies import save_ops, save_calls
    >>> save_ops(torch.ops.aten.mm) & save_calls(0, 1)
    save_all_of(save_ops(aten.mm), save_calls(0, 1))
    """
    return _Combined(tuple(policies), require_all=True)


_OPPOSITE = {
    **{decision: decision for decision in Decision},  # kept elsewhere or otherwise stays so
    Decision.SAVE: Decision.RECOMPUTE,
    Decision.RECOMPUTE: Decision.SAVE,
}


@dataclasses.dataclass(frozen=True, repr=False)
class _Not(Policy):
    """Save what `policy` recomputes and recompute what it saves; what it offloads or packs stays so."""

    policy: Any

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        return tuple(_OPPOSITE[d] for d in decide(self.policy, trace))

    def _decide(self, call: Call) -> Decision:
        return _OPPOSITE[decide_call(self.policy, call)]

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


@dataclasses.dataclass(frozen=True, repr=False)
class _KeptAs(Policy):
    """What `policy` keeps, kept as `decision` says (OFFLOAD, PACK); the rest stays RECOMPUTE."""

    policy: Any
    decision: Decision

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        return tuple(self.decision if d.keeps else d for d in decide(self.policy, trace))

    def _decide(self, call: Call) -> Decision:
        return self.decision if decide_call(self.policy, call).keeps else Decision.RECOMPUTE

    def __repr__(self) -> str:
        if self.decision in _FORMATS.values():
            return f"compress({self.policy!r}, {self.decision.value!r})"
        return f"{self.decision.value}({self.policy!r})"


def offload(policy: PolicyLike) -> Policy:
    """Offload what `policy` keeps: its SAVE decisions become OFFLOAD, the rest stays RECOMPUTE.

    The kept outputs of those calls wait for backward in host memory instead of on their
    device (see `remat.Decision`). Combine with `|` to save some calls and offload others:
    `save_tagged("q") | offload(save_tagged("k", "v"))`.

    >>> import torch, remat
    >>> from remat.policies import offload, save_ops
    >>> offload(save_ops(torch.ops.aten.mm)).plan(remat.trace(lambda a, b: (a @ b).relu(), torch.ones(2, 3), torch.ones(3, 4)))
    (remat.OFFLOAD, remat.RECOMPUTE)
    """
    return _KeptAs(policy, Decision.OFFLOAD)


def pack(policy: PolicyLike) -> Policy:
    """Pack what `policy` keeps: its SAVE decisions become PACK, the rest stays RECOMPUTE.

    The kept outputs of those calls wait for backward on their device in fewer bytes wherever
    that is exact (booleans, dropout's masks and values read only through a test, such as a ReLU's output,
    as bits: docs/storage.md), as they are elsewhere.

    >>> import torch, remat
    >>> from remat.policies import pack, save_everything
    >>> pack(save_everything).plan(remat.trace(lambda x: torch.where(x > 0, x, 0.0).sum(), torch.ones(3)))
    (remat.PACK, remat.PACK, remat.PACK, remat.PACK)
    """
    return _KeptAs(policy, Decision.PACK)


_FORMATS = {"float16": Decision.FLOAT16, "bfloat16": Decision.BFLOAT16, "fp8": Decision.FP8}


def compress(policy: PolicyLike, format: str) -> Policy:
    """Keep what `policy` keeps in a narrower `format`, approximately, where only gradient formulas read it.

    `format` is `"float16"` or `"bfloat16"` (float32 values) or `"fp8"` (e4m3 with a scale per row, for
    float32 and bfloat16 values). The gradients that read a compressed value differ from eager's by its
    rounding; `remat.report` shows the largest error each introduced on its batch. A value that a replay
    reads, or that is not of those dtypes, is kept as `SAVE` keeps it. See docs/storage.md.

    >>> import torch, remat
    >>> from remat.policies import compress, save_everything
    >>> compress(save_everything, "fp8").plan(remat.trace(lambda x: x.sin().exp().sum(), torch.ones(64, 64)))
    (remat.Decision.FP8, remat.Decision.FP8, remat.Decision.FP8)
    """
    if format not in _FORMATS:
        raise ValueError(
            f"remat.policies.compress: `format` must be one of {', '.join(map(repr, _FORMATS))}, but got {format!r}."
        )
    return _KeptAs(policy, _FORMATS[format])
