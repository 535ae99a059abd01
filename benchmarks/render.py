"""Render a results JSON as a markdown table (with the project's targets checked) and a PNG plot.

Run: python -m benchmarks.render benchmarks/results/cpu-cpu.json   (rewrites cpu-cpu.md and .png)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import heap

MIB = 2**20


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:.2f}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.1f}"


def _rows(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["method"]: row for row in workload["methods"] if "skipped" not in row}


def _check(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _versus(ours: dict[str, Any], theirs: dict[str, Any], peer: str) -> str:
    """'live A vs B MiB; time Rx peer', with the byte difference when the MiB figures hide it."""
    text = f"live {_mib(ours['live_bytes'])} vs {_mib(theirs['live_bytes'])} MiB"
    difference = ours["live_bytes"] - theirs["live_bytes"]
    if difference and _mib(ours["live_bytes"]) == _mib(theirs["live_bytes"]):
        text += f" ({difference:+,} bytes)"
    return f"{text}; time {ours['median_s'] / theirs['median_s']:.3f}x {peer}"


def targets(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(target, workload, PASS or MISS, the numbers behind it), from the results alone.

    Memory means bytes live after forward (`live_bytes`), comparable across all methods.
    """
    checks: list[tuple[str, str, str, str]] = []
    for workload in result["workloads"]:
        rows, name = _rows(workload), workload["name"]
        nothing, dots, everything = (
            rows.get(f"remat {p}") for p in ("save_nothing", "dots_saveable", "save_everything")
        )
        if nothing and "checkpoint" in rows:
            peer = rows["checkpoint"]
            ratio = nothing["median_s"] / peer["median_s"]
            ok = nothing["live_bytes"] <= peer["live_bytes"] and ratio <= 1.00
            detail = _versus(nothing, peer, "checkpoint")
            checks.append(("save_nothing: memory <= checkpoint, time <= 1.00x checkpoint", name, _check(ok), detail))
        for peer_name in ("sac", "torch_remat"):
            if dots and peer_name in rows:
                peer = rows[peer_name]
                ratio = dots["median_s"] / peer["median_s"]
                ok = dots["live_bytes"] <= peer["live_bytes"] and ratio <= 1.00
                detail = _versus(dots, peer, peer_name)
                checks.append((f"dots_saveable: memory and time <= {peer_name}", name, _check(ok), detail))
        if everything and "eager" in rows:
            peer = rows["eager"]
            ratio = everything["median_s"] / peer["median_s"]
            ok = everything["live_bytes"] <= peer["live_bytes"] and ratio <= 1.02
            detail = _versus(everything, peer, "eager")
            checks.append(("save_everything: memory <= eager, time <= 1.02x eager", name, _check(ok), detail))
        checks += _peak_targets(rows, name)
    overhead = result["call_overhead_us"]
    checks.append(
        (
            "cached-call overhead <= torch.utils.checkpoint's",
            "x.sin() on 4 floats",
            _check(overhead["remat"] <= overhead["checkpoint"]),
            f"remat {overhead['remat']:.1f} us vs checkpoint {overhead['checkpoint']:.1f} us (plain {overhead['plain']:.1f} us)",
        )
    )
    return checks


_PEERS = ("eager", "checkpoint", "sac", "torch_remat")


def _peak_targets(rows: dict[str, dict[str, Any]], name: str) -> list[tuple[str, str, str, str]]:
    """Peak forward+backward against the peer that keeps the same (or, for a budget, the closest) bytes:
    bytes live after forward, which count what SAC keeps too (it hides it from `saved_tensors_hooks`)."""
    checks = []

    def check(target: str, ours: dict[str, Any], peer_name: str, slack: float = 1.0) -> None:
        peer = rows[peer_name]
        ok = ours["peak_bytes"] <= slack * peer["peak_bytes"]
        detail = f"peak {_mib(ours['peak_bytes'])} vs {_mib(peer['peak_bytes'])} MiB ({peer_name})"
        checks.append((target, name, _check(ok), detail))

    if "remat save_everything" in rows and "eager" in rows:
        check("save_everything: peak <= 1.01x eager", rows["remat save_everything"], "eager", 1.01)
    if "remat save_nothing" in rows and "checkpoint" in rows:
        check("save_nothing: peak <= checkpoint", rows["remat save_nothing"], "checkpoint")
    for peer_name in ("sac", "torch_remat"):
        if "remat dots_saveable" in rows and peer_name in rows:
            check(f"dots_saveable: peak <= {peer_name}", rows["remat dots_saveable"], peer_name)
    peers = [peer for peer in _PEERS if peer in rows]
    for method, row in rows.items():
        if method.startswith("remat budget(") and peers:
            # The closest; of two as close, the one keeping more (the budget keeps no more than it).
            closest = min(
                peers, key=lambda peer: (abs(rows[peer]["live_bytes"] - row["live_bytes"]), -rows[peer]["live_bytes"])
            )
            check(f"{method.removeprefix('remat ')}: peak <= the peer keeping the closest bytes", row, closest)
    return checks


