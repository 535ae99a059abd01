"""`remat.fit`'s choice: the candidate plans of each block's trace, the step's predicted peak under one
candidate per block call, and the solvers that choose the cheapest that fits (NOTE [planning a step])."""

from __future__ import annotations

import collections
import dataclasses
import math
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .._core._calls import Decision, Trace
from .._deciding._decide import decide, decide_nested
from .._memory import _step
from .._partitioning._accounting import account, account_for
from .._partitioning._peak import peak_of
from .._report import Peak
from .._storing._storage import shrinking

__all__ = [
    "BYTE_BUDGETS",
    "FRACTIONS",
    "Candidate",
    "Group",
    "Planned",
    "Row",
    "candidates",
    "predicted_peak",
    "solve",
    "solve_chain",
    "step_rows",
]


@dataclasses.dataclass(frozen=True)
class Candidate:
    label: str
    decisions: tuple[Decision, ...]
    cost: float  # replay cost, in the `cost` model's unit
    peak: Peak  # predicted forward, after-forward and backward bytes
    host_bytes: int = 0  # kept in host memory (offloaded)


class Planned:
    """A block's policy under `remat.fit`: the decisions planned for each of its traces; nothing saved
    for a trace not planned yet (the probe step's plan)."""

    def __init__(self, name: str):
        self.name = name
        self._chosen: weakref.WeakKeyDictionary[Trace, tuple[Decision, ...]] = weakref.WeakKeyDictionary()
        self._by_call: dict[Hashable, Decision] = {}  # See NOTE [planning on the meta device].

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        chosen = self._chosen.get(trace)
        if chosen is not None:
            return chosen
        return tuple(self._by_call.get(_call_key(call), Decision.RECOMPUTE) for call in trace)

    def choose(self, trace: Trace, decisions: tuple[Decision, ...]) -> None:
        self._chosen[trace] = decisions
        self._by_call.update((_call_key(call), decision) for call, decision in zip(trace, decisions, strict=True))

    def __repr__(self) -> str:
        return f"remat.fit plan of {self.name!r}"


def _call_key(call: Any) -> Hashable:
    """What matches a call of a block's trace to the same call of another trace of the block: the op,
    the module that issued it, how many calls of that op came before, the shapes and dtypes it returns
    (not their device: a plan made on fake tensors holds on the real ones)."""
    return (call.op, call.module, call.occurrence, tuple((o.shape, o.dtype) for o in call.outputs))


@dataclasses.dataclass(frozen=True)
class _Fixed:
    decisions: tuple[Decision, ...]

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        return self.decisions


# --- candidates ------------------------------------------------------------------------------------------

FRACTIONS = tuple(k / 10 for k in range(1, 10))
BYTE_BUDGETS = 16  # as `budget(peak_bytes=...)` spreads them: see NOTE [planning for a peak]


