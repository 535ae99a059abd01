"""`remat.policies.budget`: the cheapest replay that keeps at most a given number of bytes.

See NOTE [the budget problem].
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._core._calls import Decision, Trace, Value
from .._partitioning._accounting import Accounting, account, account_for, stored_calls
from .._partitioning._peak import peak_of
from .._partitioning._rules import COPIED, KEPT, RECOMPUTED, REPLAYED, SAVED, STATE, Atom, rules_of
from .._partitioning._value_graph import ValueGraph
from .._storing._storage import HOST, Storage
from ..costs import Device, estimate_seconds, resolve_device
from . import _milp
from ._decide import is_collective

__all__ = [
    "HostLink",
    "InfeasibleBudget",
    "InfeasiblePeak",
    "Plan",
    "call_costs",
    "minimum_bytes",
    "replay_cost",
    "solve",
    "solve_peak",
]

# NOTE [the budget problem]
# Choose SAVE (s_c = 1) or RECOMPUTE per call, minimizing the replay cost
# sum(cost_c * r_c) subject to the bytes kept <= budget. What a choice keeps and
# replays is what the rules (`_rules`) derive from it, and the 0-1 program is
# those same clauses as rows, one 0-1 variable per atom (r_c replayed, k_v kept,
# copies of overwritten inputs, p_c recomputed to differentiate again, g_c
# generator states): a clause "h if a_1 .. a_k and not b_1 .. b_m" is the row
#
#   a_1 + ... + a_k - b_1 - ... - b_m - h <= k - 1
#
# so a solution holds at least what the rules derive. Where a clause reads an
# atom's absence (a recomputation stops at a kept constant), the solver could
# claim that atom for free; so the kept values, and the replays that make them
# read, also get the converse rows: an atom implies every literal its clauses
# share (k_v <= s_c, r_c + s_c <= 1) and one of their other atoms (k_v <= the sum
# of the r_u reading v, unless backward reads it). The bytes:
#
#   sum(bytes_v k_v) + sum(state_c g_c) <= budget
#
# With offload allowed, a kept call may be kept in host memory (o_c = 1, o_c <= s_c).
# d_v says value v is kept on the device: d_v <= k_v, d_v >= k_v - o_c, and
# d_v <= 1 - o_c unless v is returned (the caller holds it on the device). The budget
# counts d_v's bytes instead of k_v's. The copies of host values queue on one link
# (t_v = bytes_v / host bandwidth): those of the values of calls j, j+1, ... start
# after call j, so whatever of them outlasts the compute after call j shows:
#
#   e_f >= sum(t_v (k_v - d_v) for v of calls >= j) - compute(calls > j)    for each j
#
# and in backward, whose reloads must land before it reaches call j, likewise with
# the backward's compute of the calls after j (twice their forward). The exposed
# copy time e_f + e_b is added to the replay cost, both in seconds.
#
# With storages of fewer device bytes allowed (bits, where that is exact: NOTE
# [values kept as bits]; a narrower format, where the user allows it: NOTE [values
# kept lossy]), a kept value that storage S holds may be kept so (y_vS = 1,
# y_vS <= k_v, or <= d_v with offload; for a value that comes back as a stand-in
# or rounded, y_vS + r_c <= 1 and y_vS + p_c - p_u <= 1 for each call c reading
# it, u making it, which would need the value itself): the budget counts its
# stored bytes (bytes_v k_v - shrink_vS y_vS), and the objective adds the
# memory-bound passes that store and load it (seconds on the roofline's device;
# with FLOPs, one per element per pass, as an elementwise call counts), so a
# plan shrinks a value only where the replays the bytes buy cost more. A call's
# decision names one storage (with several: y_vS <= u_cS, sum over S of u_cS <=
# 1), which keeps every value of the call it holds so: never more bytes than
# the program counts.
#
# The exact mode solves it with HiGHS's branch and bound; the fast mode solves its
# LP relaxation, rounds the saves, and repairs the result with `_accounting.account`, whose
# accounting is the partitioner's own. The LP optimum bounds the exact optimum from
# below, so the fast mode reports how far from optimal it can at most be.


@dataclasses.dataclass(frozen=True)
class Plan:
    """Decisions for one trace under a byte budget, and what they cost."""

    decisions: tuple[Decision, ...]
    saved_bytes: int  # on the device, as the partitioner will keep them
    cost: float  # replay cost (and copy time not hidden by compute), in the budget's cost unit
    lower_bound: float  # no decisions within the budget cost less
    seconds: float  # solve time
    peak_bytes: int | None = None  # the predicted peak of forward and backward (planning for a peak)
    offloaded_bytes: int = 0  # kept in host memory

    @property
    def gap(self) -> float:
        """How far above the optimum `cost` can be, as a fraction of it (0 when proven optimal)."""
        if self.cost <= self.lower_bound or self.cost == 0:
            return 0.0
        return (self.cost - self.lower_bound) / self.cost


@dataclasses.dataclass(frozen=True)
class HostLink:
    """What offloading costs: seconds per byte each way, and each call's compute in seconds."""

    seconds_per_byte: float
    compute: tuple[float, ...]

    @staticmethod
    def of(trace: Trace, cost: str) -> HostLink:
        device = resolve_device(cost.removeprefix("roofline:"))
        return HostLink(HOST.move_seconds(device, 1.0), tuple(estimate_seconds(call, device) for call in trace))

    def exposed_seconds(self, host_bytes: Sequence[int]) -> float:
        """Copy time not hidden by compute, forward and backward, for `host_bytes` offloaded per call."""
        exposed = 0.0
        for backward_factor in (1.0, 2.0):
            copies = after = worst = 0.0
            for c in reversed(range(len(host_bytes))):
                copies += host_bytes[c] * self.seconds_per_byte
                worst = max(worst, copies - backward_factor * after)
                after += self.compute[c]
            exposed += worst
        return exposed


