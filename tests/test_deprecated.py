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
