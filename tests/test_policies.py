"""Built-in policies, combinators, user-written policies and planners, and `remat.report`."""

from __future__ import annotations

import functools
import pathlib
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import remat
from remat import policies
from remat.policies import (
    save_all_of,
    save_any_of,
    save_calls,
    save_everything,
    save_nothing,
    save_ops,
    save_unless,
)

aten = torch.ops.aten
DTYPE = torch.float64
S, R = remat.SAVE, remat.RECOMPUTE


def two_matmuls(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    h = a @ b  # 0: mm
    h = h.sin()  # 1: sin
    h = h @ c  # 2: mm
    return h.sum()  # 3: sum


def _args() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(shape, dtype=DTYPE, generator=generator).requires_grad_() for shape in [(2, 3), (3, 4), (4, 5)]
    )


@functools.cache
def _trace() -> remat.Trace:
    return remat.trace(two_matmuls, *_args())


def _decisions(policy: object, fn=two_matmuls, args=None) -> list[remat.Decision]:
    report = remat.report(fn, *(args if args is not None else _args()), policy=policy)
    return [row.decision for row in report.rows]


def _assert_gradients_match(policy: object) -> None:
    args = _args()
    expected = torch.autograd.grad(two_matmuls(*args), args)
    actual = torch.autograd.grad(remat.checkpoint(two_matmuls, policy=policy)(*args), args)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_the_trace_used_here():
    assert [call.name for call in _trace()] == [
        "aten.mm.default",
        "aten.sin.default",
        "aten.mm.default",
        "aten.sum.default",
    ]


def test_decision_names():
    assert remat.SAVE is remat.Decision.SAVE
    assert remat.RECOMPUTE is remat.Decision.RECOMPUTE
    assert remat.SAVE is not remat.RECOMPUTE
    assert repr(remat.SAVE) == "remat.SAVE"
    assert repr(remat.RECOMPUTE) == "remat.RECOMPUTE"
    exact = {remat.SAVE, remat.RECOMPUTE, remat.OFFLOAD, remat.PACK}
    lossy = {remat.Decision.FLOAT16, remat.Decision.BFLOAT16, remat.Decision.FP8}
    assert set(remat.Decision) == exact | lossy
    assert repr(remat.PACK) == "remat.PACK"
    assert repr(remat.Decision.FP8) == "remat.Decision.FP8" and not hasattr(remat, "FP8")


# --- constant policies ----------------------------------------------------------------------------


def test_save_nothing():
    assert _decisions(save_nothing) == [R, R, R, R]
    assert _decisions(None) == [R, R, R, R]  # the default
    assert all(save_nothing(call) is R for call in _trace())


def test_save_everything():
    assert _decisions(save_everything) == [S, S, S, S]
    assert all(save_everything(call) is S for call in _trace())


def test_save_nothing_keeps_nothing_and_save_everything_replays_nothing():
    nothing = remat.report(two_matmuls, *_args(), policy=save_nothing)
    assert nothing.saved_bytes == 0
    assert nothing.replayed_calls != ()
    assert nothing.recompute_flops > 0
    everything = remat.report(two_matmuls, *_args(), policy=save_everything)
    assert everything.replayed_calls == ()
    assert everything.recompute_flops == 0
    assert everything.saved_bytes > 0


# --- save_ops -------------------------------------------------------------------------------------


def test_save_ops_with_a_packet_or_an_overload():
    assert _decisions(save_ops(aten.mm)) == [S, R, S, R]
    assert _decisions(save_ops(aten.mm.default)) == [S, R, S, R]
    assert _decisions(save_ops(aten.sin, aten.sum.default)) == [R, S, R, S]
    assert _decisions(save_ops(aten.bmm)) == [R, R, R, R]


def several_overloads(x: torch.Tensor) -> torch.Tensor:
    y = x + x  # 0: add.Tensor
    z = aten.add.Scalar(y, 2.0)  # 1: add.Scalar
    total = x.sum()  # 2: sum.default
    columns = z.sum(0)  # 3: sum.dim_IntList
    return total * columns  # 4: mul.Tensor


def test_a_packet_matches_every_overload_and_an_overload_only_itself():
    args = (torch.randn(2, 3, dtype=DTYPE, requires_grad=True),)
    names = [call.name for call in remat.trace(several_overloads, *args)]
    assert names == [
        "aten.add.Tensor",
        "aten.add.Scalar",
        "aten.sum.default",
        "aten.sum.dim_IntList",
        "aten.mul.Tensor",
    ]
    assert _decisions(save_ops(aten.add), several_overloads, args) == [S, S, R, R, R]
    assert _decisions(save_ops(aten.add.Tensor), several_overloads, args) == [S, R, R, R, R]
    assert _decisions(save_ops(aten.add.Scalar), several_overloads, args) == [R, S, R, R, R]
    assert _decisions(save_ops(aten.sum), several_overloads, args) == [R, R, S, S, R]
    assert _decisions(save_ops(aten.sum.dim_IntList), several_overloads, args) == [R, R, R, S, R]