@dataclasses.dataclass(frozen=True)
class Shrinking:
    """What keeping each kept value in a storage of fewer device bytes (bits, a narrower format) frees and
    costs (NOTE [the budget problem]), by (value, storage)."""

    shrink: Mapping[tuple[Value, Storage], int]  # bytes freed
    cost: Mapping[tuple[Value, Storage], float]  # in the cost unit: roofline seconds, or FLOPs (`storage_cost`)
    device: Device | None
    stand_ins: frozenset[tuple[Value, Storage]] = frozenset()  # come back as stand-ins, which no replay may read
    storages: tuple[Storage, ...] = ()
    # What a call kept in a storage costs: its values that storage holds (each, freeing bytes or not).
    call_cost: Mapping[tuple[int, Storage], float] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(trace: Trace, cost: str, storages: Sequence[Storage]) -> Shrinking:
        graph = trace.values
        assert graph is not None
        device = None if cost == "flops" else resolve_device(cost.removeprefix("roofline:"))
        shrink, costs = {}, {}
        call_cost: dict[tuple[int, Storage], float] = {}
        for value, node in graph.nodes.items():
            if value[0] < 0 or value in graph.returned:
                continue
            for storage in storages:
                if not storage.can_hold(node):
                    continue
                nbytes = graph.nbytes[value]
                cost_v = storage_cost(storage, device, nbytes, node.meta.get("val"))
                call_cost[value[0], storage] = call_cost.get((value[0], storage), 0.0) + cost_v
                freed = nbytes - storage.device_bytes(nbytes, node.meta.get("val"))
                if freed > 0:
                    shrink[value, storage] = freed
                    costs[value, storage] = cost_v
        stand_ins = frozenset(k for k in shrink if not k[1].can_hold(graph.nodes[k[0]], read_again=True))
        return Shrinking(shrink, costs, device, stand_ins, tuple(storages), call_cost)

    def cost_of(self, accounting: Accounting) -> float:
        """The storing and loading `accounting`'s decisions do in these storages, in the cost unit."""
        return sum(
            self.call_cost.get((call, kept.storage), 0.0)
            for call, kept in accounting.kept_by_call.items()
            if kept.storage in self.storages and kept.stored_nbytes
        )


