"""`remat.policies.budget`: the planner's accounting is the partitioner's, it never exceeds its
budget, the exact mode is optimal, and cost falls as the budget grows."""

from __future__ import annotations

import functools
import math
from typing import Any

import models
import numpy as np
import pytest
import torch
from conftest import bytes_seen_by_saved_tensors_hooks, examples
from hypothesis import assume, given
from hypothesis import strategies as st

import remat
from remat import policies
from remat._api._inspect import _joint_of
from remat._core._rng import state_nbytes
from remat._memory._measure import storage_key, storage_nbytes, tensor_nbytes, tensors_in
from remat._partitioning._accounting import account
from remat._partitioning._partition import KeptActivation, partition
from remat._partitioning._program_graphs import device_of
from remat.testing import RandomFunction, Step, assert_checkpoint_equivalent, functions, inputs

DTYPE = torch.float64


@functools.cache
def _block(attention: str = "sdpa") -> tuple[torch.nn.Module, torch.Tensor]:
    block = models.GPT2Block(attention=attention).to(DTYPE)
    return block, torch.randn(2, 8, 32, dtype=DTYPE, generator=torch.Generator().manual_seed(0))


@functools.cache
def _block_trace(attention: str = "sdpa") -> remat.Trace:
    return remat.trace(*_block(attention))


def _everything_bytes(trace: remat.Trace) -> int:
    return account(trace, range(len(trace))).saved_bytes


def _programs_figures(fn: Any, args: Any, saved: set[int], joint: Any = None) -> tuple[set[int], int]:
    """The calls the partition's backward program replays, and the bytes its forward keeps for it
    (new storages of kept values, copies of inputs, generator states), read off the programs (of
    `joint`, `fn`'s joint graph at `args`, traced here unless given)."""
    if joint is None:
        joint, _, _ = _joint_of(fn, args, {}, "test")
    decisions = [remat.SAVE if i in saved else remat.RECOMPUTE for i in range(len(joint.trace))]
    programs = partition(joint, decisions)
    in_backward = {  # copies share `val` (the kept values' placeholders carry theirs too)
        id(node.meta["val"])
        for node in programs.backward.graph.nodes
        if node.op != "placeholder" and "val" in node.meta
    }

    replayed = {i for i, node in enumerate(joint.call_nodes) if id(node.meta.get("val", node)) in in_backward}
    inputs = {storage_key(t) for p in joint.primals for t in tensors_in(p.meta["val"])}
    storages: dict[Any, int] = {}
    nbytes = 0
    for kept in programs.kept:
        if kept.rng_state:
            nbytes += state_nbytes(device_of(kept.node))
        elif kept.node.op == "placeholder":
            nbytes += tensor_nbytes(kept.node.meta["val"]) if isinstance(kept.where, KeptActivation) else 0  # a copy
        else:
            for tensor in tensors_in(kept.node.meta["val"]):
                if storage_key(tensor) not in inputs:
                    storages[storage_key(tensor)] = storage_nbytes(tensor)
    return replayed, nbytes + sum(storages.values())


# --- the accounting is the partitioner's ----------------------------------------------------------


@examples(ci=15, soak=2_000)
@given(st.data())
def test_accounting_equals_the_partitions_programs_for_any_decisions(data: st.DataObject) -> None:
    """What planners, `remat.report` and the log count is what the programs keep and replay."""
    fn = data.draw(functions(), label="fn")
    args = data.draw(inputs(fn), label="args")
    trace = remat.trace(fn, *args)
    saved = data.draw(st.sets(st.integers(0, max(len(trace) - 1, 0))) if len(trace) else st.just(set()))
    accounting = account(trace, saved)
    assert (set(accounting.replayed_calls), accounting.saved_bytes) == _programs_figures(fn, args, saved)
    report = remat.report(fn, *args, policy=policies.save_calls(*sorted(saved)))
    assert (report.replayed_calls, report.saved_bytes) == (accounting.replayed_calls, accounting.saved_bytes)