def markdown(result: dict[str, Any], plot_note: str | None = None) -> str:
    """The results as markdown: the environment, one table per workload, call overhead, targets."""
    lines = [
        f"# Benchmarks: suite `{result['suite']}` on `{result['device']}`",
        "",
        f"{result['date']}; torch {result['torch']} (torch threads: {result['torch_threads']}), remat {result['remat']}, "
        f"torch_remat {result['torch_remat'] or 'not installed'}; {result['cpu']}"
        + (f", {result['gpu']}" if result["gpu"] else "")
        + f"; {result['platform']}; heap: {result.get('heap', heap.DEFAULT)}. "
        + f"Median of {result['repeats']} interleaved repeats.",
        "",
        "Columns: bytes live after forward (everything still allocated once the loss is computed, "
        "above what was live before), peak bytes during forward+backward (parameter gradients included), "
        "median forward+backward time, its ratio to eager, and the first-call trace time "
        "(the first call's forward minus the next, cached, forward; remat only). "
        "`saved` is what an outer `saved_tensors_hooks` sees; methods with their own hooks hide theirs from it.",
    ]
    for workload in result["workloads"]:
        lines += [
            "",
            f"## {workload['name']}",
            "",
            workload["description"] + ".",
            "",
            "| method | live after fwd (MiB) | peak fwd+bwd (MiB) | fwd+bwd median (ms) | vs eager | trace (ms) | saved (MiB) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in workload["methods"]:
            if "skipped" in row:
                lines.append(f"| {row['method']} | skipped: {row['skipped']} | | | | | |")
                continue
            lines.append(
                f"| {row['method']} | {_mib(row['live_bytes'])} | {_mib(row['peak_bytes'])} | "
                f"{_ms(row['median_s'])} | {row['ratio_to_eager']:.2f}x | {_ms(row['trace_s'])} | "
                f"{_mib(row['saved_bytes'])} |"
            )
    overhead = result["call_overhead_us"]
    lines += [
        "",
        "## Per-call overhead",
        "",
        "Cached forward call of `x.sin()` on a 4-element tensor that requires grad, median: "
        + ", ".join(f"{name} {us:.1f} us" for name, us in overhead.items())
        + ".",
        "",
        "## Targets",
        "",
        "| target | workload | result | numbers |",
        "|---|---|---|---|",
    ]
    lines += [f"| {target} | {name} | {verdict} | {detail} |" for target, name, verdict, detail in targets(result)]
    if plot_note:
        lines += ["", plot_note]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> str | None:
    """Memory against step time, one panel per workload; a note instead if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "Plot skipped: matplotlib is not installed (pip install matplotlib, or '.[bench]')."
    workloads = result["workloads"]
    columns = min(3, len(workloads))
    rows = -(-len(workloads) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    # One colour and marker per method across all panels (a workload may skip some methods).
    names = list(dict.fromkeys(row["method"] for workload in workloads for row in workload["methods"]))
    colours = plt.get_cmap("tab10")
    style = {name: (colours(i % 10), "os^Dv<>P*X"[i % 10]) for i, name in enumerate(names)}
    handles = {}
    for ax, workload in zip(axes.flat, workloads, strict=False):
        for method, row in _rows(workload).items():
            colour, marker = style[method]
            handles[method] = ax.scatter(
                row["median_s"] * 1e3, row["live_bytes"] / MIB, color=colour, marker=marker, label=method
            )
        ax.set_title(workload["name"], fontsize=9)
        ax.set_xlabel("fwd+bwd median (ms)")
        ax.set_ylabel("live after forward (MiB)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads) :]:
        ax.set_visible(False)
    ordered = [name for name in names if name in handles]
    figure.legend([handles[name] for name in ordered], ordered, loc="lower center", ncol=4, fontsize=8)
    figure.suptitle(f"remat benchmarks: {result['suite']} suite on {result['device']} ({result['date']})")
    figure.tight_layout(rect=(0, 0.08, 1, 0.96))
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None


def write(json_path: Path) -> list[str]:
    """Write the markdown and the plot next to `json_path`; return what was done, one line each."""
    result = json.loads(Path(json_path).read_text())
    png_path, md_path = json_path.with_suffix(".png"), json_path.with_suffix(".md")
    note = plot(result, png_path)
    md_path.write_text(markdown(result, note))
    return [note or f"wrote {png_path}", f"wrote {md_path}"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="a results file written by `python -m benchmarks`")
    for line in write(parser.parse_args(argv).json):
        print(line)


if __name__ == "__main__":
    main()