# --- save_calls -----------------------------------------------------------------------------------


def test_save_calls():
    assert _decisions(save_calls(1)) == [R, S, R, R]
    assert _decisions(save_calls(0, 3)) == [S, R, R, S]
    assert _decisions(save_calls()) == [R, R, R, R]


def test_save_calls_negative_indices_count_from_the_end():
    assert _decisions(save_calls(-1)) == [R, R, R, S]
    assert _decisions(save_calls(-4)) == [S, R, R, R]
    assert _decisions(save_calls(0, -2)) == [S, R, S, R]
    assert _decisions(save_calls(1, -3)) == [R, S, R, R]  # the same call twice


def test_save_calls_negative_index_inside_a_combinator():
    assert _decisions(save_calls(-1) | save_ops(aten.sin)) == [R, S, R, S]
    assert _decisions(~save_calls(-1)) == [S, S, S, R]


# --- combinators ----------------------------------------------------------------------------------


def test_or_and_save_any_of():
    assert _decisions(save_calls(1) | save_ops(aten.mm)) == [S, S, S, R]
    assert _decisions(save_any_of(save_calls(1), save_ops(aten.mm))) == [S, S, S, R]
    assert _decisions(save_any_of(save_calls(0), save_calls(1), save_calls(3))) == [S, S, R, S]
    assert _decisions(save_nothing | save_nothing) == [R, R, R, R]
    assert _decisions(save_nothing | save_everything) == [S, S, S, S]


def test_and_and_save_all_of():
    assert _decisions(save_ops(aten.mm) & save_calls(-1, 2)) == [R, R, S, R]
    assert _decisions(save_all_of(save_ops(aten.mm), save_calls(0, 1))) == [S, R, R, R]
    assert _decisions(save_all_of(save_everything, save_calls(1, 2), save_ops(aten.mm))) == [R, R, S, R]
    assert _decisions(save_everything & save_nothing) == [R, R, R, R]


def test_invert():
    assert _decisions(~save_ops(aten.mm)) == [R, S, R, S]
    assert _decisions(~save_nothing) == [S, S, S, S]
    assert _decisions(~save_everything) == [R, R, R, R]
    assert _decisions(~~save_calls(2)) == [R, R, S, R]


def test_save_unless():
    assert _decisions(save_unless(save_everything, save_ops(aten.mm))) == [R, S, R, S]
    assert _decisions(save_unless(save_ops(aten.mm), save_calls(0))) == [R, R, S, R]
    assert _decisions(save_unless(save_nothing, save_calls(0))) == [R, R, R, R]


def test_combinators_accept_plain_callables():
    def is_sin(call: remat.Call) -> bool:
        return call.op is aten.sin.default

    assert _decisions(save_ops(aten.mm) | is_sin) == [S, S, S, R]
    assert _decisions(save_any_of(is_sin, save_calls(3))) == [R, S, R, S]
    assert _decisions(save_everything & is_sin) == [R, S, R, R]
    assert _decisions(save_unless(save_everything, is_sin)) == [S, R, S, S]


@given(
    first=st.sets(st.integers(0, 3)),
    second=st.sets(st.integers(0, 3)),
)
def test_combinators_follow_set_algebra(first, second):
    trace = _trace()
    p, q = save_calls(*sorted(first)), save_calls(*sorted(second))

    def saved(policy: policies.Policy) -> set[int]:
        return {i for i, d in enumerate(policy.plan(trace)) if d is S}

    everything = set(range(len(trace)))
    assert saved(p) == first
    assert saved(p | q) == first | second
    assert saved(save_any_of(p, q)) == first | second
    assert saved(p & q) == first & second
    assert saved(save_all_of(p, q)) == first & second
    assert saved(~p) == everything - first
    assert saved(save_unless(p, q)) == first - second


# --- values: hashable, equal by value, readable -------------------------------------------------


def test_policies_are_hashable_and_equal_by_value():
    built = [
        lambda: save_nothing,
        lambda: save_everything,
        lambda: save_ops(aten.mm),
        lambda: save_ops(aten.mm, aten.add.Tensor),
        lambda: save_calls(0, -1),
        lambda: save_ops(aten.mm) | save_calls(1),
        lambda: save_ops(aten.mm) & save_calls(1),
        lambda: ~save_ops(aten.sin),
        lambda: save_unless(save_everything, save_ops(aten.mm)),
    ]
    for make in built:
        assert make() == make()
        assert hash(make()) == hash(make())
        assert {make(): "value"}[make()] == "value"
    assert len({make() for make in built}) == len(built)
    assert save_ops(aten.mm) != save_ops(aten.mm.default)
    assert save_calls(1) != save_calls(2)
    assert save_nothing != save_everything
    assert save_ops(aten.mm) | save_calls(1) != save_ops(aten.mm) & save_calls(1)


