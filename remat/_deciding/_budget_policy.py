"""The memory-budget planner as a policy (`remat.policies.budget`, `Budget`): its options, the solver it
calls (`_budget`, with highspy, imported on first use) and the plans it solves once per trace."""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._core._calls import Call, Decision, Trace, format_bytes
from .._partitioning._accounting import account
from .._storing._storage import shrinking
from ..costs import DEVICES, resolve_device
from ._policy import (
    _FORMATS,
    Policy,
)

if TYPE_CHECKING:  # highspy, which solving needs, is imported on first use
    from ._budget import Plan


__all__ = ["Budget", "budget"]


class _Solved:
    """The plans solved for one trace, by planner, and the lock the threads calling its function take
    turns on (a trace is shared by the threads that call one checkpointed function)."""

    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}
        self.lock = threading.Lock()


_solved: weakref.WeakKeyDictionary[Trace, _Solved] = weakref.WeakKeyDictionary()
_solved_lock = threading.Lock()


def _solved_once(trace: Trace, planner: Any, solve: Callable[[Trace], Any]) -> Any:
    """`planner`'s result for `trace`: `solve(trace)` the first time, the same result after, for as
    long as the trace lives."""
    with _solved_lock:
        solved = _solved.setdefault(trace, _Solved())
    with solved.lock:
        if planner not in solved.plans:
            solved.plans[planner] = solve(trace)
        return solved.plans[planner]


@dataclasses.dataclass(frozen=True, repr=False)
class Budget(Policy):
    """A memory-budget planner: see `budget`.

    >>> import torch, remat
    >>> policy = remat.policies.budget(max_bytes=4000, exact=True)
    >>> trace = remat.trace(lambda x: x.sin().sin().sin().sum(), torch.ones(1000, requires_grad=True))
    >>> plan = policy.solve(trace)  # keep one sin's output (4000 bytes), replay the other
    >>> plan.saved_bytes, plan.cost
    (4000, 1000.0)
    """

    max_bytes: int | None
    fraction: float | None
    cost: str
    exact: bool
    peak_bytes: int | None = None
    offload: bool = False
    pack: bool = True
    compress: str | None = None

    @property
    def shrink(self) -> tuple[Any, ...]:
        """The storages of fewer device bytes it may keep values in: bits, a narrower format."""
        return shrinking(self.pack, self.compress)

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        return self.solve(trace).decisions

    def solve(self, trace: Trace) -> Plan:
        """The `Plan` for `trace`: decisions, bytes kept, replay cost, a lower bound on the
        optimal cost (the gap), and the solve time. Cached with the trace."""
        if trace.dataflow is None or (self.peak_bytes is not None and trace.joint is None):
            raise TypeError(
                f"remat.policies.{self!r}: a budget plans over the dataflow of a whole trace, which this trace does "
                "not carry (a budget inside a nested checkpoint, or a hand-made Trace). Use it on the outermost "
                "checkpoint, or a per-call policy inside."
            )
        return _solved_once(trace, self, self._solve)

    def _solve(self, trace: Trace) -> Plan:
        from ._budget import InfeasibleBudget, InfeasiblePeak, solve, solve_peak  # highspy, on first use

        assert trace.dataflow is not None
        if self.peak_bytes is not None:
            try:
                return solve_peak(trace, self.peak_bytes, self.cost, self.exact, self.offload, self.shrink)
            except InfeasiblePeak as error:
                raise ValueError(
                    f"remat.policies.{self!r}: no plan found peaks as low as {format_bytes(self.peak_bytes)} "
                    f"({self.peak_bytes:,} bytes) for this trace; the lowest predicted peak is "
                    f"{format_bytes(error.lowest)} ({error.lowest:,} bytes). Raise the bound to at least that, "
                    "or checkpoint smaller pieces of the model."
                ) from None
        budget = self.max_bytes
        if budget is None:
            everything = account(trace, range(len(trace))).saved_bytes
            budget = math.floor(self.fraction * everything)  # type: ignore[operator]
        try:
            return solve(trace, budget, self.cost, self.exact, self.offload, self.shrink)
        except InfeasibleBudget as error:
            raise ValueError(
                f"remat.policies.{self!r}: no decisions keep as few as {format_bytes(budget)} ({budget:,} bytes) "
                f"for this trace; the fewest any keep is {format_bytes(error.minimum)} ({error.minimum:,} bytes: "
                "generator states of replayed random calls, inputs the function overwrites, values kept as bits). "
                "Raise the budget to at least that."
            ) from None

    def _decide(self, call: Call) -> Decision:
        raise TypeError(
            f"remat.policies.{self!r} plans for a whole trace; call `.plan(trace)`, not the policy on one call."
        )

    def __repr__(self) -> str:
        if self.peak_bytes is not None:
            limit = f"peak_bytes={self.peak_bytes}"
        elif self.max_bytes is not None:
            limit = f"max_bytes={self.max_bytes}"
        else:
            limit = f"fraction={self.fraction!r}"
        cost = "" if self.cost == "flops" else f", cost={self.cost!r}"
        options = f"{', exact=True' if self.exact else ''}{', offload=True' if self.offload else ''}"
        options += (
            f"{'' if self.pack else ', pack=False'}{'' if self.compress is None else f', compress={self.compress!r}'}"
        )
        return f"budget({limit}{cost}{options})"


