"""`remat.fit`: decisions for every checkpointed block of a model, so that a whole training step fits a
memory target, replaying as little as possible. See NOTE [planning a step].
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import nn

from . import _step
from ._accounting import account, account_for
from ._api import DEFAULT_CACHE_SIZE
from ._apply import NOTHING, CheckpointedForward, InstalledForward, Which, checkpoint_selected, uncheckpoint_modules
from ._cache import LRUCache, tensor_key
from ._calls import Decision, Trace, format_bytes
from ._decide import decide, decide_nested
from ._engine import SavedTensors, engine_runs_on, walked_backward
from ._gpu import attention_as_on_the_gpu
from ._measure import storage_key, storage_nbytes
from ._objects import opened
from ._peak import peak_of
from ._pytree import NAMESPACE
from ._report import Peak
from ._storage import shrinking

__all__ = ["BlockPlan", "Fit", "StepReport", "fit", "fit_when_called"]

LossFor = Callable[[Sequence[Any], dict[str, Any]], Callable[[Any], torch.Tensor]]
"""The probe step's loss for a batch `(args, kwargs)`: a function of the model's output."""


# NOTE [planning a step]
# A step's peak is decided by every block at once: block i's forward runs while
# blocks 0..i-1 hold what they keep, its backward while they still do, and the
# head, the loss and the parameter gradients lie outside all of them. `fit`
# measures one probe step with every block keeping the least (save nothing; see
# NOTE [a step's timeline]), then, for each block's trace, makes candidate
# plans: every built-in policy without arguments, `budget` at fractions 0.1 to
# 0.9 and at byte budgets spread from the fewest bytes to all of them (those
# `budget(peak_bytes=...)` chooses among). Each candidate's forward and backward
# peaks and kept bytes are predicted from its programs (`remat.Peak`). The
# step's predicted peak under one candidate per block is the probe's segments
# moved by the candidates' differences from the probe's plan; the choice is a
# 0-1 program: one candidate per block call, every segment within the target,
# the least replay cost. A stack of blocks called once each, backward in reverse,
# is a chain, solved exactly by dynamic programming over the calls in order
# (`_solve_chain`); any other step by HiGHS (`_milp`). A single policy applied to
# every block is one of the program's solutions, so `fit` is never costlier than
# the best uniform plan that fits. Blocks that share a trace may be given
# different candidates.


@dataclasses.dataclass(frozen=True)
class _Candidate:
    label: str
    decisions: tuple[Decision, ...]
    cost: float  # replay cost, in the `cost` model's unit
    peak: Peak  # predicted forward, after-forward and backward bytes
    host_bytes: int = 0  # kept in host memory (offloaded)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """What `remat.fit` chose for one checkpointed block at one input signature.

    Attributes:
        name: the block's qualified name in the model.
        label: the candidate plan it took (a built-in policy, or a budget).
        decisions: one per call of the block's trace.
        kept_bytes: bytes it keeps for its backward beyond what saving nothing keeps (its inputs and
            generator states), predicted.
        replay_cost: what its backward replays, in `fit`'s cost model (FLOPs, or estimated seconds), with
            the copy time to and from host memory that compute does not hide (with `offload=True`).
        host_bytes: bytes it keeps in host memory (offloaded) from its forward to its backward.
    """

    name: str
    label: str
    decisions: tuple[Decision, ...]
    kept_bytes: int
    replay_cost: float
    host_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class StepReport:
    """A training step's memory, predicted for `remat.fit`'s plan (bytes above what was live before).

    Attributes:
        parameters: bytes of the model's parameters (live before the step; not in the peak).
        gradients: bytes of the parameter gradients the step leaves in `.grad`.
        optimizer_state: bytes of optimizer state its step allocates (on a first step, all of it; 0
            without `optimizer=`).
        kept: per block, the bytes it keeps from its forward to its backward under the plan, beyond what
            saving nothing keeps.
        peak: the step's predicted peak.
        where: where the peak happens (in a block call's forward or backward, or outside the blocks), with
            the op that reached it in the probe step.
        peak_keeping_everything: the predicted peak with every block saving everything.
        peak_keeping_nothing: the predicted peak with every block saving nothing.
        activations: bytes of activations at the peak, at least: the peak less all the step's gradients.
        measured_peak: the probe step's measured peak (its blocks saving nothing).
        unsharded: of the peak, the bytes of parameters FSDP2 holds gathered, in their own storages and in
            all-gather buffers not yet freed (the running block's, the next one's where prefetched by then,
            the root's), as measured in the probe step at the peak; 0 without FSDP2.
        prefetched: of `unsharded`, the bytes of blocks other than the one whose forward or backward holds
            the peak (gathered ahead of it); 0 where the peak lies outside the blocks.
        unreduced_gradients: of the peak, the bytes of full-size gradients of gathered parameters, before
            FSDP2 reduce-scatters them into `gradients`' shards; 0 without FSDP2. See NOTE [what FSDP2 adds].
    """

    parameters: int
    gradients: int
    optimizer_state: int
    kept: dict[str, int]
    peak: int
    where: str
    peak_keeping_everything: int
    peak_keeping_nothing: int
    activations: int
    measured_peak: int
    unsharded: int = 0
    prefetched: int = 0
    unreduced_gradients: int = 0

    def __str__(self) -> str:
        share = self.activations / self.peak if self.peak else 0.0
        lines = [
            f"step peak {format_bytes(self.peak)} (predicted), {self.where}: activations are {share:.0%} of it; "
            f"keeping everything it would be {format_bytes(self.peak_keeping_everything)}, keeping nothing "
            f"{format_bytes(self.peak_keeping_nothing)}",
            f"  parameters  {format_bytes(self.parameters):>12}  (live before the step)",
            f"  gradients   {format_bytes(self.gradients):>12}",
            f"  optimizer   {format_bytes(self.optimizer_state):>12}  (state its step allocates)",
            f"  kept        {format_bytes(sum(self.kept.values())):>12}  by {len(self.kept)} blocks",
        ]
        if self.unsharded:
            prefetched = f"; {format_bytes(self.prefetched)} prefetched" if self.prefetched else ""
            lines[3:3] = [
                f"  unreduced   {format_bytes(self.unreduced_gradients):>12}  (full-size gradients before "
                "their reduce-scatter)",
                f"  unsharded   {format_bytes(self.unsharded):>12}  (FSDP2's gathered parameters at the peak"
                f"{prefetched})",
            ]
        for name, kept in self.kept.items():
            lines.append(f"    {name:<24}  {format_bytes(kept):>12}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Fit:
    """What `remat.fit` planned: the target, the predicted peak, each block's plan and the step report.

    Attributes:
        peak_bytes: the target.
        predicted_peak: the step's predicted peak under the plan (at most `peak_bytes`).
        blocks: one `BlockPlan` per checkpointed block call, in the order they ran.
        replay_cost: the sum of the blocks' replay costs.
        report: the `StepReport`.
        seconds: how long planning took (the probe step included).
    """

    peak_bytes: int
    predicted_peak: int
    blocks: tuple[BlockPlan, ...]
    replay_cost: float
    report: StepReport
    seconds: float

    def __str__(self) -> str:
        rows = [f"remat.fit: predicted peak {format_bytes(self.predicted_peak)} of {format_bytes(self.peak_bytes)}"]
        for block in self.blocks:
            host = f"  (host {format_bytes(block.host_bytes)})" if block.host_bytes else ""
            replays = f"{block.replay_cost:,.0f}" if block.replay_cost >= 1 else f"{block.replay_cost:.3g}"
            rows.append(
                f"  {block.name:<24} keeps {format_bytes(block.kept_bytes):>10}{host}  replays {replays}  {block.label}"
            )
        return "\n".join([*rows, str(self.report)])


class _Planned:
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
) -> list[_Candidate]:
    """The plans `fit` chooses among for one block's trace, each once (the first label it was found by).
    The first is saving nothing, the probe step's plan. With `pack` (and `compress`), the budget planner's
    plans keep values as bits (`remat.PACK`; and in the narrower format) where the replays the freed bytes
    save cost more than that, and their cost counts the storing and loading. With `offload`, they keep values in host
    memory where the copies compute does not hide cost less than the replays (NOTE [the budget problem]),
    and their cost counts that copy time."""
    from . import policies
    from ._budget import HostLink, Shrinking, call_costs, minimum_bytes, replay_cost

    assert trace.joint is not None, "a block's trace carries its graph, for peak predictions"
    costs = call_costs(trace, cost)
    shrink = shrinking(pack, compress)
    in_fewer_bytes = Shrinking.of(trace, cost, shrink)
    link = HostLink.of(trace, cost) if offload else None
    # Among plans of one replay cost, the one that shrinks less.
    tie = 1e-9 * (sum(costs) or 1.0)
    found: dict[tuple[Decision, ...], _Candidate] = {}

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
            found[decisions] = _Candidate(label, decisions, replay, peak, accounting.offloaded_bytes)

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
class _Group:
    """One choice of the program: a block module at one of its traces (its calls at that trace share it)."""

    name: str
    policy: _Planned
    trace: Trace
    options: tuple[_Candidate, ...]  # options[0] is the probe step's plan


@dataclasses.dataclass(frozen=True)
class _Row:
    """A segment of the probe step as a function of the choices: its peak is `measured` plus, for each
    (group, option) chosen, `terms[(group, option)]`."""

    segment: _step.Segment
    terms: dict[tuple[int, int], int]

    def peak(self, choice: Sequence[int]) -> int:
        return self.segment.peak + sum(self.terms.get((g, k), 0) for g, k in enumerate(choice))


def _rows(timeline: _step.Timeline, group_of: Sequence[int], groups: Sequence[_Group]) -> list[_Row]:
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
        rows.append(_Row(segment, terms))
    return rows


def _predicted_peak(rows: Sequence[_Row], choice: Sequence[int]) -> tuple[int, _Row | None]:
    best: tuple[int, _Row | None] = (0, None)
    for row in rows:
        peak = row.peak(choice)
        if best[1] is None or peak > best[0]:
            best = (peak, row)
    return best


def _solve_chain(
    groups: Sequence[_Group], rows: Sequence[_Row], group_of: Sequence[int], target: int
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


def _solve(
    groups: Sequence[_Group], rows: Sequence[_Row], target: int | None, exact: bool
) -> tuple[list[int] | None, float]:
    """The cheapest choice (an option per group) whose predicted peak is at most `target`; with
    `target=None`, the choice of the lowest predicted peak. (None if none fits, and the optimum.)"""
    import numpy as np

    from . import _milp

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


def fit(
    model: nn.Module,
    which: Which,
    /,
    *args: Any,
    peak_bytes: int,
    loss: Callable[[Any], torch.Tensor] | None = None,
    kwargs: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    cost: str = "flops",
    exact: bool = False,
    device: str | torch.device | None = None,
    pack: bool = True,
    compress: str | None = None,
    offload: bool = False,
) -> Fit:
    """Checkpoint the blocks of `model` that `which` selects, in place, with decisions chosen for the whole
    training step, so that its peak stays within `peak_bytes`, replaying as little as possible.

    The step is the model's forward on the example batch (`model(*args, **kwargs)`), `loss` of its output,
    and the backward of that loss. Its peak is everything allocated above what was live before it (starting
    with no parameter gradients, as after `optimizer.zero_grad(set_to_none=True)`): every block's kept values,
    the embeddings, the head, the logits and the loss, and the parameter gradients as they accumulate.
    `fit` runs the step once as a probe, with every block saving nothing, measuring the memory outside the
    blocks; the blocks' own memory under every other plan is predicted from their programs (`remat.Peak`).
    Then it chooses, for each block, one of the plans the budget planner makes for it (`budget` at fractions
    and byte budgets, and the built-in policies), so that the predicted peak of the step fits and the
    replay cost is the least: blocks of one structure may be given different plans. See docs/fit.md.

    The probe step puts back what it changes: the parameters' `.grad`, the buffers (batch norm's running
    statistics) and the random number generators.

    Args:
        model: the `nn.Module` to change in place.
        which: the blocks, as for `remat.checkpoint_modules` (a module class, a tuple of them, or a
            predicate over qualified names and modules).
        *args: an example batch, as the model is called.
        peak_bytes: the target: the most bytes the step may have live at once.
        loss: a function of the model's output giving the scalar the step backpropagates; by default the
            output's `.loss` (a Hugging Face model given labels), or the sum of its tensors.
        kwargs: the model's keyword arguments for the example batch (a dict: they never collide with
            `fit`'s own options).
        cost: what to replay least of, as for `remat.policies.budget`: `"flops"` or `"roofline:<device>"`.
        optimizer: the optimizer whose `step()` ends the step: its state (on a first step) and its
            temporaries count, measured on meta copies of its parameters.
        exact: solve every planning problem to optimality (slower); by default the solvers have time limits
            and keep the best plan found.
        device: the device to plan for, where the model's parameters (and the batch) are on the meta
            device: the probe step runs on fake tensors of that device, with the kernels it would choose
            (attention's, say), and the plan holds once the model is materialized there. See NOTE
            [planning on the meta device].
        pack: whether plans may keep values as bits where that is exact (`remat.PACK`, docs/storage.md),
            where the replays the freed bytes save cost more than packing's passes.
        compress: a narrower format plans may also keep values in, approximately, where the replays the
            freed bytes save cost more than its passes: `"float16"`, `"bfloat16"` or `"fp8"`
            (`remat.policies.compress`); None (the default): never.
        offload: whether plans may also keep values in host memory (`remat.OFFLOAD`, docs/offload.md), where
            the copies compute does not hide cost less than the replays they save; needs
            `cost="roofline:<device>"`, which times both. The peak is the device's: offloaded values take
            none of it between their copies. On the CPU, where a tensor is its own host copy, it is refused.

    Returns:
        A `remat.Fit`: the predicted peak, the plan of each block call, the step report.

    Raises:
        ValueError: no plan fits `peak_bytes` (the message names the lowest peak any plan reaches and what
            makes it up); or, as for `checkpoint_modules`, nothing matches `which` or `model` already has
            checkpointed modules.
        TypeError: a bad argument.

    >>> import torch, remat
    >>> blocks = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(4)]
    >>> model = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 10))
    >>> plan = remat.fit(model, lambda name, module: module in blocks, torch.randn(512, 64), peak_bytes=3 * 2**20)
    >>> plan.predicted_peak <= 3 * 2**20
    True
    >>> [block.name for block in plan.blocks]
    ['0', '1', '2', '3']
    """
    _check_arguments(model, peak_bytes, loss, kwargs, optimizer, cost, exact, pack, compress, offload)
    target = _target_device(model, device)
    _refuse_offload_on_the_cpu(model, target, offload)
    loss_for = _same_loss(loss or _default_loss)
    planner = _install(
        _Planner(model, peak_bytes, loss_for, optimizer, cost, exact, target, pack, compress, offload), which
    )
    try:
        return planner.fit(args, dict(kwargs or {}))
    except BaseException:
        _uninstall(model)
        raise


def fit_when_called(
    model: nn.Module,
    which: Which,
    /,
    *,
    peak_bytes: int,
    loss_for: LossFor,
    cost: str = "flops",
    pack: bool = True,
    offload: bool = False,
    planned: Callable[[Fit], None] | None = None,
) -> None:
    """`fit` without an example batch: the model is planned when it is first called with gradients on, on
    that call's batch, before the call runs (NOTE [planning before the model's hooks]), as a fitted model
    plans a new signature; where it is then (it may be on meta now). For a framework that sets up
    checkpointing before any batch exists and shards and materializes the model after (remat.torchtitan).
    `loss_for(args, kwargs)` gives the loss of the probe step on that batch (a framework's loss may need the
    batch: its labels). `planned` is called with each plan made."""
    _check_arguments(model, peak_bytes, loss_for, None, None, cost, False, pack, None, offload)
    planner = _install(_Planner(model, peak_bytes, loss_for, None, cost, False, None, pack, None, offload), which)
    planner.planned, planner.placed = planned, False


def _same_loss(loss: Callable[[Any], torch.Tensor]) -> LossFor:
    """The loss of every batch's probe step: `loss` itself."""
    return lambda args, kwargs: loss


