"""`remat.fit` under FSDP2: each rank's peak against its target, and the step time, beside the peers.

    python -m benchmarks fsdp [--ranks 2] [--targets 3] [--repeats 5] [--small] [--out benchmarks/results/fsdp-cpu.json]

A whole training step (forward, loss, backward) of the GPT-2-shaped model of `benchmarks/fit.py`, its blocks
and the model wrapped with `fully_shard`, on `--ranks` gloo processes on the CPU, each with its own batch:
no checkpointing, `torch.utils.checkpoint` on every block (full activation checkpointing), `torch_remat`
regions on every block (where it is installed), and `remat.fit` called on every rank at targets spread
from full checkpointing's measured peak to no checkpointing's. Peaks are MemTracker's on each rank, above
what was live before the step, after an untracked step; step times are medians of repeats (every rank
steps together: the collectives pace them).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import remat

from . import peers
from .fit import MIB, LanguageModel, _per_block
from .harness import environment
from .workloads import Block

RESULTS = Path(__file__).parent / "results"


def _model(small: bool) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    layers, dim, heads, vocab, length, batch = (2, 32, 4, 64, 64, 4) if small else (4, 128, 4, 256, 128, 4)
    torch.manual_seed(0)
    model = LanguageModel(layers, dim, heads, vocab, length)

    def batch_of(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(vocab, (batch, length + 1), generator=torch.Generator().manual_seed(rank))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return model, batch_of


def _sharded(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    return fully_shard(model)


def _peak(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    model(tokens, targets).backward()
    for p in model.parameters():
        p.grad = None
    tracker = MemTracker()
    tracker.track_external(model, tokens, targets)
    cpu = torch.device("cpu")
    with tracker:
        before = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        model(tokens, targets).backward()
    for p in model.parameters():
        p.grad = None
    return int(tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before)


def _step_seconds(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        model(tokens, targets).backward()
        times.append(time.perf_counter() - started)
        for p in model.parameters():
            p.grad = None
    return statistics.median(times)


def _largest(value: int) -> int:
    """`value` at its largest over the ranks."""
    held = torch.tensor([value])
    dist.all_reduce(held, dist.ReduceOp.MAX)
    return int(held)


def _rank(rank: int, world: int, port: int, options: Any, results: Any) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    try:
        base, batch_of = _model(options.small)
        tokens, targets = batch_of(rank)

        def method(prepare: Callable[[nn.Module], Any]) -> nn.Module:
            model = copy.deepcopy(base)
            prepare(model)
            return _sharded(model)

        rows: list[dict[str, Any]] = []

        def measure(name: str, model: nn.Module, target: int | None = None, plan: Any = None) -> None:
            peak = _peak(model, tokens, targets)
            seconds = _step_seconds(model, tokens, targets, options.repeats)
            row = {"method": name, "target_bytes": target, "peak_bytes": peak, "step_s": seconds}
            if plan is not None:
                row.update(predicted_peak_bytes=plan.predicted_peak, replay_flops=plan.replay_cost)
            rows.append(row)

        measure("no checkpointing", method(lambda model: None))
        measure("full AC (torch.utils.checkpoint)", method(lambda m: _per_block(m, Block, peers.checkpointed)))
        if peers.has_torch_remat():
            measure(
                "torch_remat regions",
                method(lambda m: _per_block(m, Block, lambda f: peers.torch_remat_regions(f, "block"))),
            )
        low, high = _largest(rows[1]["peak_bytes"]), _largest(rows[0]["peak_bytes"])
        for k in range(options.targets):
            target = round(low + (high - low) * (k + 1) / (options.targets + 1))
            model = method(lambda model: None)
            started = time.perf_counter()
            plan = remat.fit(model, Block, tokens, targets, peak_bytes=target, loss=lambda loss: loss)
            planning = time.perf_counter() - started
            measure("remat.fit", model, target, plan)
            rows[-1]["plan_s"] = planning
        results[rank] = {"rows": rows}
    except BaseException as error:
        results[rank] = {"error": repr(error)}
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def markdown(results: dict[str, Any]) -> str:
    lines = [f"{results['description']}; {results['ranks']} gloo ranks, torch {results['environment']['torch']}", ""]
    lines.append(
        "| method | target MiB | "
        + " | ".join(f"rank {r} peak MiB" for r in range(results["ranks"]))
        + " | predicted MiB | step ms (rank 0) |"
    )
    lines.append("|---" * (4 + results["ranks"]) + "|")
    per_rank = [results["per_rank"][str(r)]["rows"] for r in range(results["ranks"])]
    for rows in zip(*per_rank, strict=True):
        first = rows[0]
        target = "" if first["target_bytes"] is None else f"{first['target_bytes'] / MIB:.2f}"
        predicted = first.get("predicted_peak_bytes")
        peaks = " | ".join(f"{row['peak_bytes'] / MIB:.2f}" for row in rows)
        predicted_mib = "" if predicted is None else f"{predicted / MIB:.2f}"
        lines.append(f"| {first['method']} | {target} | {peaks} | {predicted_mib} | {first['step_s'] * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--targets", type=int, default=3, help="targets between full AC's peak and no checkpointing's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a tiny model: checks that the benchmark runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "fsdp-cpu.json")
    options = parser.parse_args(argv)
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(options.ranks, _free_port(), options, results), nprocs=options.ranks)
    per_rank = {str(rank): results.get(rank, {"error": "no result"}) for rank in range(options.ranks)}
    errors = {rank: r["error"] for rank, r in per_rank.items() if "error" in r}
    if errors:
        raise RuntimeError(f"benchmarks.fsdp: a rank failed: {errors}")
    model, _ = _model(options.small)
    description = f"{len(model.blocks)}-block GPT-2-shaped model, FSDP2"  # type: ignore[arg-type]
    report = {"description": description, "ranks": options.ranks, "environment": environment(), "per_rank": per_rank}
    options.out.write_text(json.dumps(report, indent=1) + "\n")
    options.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
