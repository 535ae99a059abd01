"""`remat.pareto`: the planner's memory/recompute curve, and the built-in policies beside it."""

from __future__ import annotations

import json

import models
import pytest
import torch

import remat
from remat import policies

DTYPE = torch.float64


def _block() -> tuple[torch.nn.Module, torch.Tensor]:
    block = models.GPT2Block(attention="softmax").to(DTYPE)
    return block, torch.randn(2, 8, 32, dtype=DTYPE, generator=torch.Generator().manual_seed(0))


@pytest.mark.slow  # a sweep of budgets
def test_the_curve_falls_as_the_budget_grows_and_spans_the_built_ins() -> None:
    block, x = _block()
    curve = remat.pareto(block, x)
    assert len(curve.curve) == 21
    kept = [p.saved_bytes for p in curve.curve]
    flops = [p.replay_flops for p in curve.curve]
    assert flops == sorted(flops, reverse=True)
    nothing, dots, everything = curve.policies
    assert (nothing.label, dots.label, everything.label) == ("save_nothing", "dots_saveable", "save_everything")
    assert curve.curve[0].replay_flops == nothing.replay_flops and curve.curve[-1].replay_flops == 0
    assert max(kept) <= everything.saved_bytes
    # No built-in policy beats the planner at its own memory.
    at_policies = remat.pareto(block, x, budgets=[p.saved_bytes for p in curve.policies])
    for planned, point in zip(at_policies.curve, curve.policies, strict=True):
        assert planned.saved_bytes <= point.saved_bytes
        assert planned.replay_flops <= point.replay_flops
    assert at_policies.curve[1].replay_flops < curve.policies[1].replay_flops  # strictly better than dots_saveable


def test_points_are_what_the_report_says() -> None:
    block, x = _block()
    curve = remat.pareto(block, x, budgets=[20_000, 40_000])
    for point, limit in zip(curve.curve, [20_000, 40_000], strict=True):
        report = remat.report(block, x, policy=policies.budget(max_bytes=limit, exact=True))
        assert (point.saved_bytes, point.replay_flops) == (report.saved_bytes, report.recompute_flops)
        assert point.peak_bytes == report.peak_bytes
        assert point.saved_bytes <= limit
    dots = remat.report(block, x, policy=policies.dots_saveable)
    assert (curve.policies[1].saved_bytes, curve.policies[1].replay_flops) == (dots.saved_bytes, dots.recompute_flops)
    assert curve.policies[1].peak_bytes == dots.peak_bytes
    assert curve.policies[1].replay_seconds > 0


@pytest.mark.slow
def test_to_dict_is_json_and_plot_draws_every_point(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    block, x = _block()
    curve = remat.pareto(block, x, budgets=[0, 30_000, 60_000])
    data = json.loads(json.dumps(curve.to_dict()))
    assert [p["saved_bytes"] for p in data["curve"]] == [p.saved_bytes for p in curve.curve]
    for time in (False, True):
        for peak in (False, True):
            figure = curve.plot(time=time, peak=peak)
            (axes,) = figure.axes
            assert len(axes.collections) == 3  # one scatter per built-in policy
            assert "µs" in axes.get_ylabel() if time else "FLOPs" in axes.get_ylabel()
            assert ("peak" in axes.get_xlabel()) == peak
            (line,) = axes.get_lines()
            expected = [(p.peak_bytes if peak else p.saved_bytes) / 2**20 for p in curve.curve]
            assert sorted(set(line.get_xdata())) == sorted(set(expected))
            figure.savefig(tmp_path / f"pareto-{time}-{peak}.png")
            assert (tmp_path / f"pareto-{time}-{peak}.png").stat().st_size > 1000
    assert "save_everything" in str(curve)