@pytest.mark.slow
def test_accounting_equals_the_partitions_programs_on_a_gpt2_block() -> None:
    block, x = _block("softmax")
    trace = _block_trace("softmax")
    joint, _, _ = _joint_of(block, (x,), {}, "test")  # one trace, partitioned under each set of decisions
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        saved = {c for c in range(len(trace)) if torch.rand((), generator=generator) < 0.5}
        accounting = account(trace, saved)
        figures = _programs_figures(block, (x,), saved, joint)
        assert (set(accounting.replayed_calls), accounting.saved_bytes) == figures


# --- never over budget ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
def test_budget_is_never_exceeded_on_a_gpt2_block(fraction: float, exact: bool) -> None:
    block, x = _block()
    policy = policies.budget(fraction=fraction, exact=exact)
    limit = math.floor(fraction * _everything_bytes(_block_trace()))
    report = remat.report(block, x, policy=policy)
    assert report.saved_bytes <= limit
    checkpointed = remat.checkpoint(block, policy=policy)
    checkpointed(x)  # trace first: the measurement below sees one cached call
    measured = bytes_seen_by_saved_tensors_hooks(checkpointed, x, [x, *block.parameters()])
    assert measured == report.saved_bytes
    assert_checkpoint_equivalent(block, x, checkpointed=checkpointed)


@examples(ci=8, soak=1_000)
@given(st.data())
def test_budget_is_never_exceeded_on_random_functions(data: st.DataObject) -> None:
    fn = data.draw(functions(), label="fn")
    args = data.draw(inputs(fn), label="args")
    trace = remat.trace(fn, *args)
    fraction = data.draw(st.floats(0, 1), label="fraction")
    exact = data.draw(st.booleans(), label="exact")
    limit = math.floor(fraction * _everything_bytes(trace))
    policy = policies.budget(fraction=fraction, exact=exact)
    try:
        report = remat.report(fn, *args, policy=policy)
    except ValueError as error:  # below what any decisions keep: the message gives the minimum
        minimum = int(str(error).split("the fewest any keep is ")[1].split("(")[1].split(" bytes")[0].replace(",", ""))
        assert minimum > limit
        return
    assert report.saved_bytes <= limit


# --- optimal, and monotone ---------------------------------------------------------------------------


@examples(ci=8, soak=1_000)
@given(st.data())
def test_the_exact_plan_costs_no_more_than_any_decisions_within_the_budget(data: st.DataObject) -> None:
    fn = data.draw(functions(), label="fn")
    args = data.draw(inputs(fn), label="args")
    trace = remat.trace(fn, *args)
    assume(len(trace) > 0)
    saved = data.draw(st.sets(st.integers(0, len(trace) - 1)), label="saved")
    other = remat.report(fn, *args, policy=policies.save_calls(*sorted(saved)))
    budget = other.saved_bytes
    plan = policies.budget(max_bytes=budget, exact=True).solve(trace)
    assert plan.cost <= other.recompute_flops
    assert remat.report(fn, *args, policy=policies.budget(max_bytes=budget, exact=True)).saved_bytes <= budget


def test_regression_the_exact_plan_is_optimal_where_the_solvers_presolve_was_not() -> None:
    # HiGHS's presolve called a plan replaying 4 FLOPs optimal where saving `sub` and `tanh` (40 bytes, the
    # budget) replays nothing; the solver runs without it (remat/_deciding/_milp.py).
    fn = RandomFunction(
        (2, 2), 1, (Step("abs", 0, 0), Step("mean", 0, 0), Step("abs", 2, 2), Step("sum_all", 2, 2)), (4,)
    )
    x = torch.tensor([[1.5410, -0.2934], [-2.1788, 0.5684]], dtype=torch.float64, requires_grad=True)
    trace = remat.trace(fn, x)
    plan = policies.budget(max_bytes=40, exact=True).solve(trace)
    assert (plan.cost, plan.saved_bytes) == (0, 40)


@pytest.mark.slow
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("attention", ["sdpa", "softmax"])
def test_cost_falls_as_the_budget_grows(attention: str, exact: bool) -> None:
    trace = _block_trace(attention)
    costs = [
        policies.budget(fraction=fraction, exact=exact).solve(trace).cost for fraction in [i / 20 for i in range(21)]
    ]
    assert costs == sorted(costs, reverse=True), costs
    assert costs[0] > costs[-1] == 0


