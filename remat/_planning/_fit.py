"""`remat.fit`: decisions for every checkpointed block of a model, so that a whole training step fits a
memory target, replaying as little as possible. See NOTE [planning a step].
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import optree
import torch
from torch import nn

from .._api._apply import NOTHING, InstalledForward, Which, checkpoint_selected, uncheckpoint_modules
from .._api._checkpointed import DEFAULT_CACHE_SIZE
from .._core._cache import LRUCache, tensor_key
from .._core._calls import format_bytes
from .._core._objects import opened
from .._core._pytree import NAMESPACE
from .._memory import _step
from .._memory._measure import storage_nbytes
from ._fit_choice import Candidate, Group, Planned, Row, candidates, predicted_peak, solve, solve_chain, step_rows
from ._fit_probe import agreed_across_ranks, fitted_blocks, on_this_rank, plans_for_the_cpu, probe_step, target_device
from ._fit_results import BlockPlan, Fit, StepReport

__all__ = ["LossFor", "fit", "fit_when_called"]

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
# (`solve_chain`); any other step by HiGHS (`_milp`). A single policy applied to
# every block is one of the program's solutions, so `fit` is never costlier than
# the best uniform plan that fits. Blocks that share a trace may be given
# different candidates.
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
    target = target_device(model, device)
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
    if offload and plans_for_the_cpu(model, target):
        raise ValueError(
            "remat.fit: offload=True plans copies to host memory to lower a GPU's peak, but this step runs on "
            "the CPU, where a tensor is its own host copy: offloading would free nothing. Plan without it, or "
            "for the GPU (`device='cuda'` with the model on meta, or the model on the GPU)."
        )


def _install(planner: _Planner, which: Which) -> _Planner:
    """Checkpoint the blocks `which` selects with plans to be made, and make the model plan when called."""
    model = planner.model
    checkpoint_selected(model, which, Planned, DEFAULT_CACHE_SIZE, False, "remat.fit")
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
                _refuse_offload_on_the_cpu(self.model, target_device(self.model, None), self.offload)
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
    from .. import policies

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


def _plan(planner: _Planner, args: Sequence[Any], kwargs: dict[str, Any]) -> Fit:
    """Probe the step at these arguments, choose every block's plan for the planner's target, and apply it."""
    started = time.perf_counter()
    model, target, cost, exact = planner.model, planner.target, planner.cost, planner.exact
    loss = planner.loss_for(args, kwargs)
    timeline, optimizer_state = probe_step(model, loss, planner.optimizer, planner.device, args, kwargs)
    timeline, optimizer_state = agreed_across_ranks(model, timeline, optimizer_state)
    blocks = fitted_blocks(model)
    keys: dict[tuple[int, int], int] = {}
    options: dict[int, tuple[Candidate, ...]] = {}  # by trace: blocks that share one share its candidates
    groups: list[Group] = []
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
            groups.append(Group(call.name, policy, call.trace, options[id(call.trace)]))
        group_of.append(keys[key])
    rows = step_rows(timeline, group_of, groups)
    choice, chain = solve_chain(groups, rows, group_of, target)
    if not chain:
        choice, _ = solve(groups, rows, target, exact)
    if choice is not None:
        peak, _ = predicted_peak(rows, choice)
        if peak > target:  # the solver's tolerance: shave what it let through, once
            choice, _ = solve(groups, rows, target - (peak - target), exact)
    if choice is None or predicted_peak(rows, choice)[0] > target:
        raise _infeasible(groups, rows, timeline, target, exact)
    for group, k in zip(groups, choice, strict=True):
        group.policy.choose(group.trace, group.options[k].decisions)
    for forward in blocks.values():
        forward.checkpointed.replan()
    return _record(
        model, timeline, optimizer_state, groups, group_of, rows, choice, target, time.perf_counter() - started
    )


def _where(row: Row, timeline: _step.Timeline) -> str:
    segment = row.segment
    op = f" ({segment.op})" if segment.op else ""
    if segment.call is None:
        return f"outside the blocks{op}"
    return f"in the {segment.phase.value} of {timeline.calls[segment.call].name!r}{op}"


def _infeasible(
    groups: Sequence[Group], rows: Sequence[Row], timeline: _step.Timeline, target: int, exact: bool
) -> ValueError:
    lowest_choice, _ = solve(groups, rows, None, exact)
    assert lowest_choice is not None
    lowest, row = predicted_peak(rows, lowest_choice)
    assert row is not None
    kept = sum(row.terms.get((g, k), 0) for g, k in enumerate(lowest_choice))
    # A plan can lower a peak below saving nothing's: a backward that replays less holds less.
    change = "" if not kept else f" and {format_bytes(abs(kept))} {'more' if kept > 0 else 'less'} under that plan"
    return ValueError(
        f"remat.fit: no plan fits the step in {format_bytes(target)} ({target:,} bytes): the lowest predicted "
        f"peak is {format_bytes(lowest)} ({lowest:,} bytes), {_where(row, timeline)}, where "
        f"{format_bytes(row.segment.peak)} are live when every block saves nothing"
        f"{change}. "
        "Raise `peak_bytes` to at least that, use a smaller batch, or checkpoint more of the model "
        "(what lies outside the blocks is not checkpointed)."
    )


def _record(
    model: nn.Module,
    timeline: _step.Timeline,
    optimizer_state: int,
    groups: Sequence[Group],
    group_of: Sequence[int],
    rows: Sequence[Row],
    choice: Sequence[int],
    target: int,
    seconds: float,
) -> Fit:
    peak, row = predicted_peak(rows, choice)
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
        return predicted_peak(rows, picks)[0]

    report = StepReport(
        parameters=sum(storage_nbytes(on_this_rank(p)) for p in model.parameters()),
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
