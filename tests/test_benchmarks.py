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