def test_the_fast_plan_is_near_the_exact_one_on_a_gpt2_block() -> None:
    trace = _block_trace("softmax")
    for fraction in (0.1, 0.25, 0.5, 0.75):
        fast = policies.budget(fraction=fraction).solve(trace)
        exact = policies.budget(fraction=fraction, exact=True).solve(trace)
        assert exact.cost <= fast.cost <= 1.02 * exact.cost + 1e-9
        assert exact.gap == 0.0
        assert fast.lower_bound <= exact.cost + 1e-6  # the relaxation bounds the optimum from below


def test_without_time_for_branch_and_bound_the_fast_plan_rounds_the_relaxation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Branch and bound finds nothing in no time; the fast mode then rounds and repairs the LP relaxation,
    # whose optimum still bounds the exact one from below.
    from remat._deciding import _budget

    trace = _block_trace("softmax")
    exact = {f: policies.budget(fraction=f, exact=True).solve(trace) for f in (0.25, 0.5)}
    monkeypatch.setattr(_budget, "FAST_TIME_LIMIT", 0.0)
    for fraction, optimum in exact.items():
        rounded = _budget.solve(trace, math.floor(fraction * _everything_bytes(trace)), "flops", exact=False)
        assert rounded.saved_bytes <= fraction * _everything_bytes(trace)
        assert optimum.cost <= rounded.cost
        assert rounded.lower_bound <= optimum.cost + 1e-6
    with pytest.raises(_budget.InfeasibleBudget):
        _budget.solve(trace, -1, "flops", exact=False)


def test_the_fast_modes_repair_stops_at_its_deadline() -> None:
    # Each greedy step weighs every replayed call: on a trace of a thousand calls it could run for
    # minutes. Past its deadline the repair keeps the rounding it has.
    from remat._deciding import _budget

    trace = _block_trace("softmax")
    costs = _budget.call_costs(trace, "flops")
    nothing = np.zeros(len(trace))  # the relaxation's saves, rounded at 0.5: none
    budget = _everything_bytes(trace)
    assert _budget._round_and_repair(trace, costs, nothing, budget, deadline=0.0) == set()
    repaired = _budget._round_and_repair(trace, costs, nothing, budget, deadline=math.inf)
    assert repaired and account(trace, repaired).saved_bytes <= budget
    assert replay_cost_of(trace, repaired, costs) < replay_cost_of(trace, set(), costs)


def replay_cost_of(trace: remat.Trace, saved: set[int], costs: list[float]) -> float:
    from remat._deciding import _budget

    return _budget.replay_cost(account(trace, saved), costs)


# --- errors, repr, caching ---------------------------------------------------------------------------


def test_a_budget_below_every_plan_says_the_minimum() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x.sin(), 0.5).sum()

    x = torch.randn(10_000, dtype=DTYPE, requires_grad=True)
    trace = remat.trace(fn, x)
    state = trace.dataflow.rng_state_nbytes  # type: ignore[union-attr]
    # Replay the dropout: its generator state beats keeping its mask as it is (10,000 elements)...
    minimum = max(state)
    with pytest.raises(ValueError, match=rf"the fewest any keep is .*\({minimum:,} bytes.*Raise the budget"):
        remat.checkpoint(fn, policy=policies.budget(max_bytes=100, pack=False))(x)
    report = remat.report(fn, x, policy=policies.budget(max_bytes=minimum, pack=False))
    assert report.saved_bytes == minimum
    # ...but not keeping it as bits (NOTE [values kept as bits]).
    with pytest.raises(ValueError, match=r"the fewest any keep is .*\(1,250 bytes.*Raise the budget"):
        remat.checkpoint(fn, policy=policies.budget(max_bytes=100))(x)
    report = remat.report(fn, x, policy=policies.budget(max_bytes=1250))
    assert report.saved_bytes == 1250 and [row.storage for row in report.rows if row.saved] == ["bits"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, TypeError, "exactly one of `max_bytes`"),
        ({"max_bytes": 10, "fraction": 0.5}, TypeError, "exactly one of `max_bytes`"),
        ({"max_bytes": -1}, ValueError, "non-negative integer"),
        ({"max_bytes": 1.5}, ValueError, "non-negative integer"),
        ({"fraction": 1.5}, ValueError, "from 0 to 1"),
        ({"fraction": 0.5, "cost": "time"}, ValueError, "'flops' or 'roofline:<device>'"),
        ({"fraction": 0.5, "cost": "roofline:a100"}, ValueError, "unknown device 'a100'"),
    ],
)
def test_bad_budget_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        policies.budget(**kwargs)