def _refuse_offload_on_the_cpu(model: nn.Module, target: torch.device | None, offload: bool) -> None:
    if offload and _plans_for_the_cpu(model, target):
        raise ValueError(
            "remat.fit: offload=True plans copies to host memory to lower a GPU's peak, but this step runs on "
            "the CPU, where a tensor is its own host copy: offloading would free nothing. Plan without it, or "
            "for the GPU (`device='cuda'` with the model on meta, or the model on the GPU)."
        )


def _install(planner: _Planner, which: Which) -> _Planner:
    """Checkpoint the blocks `which` selects with plans to be made, and make the model plan when called."""
    model = planner.model
    checkpoint_selected(model, which, _Planned, DEFAULT_CACHE_SIZE, False, "remat.fit")
    model.__dict__["forward"] = _FittedForward(model, planner)
    _plans_when_called(model)
    return planner


def _uninstall(model: nn.Module) -> None:
    """Undo `_install` of a plan that failed: the model as it was, its class included."""
    uncheckpoint_modules(model)
    if type(model) in _PLANNING_CLASSES.values():
        model.__class__ = type(model).__bases__[1]


class _Planner:
    """A fitted model's target and options, and its plans by input signature (see `_FittedForward`)."""

    def __init__(
        self,
        model: nn.Module,
        target: int,
        loss_for: LossFor,
        optimizer: torch.optim.Optimizer | None,
        cost: str,
        exact: bool,
        device: torch.device | None,
        pack: bool,
        compress: str | None,
        offload: bool,
    ):
        self.model, self.target, self.loss_for, self.optimizer = model, target, loss_for, optimizer
        self.cost, self.exact, self.pack, self.compress, self.offload = cost, exact, pack, compress, offload
        self.device = device  # the target of a model on meta (None: where it is)
        self.fits: LRUCache[Fit] = LRUCache(DEFAULT_CACHE_SIZE)
        self.planned: Callable[[Fit], None] | None = None  # told of each plan made
        self.placed = True  # whether the target and the refusals that depend on it were settled

    def fit(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Fit:
        """The plan at the signature of `(args, kwargs)`: planned (a probe step) the first time."""
        key = _signature(args, kwargs, self.device)
        found = self.fits.get(key)
        if found is None:
            if not self.placed:  # planned when called, where the model is by then (`fit_when_called`)
                _refuse_offload_on_the_cpu(self.model, _target_device(self.model, None), self.offload)
                self.placed = True
            found = _plan(self, args, kwargs)
            self.fits.put(key, found)
            if self.planned is not None:
                self.planned(found)
        return found


class _FittedForward(InstalledForward):
    """The fitted model's own instance `forward`: it holds the planner, and at an input signature not
    planned yet (with gradients on), plans the step again for the same target, then runs the model's
    forward. A call of the model has planned before its hooks ran (`_PlansWhenCalled`); this plans a
    direct call of `model.forward`."""

    def __init__(self, model: nn.Module, planner: _Planner):
        self.replaced = model.__dict__.get("forward", NOTHING)
        self.forward = model.forward  # its class's, or the block forward installed on it
        self.planner = planner

    def plan(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if torch.is_grad_enabled() and _step.recorder is None:  # not in the probe step itself
            if torch.compiler.is_compiling():
                _plan_outside_the_graph(self.planner, args, kwargs)
            else:
                self.planner.fit(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.plan(args, kwargs)
        return self.forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<remat.fit forward, peak_bytes={self.planner.target:,}>"


# NOTE [planning before the model's hooks]
# A new signature is planned when the fitted model is called, before anything
# of that call runs, its forward pre-hooks included. Planned inside the call
# (in its forward), the probe step would run the model again under the state
# its hooks set up for the call: FSDP2's root hook has gathered the root's
# parameters for this forward, and the probe step's backward shards them again
# and reduces their gradients before the forward reads them (found: a crash on
# mixed DTensor and tensor arguments, or, with the parameters gathered again,
# wrong gradients). Python looks `__call__` up on the class, so no attribute of
# the instance comes before the hooks: `fit` gives the model a subclass of its
# class that adds only this `__call__`, as FSDP2's `fully_shard` gives it one of
# its own. Either may come first: a subclass of the other's. The subclass keeps
# the class's name; `uncheckpoint_modules` leaves it, calling straight through.


class _PlansWhenCalled:
    """Mixed into a fitted model's class: plans a new signature before the call (NOTE [planning before
    the model's hooks])."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fitted = self.__dict__.get("forward")
        if isinstance(fitted, _FittedForward):
            fitted.plan(args, kwargs)
        return super().__call__(*args, **kwargs)  # type: ignore[misc]


_PLANNING_CLASSES: dict[type, type] = {}


def _plans_when_called(model: nn.Module) -> None:
    kind = type(model)
    if issubclass(kind, _PlansWhenCalled):
        return
    made = _PLANNING_CLASSES.get(kind)
    if made is None:
        names = {"__module__": kind.__module__, "__qualname__": kind.__qualname__, "__doc__": kind.__doc__}
        made = _PLANNING_CLASSES[kind] = type(kind.__name__, (_PlansWhenCalled, kind), names)
    model.__class__ = made


@torch.compiler.disable
def _plan_outside_the_graph(planner: _Planner, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Under `torch.compile(model)`, a graph break: the plan is looked up (or made) eagerly, and the
    model's forward compiles in its own frame, its blocks' regions following the plan."""
    planner.fit(args, kwargs)


def _signature(args: Sequence[Any], kwargs: dict[str, Any], device: torch.device | None = None) -> Hashable:
    """What tells one batch's step from another's: the tensors' metadata, the other leaves' values
    (their types, where they cannot be hashed or hash by identity), the structure. Objects are opened as a
    checkpointed function's arguments are (NOTE [objects handed to a checkpointed function]): a mask
    object made anew each step, over tensors of the same shapes, is the same signature. A meta tensor
    counts as one on `device` (the target of a plan made on meta), so that the materialized model's batch
    finds its plan."""
    tree: Any = opened((tuple(args), kwargs), NAMESPACE)
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
    key: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape, stride, dtype, on, *rest = tensor_key(leaf)
            key.append((shape, stride, dtype, device if device is not None and leaf.is_meta else on, *rest))
            continue
        try:
            hash(leaf)
        except TypeError:
            key.append(type(leaf))
            continue
        key.append(type(leaf) if type(leaf).__hash__ is object.__hash__ else leaf)
    return spec, tuple(key)


def _check_arguments(
    model: Any,
    peak_bytes: Any,
    loss: Any,
    kwargs: Any,
    optimizer: Any,
    cost: Any,
    exact: Any,
    pack: Any,
    compress: Any,
    offload: Any,
) -> None:
    from . import policies

    if isinstance(peak_bytes, bool) or not isinstance(peak_bytes, int) or peak_bytes <= 0:
        raise ValueError(f"remat.fit: `peak_bytes` must be a positive integer (bytes), but got {peak_bytes!r}.")
    if loss is not None and not callable(loss):
        raise TypeError(f"remat.fit: `loss` must be a function of the model's output, but got {loss!r}.")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(
            f"remat.fit: `kwargs` must be a dict of the model's keyword arguments, but got {type(kwargs).__name__}."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"remat.fit: `optimizer` must be a torch.optim.Optimizer, but got {optimizer!r}.")
    for name, value in (("exact", exact), ("pack", pack), ("offload", offload)):
        if not isinstance(value, bool):
            raise TypeError(f"remat.fit: `{name}` must be True or False, but got {value!r}.")
    try:
        policies.budget(max_bytes=0, cost=cost, compress=compress, offload=offload)
    except ValueError as error:
        raise ValueError(str(error).replace("remat.policies.budget", "remat.fit")) from None


def _default_loss(output: Any) -> torch.Tensor:
    value = getattr(output, "loss", None)
    if isinstance(value, torch.Tensor):
        return value
    tensors = [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError(
            "remat.fit: the model's output has no `.loss` and no tensor that requires grad, so there is no step "
            "to plan. Pass `loss=` (a function of the output giving the scalar to backpropagate)."
        )
    return sum((t.sum() for t in tensors), torch.zeros((), device=tensors[0].device, dtype=tensors[0].dtype))


def _blocks(model: nn.Module) -> dict[nn.Module, CheckpointedForward]:
    found = {}
    for _, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward) and isinstance(forward.policy, _Planned):
            found[module] = forward
    return found


@contextlib.contextmanager
def _put_back(model: nn.Module) -> Iterator[None]:
    """Run the probe step, then put back the parameters' gradients, the buffers and the generators."""
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in parameters if p.device.type == "cuda"})
    for p in parameters:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, grad in zip(parameters, grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


# NOTE [planning on the meta device]
# A model too big for this machine is planned with its parameters on the meta
# device, for a named target (`device=`). The meta device's own kernels are not
# the target's (attention decomposes to the math kernel there, which keeps the
# T x T scores), so the probe step runs on fake tensors of the target device
# instead (a FakeTensorMode: shapes, dtypes and strides, no data): torch's
# composite ops choose the kernels that device would run (CPU's flash attention,
# say), and every block is traced as it will be. Nothing real is allocated; the
# recorder counts the fake storages. Once the model is materialized on the
# target (`to_empty` and `load_state_dict`, or built there again), its batch
# has the planned signature (a meta tensor counts as one on the target), so it
# is not planned again, and each block, tracing itself again on real tensors,
# takes the planned decision of each call by its op, module, occurrence and
# output shapes and dtypes (a call the plan has no match for recomputes).


def _plans_for_the_cpu(model: nn.Module, target: torch.device | None) -> bool:
    """Whether the step planned runs on the CPU (the target of a model on meta, or where it is)."""
    if target is not None:
        return target.type == "cpu"
    return any(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers()))


def _target_device(model: nn.Module, device: Any) -> torch.device | None:
    """The device a model on meta is planned for (None: plan where the model is)."""
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if device is None:
        if on_meta:
            raise ValueError(
                "remat.fit: the model's parameters are on the meta device, whose kernels are not any real "
                "device's: name the device to plan for (`device='cuda'`, say)."
            )
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise TypeError(f"remat.fit: `device` must name a device ('cpu', 'cuda'), but got {device!r}.") from None
    if target.type == "meta":
        raise ValueError("remat.fit: `device` is the real device to plan for, not 'meta'.")
    if target.type == "cuda" and on_meta and not torch.backends.cuda.is_built():
        # Fake CUDA tensors need torch's CUDA kernels registered, GPU or not (NOTE [planning on the meta device]).
        raise ValueError(
            "remat.fit: planning for `device='cuda'` runs the probe step on fake CUDA tensors, which need a "
            "CUDA build of torch (the default Linux wheel; no GPU needed), but this torch is built for the CPU "
            "only (`torch.backends.cuda.is_built()` is False)."
        )
    where = {t.device for t in (*model.parameters(), *model.buffers())}
    if not on_meta and where != {target} and where:
        raise ValueError(
            f"remat.fit: `device={device!r}` plans a model on the meta device for that device, but this "
            f"model is on {', '.join(sorted(str(d) for d in where))}: leave out `device` to plan it where it is."
        )
    return target if on_meta else None


@contextlib.contextmanager
def _stepping(
    model: nn.Module, device: torch.device | None, args: Sequence[Any], kwargs: dict[str, Any]
) -> Iterator[tuple[Callable[[], Any], list[torch.Tensor], Any]]:
    """(a call of the model on the batch, the parameters it trains, the fake mode the tensors are of, if
    any): on the model as it is, or, for a
    `device` to plan a model on meta for, on fake tensors of that device (NOTE [planning on the meta
    device]). The blocks' traces made on fakes are dropped after."""
    if device is None:
        yield (lambda: model(*args, **kwargs)), [p for p in model.parameters() if p.requires_grad], None
        return
    from ._torch import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_meta:
            return mode.from_tensor(tensor)
        with mode:
            made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
        return made.requires_grad_(tensor.requires_grad)

    state = {name: fake(t) for name, t in (*model.named_parameters(), *model.named_buffers())}
    names = {id(p): name for name, p in model.named_parameters()}
    batch: Any = (tuple(args), kwargs)
    fake_args, fake_kwargs = optree.tree_map(  # type: ignore[misc]
        lambda leaf: fake(leaf) if isinstance(leaf, torch.Tensor) else leaf, batch, none_is_leaf=True
    )
    trained = [state[names[id(p)]] for p in model.parameters() if p.requires_grad]
    try:
        with mode, attention_as_on_the_gpu(list(state.values())):
            yield (lambda: torch.func.functional_call(model, state, fake_args, fake_kwargs)), trained, mode  # type: ignore[arg-type]
    finally:
        for forward in _blocks(model).values():
            forward.cache_clear()


def _probe(planner: _Planner, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[_step.Timeline, int]:
    """The probe step's timeline, with the optimizer's step after it, and the bytes of new optimizer state."""
    model, loss, optimizer = planner.model, planner.loss_for(args, kwargs), planner.optimizer
    with _put_back(model), _stepping(model, planner.device, args, kwargs) as (call, parameters, fakes):
        # Without a GPU, the backward of fake CUDA tensors is walked, releasing saved tensors as the engine
        # does (NOTE [a backward walked without the engine]).
        saved = None if planner.device is None or engine_runs_on(planner.device) else SavedTensors()

        def step() -> None:
            with saved.packing() if saved is not None else contextlib.nullcontext():
                value = loss(call())
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
                raise ValueError(
                    "remat.fit: `loss` must give a scalar tensor that requires grad (the value the step "
                    f"backpropagates), but gave {value!r}."
                )
            if saved is None:
                value.backward()
            else:
                walked_backward([value], [torch.ones_like(value)], saved)

        recorder = _step.run_step(step, fakes, _step.kernel_workspaces(parameters))
        # Distinct storages: FSDP2's gradient shards of a block are views of one reduce-scatter output.
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        gradients = sum({storage_key(g): storage_nbytes(g) for g in grads}.values())
        timeline = _step.timeline_of(recorder, gradients)
    if optimizer is None:
        return timeline, 0
    step_peak, state = _optimizer_step(optimizer, planner.device)
    last = timeline.segments[-1]
    after = _step.Segment(_step.Phase.OUTSIDE, None, last.alive, timeline.end + step_peak, "optimizer.step")
    return dataclasses.replace(timeline, segments=(*timeline.segments, after)), state


# NOTE [planning on every rank]
# Under FSDP2 each rank runs the same step on its own shard of the batch and
# of the parameters, and plans it with its own probe step, whose collectives
# (the all-gathers and reduce-scatters of the step itself) every rank issues
# in the same order, as in training: `fit` is called on every rank. The ranks
# then agree on what they measured, each segment of the step at its largest
# over the ranks, and solve the same program from it: every rank checkpoints
# alike, and the plan holds on the rank whose memory is tightest.


def _agreed_across_ranks(model: nn.Module, timeline: _step.Timeline, state: int) -> tuple[_step.Timeline, int]:
    """The probe step's timeline and optimizer state at their largest over the ranks of a model sharded with
    FSDP2 (NOTE [planning on every rank]); as they are otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return timeline, state
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return timeline, state
    mine = [len(timeline.segments), timeline.peak, timeline.gradients, timeline.end, state]
    mine += [segment.peak for segment in timeline.segments]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len({len(theirs) for theirs in everyone}) != 1:
        raise ValueError(
            "remat.fit: the ranks' probe steps ran different block calls; every rank must run the same step "
            "(the same model and batch shapes) and call `remat.fit` together."
        )
    largest = [max(values) for values in zip(*everyone, strict=True)]
    _, peak, gradients, end, state, *peaks = largest
    segments = tuple(dataclasses.replace(s, peak=p) for s, p in zip(timeline.segments, peaks, strict=True))
    return dataclasses.replace(timeline, segments=segments, peak=peak, gradients=gradients, end=end), state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What `tensor` holds on this rank: a DTensor's shard (FSDP2's parameters, gradients and optimizer
    state), any other tensor itself."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.to_local()
    return tensor


def _optimizer_step(optimizer: torch.optim.Optimizer, device: torch.device | None) -> tuple[int, int]:
    """(peak bytes, bytes of new state) of one `optimizer.step()`, measured on meta copies of its
    parameters and gradients (nothing real is touched). State it already holds was live before the step
    and is not counted; a first step allocates its state."""
    copies: dict[int, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            meta = nn.Parameter(torch.empty_like(_local(p), device="meta"), requires_grad=p.requires_grad)
            if p.requires_grad:
                meta.grad = torch.empty_like(meta)
            copies[id(p)] = meta
            params.append(meta)
        options = {k: v for k, v in group.items() if k != "params"}
        on_cuda = device.type == "cuda" if device is not None else any(p.is_cuda for p in group["params"])
        if options.get("foreach") is None and on_cuda:
            options["foreach"] = True  # what torch chooses on CUDA; on meta it would loop over the tensors
        groups.append({**options, "params": params})
    kind: Any = type(optimizer)
    try:
        replica = kind(groups)
    except TypeError as error:
        raise TypeError(
            f"remat.fit: cannot make a copy of the optimizer {type(optimizer).__name__} on the meta device to "
            f"measure its step ({error}); plan without `optimizer=` and leave room for its state."
        ) from None
    for p, state in optimizer.state.items():
        if id(p) in copies:
            replica.state[copies[id(p)]] = {
                k: torch.empty_like(_local(v), device="meta") if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in state.items()
            }
    recorder = _step.run_step(replica.step)
    return recorder.peak, recorder.total


def _plan(planner: _Planner, args: Sequence[Any], kwargs: dict[str, Any]) -> Fit:
    """Probe the step at these arguments, choose every block's plan for the planner's target, and apply it."""
    started = time.perf_counter()
    model, target, cost, exact = planner.model, planner.target, planner.cost, planner.exact
    timeline, optimizer_state = _probe(planner, args, kwargs)
    timeline, optimizer_state = _agreed_across_ranks(model, timeline, optimizer_state)
    blocks = _blocks(model)
    keys: dict[tuple[int, int], int] = {}
    options: dict[int, tuple[_Candidate, ...]] = {}  # by trace: blocks that share one share its candidates
    groups: list[_Group] = []
    group_of: list[int] = []
    for call in timeline.calls:
        policy = blocks[call.module].policy
        if call.trace is None:
            raise ValueError(f"remat.fit: the block {call.name!r} ran without a trace (it was called without grad).")
        key = (id(policy), id(call.trace))
        if key not in keys:
            keys[key] = len(groups)
            if id(call.trace) not in options:
                options[id(call.trace)] = tuple(
                    candidates(call.trace, call.regions, cost, exact, planner.pack, planner.compress, planner.offload)
                )
            groups.append(_Group(call.name, policy, call.trace, options[id(call.trace)]))
        group_of.append(keys[key])
    rows = _rows(timeline, group_of, groups)
    choice, chain = _solve_chain(groups, rows, group_of, target)
    if not chain:
        choice, _ = _solve(groups, rows, target, exact)
    if choice is not None:
        peak, _ = _predicted_peak(rows, choice)
        if peak > target:  # the solver's tolerance: shave what it let through, once
            choice, _ = _solve(groups, rows, target - (peak - target), exact)
    if choice is None or _predicted_peak(rows, choice)[0] > target:
        raise _infeasible(groups, rows, timeline, target, exact)
    for group, k in zip(groups, choice, strict=True):
        group.policy.choose(group.trace, group.options[k].decisions)
    for forward in blocks.values():
        forward.checkpointed.replan()
    return _record(
        model, timeline, optimizer_state, groups, group_of, rows, choice, target, time.perf_counter() - started
    )


def _where(row: _Row, timeline: _step.Timeline) -> str:
    segment = row.segment
    op = f" ({segment.op})" if segment.op else ""
    if segment.call is None:
        return f"outside the blocks{op}"
    return f"in the {segment.phase.value} of {timeline.calls[segment.call].name!r}{op}"


def _infeasible(
    groups: Sequence[_Group], rows: Sequence[_Row], timeline: _step.Timeline, target: int, exact: bool
) -> ValueError:
    lowest_choice, _ = _solve(groups, rows, None, exact)
    assert lowest_choice is not None
    lowest, row = _predicted_peak(rows, lowest_choice)
    assert row is not None
    kept = sum(row.terms.get((g, k), 0) for g, k in enumerate(lowest_choice))
    return ValueError(
        f"remat.fit: no plan fits the step in {format_bytes(target)} ({target:,} bytes): the lowest predicted "
        f"peak is {format_bytes(lowest)} ({lowest:,} bytes), {_where(row, timeline)}, where "
        f"{format_bytes(row.segment.peak)} are live when every block saves nothing"
        f"{'' if not kept else f' and {format_bytes(kept)} more under that plan'}. "
        "Raise `peak_bytes` to at least that, use a smaller batch, or checkpoint more of the model "
        "(what lies outside the blocks is not checkpointed)."
    )


def _record(
    model: nn.Module,
    timeline: _step.Timeline,
    optimizer_state: int,
    groups: Sequence[_Group],
    group_of: Sequence[int],
    rows: Sequence[_Row],
    choice: Sequence[int],
    target: int,
    seconds: float,
) -> Fit:
    peak, row = _predicted_peak(rows, choice)
    assert row is not None
    plans = []
    kept: dict[str, int] = {}
    for call in timeline.calls:
        g = group_of[call.index]
        option = groups[g].options[choice[g]]
        nothing = groups[g].options[0]
        extra = option.peak.after_forward - nothing.peak.after_forward
        plans.append(BlockPlan(call.name, option.label, option.decisions, extra, option.cost, option.host_bytes))
        kept[call.name] = kept.get(call.name, 0) + extra

    def uniform(label: str) -> int:
        picks = [next((k for k, o in enumerate(g.options) if o.label == label), 0) for g in groups]
        return _predicted_peak(rows, picks)[0]

    report = StepReport(
        parameters=sum(storage_nbytes(_local(p)) for p in model.parameters()),
        gradients=timeline.gradients,
        optimizer_state=optimizer_state,
        kept=kept,
        peak=peak,
        where=_where(row, timeline),
        peak_keeping_everything=uniform("save_everything"),
        peak_keeping_nothing=uniform("save_nothing"),
        activations=max(0, peak - timeline.gradients),
        measured_peak=timeline.peak,
        unsharded=row.segment.resized,
        prefetched=row.segment.prefetched,
        unreduced_gradients=row.segment.unreduced,
    )
    return Fit(target, peak, tuple(plans), sum(p.replay_cost for p in plans), report, seconds)
