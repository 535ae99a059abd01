"""Mixed-integer linear programs, solved by HiGHS through its own Python binding, `highspy`.

The planners (`_budget`, `_fit`) state their programs as sparse rows; this module is the only one that
speaks to the solver. It prints nothing: HiGHS is told to be silent before it is asked anything. (scipy's
`milp` bundles HiGHS 1.12, whose branch and bound prints a debug line to the process's standard output
whatever its options say, HiGHS issue 2783; HiGHS 1.13 dropped it. highspy 1.16's `Highs` class, unlike
its base class, prints its banner when it is made, before any option can be set.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import highspy
import numpy as np

__all__ = ["Solution", "solve"]


@dataclasses.dataclass(frozen=True)
class Solution:
    """What the solver found: a point (None if it found no feasible one) and a lower bound on the optimum."""

    x: np.ndarray | None
    objective: float  # at `x` (inf without one)
    bound: float  # -inf where the solver proved none


def solve(
    objective: np.ndarray,
    rows: Sequence[Mapping[int, float]],
    row_lower: Sequence[float],
    row_upper: Sequence[float],
    *,
    column_upper: np.ndarray,
    integral: np.ndarray,
    time_limit: float | None = None,
    relative_gap: float | None = None,
) -> Solution:
    """Minimize `objective @ x` subject to `row_lower <= rows @ x <= row_upper` and `0 <= x <= column_upper`,
    the columns where `integral` is true taking integer values. Each row maps columns to coefficients.

    Stops after `time_limit` seconds with the best point found so far, if any; a branch and bound stops
    once its point is within `relative_gap` of its bound (HiGHS's default gap where None).
    """
    n = len(objective)
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = len(rows)
    lp.col_cost_ = np.asarray(objective, dtype=float)
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.asarray(column_upper, dtype=float)  # HiGHS's infinity is IEEE's
    lp.row_lower_ = np.asarray(row_lower, dtype=float)
    lp.row_upper_ = np.asarray(row_upper, dtype=float)
    starts, indices, values = [0], [], []
    for row in rows:
        for column, coefficient in row.items():
            if coefficient:
                indices.append(column)
                values.append(coefficient)
        starts.append(len(indices))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = n
    lp.a_matrix_.num_row_ = len(rows)
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(indices, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(values, dtype=float)
    is_mip = bool(np.any(integral))
    if is_mip:
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integral]

    solver = highspy._Highs()  # type: ignore[attr-defined]  # the binding's base class: see the docstring
    solver.setOptionValue("output_flag", False)
    # HiGHS 1.16's presolve returned a point of objective 1 as optimal, its bound 1, on a 19-column program
    # of the budget planner whose optimum is 0 (a random function of 5 calls: tests/test_budget.py); the
    # same solve without presolve finds the optimum, as fast on the planners' programs.
    solver.setOptionValue("presolve", "off")
    if time_limit is not None:
        solver.setOptionValue("time_limit", float(time_limit))
    if relative_gap is not None:
        solver.setOptionValue("mip_rel_gap", float(relative_gap))
    solver.passModel(lp)
    solver.run()
    info = solver.getInfo()
    found = info.primal_solution_status == highspy.kSolutionStatusFeasible
    x = np.asarray(solver.getSolution().col_value, dtype=float) if found else None
    if is_mip:
        bound = info.mip_dual_bound
    else:  # a linear program solved to optimality bounds itself
        bound = info.objective_function_value if solver.getModelStatus() == highspy.HighsModelStatus.kOptimal else None
    return Solution(
        x=x,
        objective=float(info.objective_function_value) if found else math.inf,
        bound=float(bound) if bound is not None and np.isfinite(bound) else -math.inf,
    )