def storage_cost(storage: Storage, device: Device | None, nbytes: int, value: Any) -> float:
    """What storing and loading a value of `nbytes` costs: its memory-bound passes, in seconds on the
    roofline's `device`, or, with FLOPs (`device` None), one FLOP per element per pass."""
    if device is not None:
        return 2 * storage.move_seconds(device, nbytes)
    return float(storage.passes * (value.numel() if value is not None else nbytes))


def call_costs(trace: Trace, cost: str) -> list[float]:
    """The replay cost of each call: FLOPs, or roofline seconds on a device (`"roofline:h100"`)."""
    if cost == "flops":
        return [float(call.flops) for call in trace]
    device = resolve_device(cost.removeprefix("roofline:"))
    return [estimate_seconds(call, device) for call in trace]


class _Program:
    """The 0-1 program of NOTE [the budget problem], as sparse rows for the solver (`_milp`): the rules'
    own clauses as rows (`_rules.Rules.rows`), and the budget's."""

    def __init__(
        self,
        graph: ValueGraph,
        costs: Sequence[float],
        forced: frozenset[int] = frozenset(),
        link: HostLink | None = None,
        shrinking: Shrinking | None = None,
    ):
        n = len(costs)
        self.n = n
        self.graph = graph
        decisions = [*(Atom(SAVED, c) for c in range(n)), *(Atom(REPLAYED, c) for c in range(n))]
        rows = rules_of(graph, inputs=False).rows(decisions)
        # Variables: s (saved), r (replayed), then the rules' other atoms: kept values and copies,
        # recomputed calls, generator states.
        others = {a for r in rows for a in r.coefficients} - set(decisions)
        order = {RECOMPUTED: 0, KEPT: 1, COPIED: 2, STATE: 3}
        self._column = {a: j for j, a in enumerate([*decisions, *sorted(others, key=lambda a: (order[a.kind], a.key))])}
        self.size = len(self._column)
        self.rows: list[dict[int, float]] = [{self._column[a]: x for a, x in r.coefficients.items()} for r in rows]
        self.upper: list[float] = [r.bound for r in rows]
        for c in forced:  # collectives: see NOTE [collectives are never replayed]
            self._row({self._s(c): -1}, -1)
        self.budget_row = {
            j: float(graph.rng_state_nbytes[atom.key] if atom.kind == STATE else graph.nbytes[atom.key])
            for atom, j in self._column.items()
            if atom.kind in (KEPT, COPIED, STATE)
        }
        self.link = link
        if link is not None:
            self._offload(link)
        self._shrunk_index: dict[tuple[Value, Storage], int] = {}
        if shrinking is not None:
            self._shrink(shrinking)
        scale = max(costs, default=0.0) or 1.0
        # Replay cost first; among equal costs, fewer saves (a tiny tie-break, well below any real cost).
        self.objective = np.zeros(self.size)
        self.objective[n : 2 * n] = np.asarray(costs) / scale
        self.objective[:n] = 1e-9
        if link is not None:  # exposed copy time, in the same seconds; offload only where it helps
            self.objective[self._exposed : self._exposed + 2] = 1 / scale
            self.objective[self._o(0) : self._o(0) + n] = 1e-9
        for key, j in self._shrunk_index.items():  # shrink only where it helps
            self.objective[j] = shrinking.cost[key] / scale + 1e-9  # type: ignore[union-attr]
        self.scale = scale

    # The columns of each variable.
    def _s(self, c: int) -> int:
        return c

    def _k(self, value: Value) -> int:
        return self._column[Atom(KEPT, value)]

    def _o(self, c: int) -> int:
        return self._offload_base + c

    def _d(self, value: Value) -> int:
        return self._device_index[value]

    def _offload(self, link: HostLink) -> None:
        """Variables and rows of offloading: see NOTE [the budget problem]. `q_j`, the copy seconds
        of the values of calls j and after, is continuous, as are e_f and e_b."""
        n = self.n
        produced = [atom.key for atom in self._column if atom.kind == KEPT]
        self._offload_base = self.size
        self._device_index = {v: self.size + n + i for i, v in enumerate(produced)}
        self._queued = self.size + n + len(produced)  # q_0 .. q_{n-1}
        self._exposed = self._queued + n  # e_f, e_b
        self.continuous = slice(self._queued, self._exposed + 2)
        self.size = self._exposed + 2
        for c in range(n):
            self._row({self._o(c): 1, self._s(c): -1}, 0)
        host_seconds: dict[int, dict[int, float]] = {c: {} for c in range(n)}
        for v in produced:
            self._row({self._d(v): 1, self._k(v): -1}, 0)
            if v in self.graph.returned:
                self._row({self._k(v): 1, self._d(v): -1}, 0)
            else:
                self._row({self._k(v): 1, self._o(v[0]): -1, self._d(v): -1}, 0)
                self._row({self._d(v): 1, self._o(v[0]): 1}, 1)
                t = self.graph.nbytes[v] * link.seconds_per_byte
                host_seconds[v[0]][self._k(v)] = t
                host_seconds[v[0]][self._d(v)] = -t
            del self.budget_row[self._k(v)]
            self.budget_row[self._d(v)] = float(self.graph.nbytes[v])
        after = 0.0
        for j in reversed(range(n)):
            queued = {**host_seconds[j], self._queued + j: -1.0}
            if j + 1 < n:
                queued[self._queued + j + 1] = 1.0
            self._row(queued, 0)  # q_j >= q_{j+1} + the copies of call j's host values
            for e, backward_factor in ((self._exposed, 1.0), (self._exposed + 1, 2.0)):
                self._row({self._queued + j: 1, e: -1}, backward_factor * after)
            after += link.compute[j]

    def _shrink(self, shrinking: Shrinking) -> None:
        """Variables and rows of keeping values in fewer bytes: see NOTE [the budget problem]."""
        chosen: dict[int, dict[Storage, int]] = {}  # call -> storage -> u_{c,S}, where storages compete
        readers: dict[Value, list[int]] = {}  # the calls whose replays (or recomputations) read a value
        for c, reads in enumerate(self.graph.reads):
            for value in reads:
                readers.setdefault(value, []).append(c)
        for (value, storage), freed in shrinking.shrink.items():
            kept = self._column.get(Atom(KEPT, value))
            if kept is None:
                continue
            j = self._shrunk_index[value, storage] = self.size
            self.size += 1
            self._row({j: 1, self._device_index[value] if self.link is not None else kept: -1}, 0)
            self.budget_row[j] = -float(freed)
            if (value, storage) in shrinking.stand_ins:  # no replay reads it, nor a recomputation as it was kept
                recomputed = self._column.get(Atom(RECOMPUTED, value[0]))
                for c in dict.fromkeys(readers.get(value, ())):
                    self._row({j: 1, self._column[Atom(REPLAYED, c)]: 1}, 1)
                    if Atom(RECOMPUTED, c) in self._column:
                        row = {j: 1.0, self._column[Atom(RECOMPUTED, c)]: 1.0}
                        if recomputed is not None:
                            row[recomputed] = -1.0
                        self._row(row, 1)
            if len(shrinking.storages) > 1:  # a call's decision names one storage
                of_call = chosen.setdefault(value[0], {})
                if storage not in of_call:
                    of_call[storage] = self.size
                    self.size += 1
                self._row({j: 1, of_call[storage]: -1}, 0)
        for of_call in chosen.values():
            self._row(dict.fromkeys(of_call.values(), 1.0), 1)

    def decisions(self, solution: np.ndarray) -> tuple[Decision, ...]:
        """The decisions of a solution: SAVE, OFFLOAD, or the decision of the storage its kept values shrink
        into (PACK, a narrower format), or RECOMPUTE, per call."""
        shrunk = {value[0]: storage for (value, storage), j in self._shrunk_index.items() if solution[j] > 0.5}

        def decision(c: int) -> Decision:
            if solution[self._s(c)] <= 0.5:
                return Decision.RECOMPUTE
            if self.link is not None and solution[self._o(c)] > 0.5:
                return Decision.OFFLOAD
            return shrunk[c].decision if c in shrunk else Decision.SAVE

        return tuple(decision(c) for c in range(self.n))

    def _row(self, coefficients: dict[int, float], bound: float) -> None:
        """The constraint sum(a_j x_j) <= bound."""
        self.rows.append(coefficients)
        self.upper.append(bound)

    def solve(
        self, budget: float, *, integral: bool, time_limit: float | None = None, objective: Any = None
    ) -> tuple[np.ndarray | None, float]:
        """A solution (None if none was found) and a lower bound on the objective's optimum."""
        integrality = np.full(self.size, integral)
        upper = np.ones(self.size)
        if self.link is not None:  # queued and exposed copy seconds
            integrality[self.continuous] = False
            upper[self.continuous] = np.inf
        solution = _milp.solve(
            self.objective if objective is None else objective,
            [*self.rows, self.budget_row],
            [-np.inf] * (len(self.rows) + 1),
            [*self.upper, budget],
            column_upper=upper,
            integral=integrality,
            time_limit=time_limit,
            relative_gap=1e-9,
        )
        return solution.x, solution.bound


