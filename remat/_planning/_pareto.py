"""`remat.pareto`: how replay cost falls as the memory budget grows, for one function."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from .. import policies
from .._api._inspect import trace as trace_of
from .._core._calls import Decision, Trace, format_bytes
from .._core._deprecated import warn_renamed
from .._deciding._decide import is_collective
from .._partitioning._accounting import account_for
from .._partitioning._peak import peak_of
from ..costs import estimate_seconds

__all__ = ["Pareto", "ParetoPoint", "pareto"]


@dataclasses.dataclass(frozen=True)
class ParetoPoint:
    """One plan: the bytes it keeps, its predicted peak and what backward replays."""

    label: str
    saved_bytes: int
    replay_flops: int
    replay_seconds: float  # roofline estimate on the device the curve is timed on (`Pareto.timed_on`)
    peak_bytes: int  # predicted peak of forward and backward (`remat.Report.peak_bytes`)


@dataclasses.dataclass(frozen=True)
class Pareto:
    """The budget planner's curve for one trace, and the built-in policies beside it.

    Attributes:
        curve: one point per budget, by growing budget: the exact planner's optimum.
        policies: `save_nothing`, `dots_saveable` and `save_everything` on the same trace.
        timed_on: the device of `remat.costs.DEVICES` the replay times are roofline estimates on (a cost
            model's name, not a torch device).

    >>> import torch, remat
    >>> x = torch.ones(1000, requires_grad=True)
    >>> frontier = remat.pareto(lambda x: x.sin().sin().sin().sum(), x, budgets=[0, 4000, 8000])
    >>> [(point.saved_bytes, point.replay_flops) for point in frontier.curve]
    [(0, 2000), (4000, 1000), (8000, 0)]
    >>> [point.label for point in frontier.policies]
    ['save_nothing', 'dots_saveable', 'save_everything']
    """

    curve: tuple[ParetoPoint, ...]
    policies: tuple[ParetoPoint, ...]
    timed_on: str

    @property
    def device(self) -> str:
        """Deprecated: `timed_on`."""
        warn_renamed("remat.Pareto.device", "remat.Pareto.timed_on")
        return self.timed_on

    def to_dict(self) -> dict[str, Any]:
        """The curve and the policies' points as plain data."""
        return {
            "timed_on": self.timed_on,
            "curve": [dataclasses.asdict(p) for p in self.curve],
            "policies": [dataclasses.asdict(p) for p in self.policies],
        }

    def plot(self, *, time: bool = False, peak: bool = False) -> Any:
        """A matplotlib figure: bytes kept (or, with `peak=True`, the predicted peak of
        forward and backward) against replay FLOPs (or estimated seconds with `time=True`),
        the planner's curve as a line and the built-in policies as labeled points. Save it
        with `figure.savefig(path)`. Needs matplotlib."""
        import matplotlib.pyplot as plt

        def x(point: ParetoPoint) -> float:
            return (point.peak_bytes if peak else point.saved_bytes) / 2**20

        def y(point: ParetoPoint) -> float:
            return point.replay_seconds * 1e6 if time else point.replay_flops

        figure, axes = plt.subplots(figsize=(6, 4))
        # The peak is not monotone in the bytes kept: without steps, in the curve's order.
        draw = axes.plot if peak else functools.partial(axes.step, where="post")
        draw(
            [x(p) for p in self.curve],
            [y(p) for p in self.curve],
            marker="o",
            markersize=3,
            label="remat.policies.budget (exact)",
        )
        for point in self.policies:
            axes.scatter([x(point)], [y(point)], zorder=3)
            axes.annotate(point.label, (x(point), y(point)), textcoords="offset points", xytext=(5, 5))
        axes.set_xlabel("peak of forward and backward (MiB)" if peak else "activation memory kept (MiB)")
        axes.set_ylabel(f"replay time, roofline on {self.timed_on} (µs)" if time else "replay FLOPs")
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        return figure

    def __str__(self) -> str:
        rows = [f"{'kept':>12}  {'peak':>12}  {'replay FLOPs':>16}  {'replay time':>12}  plan"]
        for point in (*self.curve, *self.policies):
            rows.append(
                f"{format_bytes(point.saved_bytes):>12}  {format_bytes(point.peak_bytes):>12}  {point.replay_flops:>16,}  "
                f"{point.replay_seconds * 1e6:>10.2f}µs  {point.label}"
            )
        return "\n".join(rows)


def _point(label: str, trace: Trace, saved: set[int], device: str) -> ParetoPoint:
    saved = saved | {call.index for call in trace if is_collective(call)}  # always saved
    decisions = [Decision.SAVE if c in saved else Decision.RECOMPUTE for c in range(len(trace))]
    return _point_of(label, trace, decisions, device)


def _point_of(label: str, trace: Trace, decisions: Sequence[Decision], device: str) -> ParetoPoint:
    """The point of `decisions`, as the programs keep their values (packed, compressed, as they are)."""
    kept = account_for(trace, decisions)
    return ParetoPoint(
        label,
        kept.saved_bytes,
        kept.recompute_flops,
        sum(estimate_seconds(trace[c], device) for c in kept.replayed_calls),
        peak_of(trace, decisions).bytes,
    )


def pareto(
    fn: Callable[..., Any],
    /,
    *args: Any,
    budgets: Sequence[int] | None = None,
    cost: str = "flops",
    compress: str | None = None,
    device: str | None = None,
    **kwargs: Any,
) -> Pareto:
    """The memory/recompute Pareto curve of `fn` at these arguments.

    For each budget, the exact planner (`remat.policies.budget(max_bytes=b, exact=True)`)
    gives the least replay FLOPs that keep at most `b` bytes; beside the curve, the points of
    `save_nothing`, `dots_saveable` and `save_everything` show where the built-ins sit.

    Args:
        fn: a function or `nn.Module` (or a `remat.checkpoint` of one).
        *args: example arguments.
        budgets: byte budgets; by default 21, evenly spaced from what `save_nothing` keeps to
            what `save_everything` keeps.
        cost: the cost model, spelled as for `remat.policies.budget` and `remat.fit`: what the curve's plans
            replay least of, `"flops"` (the default) or `"roofline:<device>"` (estimated seconds on a device
            of `remat.costs.DEVICES`); the points' replay times are roofline estimates on that device (on
            an H100 where `cost` is `"flops"`).
        device: deprecated: the device of the time estimates alone (the curve minimizing FLOPs); name the
            cost model instead, `cost="roofline:<device>"`.
        compress: a narrower format the planner may also keep values in, approximately, as
            `remat.policies.budget(..., compress=...)` (None: only exact storages).
        **kwargs: example keyword arguments.

    Returns:
        A `remat.Pareto`: `.curve`, `.policies`, `.to_dict()`, `.plot()`.

    >>> import torch, remat
    >>> curve = remat.pareto(lambda x: x.sin().sin().sin().sum(), torch.ones(1000, requires_grad=True))
    >>> [p.replay_flops for p in curve.curve][::10]  # 0, 4000 and 8000 bytes: two, one, no sins replayed
    [2000, 1000, 0]
    """
    if device is not None:
        warn_renamed("remat.pareto(..., device=...)", "remat.pareto(..., cost='roofline:<device>')", stacklevel=2)
        timed_on = device
    else:
        try:  # a bad `cost` is refused as the planner refuses it
            policies.budget(max_bytes=0, cost=cost)
        except ValueError as error:
            raise ValueError(str(error).replace("remat.policies.budget", "remat.pareto")) from None
        timed_on = cost.removeprefix("roofline:") if cost.startswith("roofline:") else "h100"
    device = timed_on
    trace = trace_of(fn, *args, **kwargs)
    everything = _point("save_everything", trace, set(range(len(trace))), device)
    nothing = _point("save_nothing", trace, set(), device)
    if budgets is None:
        low, high = nothing.saved_bytes, everything.saved_bytes
        budgets = sorted({low + (high - low) * i // 20 for i in range(21)})
    curve = []
    for limit in budgets:
        plan = policies.budget(max_bytes=int(limit), exact=True, cost=cost, compress=compress).solve(trace)
        options = ("" if cost == "flops" else f", cost={cost!r}") + (
            "" if compress is None else f", compress={compress!r}"
        )
        label = f"budget(max_bytes={int(limit)}{options})"
        curve.append(_point_of(label, trace, plan.decisions, device))
    dots = {i for i, d in enumerate(policies.dots_saveable.plan(trace)) if d is Decision.SAVE}
    return Pareto(tuple(curve), (nothing, _point("dots_saveable", trace, dots, device), everything), device)
