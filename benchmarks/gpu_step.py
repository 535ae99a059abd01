"""A GPT-style training step at a GPU's size under each way to checkpoint it, side by side in one process.

    python -m benchmarks.gpu_step [--device cuda] [--repeats 5] [--out benchmarks/results/gpu-step-cuda.json]
    python -m benchmarks.gpu_step --dry-run       # the same rows at a toy size on the CPU, in seconds

The model: 12 GPT-2-shaped blocks (pre-LayerNorm, causal SDPA attention, a GELU MLP), d=2048, 16 heads,
T=2048, vocabulary 32768, batch 1, in bfloat16. The rows, each on a copy of the same weights and batch:

- eager; `torch.utils.checkpoint` per block (non-reentrant); SAC per block, saving the op list SAC users
  write (matmuls, attention); `torch_remat` per block with its regions around the linears and attention
  (where it is installed);
- `torch.compile` (inductor) of the whole step with the partitioner's `activation_memory_budget` at
  `BUDGET`: the compiler's own trade;
- remat: `dots_saveable` on every block (`checkpoint_modules`), and `remat.fit` (on a GPU, also with
  `offload=True`) at two targets, a third and two thirds of the way from `torch.utils.checkpoint`'s
  measured peak to eager's.

Peaks are `torch.cuda.max_memory_allocated` over forward, loss and backward (parameter gradients
included) above what was live before, after an untracked step that traces, plans and compiles; on the CPU
(`--dry-run`), torch's MemTracker. Step times are medians of interleaved repeats. Every row's gradients are
compared with eager's. The dry run uses the `aot_eager_decomp_partition` backend (the partitioner without
inductor's code generation) so that it takes seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import remat
from remat import policies

from . import peers
from .compiled import inductor
from .fit import (
    MIB,
    Case,
    LanguageModel,
    Row,
    _fitted,
    _grads_difference,
    _per_block,
    _record,
    measure_peak,
    time_rows,
)
from .harness import describe, environment
from .heap import DEFAULT
from .workloads import Block

RESULTS = Path(__file__).parent / "results"
BUDGET = 0.5  # torch.compile's activation_memory_budget: half of what its partitioner would save
FRACTIONS = (1 / 3, 2 / 3)  # fit's targets, between checkpoint's peak and eager's

# (layers, dim, heads, vocab, length, batch, dtype)
GPU_SIZE = (12, 2048, 16, 32768, 2048, 1, torch.bfloat16)
DRY_RUN_SIZE = (2, 64, 4, 128, 32, 1, torch.bfloat16)


def gpt(device: torch.device, dry_run: bool) -> Case:
    layers, dim, heads, vocab, length, batch, dtype = DRY_RUN_SIZE if dry_run else GPU_SIZE
    torch.manual_seed(0)
    model = LanguageModel(layers, dim, heads, vocab, length).to(device=device, dtype=dtype)

    def make(size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tokens = torch.randint(vocab, (size, length + 1), generator=torch.Generator().manual_seed(size)).to(device)
        return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), {}

    description = (
        f"{layers}-layer GPT-2-shaped model, d={dim}, {heads} heads, vocab {vocab}, T={length}, batch {batch}, "
        f"{str(dtype).removeprefix('torch.')}"
    )
    return Case("gpt", description, model, Block, make, batch, lambda output: output)


def _copy(case: Case, name: str, prepare: Callable[[torch.nn.Module], Any]) -> Row:
    model = copy.deepcopy(case.model)
    prepared = prepare(model)
    return Row(name, model if prepared is None else prepared, list(model.parameters()))


def rows_of(case: Case, backend: Callable[..., Any] | str) -> list[Row]:
    """Every row but fit's, which take their targets from the measured peaks of the first two."""
    rows = [
        _copy(case, "eager", lambda model: None),
        _copy(case, "checkpoint", lambda model: _per_block(model, case.block, peers.checkpointed)),
        _copy(case, "sac", lambda model: _per_block(model, case.block, peers.selective)),
    ]
    if peers.has_torch_remat():
        rows.append(
            _copy(
                case,
                "torch_remat",
                lambda model: _per_block(model, case.block, lambda f: peers.torch_remat_regions(f, "block")),
            )
        )
    rows.append(_copy(case, f"torch.compile, budget {BUDGET}", lambda model: torch.compile(model, backend=backend)))
    rows.append(
        _copy(
            case,
            "remat dots_saveable",
            lambda model: remat.checkpoint_modules(model, case.block, policy=policies.dots_saveable),
        )
    )
    return rows