# How long the fast mode lets branch and bound run before it settles for the rounded relaxation.
FAST_TIME_LIMIT = 0.5


def solve(
    trace: Trace, budget: int, cost: str, exact: bool, offload: bool = False, shrink: Sequence[Storage] = ()
) -> Plan:
    """The cheapest decisions for `trace` whose kept bytes (on the device) are at most `budget`.

    Exact: branch and bound to optimality. Fast: branch and bound for at most
    `FAST_TIME_LIMIT` seconds (traces of a few hundred calls finish, optimal, well within it),
    its bound starting from the LP relaxation's; if that finds nothing, the LP relaxation (a
    lower bound on the optimum) rounded and repaired (without offloading). With `offload`, a
    kept call may be kept in host memory, at the copy time the roofline `cost` device's host
    link leaves exposed. A kept value that a storage of `shrink` holds in fewer device bytes (bits,
    exactly; a narrower format) may be kept so.
    """
    assert trace.values is not None
    started = time.perf_counter()
    costs = call_costs(trace, cost)
    link = HostLink.of(trace, cost) if offload else None
    shrinking = Shrinking.of(trace, cost, shrink) if shrink else None
    forced = frozenset(call.index for call in trace if is_collective(call))
    program = _Program(trace.values, costs, forced, link, shrinking)
    candidates: list[tuple[Decision, ...]] = []
    solution: np.ndarray | None
    if not len(trace):  # nothing to decide (a function of views only); HiGHS refuses empty programs
        solution, bound = np.zeros(program.size), 0.0
    elif exact:
        solution, bound = program.solve(budget, integral=True)
    else:
        solution, bound = program.solve(budget, integral=True, time_limit=FAST_TIME_LIMIT)
        if solution is None:  # out of time, or infeasible: the relaxation tells which
            relaxed, relaxed_bound = program.solve(budget, integral=False)
            if relaxed is None:
                raise InfeasibleBudget(minimum_bytes(trace, link, shrinking))
            bound = max(bound, relaxed_bound)
            deadline = time.perf_counter() + FAST_TIME_LIMIT
            saved = set(forced) | _round_and_repair(trace, costs, relaxed[: program.n], budget, deadline)
            candidates.append(_saving(saved, len(trace)))
    if solution is not None:
        candidates.append(program.decisions(solution))
    # Offloading where the device has room is a tie the objective breaks by 1e-9, below the solver's
    # tolerance: each plan on the device wins a tie with the same plan offloaded.
    candidates += [_on_device(d) for d in candidates if Decision.OFFLOAD in d]
    candidates += [_unshrunk(d) for d in candidates if set(d) & {s.decision for s in shrink}]  # likewise
    scored = []
    for decisions in candidates:
        accounting = account_for(trace, decisions)
        if accounting.saved_bytes <= budget:
            total = replay_cost(accounting, costs, link) + (shrinking.cost_of(accounting) if shrinking else 0.0)
            scored.append((total, sum(d.keeps for d in decisions), len(stored_calls(decisions)), decisions, accounting))
    if not scored:
        raise InfeasibleBudget(minimum_bytes(trace, link, shrinking))
    total, _, _, decisions, accounting = min(scored, key=lambda score: score[:3])
    return Plan(
        decisions=decisions,
        saved_bytes=accounting.saved_bytes,
        cost=total,
        lower_bound=total if exact else min(total, bound * program.scale),
        seconds=time.perf_counter() - started,
        offloaded_bytes=accounting.offloaded_bytes,
    )