def test_policies_are_immutable():
    policy = save_calls(1)
    with pytest.raises(AttributeError):
        policy.indices = (2,)  # type: ignore[misc]
    assert policy == save_calls(1)


def test_policy_reprs():
    assert repr(save_nothing) == "save_nothing"
    assert repr(save_everything) == "save_everything"
    assert repr(save_ops(aten.mm)) == "save_ops(aten.mm)"
    assert repr(save_ops(aten.mm.default, aten.add.Tensor)) == "save_ops(aten.mm.default, aten.add.Tensor)"
    assert repr(save_calls(0, -1)) == "save_calls(0, -1)"
    assert repr(save_ops(aten.mm) | save_calls(0)) == "save_any_of(save_ops(aten.mm), save_calls(0))"
    assert repr(save_ops(aten.mm) & save_calls(0)) == "save_all_of(save_ops(aten.mm), save_calls(0))"
    assert repr(~save_ops(aten.mm)) == "~save_ops(aten.mm)"
    assert repr(save_unless(save_everything, save_ops(aten.mm))) == "save_all_of(save_everything, ~save_ops(aten.mm))"


def test_checkpointed_repr_shows_the_policy():
    f = remat.checkpoint(two_matmuls, policy=save_ops(aten.mm))
    assert repr(f) == "remat.checkpoint(two_matmuls, policy=save_ops(aten.mm))"


# --- user policies --------------------------------------------------------------------------------


def test_a_plain_callable_returning_bool():
    def policy(call: remat.Call) -> bool:
        return call.op is aten.mm.default and call.occurrence == 1  # the second matmul only

    assert _decisions(policy) == [R, R, S, R]
    assert _decisions(lambda call: True) == [S, S, S, S]
    assert _decisions(lambda call: False) == [R, R, R, R]
    _assert_gradients_match(policy)


def test_a_plain_callable_returning_decisions():
    def policy(call: remat.Call) -> remat.Decision:
        return remat.SAVE if call.outputs[0].nbytes >= 64 else remat.RECOMPUTE

    assert _decisions(policy) == [S, S, S, R]
    _assert_gradients_match(policy)


def test_a_callable_policy_sees_every_call_in_order():
    seen: list[remat.Call] = []

    def policy(call: remat.Call) -> remat.Decision:
        seen.append(call)
        return remat.RECOMPUTE

    f = remat.checkpoint(two_matmuls, policy=policy)
    f(*_args()).backward()
    assert [call.index for call in seen] == [0, 1, 2, 3]
    assert all(isinstance(call, remat.Call) for call in seen)
    assert [call.name for call in seen] == [call.name for call in _trace()]


def test_a_planner_object():
    class EveryOther:
        def __init__(self) -> None:
            self.traces: list[remat.Trace] = []

        def plan(self, trace: remat.Trace) -> list[remat.Decision]:
            self.traces.append(trace)
            return [remat.SAVE if call.index % 2 == 0 else remat.RECOMPUTE for call in trace]

    planner = EveryOther()
    assert _decisions(planner) == [S, R, S, R]
    assert len(planner.traces) == 1
    assert isinstance(planner.traces[0], remat.Trace)
    assert len(planner.traces[0]) == 4
    _assert_gradients_match(EveryOther())


def test_a_planner_may_return_bools():
    class LastOnly:
        def plan(self, trace: remat.Trace) -> tuple[bool, ...]:
            return tuple(call.index == len(trace) - 1 for call in trace)

    assert _decisions(LastOnly()) == [R, R, R, S]


def test_built_in_policies_are_planners_and_callables():
    trace = _trace()
    policy = save_ops(aten.mm)
    assert policy.plan(trace) == (S, R, S, R)
    assert [policy(call) for call in trace] == [S, R, S, R]
    assert save_calls(-1).plan(trace) == (R, R, R, S)


@pytest.mark.parametrize(
    "policy",
    [save_nothing, save_everything, save_ops(aten.mm), save_calls(1, -1), ~save_ops(aten.sin)],
    ids=repr,
)
def test_every_builtin_gives_the_unwrapped_gradients(policy):
    _assert_gradients_match(policy)


# --- report ---------------------------------------------------------------------------------------


