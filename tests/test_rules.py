"""`remat._partitioning._rules`: the rules, written once, resolve decisions to what the programs keep, and their 0-1
rows allow exactly that and nothing less (the least solution of the rows is the resolution)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import examples
from hypothesis import given
from hypothesis import strategies as st

import remat
from remat._partitioning._rules import (
    AS_IS,
    KEPT,
    RECOMPUTED,
    REPLAYED,
    SAVED,
    STATE,
    Atom,
    Clause,
    Rules,
    _converse,
    _strata,
    rules_of,
)
from remat.testing import functions, inputs

pytest.importorskip("highspy")

from remat._deciding import _milp


def _holds(rules: Rules, saved: set[int]) -> set[Atom]:
    """Every atom the resolution of `saved` says holds, the decisions included."""
    resolved = rules.resolve(saved)
    return {
        *(Atom(SAVED, c) for c in saved),
        *(Atom(REPLAYED, c) for c in resolved.replayed),
        *(Atom(KEPT, v) for v in resolved.kept),
        *(Atom("copied", v) for v in resolved.copied),
        *(Atom(RECOMPUTED, c) for c in resolved.recomputed),
        *(Atom(STATE, c) for c in resolved.states),
    }


@examples(ci=15, soak=1_000)
@given(st.data())
def test_the_least_solution_of_the_rows_is_the_resolution(data: st.DataObject) -> None:
    """The planner's rows and `resolve` are one set of rules: with the decisions fixed, the fewest
    atoms the rows allow are exactly what `resolve` derives (a row too loose would let the planner
    claim a replay or a kept value for free; one too tight would forbid the programs' own)."""
    fn = data.draw(functions(), label="fn")
    args = data.draw(inputs(fn), label="args")
    trace = remat.trace(fn, *args)
    n = len(trace)
    saved = data.draw(st.sets(st.integers(0, max(n - 1, 0))) if n else st.just(set()), label="saved")
    rules = rules_of(trace.values, inputs=False)
    decisions = [*(Atom(SAVED, c) for c in range(n)), *(Atom(REPLAYED, c) for c in range(n))]
    rows = rules.rows(decisions)
    columns = {
        atom: j for j, atom in enumerate(dict.fromkeys([*decisions, *(a for r in rows for a in r.coefficients)]))
    }
    expected = _holds(rules, saved)
    # every row holds at the resolution
    for row in rows:
        assert sum(x for a, x in row.coefficients.items() if a in expected) <= row.bound + 1e-9, row
    if not n:
        return
    fixed = [{columns[Atom(SAVED, c)]: 1.0} for c in range(n)]
    decided = [1.0 if c in saved else 0.0 for c in range(n)]
    solution = _milp.solve(
        np.ones(len(columns)),
        [*({columns[a]: x for a, x in r.coefficients.items()} for r in rows), *fixed],
        [*([-math.inf] * len(rows)), *decided],
        [*(r.bound for r in rows), *decided],
        column_upper=np.ones(len(columns)),
        integral=np.ones(len(columns), dtype=bool),
    )
    assert solution.x is not None
    least = {atom for atom, j in columns.items() if solution.x[j] > 0.5}
    assert least == expected


def test_a_value_backward_reads_is_kept_if_its_call_is_saved_else_replayed() -> None:
    x = torch.randn(8, requires_grad=True)
    trace = remat.trace(lambda x: x.sin().sin(), x)
    rules = rules_of(trace.values)
    assert rules.resolve({0}).kept == {(0, 0)} and not rules.resolve({0}).replayed
    replaying = rules.resolve(set())
    assert replaying.replayed == {0} and not replaying.kept
    assert (-1, 0) in replaying.as_is  # the replay reads the input as it is: no copy


def test_an_overwritten_input_that_a_replay_reads_is_kept_as_a_copy() -> None:
    def fn(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        out = (x + buffer).sin()
        buffer.add_(1)
        return out

    trace = remat.trace(fn, torch.randn(4, requires_grad=True), torch.randn(4))
    rules = rules_of(trace.values)
    replaying = rules.resolve(set())  # sin's derivative reads x + buffer: replayed, from the old buffer
    assert 0 in replaying.replayed and (-2, 0) in replaying.copied
    saving = rules.resolve({0})  # kept with a derivative: recomputed to differentiate again, from the copy
    assert saving.kept == {(0, 0)} and saving.recomputed == {0} and (-2, 0) in saving.copied
    report = remat.report(fn, torch.randn(4, requires_grad=True), torch.randn(4))
    assert report.saved_bytes == 16  # the copy


def test_converse_rows_say_an_atom_holds_only_if_some_clause_derives_it() -> None:
    s0, r0, r1, r2 = Atom(SAVED, 0), Atom(REPLAYED, 0), Atom(REPLAYED, 1), Atom(REPLAYED, 2)
    read_by_two = [Clause(r0, (r1,), (s0,)), Clause(r0, (r2,), (s0,))]
    rows = {(tuple(sorted(r.coefficients.items())), r.bound) for r in _converse(r0, read_by_two)}
    assert rows == {
        (tuple(sorted({r0: 1.0, s0: 1.0}.items())), 1.0),  # never both saved and replayed
        (tuple(sorted({r0: 1.0, r1: -1.0, r2: -1.0}.items())), 0.0),  # replayed only if a replay reads it
    }
    read_by_backward = [Clause(r0, (), (s0,)), Clause(r0, (r1,), (s0,))]
    assert [r.coefficients for r in _converse(r0, read_by_backward)] == [{r0: 1.0, s0: 1.0}]
    assert [(r.coefficients, r.bound) for r in _converse(r0, [])] == [({r0: 1.0}, 0.0)]


def test_rules_that_need_their_own_absence_are_refused() -> None:
    a, b = Atom(KEPT, (0, 0)), Atom(AS_IS, (-1, 0))
    assert _strata([Clause(a, (), (b,)), Clause(b)]) == {SAVED: 0, AS_IS: 1, KEPT: 2}
    with pytest.raises(AssertionError, match="not stratified"):
        _strata([Clause(a, (), (b,)), Clause(b, (), (a,))])