def _on_device(decisions: tuple[Decision, ...]) -> tuple[Decision, ...]:
    return tuple(Decision.SAVE if d is Decision.OFFLOAD else d for d in decisions)


def _unshrunk(decisions: tuple[Decision, ...]) -> tuple[Decision, ...]:
    return tuple(d if d in (Decision.RECOMPUTE, Decision.OFFLOAD) else Decision.SAVE for d in decisions)


def _saving(saved: set[int], n: int) -> tuple[Decision, ...]:
    return tuple(Decision.SAVE if c in saved else Decision.RECOMPUTE for c in range(n))


def _round_and_repair(
    trace: Trace, costs: Sequence[float], fractions: np.ndarray, budget: int, deadline: float
) -> set[int]:
    """Saves from the LP relaxation: try rounding at 0.5, then at the other thresholds from high to
    low, and keep the cheapest rounding within budget; then greedily add saves that lower the cost and
    still fit; all but the first rounding only until `deadline` (a `time.perf_counter()`). (Each greedy step weighs every replayed call: on a trace of a
    thousand calls that is seconds a step, and the steps could run for minutes.)"""
    best: set[int] | None = None
    best_cost = math.inf
    thresholds = sorted({float(f) for f in fractions if f > 1e-6} - {0.5}, reverse=True)
    for k, threshold in enumerate([0.5, *thresholds]):
        if k and time.perf_counter() >= deadline:
            break
        saved = {c for c, f in enumerate(fractions) if f >= threshold - 1e-9}
        kept = account(trace, saved)
        if kept.saved_bytes <= budget and replay_cost(kept, costs) < best_cost:
            best, best_cost = saved, replay_cost(kept, costs)
    if best is None:
        best = set()
        kept = account(trace, best)
        if kept.saved_bytes > budget:
            raise InfeasibleBudget(kept.saved_bytes)
        best_cost = replay_cost(kept, costs)
    improved = True
    while improved and time.perf_counter() < deadline:  # one more save at a time, the best cost per byte first
        improved = False
        options = []
        for c in account(trace, best).replayed_calls:
            candidate = account(trace, best | {c})
            if candidate.saved_bytes <= budget and replay_cost(candidate, costs) < best_cost:
                options.append((replay_cost(candidate, costs), candidate.saved_bytes, c))
        if options:
            cost, _, c = min(options)
            best, best_cost, improved = best | {c}, cost, True
    return best