def budget(
    max_bytes: int | None = None,
    fraction: float | None = None,
    *,
    peak_bytes: int | None = None,
    cost: str = "flops",
    exact: bool = False,
    offload: bool = False,
    pack: bool = True,
    compress: str | None = None,
) -> Budget:
    """Replay as little as possible while keeping at most a budget of bytes (a planner).

    For each trace, chooses SAVE, PACK or RECOMPUTE for every call to minimize the replay
    cost, subject to the bytes kept between forward and backward (activations and
    generator states, exactly as `remat.report` counts them) staying within the
    budget. The budget is `max_bytes`, or a `fraction` of what `save_everything`
    keeps. A budget below what any decisions can keep raises `ValueError` with the
    minimum. Plans are computed once per trace and cached with it.

    With `peak_bytes` instead, the bound is on the peak of forward and backward
    (`remat.Report.peak_bytes`, what decides an out-of-memory): of the plans the
    byte budget gives at 16 budgets from the fewest bytes to all of them, and of
    saving everything and saving nothing, the cheapest whose predicted peak is
    within `peak_bytes`. Its predicted peak never
    exceeds the bound; a bound no plan meets raises `ValueError` with the lowest peak.

    Args:
        max_bytes: the budget in bytes.
        fraction: the budget as a fraction (0 to 1) of `save_everything`'s bytes.
        peak_bytes: a bound on the predicted peak bytes of forward and backward.
        cost: `"flops"` (the calls' FLOPs) or `"roofline:<device>"` (estimated seconds
            on a device of `remat.costs.DEVICES`, such as `"roofline:h100"`).
        exact: solve to optimality (a 0-1 program, with HiGHS); the default
            gives branch and bound half a second, falls back on its LP relaxation
            rounded and repaired, and reports its largest possible gap to the optimum
            (`policy.solve(trace).gap`).
        offload: also choose OFFLOAD: keep a value in host memory, where it costs no device
            bytes but two copies over the host link of the `cost` device
            (`remat.costs.Device.host_bandwidth`). A copy costs only the time the compute
            after its producer (in forward, and before its consumer in backward) does not
            hide; copies queue on one link. Needs `cost="roofline:<device>"`, so that replays
            and copies are both in seconds. The device bytes stay within the budget.
        pack: also choose PACK where it helps: keep booleans, dropout's masks and values read
            only through a test as bits, exactly (docs/storage.md), where the replays the freed
            bytes save cost more than packing: its memory-bound passes over the value (with `cost="roofline:<device>"`,
            in seconds; with FLOPs, one per element per pass, as an elementwise call counts).
            `pack=False` keeps every kept value as it is.
        compress: also choose this narrower format, approximately, where it helps:
            `"float16"`, `"bfloat16"` or `"fp8"` (as `remat.policies.compress` keeps values;
            docs/storage.md). None (the default): never; no planner compresses unless asked.

    Needs highspy, HiGHS's Python binding (`pip install highspy`, or `remat[planner]`).

    >>> import torch, remat
    >>> def f(x):
    ...     return x.sin().exp().cos().sum()
    >>> x = torch.ones(1000, requires_grad=True)
    >>> policy = remat.policies.budget(max_bytes=4000)
    >>> remat.report(f, x, policy=policy).saved_bytes <= 4000
    True
    """
    if sum(limit is not None for limit in (max_bytes, fraction, peak_bytes)) != 1:
        raise TypeError(
            "remat.policies.budget: give exactly one of `max_bytes` (bytes kept), `fraction` (0 to 1 of what "
            "save_everything keeps) and `peak_bytes` (the peak of forward and backward)."
        )
    for name, limit in (("max_bytes", max_bytes), ("peak_bytes", peak_bytes)):
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"remat.policies.budget: `{name}` must be a non-negative integer, but got {limit!r}.")
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1
    ):
        raise ValueError(
            f"remat.policies.budget: `fraction` is of what save_everything keeps, from 0 to 1, but got {fraction!r}."
        )
    if not isinstance(cost, str) or not (cost == "flops" or cost.startswith("roofline:")):
        raise ValueError(
            f"remat.policies.budget: `cost` must be 'flops' or 'roofline:<device>' (one of "
            f"{', '.join(repr('roofline:' + name) for name in DEVICES)}), but got {cost!r}."
        )
    if cost != "flops":
        resolve_device(cost.removeprefix("roofline:"))
    elif offload:
        raise ValueError(
            "remat.policies.budget: offload=True weighs copies against replays in seconds, so it needs "
            "cost='roofline:<device>' (such as 'roofline:h100'), whose host bandwidth times the copies."
        )
    if compress is not None and compress not in _FORMATS:
        raise ValueError(
            f"remat.policies.budget: `compress` must be None or one of {', '.join(map(repr, _FORMATS))}, "
            f"but got {compress!r}."
        )
    return Budget(
        max_bytes,
        None if fraction is None else float(fraction),
        cost,
        bool(exact),
        peak_bytes,
        bool(offload),
        bool(pack),
        compress,
    )
