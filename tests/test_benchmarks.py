"""The benchmark harness runs end to end on the smoke suite (no timing assertions: see benchmarks/)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness, heap, render, workloads
from benchmarks.methods import METHODS
from benchmarks.workloads import SUITES

pytestmark = pytest.mark.slow  # runs the benchmarks, small


# The tests that read the smoke run run on one xdist worker (`--dist loadgroup` in pyproject.toml), which
# makes the run once: a module-scoped fixture is made again on every worker that runs one of its tests.
SMOKE = pytest.mark.xdist_group("benchmarks-smoke-run")


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


@SMOKE
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


@SMOKE
def test_environment_is_recorded(smoke_run: tuple[Path, list[str]]) -> None:
    result = json.loads(smoke_run[0].read_text())
    for key in ("platform", "cpu", "torch", "torch_threads", "remat", "date"):
        assert result[key], key
    assert result["torch_threads"] == 1
    assert set(result["call_overhead_us"]) == {"plain", "remat", "checkpoint"}
    assert result["heap"] == heap.DEFAULT
    assert f"heap: {heap.DEFAULT}" in render.markdown(result)


@SMOKE
def test_save_nothing_keeps_less_than_eager_on_the_block(smoke_run: tuple[Path, list[str]]) -> None:
    result = json.loads(smoke_run[0].read_text())
    (block,) = (w for w in result["workloads"] if w["name"].startswith("gpt2 block"))
    rows = {row["method"]: row for row in block["methods"]}
    assert rows["eager"]["saved_bytes"] > rows["remat save_nothing"]["saved_bytes"]
    assert rows["eager"]["live_bytes"] > rows["remat save_nothing"]["live_bytes"]


@SMOKE
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


@SMOKE
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
        "environment": harness.environment(),
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


def test_startup_benchmark_counts_traces_per_method_and_renders_the_ratio() -> None:
    import remat
    from benchmarks import startup

    policy = remat.policies.dots_saveable
    rows = [
        startup.measure("gpt2", layers, method, policy, repeats=1) for layers in (2, 3) for method in startup.METHODS
    ]
    traces = {(row["layers"], row["method"]): row["traces"] for row in rows}
    assert traces == {
        (2, "remat"): 1,  # the blocks share one trace (the input requires grad, as every block's does)
        (2, "remat, one trace per block"): 2,
        (2, "torch.utils.checkpoint"): 0,
        (3, "remat"): 1,
        (3, "remat, one trace per block"): 3,
        (3, "torch.utils.checkpoint"): 0,
    }
    for row in rows:
        row["startup_s"] = row["layers"] * (1.0 if row["method"] != "remat" else 0.5)  # for the rendering
    text = startup.markdown({**harness.environment(), "policy": "dots_saveable", "rows": rows})
    assert "- gpt2, remat: 1.50x" in text and "- gpt2, remat, one trace per block: 1.50x" in text
    assert text.count("| gpt2 |") == 6


@pytest.mark.slow
def test_startup_benchmark_plans_two_structures_with_two_traces() -> None:
    from benchmarks import startup

    rows = [startup.measure_fit(2, structures) for structures in (1, 2)]
    assert [(row["structures"], row["traces"]) for row in rows] == [(1, 1), (2, 2)]
    for row in rows:
        assert row["predicted_peak"] <= row["target"]
        row["plan_s"] = 0.5 * row["structures"]  # for the rendering
    meta = startup.measure_meta_llama(layers=1, tokens=64)
    assert meta["peak_keeping_nothing"] <= meta["predicted_peak"] <= meta["target"] <= meta["peak_keeping_everything"]
    result = {**harness.environment(), "policy": "p", "rows": [], "fit": rows, "meta_llama": meta}
    text = startup.markdown(result)
    assert f"| 2 | 2 | 2 | {rows[1]['plans']} | 1.00 |" in text
    assert "Llama-3-8B-shaped model on the meta device for the CPU (1 layers, bfloat16, batch 1 x 64 tokens)" in text


# --- benchmarks.compiled ---------------------------------------------------------------------------------


def _compiled_row(method: str, saved_mib: float, step_ms: float, **extra: object) -> dict[str, object]:
    return {
        "method": method,
        "saved_bytes": round(saved_mib * 2**20),
        "first_step_s": 20.0,
        "step_s": step_ms / 1e3,
        "time_vs_eager": step_ms / 370.0,
        "time_vs_compiler_budget": step_ms / 318.0,
        **extra,
    }


def test_compiled_benchmark_renders_each_depth_and_the_rows_at_the_compilers_bytes() -> None:
    from benchmarks import compiled

    rows = [
        _compiled_row("eager", 79.31, 370.0),
        _compiled_row("torch.compile budget=0.6875", 54.0, 318.0, activation_memory_budget=0.6875),
        _compiled_row("torch.compile(remat budget per block)", 51.25, 331.7, max_bytes=13_348_864, block={}),
        _compiled_row("torch.compile(remat budget whole stack)", 54.0, 310.1, max_bytes=54 * 2**20, stack={}),
    ]
    results = {
        **harness.environment(),
        "config": {"d": 256, "heads": 4, "batch": 4, "seq": 256, "repeats": 15},
        "runs": [{"layers": 4, "rows": rows}, {"layers": 12, "rows": rows}],
    }
    text = compiled.markdown(results)
    four, twelve = text.split("## 12 blocks")
    assert four.startswith("## 4 blocks")
    for section in (four, twelve):
        assert "| eager | 79.31 | 370.0 | 1.00x | 20.0 |" in section
        assert "| torch.compile budget=0.6875 | activation_memory_budget=0.6875 | 54.00 | 318.0 | 1.000x |" in section
        assert (
            "| torch.compile(remat budget per block) | max_bytes=12.73 MiB per block | 51.25 | 331.7 | 1.043x |"
            in section
        )
        assert "| torch.compile(remat budget whole stack) | max_bytes=54.00 MiB | 54.00 | 310.1 | 0.975x |" in section
        assert "| eager | eager" not in section  # rows without a budget stay out of the comparison


def test_a_per_block_budget_keeps_the_stack_within_the_total_it_is_derived_from() -> None:
    """remat's budget counts one block without its input; the benchmark counts the stack, input excluded."""
    import remat
    from benchmarks import compiled

    layers, x = 3, workloads.stack_input(2, 16, 32)

    def stack(policy: object) -> object:
        return remat.checkpoint_modules(
            workloads.matmul_attention_stack(layers, 32, 4), workloads.MatmulAttentionBlock, policy=policy
        )

    model = stack(remat.policies.dots_saveable)
    kept, tensors = compiled.kept_tensors(model, x, model)
    block = workloads.matmul_attention_stack(1, 32, 4)[0]
    outside = kept - layers * remat.report(block, x, policy=remat.policies.dots_saveable).saved_bytes
    assert outside == (layers - 1) * x.numel() * x.element_size()  # each later block's input, for its LayerNorm
    assert tensors["float32[2,16,32]"] >= layers - 1
    total = kept * 9 // 10
    model = stack(remat.policies.budget(max_bytes=compiled.per_block_budget(total, outside, layers)))
    assert compiled.kept_tensors(model, x, model)[0] <= total