def test_budget_repr_and_equality() -> None:
    assert repr(policies.budget(fraction=0.25)) == "budget(fraction=0.25)"
    assert repr(policies.budget(max_bytes=1024, cost="roofline:h100", exact=True)) == (
        "budget(max_bytes=1024, cost='roofline:h100', exact=True)"
    )
    assert policies.budget(fraction=0.25) == policies.budget(fraction=0.25)
    assert hash(policies.budget(fraction=0.25)) == hash(policies.budget(fraction=0.25))


def test_plans_are_cached_with_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat._deciding._budget

    solves = []
    solve = remat._deciding._budget.solve
    monkeypatch.setattr(remat._deciding._budget, "solve", lambda *a, **k: solves.append(a) or solve(*a, **k))
    block, x = _block()
    checkpointed = remat.checkpoint(block, policy=policies.budget(fraction=0.5))
    for _ in range(3):
        checkpointed(x).sum().backward()
    assert len(solves) == 1


def test_roofline_cost_plans_by_estimated_time() -> None:
    trace = _block_trace()
    plan = policies.budget(fraction=0.5, cost="roofline:h100", exact=True).solve(trace)
    assert plan.cost > 0
    assert plan.cost < sum(remat.costs.estimate_seconds(call, "h100") for call in trace)


def test_a_budget_inside_a_nested_checkpoint_is_refused() -> None:
    inner = remat.checkpoint(lambda x: x.sin().cos(), policy=policies.budget(fraction=0.5))
    outer = remat.checkpoint(lambda x: inner(x).exp().sum())
    with pytest.raises(TypeError, match="a budget plans over the dataflow of a whole trace"):
        outer(torch.randn(3, dtype=DTYPE, requires_grad=True))


def test_regression_a_kept_value_without_a_derivative_stops_the_recomputation_behind_it() -> None:
    # The planner counted a copy of every overwritten input a kept differentiable value came from,
    # even behind a kept value that needs no grad, where the partitioner stops: 40 bytes, not 24.
    fn = RandomFunction(
        (1, 2), 2, (Step("abs", 0, 0), Step("matmul", 2, 1), Step("abs", 3, 3), Step("abs", 4, 4)), (5, 0)
    )
    args = (torch.tensor([[1.5410, -0.2934]], dtype=DTYPE), torch.tensor([[-2.1788, 0.5684]], dtype=DTYPE))
    args[1].requires_grad_()
    trace = remat.trace(fn, *args)
    report = remat.report(fn, *args, policy=policies.save_calls(0, 1))
    assert _programs_figures(fn, args, {0, 1}) == (set(report.replayed_calls), report.saved_bytes)
    assert report.saved_bytes == 24
    plan = policies.budget(max_bytes=24, exact=True).solve(trace)
    assert plan.saved_bytes <= 24


def test_regression_the_planner_cannot_claim_a_replay_nothing_needs() -> None:
    # The 0-1 program could mark a call replayed that nothing reads, so that it "read" a kept value
    # without a derivative and stopped a recomputation for free: the plan kept more than planned,
    # and a feasible budget (save_nothing's own 5,056 bytes) was called infeasible.
    fn = RandomFunction((1, 2), 1, (Step("abs", 0, 0), Step("rand_like", 1, 1), Step("abs", 2, 2)), (3,))
    x = torch.tensor([[1.5410, -0.2934]], dtype=DTYPE, requires_grad=True)
    trace = remat.trace(fn, x)
    limit = remat.report(fn, x, policy=policies.save_nothing).saved_bytes
    plan = policies.budget(max_bytes=limit, exact=True).solve(trace)
    report = remat.report(fn, x, policy=policies.budget(max_bytes=limit, exact=True))
    assert plan.saved_bytes == report.saved_bytes <= limit
    assert plan.cost <= report.recompute_flops <= remat.report(fn, x).recompute_flops