def test_report_rows_follow_the_trace():
    report = remat.report(two_matmuls, *_args(), policy=save_ops(aten.mm))
    assert isinstance(report, remat.Report)
    assert len(report.rows) == len(_trace())
    assert [row.call.index for row in report.rows] == [0, 1, 2, 3]
    assert [row.call.name for row in report.rows] == [call.name for call in _trace()]
    assert [row.decision for row in report.rows] == [S, R, S, R]
    assert [call.name for call in report.trace] == [call.name for call in _trace()]


def test_report_of_a_checkpointed_function_uses_its_policy():
    f = remat.checkpoint(two_matmuls, policy=save_calls(1))
    assert [row.decision for row in remat.report(f, *_args()).rows] == [R, S, R, R]
    assert [row.decision for row in remat.report(f, *_args(), policy=save_calls(2)).rows] == [R, R, S, R]


def test_report_of_a_checkpointed_function_reuses_its_cached_decisions_and_programs(monkeypatch):
    f = remat.checkpoint(two_matmuls, policy=save_calls(1))
    f(*_args())
    expected = remat.report(two_matmuls, *_args(), policy=save_calls(1))
    partitions = []
    partition = remat._api._inspect.partition
    monkeypatch.setattr(remat._api._inspect, "partition", lambda *a: partitions.append(1) or partition(*a))
    monkeypatch.setattr(remat._api._inspect, "decide_nested", lambda *a: pytest.fail("decided again"))
    report = remat.report(f, *_args())
    assert partitions == []
    assert [row.decision for row in report.rows] == [R, S, R, R]
    assert (report.saved_bytes, report.peak, report.replayed_calls) == (
        expected.saved_bytes,
        expected.peak,
        expected.replayed_calls,
    )


def test_report_saved_bytes_and_replays():
    # mm #0 -> 2x4, sin -> 2x4, mm #2 -> 2x5, sum -> scalar; backward reads
    # mm #0's output (for sin's gradient) and sin's output (for mm #2's gradient).
    nothing = remat.report(two_matmuls, *_args(), policy=save_nothing)
    assert nothing.saved_bytes == 0
    assert nothing.replayed_calls == (0, 1)
    assert nothing.recompute_flops == _trace()[0].flops + _trace()[1].flops
    assert [row.replayed for row in nothing.rows] == [True, True, False, False]
    assert not any(row.saved for row in nothing.rows)

    everything = remat.report(two_matmuls, *_args(), policy=save_everything)
    assert everything.saved_bytes == 2 * 4 * 8 + 2 * 4 * 8
    assert everything.replayed_calls == ()
    assert [row.saved for row in everything.rows] == [True, True, False, False]

    only_mm = remat.report(two_matmuls, *_args(), policy=save_calls(0))
    assert only_mm.saved_bytes == 2 * 4 * 8
    assert only_mm.replayed_calls == (1,)
    assert only_mm.recompute_flops == _trace()[1].flops


def test_report_str_has_decisions_and_a_summary():
    report = remat.report(two_matmuls, *_args(), policy=save_calls(0))
    text = str(report)
    lines = text.splitlines()
    assert "decision" in lines[0]
    assert len(lines) == 2 + len(report.rows) + 4  # header, rule, rows, policy and three summary lines
    for line, decision in zip(lines[2:6], ["SAVE", "RECOMPUTE", "RECOMPUTE", "RECOMPUTE"], strict=True):
        assert decision in line.split()
    assert "aten.mm.default" in lines[2]
    assert "aten.sin.default" in lines[3]
    policy, kept, peak, replayed = lines[-4:]
    assert policy == "policy: save_calls(0)"
    assert re.search(r"kept: 64 B from 1 calls?\b", kept), kept
    assert peak.startswith(f"peak: {report.peak_bytes} B (forward {report.peak.forward} B,"), peak
    assert re.search(r"replayed in backward: 1 calls?\b", replayed), replayed
    assert f"{_trace()[1].flops:,} FLOPs" in replayed


def test_docs_policies_md_lists_every_built_in_policy():
    docs = (pathlib.Path(__file__).parent.parent / "docs" / "policies.md").read_text()
    policies_ = [name for name in remat.policies.__all__ if name[0].islower()]  # not the classes
    missing = [name for name in policies_ if f"`{name}" not in docs]
    assert not missing, f"docs/policies.md does not list {missing}"


def test_combined_policies_answer_for_one_call_too():
    mm, sin, *_ = _trace()
    either = save_ops(aten.mm) | save_ops(aten.sin)
    both = save_ops(aten.mm) & (lambda call: call.index == 0)
    assert (either(mm), either(sin)) == (remat.SAVE, remat.SAVE)
    assert (both(mm), both(sin)) == (remat.SAVE, remat.RECOMPUTE)
    assert ((~save_ops(aten.mm))(mm), (~save_ops(aten.mm))(sin)) == (remat.RECOMPUTE, remat.SAVE)