def test_faults_benchmark_runs_a_whole_step_of_each_method_and_counts_its_faults() -> None:
    import torch

    from benchmarks import faults
    from benchmarks.workloads import mlp

    torch.manual_seed(0)
    workload = mlp(torch.device("cpu"), width=16, layers=2, batch=4)
    by_name = {method.name: method for method in METHODS}
    grads = {}
    for name in ("eager", "remat save_everything"):
        units = [by_name[name].wrap(unit, workload) for unit in workload.units]
        before = faults.minor_faults()
        forward_s, backward_s, forward_faults, backward_faults = faults.timed_step(workload, units)
        # The forward's and the backward's faults are the process's own, counted apart: together within the
        # whole call's.
        assert forward_s > 0 and backward_s > 0
        assert min(forward_faults, backward_faults) >= 0
        assert forward_faults + backward_faults <= faults.minor_faults() - before
        grads[name] = [p.grad.clone() for p in workload.model.parameters()]  # the step ran backward
    for eager, checkpointed in zip(grads["eager"], grads["remat save_everything"], strict=True):
        torch.testing.assert_close(checkpointed, eager)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_faults_runs_on_a_heap_that_keeps_freed_memory() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.faults", "--workload", "mlp", "--steps", "1", "--keep-freed-memory"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    assert "heap: glibc, freed memory kept (never trimmed" in done.stdout
    assert done.stdout.count(" faults\n") == 2  # the two methods' medians


def test_offload_benchmark_runs_small_and_checks_its_twin(tmp_path: Path) -> None:
    pytest.importorskip("highspy")
    from benchmarks import offload

    out = tmp_path / "offload-cpu.json"
    argv = ["--layers", "2", "--d", "32", "--heads", "2", "--batch", "1", "--seq", "16", "--repeats", "1"]
    offload.main([*argv, "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {row["method"]: row for row in result["rows"]}
    assert list(rows) == ["eager", "save_on_cpu", *offload.POLICIES]  # no torch.compile row on the CPU
    assert rows["remat offload_dots"]["bit_identical_to"] == "remat dots_saveable"
    assert rows["remat offload_dots"]["host_bytes"] == rows["remat dots_saveable"]["device_bytes"] > 0
    assert rows["remat offload_dots"]["device_bytes"] == 0
    assert all(row["max_grad_difference"] < 1e-5 for row in rows.values())
    markdown = out.with_suffix(".md").read_text()
    assert "| remat offload_dots | 0.00 |" in markdown
    assert "copy nothing" in markdown


def test_fit_benchmark_keeps_every_plan_within_its_target_and_renders_the_comparison(tmp_path: Path) -> None:
    pytest.importorskip("highspy")
    from benchmarks import fit

    out = tmp_path / "fit-cpu.json"
    fit.main(["--small", "--models", "gpt", "--targets", "2", "--repeats", "1", "--batches", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    (case,) = result["cases"]
    methods = [row["method"] for row in case["rows"]]
    assert methods[:3] == ["eager", "checkpoint", "sac"]
    assert {"remat whole-model budget", "remat save_nothing", "remat save_everything"} <= set(methods)
    fitted = [row for row in case["rows"] if row["method"] == "remat.fit" and "refused" not in row]
    assert len(fitted) == 2  # checkpoint's peak and eager's: both reachable by a plan
    for row in fitted:
        assert row["peak_bytes"] <= row["target_bytes"]
        assert row["predicted_peak_bytes"] <= row["target_bytes"]
        assert abs(row["predicted_peak_bytes"] - row["peak_bytes"]) <= 0.05 * row["peak_bytes"]
    assert all(row["max_grad_difference"] < 1e-5 for row in case["rows"] if "refused" not in row)
    largest = {row["method"]: row for row in result["largest_batch"]["rows"]}
    assert largest["eager"]["batch"] == 2  # the memory is eager's peak at batch 2
    assert largest["remat.fit"]["peak_bytes"] <= result["largest_batch"]["memory_bytes"]
    markdown = out.with_suffix(".md").read_text()
    assert markdown.count("| remat.fit |") == 2 + 1  # two targets, and the largest-batch row
    assert "vs fastest peer" in markdown
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0


def test_compression_benchmark_packs_within_each_target_and_says_where_it_saves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("highspy")
    from benchmarks import compression

    out = tmp_path / "compression-cpu.json"
    compression.main(["--small", "--targets", "2", "--repeats", "1", "--batches", "2", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [case["name"] for case in result["cases"]] == ["gpt-dropout", "relu-mlp"]
    for case in result["cases"]:
        fitted = [row for row in case["rows"] if row["method"].startswith("fit")]
        assert len(fitted) == 4  # two targets, with and without packing
        for row in fitted:
            assert row["peak_bytes"] <= row["target_bytes"]
            assert abs(row["predicted_peak_bytes"] - row["peak_bytes"]) <= 0.05 * row["peak_bytes"]
            assert row["packed_calls"] == 0 or row["method"] == "fit"
        kept = {row["method"]: row for row in case["rows"] if row["method"].endswith("everything blocks")}
        assert kept["pack_everything blocks"]["peak_bytes"] < kept["save_everything blocks"]["peak_bytes"]
        kinds = case["bytes"]
        assert kinds["packed_bytes"] < kinds["kept_bytes"]
        assert "dropout masks (Bernoulli draws, scaled)" in kinds["freed_by_kind"]
    relu = result["cases"][1]["bytes"]["freed_by_kind"]
    assert relu["read through a test (ReLU's output)"] > 0
    assert result["convolution"]["packed_bytes"] == result["convolution"]["kept_bytes"]  # nothing to pack
    assert "| fit |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_fsdp_benchmark_holds_every_ranks_target(tmp_path: Path) -> None:
    pytest.importorskip("highspy")
    from benchmarks import fsdp

    out = tmp_path / "fsdp-cpu.json"
    fsdp.main(["--small", "--targets", "2", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    model, _ = fsdp._model(small=True)
    one_block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())  # type: ignore[index]
    for rank in ("0", "1"):
        rows = result["per_rank"][rank]["rows"]
        assert [row["method"] for row in rows][:2] == ["no checkpointing", "full AC (torch.utils.checkpoint)"]
        fitted = [row for row in rows if row["method"] == "remat.fit"]
        assert len(fitted) == 2
        for row in fitted:
            # The prediction is the worst case over when gloo's thread lets go of an all-gather's buffer (NOTE
            # [what FSDP2 adds]): a step that lets go early measures up to one block's parameters less.
            assert row["peak_bytes"] <= row["predicted_peak_bytes"] <= row["target_bytes"], row
            assert row["predicted_peak_bytes"] - row["peak_bytes"] <= one_block, (row, one_block)
    assert "| remat.fit |" in out.with_suffix(".md").read_text()


def test_the_gpu_script_runs_its_stages_at_a_toy_size_on_the_cpu(tmp_path: Path) -> None:
    # `benchmarks/gpu.sh` runs as-is where a GPU is lent; its dry run keeps it from rotting in between.
    pytest.importorskip("highspy")
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "--dry-run", str(tmp_path)],
        cwd=root,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [line.split()[1] for line in run.stdout.splitlines() if line.startswith("== ")][:4] == [
        "tests",
        "workspaces",
        "fit",
        "step",
    ]
    workspaces = json.loads((tmp_path / "workspaces-cpu.json").read_text())["families"]
    assert "cudnn conv2d backward" in workspaces and all("held_bytes" in row for row in workspaces.values())
    collected = (tmp_path / "cuda-tests.txt").read_text()
    assert int(re.search(r"(\d+)/\d+ tests collected", collected).group(1)) > 100  # type: ignore[union-attr]
    assert json.loads((tmp_path / "fit-cpu.json").read_text())["cases"][0]["rows"]
    step = json.loads((tmp_path / "gpu-step-cpu.json").read_text())
    methods = [row["method"] for row in step["rows"]]
    peers = ["eager", "checkpoint", "sac", *(["torch_remat"] if "torch_remat" in methods else [])]
    assert methods == [*peers, "torch.compile, budget 0.5", "remat dots_saveable", "remat.fit", "remat.fit"]
    fitted = [row for row in step["rows"] if row["method"] == "remat.fit"]
    assert fitted[0]["target_bytes"] < fitted[1]["target_bytes"]
    assert all(row["peak_bytes"] <= row["target_bytes"] for row in fitted)
    assert all(row["max_grad_difference"] == 0 for row in step["rows"] if row["method"] != "torch.compile, budget 0.5")
    assert "| remat dots_saveable |" in (tmp_path / "gpu-step-cpu.md").read_text()


def test_the_gpu_script_fails_on_an_unknown_stage(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "--dry-run", str(tmp_path), "nonesuch"],
        cwd=root,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1
    assert "unknown stage: nonesuch" in run.stdout


# --- the entry point ---------------------------------------------------------------------------------


def test_every_benchmark_with_a_main_runs_from_the_one_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    import ast
    import importlib

    from benchmarks.__main__ import BENCHMARKS, main

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    with_main = {
        f"benchmarks.{path.stem}"
        for path in folder.glob("*.py")
        if path.stem != "__main__"
        and any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in ast.parse(path.read_text()).body)
    }
    assert set(BENCHMARKS.values()) == with_main
    main(["list"])
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(BENCHMARKS)
    for name, module in BENCHMARKS.items():
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        usage = capsys.readouterr().out
        assert "usage:" in usage and "--" in usage, (name, usage[:200])
        assert importlib.import_module(module).main.__code__.co_argcount >= 1  # takes its own argv
