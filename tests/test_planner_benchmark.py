"""The planner benchmark runs end to end on a tiny stack (no timing assertions: see benchmarks/planner.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import planner

pytestmark = pytest.mark.slow  # runs the planner benchmark


def test_planner_benchmark_on_a_tiny_stack(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    lines: list[str] = []
    argv = ["--layers", "1", "--fractions", "0.5", "--d", "16", "--seq", "8", "--out", str(out), "--plot", ""]
    planner.main(argv, log=lines.append)

    result = json.loads(out.read_text())
    assert {"date", "torch", "remat", "cpu", "torch_threads", "config", "runs", "targets"} <= result.keys()
    assert out.with_suffix(".md").read_text().startswith("# Budget planner")
    assert any("torch.compile" in line for line in lines)
    [run] = result["runs"]
    assert run["layers"] == 1 and run["calls"] > 0
    [point] = run["points"]
    assert {"fraction", "budget_bytes", "remat_fast", "remat_exact", "fast_gap", "torch_compile"} <= point.keys()
    fast, exact = point["remat_fast"], point["remat_exact"]
    for plan in (fast, exact):
        assert plan["saved_bytes"] <= point["budget_bytes"]
        assert plan["report_saved_bytes"] == plan["saved_bytes"]
    assert fast["flops"] >= exact["flops"]
    # The gap is the fast plan's replay FLOPs above the exact plan's, relative to them.
    expected_gap = (fast["flops"] - exact["flops"]) / exact["flops"] if exact["flops"] else float(fast["flops"] > 0)
    assert point["fast_gap"] == pytest.approx(expected_gap)

    compiled = point["torch_compile"]
    if "error" in compiled:  # recorded, not raised; the comparison target then says so
        assert compiled["error"]
        assert not result["targets"][-1]["pass"]
        return
    assert {"flops", "matmul_flops", "saved_bytes"} <= compiled.keys()
    if compiled["saved_bytes"] <= point["budget_bytes"]:
        assert exact["flops"] <= compiled["flops"]
    at_compile_bytes = point["remat_at_compile_bytes"]
    if "error" not in at_compile_bytes:
        assert at_compile_bytes["saved_bytes"] <= compiled["saved_bytes"]
