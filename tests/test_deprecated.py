"""Old public names keep working for one release, each with a DeprecationWarning that names the new one
(the migration table is in CHANGELOG.md)."""

from __future__ import annotations

import pytest
import torch

import remat
from remat import policies


def _tagged(x: torch.Tensor) -> torch.Tensor:
    return remat.tag(remat.tag(x.sin(), "a").cos(), "b").exp()


def test_save_all_but_tagged_is_save_tagged_except() -> None:
    trace = remat.trace(_tagged, torch.ones(2))
    with pytest.warns(
        DeprecationWarning, match=r"save_all_but_tagged is deprecated.*use remat\.policies\.save_tagged_except"
    ):
        old = policies.save_all_but_tagged("a")
    assert old == policies.save_tagged_except("a")
    assert old.plan(trace) == (remat.RECOMPUTE, remat.SAVE, remat.RECOMPUTE)
    assert "save_all_but_tagged" not in policies.__all__


def test_report_row_is_exported_and_the_old_module_path_warns() -> None:
    assert remat.ReportRow is type(remat.report(lambda x: x.sin(), torch.ones(2)).rows[0])
    assert callable(remat.report)  # the function, not a module
    with pytest.warns(DeprecationWarning, match=r"remat\.report\.ReportRow is deprecated.*use remat\.ReportRow"):
        from remat.report import ReportRow
    assert ReportRow is remat.ReportRow
    assert callable(remat.report)  # importing from the old path left the function in place
    with pytest.raises(ImportError):
        from remat.report import nothing  # noqa: F401


def test_save_by_cost_names_its_cost_model_as_budget_does() -> None:
    new = policies.save_by_cost(1e-12, "roofline:h200")
    with pytest.warns(DeprecationWarning, match=r"save_by_cost\(\.\.\., device=\.\.\.\) is deprecated"):
        assert policies.save_by_cost(1e-12, device="h200") == new
    with pytest.warns(DeprecationWarning, match=r"use save_by_cost\(threshold, 'roofline:<device>'\)"):
        assert policies.save_by_cost(1e-12, "h200") == new
    with pytest.raises(ValueError, match=r"`cost` is a roofline on a device, 'roofline:<device>'"):
        policies.save_by_cost(1e-12, "flops")


def test_pareto_names_its_cost_model_as_budget_does() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x @ x).relu().sin().sum()

    x = torch.randn(64, 64, requires_grad=True)
    flops = remat.pareto(fn, x)
    with pytest.warns(DeprecationWarning, match=r"remat\.pareto\(\.\.\., device=\.\.\.\) is deprecated"):
        old = remat.pareto(fn, x, device="h100")
    assert old == flops and flops.timed_on == "h100"  # the default: FLOPs, timed on an H100
    timed = remat.pareto(fn, x, cost="roofline:h200")
    assert timed.timed_on == "h200" and "cost='roofline:h200'" in timed.curve[0].label
    with pytest.raises(ValueError, match=r"remat\.pareto: `cost` must be 'flops' or 'roofline:<device>'"):
        remat.pareto(fn, x, cost="seconds")
    # The curve's field named the device its times are estimated on (a cost model's name): `timed_on` now.
    with pytest.warns(DeprecationWarning, match=r"remat\.Pareto\.device is deprecated .* use remat\.Pareto\.timed_on"):
        assert timed.device == "h200"
    assert timed.to_dict()["timed_on"] == "h200" and "device" not in timed.to_dict()