def candidates(
    trace: Trace,
    regions: Any,
    cost: str,
    exact: bool,
    pack: bool = True,
    compress: str | None = None,
    offload: bool = False,
) -> list[Candidate]:
    """The plans `fit` chooses among for one block's trace, each once (the first label it was found by).
    The first is saving nothing, the probe step's plan. With `pack` (and `compress`), the budget planner's
    plans keep values as bits (`remat.PACK`; and in the narrower format) where the replays the freed bytes
    save cost more than that, and their cost counts the storing and loading. With `offload`, they keep values in host
    memory where the copies compute does not hide cost less than the replays (NOTE [the budget problem]),
    and their cost counts that copy time."""
    from .. import policies
    from .._deciding._budget import HostLink, Shrinking, call_costs, minimum_bytes, replay_cost

    assert trace.joint is not None, "a block's trace carries its graph, for peak predictions"
    costs = call_costs(trace, cost)
    shrink = shrinking(pack, compress)
    in_fewer_bytes = Shrinking.of(trace, cost, shrink)
    link = HostLink.of(trace, cost) if offload else None
    # Among plans of one replay cost, the one that shrinks less.
    tie = 1e-9 * (sum(costs) or 1.0)
    found: dict[tuple[Decision, ...], Candidate] = {}

    def add(label: str, planned: Sequence[Decision]) -> None:
        decisions = decide_nested(_Fixed(tuple(planned)), trace, regions)  # as the block will run them
        if decisions not in found:
            accounting = account_for(trace, decisions)
            shrunk = sum(
                1 for kept in accounting.kept_by_call.values() if kept.storage in shrink and kept.stored_nbytes
            )
            replay = replay_cost(accounting, costs, link) + in_fewer_bytes.cost_of(accounting) + tie * shrunk
            # As the probe step measures it: NOTE [generator states in the peak].
            peak = peak_of(trace, decisions, generator_states=False)
            found[decisions] = Candidate(label, decisions, replay, peak, accounting.offloaded_bytes)

    builtins = {
        "save_nothing": policies.save_nothing,
        "save_everything": policies.save_everything,
        "dots_saveable": policies.dots_saveable,
        "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
    }
    if pack:  # the uniform plans it may use: never costlier than the best of them that fits
        builtins["pack_everything"] = policies.pack_everything
    if compress is not None:
        builtins[f"compress(save_everything, {compress!r})"] = policies.compress(policies.save_everything, compress)
    if offload:
        builtins["offload_dots"] = policies.offload_dots
        builtins["offload(save_everything)"] = policies.offload(policies.save_everything)
    for label, policy in builtins.items():
        add(label, decide(policy, trace))
    options = {"cost": cost, "exact": exact, "pack": pack, "compress": compress, "offload": offload}
    budgets = [policies.budget(fraction=f, **options) for f in FRACTIONS]  # type: ignore[arg-type]
    low = minimum_bytes(trace, link, in_fewer_bytes if shrink else None)
    high = account(trace, range(len(trace))).saved_bytes
    budgets += [
        policies.budget(max_bytes=low + (high - low) * i // (BYTE_BUDGETS - 1), **options)  # type: ignore[arg-type]
        for i in range(BYTE_BUDGETS)
    ]
    for budget in budgets:
        try:
            add(repr(budget), budget.plan(trace))
        except ValueError:  # below the fewest bytes any decisions keep
            continue
    return list(found.values())


# --- the step's 0-1 program ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Group:
    """One choice of the program: a block module at one of its traces (its calls at that trace share it)."""

    name: str
    policy: Planned
    trace: Trace
    options: tuple[Candidate, ...]  # options[0] is the probe step's plan


@dataclasses.dataclass(frozen=True)
class Row:
    """A segment of the probe step as a function of the choices: its peak is `measured` plus, for each
    (group, option) chosen, `terms[(group, option)]`."""

    segment: _step.Segment
    terms: dict[tuple[int, int], int]

    def peak(self, choice: Sequence[int]) -> int:
        return self.segment.peak + sum(self.terms.get((g, k), 0) for g, k in enumerate(choice))


def step_rows(timeline: _step.Timeline, group_of: Sequence[int], groups: Sequence[Group]) -> list[Row]:
    """Each segment's peak as a function of the choices: see NOTE [a step's timeline]."""

    def moved(by: Callable[[Peak], int]) -> list[list[int]]:  # per group, per option
        return [[by(option.peak) - by(group.options[0].peak) for option in group.options] for group in groups]

    kept = moved(lambda peak: peak.after_forward)
    forward, backward = moved(lambda peak: peak.forward), moved(lambda peak: peak.backward)
    rows = []
    for segment in timeline.segments:
        alive = collections.Counter(group_of[call] for call in segment.alive)  # calls of a group move alike
        terms = {(g, k): count * change for g, count in alive.items() for k, change in enumerate(kept[g])}
        own = {_step.Phase.FORWARD: forward, _step.Phase.BACKWARD: backward}.get(segment.phase)
        if own is not None and segment.call is not None:
            g = group_of[segment.call]
            for k, change in enumerate(own[g]):
                terms[(g, k)] = terms.get((g, k), 0) + change
        rows.append(Row(segment, terms))
    return rows


def predicted_peak(rows: Sequence[Row], choice: Sequence[int]) -> tuple[int, Row | None]:
    best: tuple[int, Row | None] = (0, None)
    for row in rows:
        peak = row.peak(choice)
        if best[1] is None or peak > best[0]:
            best = (peak, row)
    return best


def solve_chain(
    groups: Sequence[Group], rows: Sequence[Row], group_of: Sequence[int], target: int
) -> tuple[list[int] | None, bool]:
    """The cheapest choice whose predicted peak is at most `target`, by dynamic programming over the block
    calls in order, where the step is a chain: each block call its own choice, and every segment holds the
    kept values of the calls before one call and lies in that call (or between it and the one before).
    Returns (choice or None if none fits, whether the step was a chain: if not, nothing was solved).

    The states after k calls are the Pareto front of (bytes the first k calls keep beyond saving nothing,
    replay cost); exact, as the 0-1 program is, and fast where HiGHS branches long on identical blocks.
    Only states that can still fit are carried (see `_chain_caps`), and only options no other option of
    the same call beats on cost, kept bytes and the room its own peak leaves."""
    import numpy as np

    n = len(group_of)
    if sorted(group_of) != list(range(n)) or list(group_of) != sorted(group_of):
        return None, False
    before: list[int] = [target] * (n + 1)  # before[k]: the most the first k calls may keep beyond saving nothing
    inside: list[np.ndarray] = [np.full(len(groups[k].options), target, dtype=np.int64) for k in range(n)]
    own_terms: dict[tuple[int, _step.Phase], np.ndarray] = {}  # a call's own peak moves alike in one phase
    room_in: dict[tuple[int, _step.Phase], int] = {}
    for row in rows:
        segment = row.segment
        m = len(segment.alive)
        if segment.alive != frozenset(range(m)):
            return None, False
        room = target - segment.peak
        if segment.call is None:
            before[m] = min(before[m], room)
        elif segment.call != m:
            return None, False
        else:  # inside call m: its own peak's change, for each of its options
            key = (m, segment.phase)
            if key not in own_terms:
                own_terms[key] = np.array([row.terms.get((m, o), 0) for o in range(len(groups[m].options))])
            room_in[key] = min(room_in.get(key, room), room)
    for (m, phase), room in room_in.items():
        inside[m] = np.minimum(inside[m], room - own_terms[(m, phase)])
    kept = [np.array([o.peak.after_forward - g.options[0].peak.after_forward for o in g.options]) for g in groups]
    costs = [np.array([o.cost for o in g.options], dtype=np.float64) for g in groups]
    cheapest = [int(np.lexsort((-inside[k], kept[k], costs[k]))[0]) for k in range(n)]
    if _chain_fits(cheapest, before, inside, kept):
        return cheapest, True  # the least cost of each call is the least of their sum
    caps = _chain_caps(before, inside, kept)
    front_kept, front_cost = np.zeros(1, dtype=np.int64), np.zeros(1)
    parents: list[tuple[np.ndarray, np.ndarray]] = []
    for k in range(n):
        fits = front_kept <= before[k]
        states = np.flatnonzero(fits)
        new_kept, new_cost, parent, option = [], [], [], []
        for o in _undominated(kept[k], costs[k], inside[k]):
            ok = states[front_kept[states] <= inside[k][o]]
            ok = ok[front_kept[ok] + kept[k][o] <= caps[k + 1]]
            new_kept.append(front_kept[ok] + kept[k][o])
            new_cost.append(front_cost[ok] + costs[k][o])
            parent.append(ok)
            option.append(np.full(len(ok), o))
        all_kept, all_cost = np.concatenate(new_kept), np.concatenate(new_cost)
        if not len(all_kept):
            return None, True
        order = np.lexsort((all_cost, all_kept))
        all_kept, all_cost = all_kept[order], all_cost[order]
        best_so_far = np.minimum.accumulate(all_cost)
        keep = np.ones(len(all_cost), dtype=bool)
        keep[1:] = all_cost[1:] < best_so_far[:-1]  # strictly cheaper than every state keeping less
        chosen = order[keep]
        front_kept, front_cost = all_kept[keep], all_cost[keep]
        parents.append((np.concatenate(parent)[chosen], np.concatenate(option)[chosen]))
    final = np.flatnonzero(front_kept <= before[n])
    if not len(final):
        return None, True
    state = int(final[np.argmin(front_cost[final])])
    choice = [0] * n
    for k in range(n - 1, -1, -1):
        parent_of, option_of = parents[k]
        choice[k] = int(option_of[state])
        state = int(parent_of[state])
    return choice, True


def _chain_fits(choice: Sequence[int], before: Sequence[int], inside: Sequence[Any], kept: Sequence[Any]) -> bool:
    """Whether one option per call keeps every segment of the chain within its room."""
    total = 0
    for k, o in enumerate(choice):
        if total > before[k] or total > inside[k][o]:
            return False
        total += int(kept[k][o])
    return total <= before[len(choice)]


def _chain_caps(before: Sequence[int], inside: Sequence[Any], kept: Sequence[Any]) -> list[int]:
    """caps[k]: the most the first k calls may keep beyond saving nothing and still leave some choice of the
    later calls within every later segment (each later call adds at least its least kept bytes)."""
    n = len(kept)
    caps = [0] * (n + 1)
    caps[n] = before[n]
    for k in range(n - 1, -1, -1):  # the first k calls, then call k with its least kept bytes, then the rest
        limit = min(before[k], int(inside[k].max()))
        caps[k] = min(limit, caps[k + 1] - int(kept[k].min()))
    return caps


def _undominated(kept: Any, costs: Any, room: Any) -> list[int]:
    """The options of one call that no other option beats: none keeps as little or less, costs as little or
    less and leaves as much room or more inside the call, being better in one (the first of equals stays)."""
    import numpy as np

    options = []
    for o in range(len(kept)):
        beaten = (kept <= kept[o]) & (costs <= costs[o]) & (room >= room[o])
        better = (kept < kept[o]) | (costs < costs[o]) | (room > room[o])
        earlier_equal = ~better & (np.arange(len(kept)) < o)
        if not np.any(beaten & (better | earlier_equal)):
            options.append(o)
    return options


def solve(
    groups: Sequence[Group], rows: Sequence[Row], target: int | None, exact: bool
) -> tuple[list[int] | None, float]:
    """The cheapest choice (an option per group) whose predicted peak is at most `target`; with
    `target=None`, the choice of the lowest predicted peak. (None if none fits, and the optimum.)"""
    import numpy as np

    from .._deciding import _milp

    offsets = [0]
    for group in groups:
        offsets.append(offsets[-1] + len(group.options))
    n = offsets[-1] + (1 if target is None else 0)  # the lowest-peak program has the peak as a variable
    unit = 1024.0  # bytes in KiB, to keep HiGHS's numbers moderate
    scale = max((o.cost for g in groups for o in g.options), default=0.0) or 1.0
    objective = np.zeros(n)
    if target is None:
        objective[-1] = 1.0
    else:
        for g, group in enumerate(groups):
            for k, option in enumerate(group.options):
                objective[offsets[g] + k] = option.cost / scale
    one_each = [{offsets[g] + k: 1.0 for k in range(len(group.options))} for g, group in enumerate(groups)]
    peaks: list[dict[int, float]] = []
    upper: list[float] = []
    for row in rows:
        peaks.append({offsets[g] + k: term / unit for (g, k), term in row.terms.items()})
        if target is None:
            peaks[-1][n - 1] = -1.0
            upper.append(-row.segment.peak / unit)
        else:
            upper.append((target - row.segment.peak) / unit)
    integral = np.ones(n, dtype=bool)
    column_upper = np.ones(n)
    if target is None:
        integral[-1], column_upper[-1] = False, np.inf
    solution = _milp.solve(
        objective,
        [*one_each, *peaks],
        [1.0] * len(one_each) + [-np.inf] * len(peaks),
        [1.0] * len(one_each) + upper,
        column_upper=column_upper,
        integral=integral,
        time_limit=None if exact else 5.0,
    )
    if solution.x is None:
        return None, math.inf
    choice = [int(np.argmax(solution.x[offsets[g] : offsets[g + 1]])) for g in range(len(groups))]
    return choice, solution.objective


# --- fit -------------------------------------------------------------------------------------------------