def _fitted_offloading(case: Case, target: int, args: Sequence[Any], kwargs: dict[str, Any]) -> Row:
    """`remat.fit` with offloading, its copies and replays timed on an H100's roofline (docs/fit.md)."""
    model = copy.deepcopy(case.model)
    plan = remat.fit(
        model, case.block, *args, kwargs=kwargs, peak_bytes=target, loss=case.loss, offload=True, cost="roofline:h100"
    )
    return Row("remat.fit(offload=True)", model, list(model.parameters()), target, plan)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    device = torch.device(args.device)
    started = time.perf_counter()
    case = gpt(device, args.dry_run)
    log(f"[{time.perf_counter() - started:6.0f} s] {case.description}")
    batch, kwargs = case.batch(case.batch_size)
    backend = "aot_eager_decomp_partition" if args.dry_run else inductor()
    rows = rows_of(case, backend)
    with warnings.catch_warnings(), torch._functorch.config.patch(activation_memory_budget=BUDGET):
        warnings.simplefilter("ignore")  # checkpoint's and the compiler's advice, once per call
        for row in rows:
            row.measured["peak_bytes"] = measure_peak(case, row, batch, kwargs, device)
            log(
                f"[{time.perf_counter() - started:6.0f} s]   {row.method}: peak {row.measured['peak_bytes'] / MIB:.1f} MiB"
            )
        eager, checkpointed = rows[0], rows[1]
        low, high = checkpointed.measured["peak_bytes"], eager.measured["peak_bytes"]
        for fraction in FRACTIONS:
            target = round(low + (high - low) * fraction)
            fits = [_fitted(case, target, batch, kwargs)]
            if device.type == "cuda":  # (on the CPU a tensor is its own host copy: fit refuses to offload)
                fits.append(_fitted_offloading(case, target, batch, kwargs))
            for row in fits:
                row.measured["peak_bytes"] = measure_peak(case, row, batch, kwargs, device)
                rows.append(row)
                log(
                    f"[{time.perf_counter() - started:6.0f} s]   {row.method} at {target / MIB:.1f} MiB: "
                    f"peak {row.measured['peak_bytes'] / MIB:.1f} MiB (predicted {row.fit.predicted_peak / MIB:.1f})"  # type: ignore[union-attr]
                )
        for row in rows:  # the gradients of the last measured step, against eager's
            row.measured["max_grad_difference"] = _grads_difference(row, eager)
        time_rows(case, rows, batch, kwargs, device, args.repeats)
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **environment(device, DEFAULT),
        "total_s": time.perf_counter() - started,
        "description": case.description,
        "rows": [_record(row) for row in rows],
    }


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    eager = rows[0]
    lines = [
        f"# One training step at a GPU's size on `{results['device']}`",
        "",
        f"{results['description']}. {describe(results)}; median of {results['config']['repeats']} interleaved "
        "steps. Peak: measured over forward, loss and backward, parameter gradients included, above what was "
        "live before (`torch.cuda.max_memory_allocated` on a GPU).",
        "",
        "| method | target (MiB) | measured peak (MiB) | predicted (MiB) | step (ms) | vs eager | spread | max grad diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        target = "" if r["target_bytes"] is None else f"{r['target_bytes'] / MIB:.1f}"
        predicted = r.get("predicted_peak_bytes")
        lines.append(
            f"| {r['method']} | {target} | {r['peak_bytes'] / MIB:.1f} | "
            f"{'' if predicted is None else f'{predicted / MIB:.1f}'} | {r['step_s'] * 1e3:.1f} | "
            f"{r['step_s'] / eager['step_s']:.2f}x | {r['spread']:.1%} | {r['max_grad_difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="a toy size on the CPU: checks that the rows run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/gpu-step-<device>.json")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; --dry-run runs the same rows at a toy size on the CPU")
    args.out = args.out or RESULTS / f"gpu-step-{args.device}.json"
    results = run(args, log=lambda line: print(line, flush=True))
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