def replay_cost(accounting: Accounting, costs: Sequence[float], link: HostLink | None = None) -> float:
    """The replay cost of the calls `accounting` replays, and the copy time it leaves exposed."""
    replay = sum(costs[c] for c in accounting.replayed_calls)
    if link is None or not accounting.offloaded_bytes:
        return replay
    host = [0] * len(costs)
    for c, kept in accounting.kept_by_call.items():
        host[c] = kept.stored_nbytes if kept.offloaded else 0
    return replay + link.exposed_seconds(host)


def minimum_bytes(trace: Trace, link: HostLink | None = None, shrinking: Shrinking | None = None) -> int:
    """The fewest device bytes any decisions for `trace` keep (offloading too, given a host `link`;
    in fewer bytes too, given `shrinking`)."""
    assert trace.values is not None
    forced = frozenset(call.index for call in trace if is_collective(call))
    if not len(trace):
        return account(trace, set()).saved_bytes
    program = _Program(trace.values, [0.0] * len(trace), forced, link, shrinking)
    objective = np.zeros(program.size)
    for j, a in program.budget_row.items():
        objective[j] = a
    solution, _ = program.solve(math.inf, integral=True, objective=objective)
    assert solution is not None
    decisions = program.decisions(solution)
    return account_for(trace, decisions).saved_bytes


