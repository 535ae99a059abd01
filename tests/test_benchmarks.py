"""The benchmark harness runs end to end on the smoke suite (no timing assertions: see benchmarks/)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from benchmarks import harness, render
from benchmarks.methods import METHODS
from benchmarks.workloads import SUITES


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One smoke run, with matplotlib and torch_remat made unimportable (the harness must not need them)."""
    out = tmp_path_factory.mktemp("results")
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
        patch.setitem(sys.modules, "torch_remat", None)
        json_path = harness.run("smoke", "cpu", repeats=1, out=out, log=lines.append, threads=1)
    return json_path, lines


def test_every_workload_and_method_is_present(smoke_run: tuple[Path, list[str]]) -> None:
    json_path, _ = smoke_run
    result = json.loads(json_path.read_text())
    assert json_path.name == "smoke-cpu.json"
    assert len(result["workloads"]) == len(SUITES["smoke"])
    for workload in result["workloads"]:
        assert [row["method"] for row in workload["methods"]] == [method.name for method in METHODS]
        for row in workload["methods"]:
            if row["method"] == "torch_remat":
                assert "skipped" in row
                continue
            assert "skipped" not in row, (workload["name"], row)
            for key in ("saved_bytes", "live_bytes", "peak_bytes"):
                assert isinstance(row[key], int) and row[key] >= 0, (workload["name"], row["method"], key, row[key])
            assert len(row["times_s"]) == 1


def test_environment_is_recorded(smoke_run: tuple[Path, list[str]]) -> None:
    result = json.loads(smoke_run[0].read_text())
    for key in ("platform", "cpu", "torch", "torch_threads", "remat", "date"):
        assert result[key], key
    assert result["torch_threads"] == 1
    assert set(result["call_overhead_us"]) == {"plain", "remat", "checkpoint"}


def test_save_nothing_keeps_less_than_eager_on_the_block(smoke_run: tuple[Path, list[str]]) -> None:
    result = json.loads(smoke_run[0].read_text())
    (block,) = (w for w in result["workloads"] if w["name"].startswith("gpt2 block"))
    rows = {row["method"]: row for row in block["methods"]}
    assert rows["eager"]["saved_bytes"] > rows["remat save_nothing"]["saved_bytes"]
    assert rows["eager"]["live_bytes"] > rows["remat save_nothing"]["live_bytes"]


def test_markdown_has_a_row_per_method_and_the_plot_note(smoke_run: tuple[Path, list[str]]) -> None:
    json_path, lines = smoke_run
    markdown = json_path.with_suffix(".md").read_text()
    result = json.loads(json_path.read_text())
    for workload in result["workloads"]:
        section = markdown.split(f"## {workload['name']}\n", 1)[1].split("\n## ", 1)[0]
        for method in METHODS:
            assert f"\n| {method.name} |" in section, (workload["name"], method.name)
    assert "## Targets" in markdown
    assert "Plot skipped: matplotlib is not installed" in markdown
    assert not json_path.with_suffix(".png").exists()
    assert any(line.startswith("[") and "/ remat save_nothing:" in line for line in lines)


def test_render_regenerates_from_the_json(smoke_run: tuple[Path, list[str]], tmp_path: Path) -> None:
    copy = tmp_path / "smoke-cpu.json"
    copy.write_text(smoke_run[0].read_text())
    render.write(copy)
    markdown = copy.with_suffix(".md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert copy.with_suffix(".png").stat().st_size > 0
        assert "Plot skipped" not in markdown
    else:
        assert "Plot skipped: matplotlib is not installed" in markdown


def test_peak_targets_compare_each_remat_method_with_its_peer() -> None:
    def row(live: int, peak: int) -> dict[str, int]:
        return {"live_bytes": live, "peak_bytes": peak}

    rows = {
        "eager": row(100, 200),
        "checkpoint": row(0, 150),
        "sac": row(60, 210),
        "remat save_everything": row(100, 202),  # within 1.01x eager
        "remat save_nothing": row(0, 151),  # above checkpoint
        "remat dots_saveable": row(55, 205),  # below SAC
        "remat budget(0.5)": row(50, 205),  # closest peer by bytes kept: SAC (60)
        "remat budget(0.25)": row(20, 160),  # closest: checkpoint (0)
        "remat budget(0.75)": row(30, 205),  # as close to checkpoint (0) as to SAC (60): SAC keeps more
    }
    checks = {target: (verdict, detail) for target, _, verdict, detail in render._peak_targets(rows, "w")}
    assert checks["save_everything: peak <= 1.01x eager"][0] == "PASS"
    assert checks["save_nothing: peak <= checkpoint"][0] == "MISS"
    assert checks["dots_saveable: peak <= sac"][0] == "PASS"
    assert "dots_saveable: peak <= torch_remat" not in checks  # no such row
    assert checks["budget(0.5): peak <= the peer keeping the closest bytes"] == (
        "PASS",
        "peak 0.00 vs 0.00 MiB (sac)",
    )
    assert checks["budget(0.25): peak <= the peer keeping the closest bytes"][0] == "MISS"
    assert checks["budget(0.25): peak <= the peer keeping the closest bytes"][1].endswith("(checkpoint)")
    assert checks["budget(0.75): peak <= the peer keeping the closest bytes"][1].endswith("(sac)")


# --- benchmarks.models ---------------------------------------------------------------------------------


def test_models_benchmark_finds_a_gradient_that_differs() -> None:
    import torch

    from benchmarks import models

    grads = {"w": torch.zeros(2), "b": None}
    assert models.largest_difference(dict(grads), grads) == 0.0
    assert models.largest_difference({"w": torch.tensor([0.0, 0.5]), "b": None}, grads) == 0.5
    assert models.largest_difference({"w": torch.zeros(2), "b": torch.zeros(1)}, grads) == float("inf")


def test_models_benchmark_renders_failures_and_ratios_to_the_peer() -> None:
    from benchmarks import models

    check = {"model": "m", "experts": None, "passed": True, "layers": 2, "traces": 2}
    results = {
        "environment": {"torch": "t", "transformers": "x", "threads": 1, "date": "d"},
        "policies": ["save_nothing", "budget"],
        "checks": [
            {**check, "policy": "save_nothing", "max_grad_difference": 1e-8, "trace_seconds_per_layer": 0.25},
            {"model": "m", "experts": None, "policy": "budget", "passed": False, "error": "ValueError: no plan"},
        ],
        "moe": [
            {"model": "e", "experts": "eager", "method": m, "live_bytes": 2**20, "peak_bytes": 2**21, "step_seconds": s}
            for m, s in [("torch.utils.checkpoint", 2.0), ("remat save_nothing", 1.5)]
        ],
    }
    text = models.render(results)
    assert "| m | - | pass (1e-08) | **fail** | 2 / 2 | 0.25 |" in text
    assert "- m (budget): `ValueError: no plan`" in text
    assert "| e | eager | remat save_nothing | 1.0 | 2.0 | 1.500 | 0.75 |" in text
