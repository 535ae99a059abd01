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


def test_each_point_counts_its_plans_values_as_kept_and_compress_lowers_the_curve() -> None:
    # A plan that packs (the gate's comparison, which only a matmul remakes) keeps its bits: each point's
    # bytes are within its budget, as the programs keep them. Allowed FP8, the planner replays about as much
    # at any budget, and far less at some.
    def gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (32,)) @ up)
        return (torch.where(x @ gate > 0, hidden, 0.0) @ down).sum()

    args = [
        torch.randn(256, 32),
        torch.randn(32, 128),
        *(torch.randn(*s, requires_grad=True) for s in [(32, 128), (128, 32)]),
    ]
    exact = remat.pareto(gated, *args)
    budgets = [int(point.label.removeprefix("budget(max_bytes=").removesuffix(")")) for point in exact.curve]
    lossy = remat.pareto(gated, *args, budgets=budgets, compress="fp8")
    assert all(point.saved_bytes <= budget for point, budget in zip(exact.curve, budgets, strict=True))
    assert all(point.saved_bytes <= budget for point, budget in zip(lossy.curve, budgets, strict=True))
    assert lossy.curve[0].label == f"budget(max_bytes={budgets[0]}, compress='fp8')"
    pairs = list(zip(lossy.curve, exact.curve, strict=True))
    # (Its cost counts FP8's passes too: at a budget, one more replayed FLOP may buy fewer passes.)
    assert all(narrow.replay_flops <= kept.replay_flops + 1 for narrow, kept in pairs)
    assert any(narrow.replay_flops < kept.replay_flops / 100 for narrow, kept in pairs)