class InfeasibleBudget(ValueError):
    """No decisions keep as few bytes as the budget; `minimum` is the fewest any keep."""

    def __init__(self, minimum: int):
        self.minimum = minimum
        super().__init__(minimum)


# NOTE [planning for a peak]
# The peak of forward and backward is not a sum over the calls, as kept bytes
# are: it depends on when each value is freed, and a replayed call adds to the
# backward while it is alive. So it is not a constraint of the 0-1 program.
# Instead, the byte-budget planner's plans at budgets spread from the fewest
# bytes any decisions keep to all of them are candidates, with saving
# everything and saving nothing (a collective is always saved); each one's peak is
# predicted from its programs (`remat.Peak`), and the cheapest within the peak
# bound wins. The chosen plan's predicted peak never exceeds the bound. A plan
# under a peak bound keeps less than the bound, so the byte-budget optimum at
# the bound is a lower bound on the cost.
PEAK_CANDIDATES = 16  # byte budgets tried, evenly spaced


def solve_peak(
    trace: Trace, peak_bytes: int, cost: str, exact: bool, offload: bool = False, shrink: Sequence[Storage] = ()
) -> Plan:
    """The cheapest of the byte-budget planner's plans, and of saving everything and saving nothing,
    whose predicted peak is at most `peak_bytes`."""
    assert trace.values is not None and trace.joint is not None
    started = time.perf_counter()
    costs = call_costs(trace, cost)
    forced = {call.index for call in trace if is_collective(call)}
    link = HostLink.of(trace, cost) if offload else None
    shrinking = Shrinking.of(trace, cost, shrink) if shrink else None
    low, high = minimum_bytes(trace, link, shrinking), account(trace, range(len(trace))).saved_bytes
    budgets = sorted({low + (high - low) * i // (PEAK_CANDIDATES - 1) for i in range(PEAK_CANDIDATES)})
    candidates = [_plan_of(trace, costs, forced), _plan_of(trace, costs, set(range(len(trace))))]
    candidates += [solve(trace, budget, cost, exact, offload, shrink) for budget in budgets]
    best: tuple[float, int, Plan] | None = None
    peaks: dict[tuple[Decision, ...], int] = {}  # candidates often repeat a plan: partition each once
    for plan in candidates:
        if plan.decisions not in peaks:
            peaks[plan.decisions] = peak_of(trace, plan.decisions).bytes
        peak = peaks[plan.decisions]
        if peak <= peak_bytes and (best is None or (plan.cost, peak) < best[:2]):
            best = (plan.cost, peak, plan)
    if best is None:
        raise InfeasiblePeak(min(peaks.values()))
    _, peak, plan = best
    bound = solve(trace, min(peak_bytes, high), cost, exact, offload, shrink).lower_bound
    return dataclasses.replace(
        plan, lower_bound=min(plan.cost, bound), seconds=time.perf_counter() - started, peak_bytes=peak
    )


def _plan_of(trace: Trace, costs: Sequence[float], saved: set[int]) -> Plan:
    kept = account(trace, saved)
    total = replay_cost(kept, costs)
    return Plan(_saving(saved, len(costs)), kept.saved_bytes, total, lower_bound=total, seconds=0.0)


class InfeasiblePeak(ValueError):
    """No plan the planner tried peaks as low as the bound; `lowest` is the lowest predicted peak."""

    def __init__(self, lowest: int):
        self.lowest = lowest
        super().__init__(lowest)
