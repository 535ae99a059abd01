"""`remat._deciding._milp`: the planners' solver finds optima and bounds, says when nothing is feasible, and prints
nothing, from the process's first solve on."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("highspy")

from remat._deciding import _milp


def knapsack(values: list[float], weights: list[float], capacity: float, *, integral: bool) -> _milp.Solution:
    """Maximize the value of the items taken (as a minimum of its negative) within `capacity`."""
    n = len(values)
    return _milp.solve(
        -np.asarray(values),
        [dict(enumerate(weights))],
        [-math.inf],
        [capacity],
        column_upper=np.ones(n),
        integral=np.full(n, integral),
    )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20)), min_size=1, max_size=7),
    st.integers(0, 60),
)
def test_a_0_1_program_is_solved_to_its_optimum_which_its_relaxation_bounds(
    items: list[tuple[int, int]], capacity: int
) -> None:
    values = [float(v) for v, _ in items]
    weights = [float(w) for _, w in items]
    best = max(
        sum(v for v, t in zip(values, take, strict=True) if t)
        for take in itertools.product((0, 1), repeat=len(items))
        if sum(w for w, t in zip(weights, take, strict=True) if t) <= capacity
    )
    exact = knapsack(values, weights, capacity, integral=True)
    assert exact.x is not None
    assert set(np.round(exact.x, 6)) <= {0.0, 1.0}
    assert -exact.objective == pytest.approx(best)
    assert exact.bound <= exact.objective + 1e-6
    relaxed = knapsack(values, weights, capacity, integral=False)
    assert relaxed.bound == pytest.approx(relaxed.objective)
    assert relaxed.bound <= exact.objective + 1e-6  # the relaxation's optimum bounds the 0-1 optimum from below


def test_equality_rows_and_unbounded_continuous_columns() -> None:
    # Choose one of three options (x0 + x1 + x2 = 1); t >= 5 x0 + 2 x1 + 7 x2; minimize t.
    solution = _milp.solve(
        np.array([0.0, 0.0, 0.0, 1.0]),
        [{0: 1.0, 1: 1.0, 2: 1.0}, {0: 5.0, 1: 2.0, 2: 7.0, 3: -1.0}],
        [1.0, -math.inf],
        [1.0, 0.0],
        column_upper=np.array([1.0, 1.0, 1.0, math.inf]),
        integral=np.array([True, True, True, False]),
    )
    assert solution.x is not None
    assert np.round(solution.x[:3]).tolist() == [0.0, 1.0, 0.0]
    assert solution.objective == pytest.approx(2.0)


@pytest.mark.parametrize("integral", [True, False])
def test_an_infeasible_program_gives_no_point(integral: bool) -> None:
    solution = _milp.solve(
        np.array([1.0]), [{0: 1.0}], [2.0], [math.inf], column_upper=np.ones(1), integral=np.array([integral])
    )
    assert solution.x is None
    assert solution.objective == math.inf


@pytest.mark.slow
def test_solving_prints_nothing_from_the_first_solve_on() -> None:
    """In a fresh process (HiGHS prints its banner once per process, unless told not to before), a 0-1
    program, a linear one, and the planners that use them write nothing to standard output or error."""
    script = textwrap.dedent(
        """
        import numpy as np
        import torch
        import remat
        from remat._deciding import _milp

        for integral in (True, False):
            _milp.solve(
                -np.arange(1.0, 9.0), [dict(enumerate(np.arange(2.0, 10.0)))], [-np.inf], [17.0],
                column_upper=np.ones(8), integral=np.full(8, integral),
            )
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh())
        x = torch.randn(4, 8)
        trace = remat.trace(lambda x: block(x).sum(), x)
        for exact in (True, False):
            remat.policies.budget(fraction=0.5, exact=exact).solve(trace)
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(8, 8)

            def forward(self, x):
                return self.linear(x).tanh()

        model = torch.nn.Sequential(*[Block() for _ in range(3)])
        try:  # an infeasible target: the lowest peak comes from the solver
            remat.fit(model, Block, x, peak_bytes=1)
        except ValueError:
            pass
        else:
            raise SystemExit("a one-byte target was met")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    assert run.stderr == ""
