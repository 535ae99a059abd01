"""Start-up against depth: what the first training step costs beyond the compute, at 2, 12 and 48 layers.

    python -m benchmarks.startup [--layers 2 12 48] [--models gpt2 llama] [--policy dots_saveable]
                                 [--trials 3] [--repeats 3] [--threads N]
                                 [--out benchmarks/results/startup-cpu.json]

Models: a stack of GPT-2-style blocks (`benchmarks.workloads.MatmulAttentionBlock`, d=128, 4 heads, batch 2 x 32
tokens) and transformers' Llama at a tiny config (hidden 64, 4 heads, batch 2 x 16 tokens), every
block checkpointed with `--policy`. Methods, each on a fresh model:

- remat: `remat.checkpoint_modules(model, Block, policy=...)`, whose identical blocks share a trace
  (NOTE [sharing traces between identical blocks]);
- remat, one trace per block: each block replaced by its own `remat.checkpoint(block, ...)`, which
  shares nothing: how start-up grew with depth before traces were shared;
- torch.utils.checkpoint (non-reentrant) of each block, which traces nothing.

Start-up is the first step's time minus the median of `--repeats` later steps: the time spent
tracing, planning and building programs; each row is the median over `--trials` fresh models, after
one warm-up model of each kind. The target is remat's start-up at the deepest model no more than 1.2x
its start-up at the shallowest.

Then `remat.fit`'s planning time (its probe step, the traces, every block's candidates and the choice
for the step) on the GPT-2 stack at each depth, with one block structure and with two (every other
block with twice the heads: one class whose attribute the trace reads, as Gemma's sliding and full
attention layers), at a target halfway between the peaks keeping nothing and keeping everything. The
targets: 2 s for 48 identical blocks and 10 s for 48 blocks of two structures. Last, `remat.fit` of a
Llama-3-8B-shaped model (transformers, bfloat16, T=8192) on the meta device for the CPU: a plan for a
model this machine could not hold. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat

from . import models
from .harness import describe, environment
from .workloads import MatmulAttentionBlock, matmul_attention_stack, stack_input

RESULTS = Path(__file__).parent / "results"
TARGET = 1.2
FIT_TARGETS = {1: 2.0, 2: 10.0}  # seconds to plan 48 blocks of one structure, of two
METHODS = ("remat", "remat, one trace per block", "torch.utils.checkpoint")


class _Checkpointed(nn.Module):
    """A block run under `torch.utils.checkpoint`."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _replace_blocks(model: nn.Module, block_type: type[nn.Module], wrap: Callable[[nn.Module], nn.Module]) -> None:
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, block_type):
                setattr(parent, name, wrap(child))


def _gpt2(layers: int) -> tuple[nn.Module, type[nn.Module], Callable[[nn.Module], torch.Tensor]]:
    model = matmul_attention_stack(layers, d=128, heads=4)
    x = stack_input(2, 32, 128)
    return model, MatmulAttentionBlock, lambda m: m(x).sum()


def _llama(layers: int) -> tuple[nn.Module, type[nn.Module], Callable[[nn.Module], torch.Tensor]]:
    model = models.build("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=layers)
    model.config.use_cache = False  # the same call for every method
    batch = models.inputs("llama", step=0)
    return model, transformers.GradientCheckpointingLayer, lambda m: m(**batch).loss


MODELS = {"gpt2": _gpt2, "llama": _llama}


def prepare(model_name: str, layers: int, method: str, policy: Any) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """A fresh model of `layers` blocks checkpointed by `method`, and its loss function."""
    model, block_type, loss = MODELS[model_name](layers)
    if method == "remat":
        remat.checkpoint_modules(model, block_type, policy=policy)
    elif method == "remat, one trace per block":
        _replace_blocks(model, block_type, lambda block: remat.checkpoint(block, policy=policy))
    elif method == "torch.utils.checkpoint":
        _replace_blocks(model, block_type, _Checkpointed)
    else:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    return model, lambda: loss(model)


def traces_of(model: nn.Module) -> int:
    """Traces remat made in `model` (0 for torch.utils.checkpoint)."""
    infos = [m.cache_info() for m in model.modules() if isinstance(m, remat.CheckpointedModule)]
    infos += [m.forward.cache_info() for m in model.modules() if hasattr(m.__dict__.get("forward"), "cache_info")]
    return sum(info.traces for info in infos)


def measure(model_name: str, layers: int, method: str, policy: Any, repeats: int) -> dict[str, Any]:
    """One fresh model's first step, the median of `repeats` later steps, and its traces."""
    model, loss = prepare(model_name, layers, method, policy)
    started = time.perf_counter()
    loss().backward()
    first = time.perf_counter() - started
    steps = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss().backward()
        steps.append(time.perf_counter() - started)
    step = statistics.median(steps)
    return {
        "model": model_name,
        "layers": layers,
        "method": method,
        "first_step_s": first,
        "step_s": step,
        "startup_s": max(first - step, 0.0),
        "traces": traces_of(model),
    }


def median_of_trials(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The trials' row, with each time the median over the trials."""
    row = dict(trials[0])
    for key in ("first_step_s", "step_s", "startup_s"):
        row[key] = statistics.median(trial[key] for trial in trials)
    return row


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = getattr(remat.policies, args.policy)
    rows = []
    for model_name in args.models:
        for method in METHODS:  # warm-up: torch's and remat's first calls of these ops
            measure(model_name, min(args.layers), method, policy, 1)
        for layers in args.layers:
            for method in METHODS:
                trials = [measure(model_name, layers, method, policy, args.repeats) for _ in range(args.trials)]
                row = median_of_trials(trials)
                rows.append(row)
                log(
                    f"{model_name:<6} {layers:>3} layers  {method:<28} first {row['first_step_s']:7.2f} s  "
                    f"step {row['step_s'] * 1e3:7.1f} ms  start-up {row['startup_s']:6.2f} s  traces {row['traces']}"
                )
    return {
        **environment(),
        "policy": args.policy,
        "trials": args.trials,
        "rows": rows,
    }


def _gpt2_structures(layers: int, structures: int) -> nn.Sequential:
    """The GPT-2 stack, with twice the heads in every other block when `structures` is 2."""
    model = matmul_attention_stack(layers, d=128, heads=4)
    for i, block in enumerate(model):
        block.heads *= 1 + i % structures
    return model


def _mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def measure_fit(layers: int, structures: int) -> dict[str, Any]:
    """`remat.fit`'s planning time on a fresh stack, at a target halfway between the peaks keeping
    nothing and keeping everything (read off a plan without a binding target, untimed)."""
    x = stack_input(2, 32, 128)
    model = _gpt2_structures(layers, structures)
    loose = remat.fit(model, MatmulAttentionBlock, x, peak_bytes=2**62, loss=_mean_square).report
    target = (loose.peak_keeping_nothing + loose.peak_keeping_everything) // 2
    model = _gpt2_structures(layers, structures)
    started = time.perf_counter()
    plan = remat.fit(model, MatmulAttentionBlock, x, peak_bytes=target, loss=_mean_square)
    return {
        "layers": layers,
        "structures": structures,
        "plan_s": time.perf_counter() - started,
        "traces": traces_of(model),
        "target": target,
        "predicted_peak": plan.predicted_peak,
        "plans": len({block.label for block in plan.blocks}),
    }


def run_fit(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    rows = []
    measure_fit(min(args.layers), 1)  # warm-up
    for structures in (1, 2):
        for layers in args.layers:
            trials = [measure_fit(layers, structures) for _ in range(args.trials)]
            row = {**trials[0], "plan_s": statistics.median(t["plan_s"] for t in trials)}
            rows.append(row)
            log(
                f"remat.fit {layers:>3} layers, {structures} structure(s): planned in {row['plan_s']:.2f} s, "
                f"traces {row['traces']}, {row['plans']} distinct plans"
            )
    return rows


def measure_meta_llama(layers: int = 32, tokens: int = 8192, device: str = "cpu") -> dict[str, Any]:
    """`remat.fit` of a Llama-3-8B-shaped model (bfloat16) on the meta device for `device`, at batch 1 x
    `tokens`: a plan for a model this machine could not hold, at a target halfway between keeping nothing
    and keeping everything (read off a plan without a binding target, which is timed too). For "cuda" on
    a machine without a GPU, planned for an H100 (docs/fit.md)."""
    config = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=tokens,
    )
    config.use_cache = False
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    block = transformers.GradientCheckpointingLayer

    def planned(target: int) -> tuple[Any, float]:
        started = time.perf_counter()
        plan = remat.fit(model, block, ids, kwargs={"labels": ids}, peak_bytes=target, device=device)
        seconds = time.perf_counter() - started
        remat.uncheckpoint_modules(model)
        return plan, seconds

    with remat.assume_gpu("H100") as gpu:  # (where a GPU is present, it chooses its kernels itself)
        loose, first_s = planned(2**62)
        target = (loose.report.peak_keeping_nothing + loose.report.peak_keeping_everything) // 2
        plan, plan_s = planned(target)
    return {
        "layers": layers,
        "tokens": tokens,
        "device": device,
        "gpu": str(gpu) if device == "cuda" and not torch.cuda.is_available() else None,
        "first_plan_s": first_s,
        "plan_s": plan_s,
        "peak_keeping_nothing": loose.report.peak_keeping_nothing,
        "peak_keeping_everything": loose.report.peak_keeping_everything,
        "target": target,
        "predicted_peak": plan.predicted_peak,
    }


def startup_ratio(rows: Sequence[dict[str, Any]], model_name: str, method: str) -> float:
    """Start-up at the deepest model over start-up at the shallowest, for one model and method."""
    mine = sorted((r for r in rows if r["model"] == model_name and r["method"] == method), key=lambda r: r["layers"])
    return float(mine[-1]["startup_s"] / mine[0]["startup_s"])


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"First training step against depth, policy {result['policy']}; {describe(result)}. Start-up = first step - median later step; each row the "
        f"median of {result.get('trials', 1)} fresh models.",
        "",
        "| model | layers | method | traces | first step (s) | later step (ms) | start-up (s) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['method']} | {r['traces']} | {r['first_step_s']:.2f} | "
            f"{r['step_s'] * 1e3:.1f} | {r['startup_s']:.2f} |"
        )
    lines += ["", f"Start-up at the deepest model over the shallowest (target for remat: <= {TARGET}x):", ""]
    for model_name in dict.fromkeys(r["model"] for r in rows):
        for method in METHODS[:2]:
            lines.append(f"- {model_name}, {method}: {startup_ratio(rows, model_name, method):.2f}x")
    fits = result.get("fit", [])
    if fits:
        lines += [
            "",
            f"`remat.fit`'s planning time, a target halfway between keeping nothing and everything (median of "
            f"{result.get('trials', 1)} fresh models; targets: {FIT_TARGETS[1]} s for 48 identical blocks, "
            f"{FIT_TARGETS[2]} s for 48 of two structures):",
            "",
            "| layers | block structures | traces | distinct plans | planning (s) |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['layers']} | {r['structures']} | {r['traces']} | {r['plans']} | {r['plan_s']:.2f} |" for r in fits
        ]
    for meta in (result.get("meta_llama"), result.get("meta_llama_cuda")):
        if not meta:
            continue
        gib = 2**30
        target = "the CPU" if meta.get("device", "cpu") == "cpu" else "CUDA"
        if meta.get("gpu"):
            target += f" without a GPU (assumed: {meta['gpu']})"
        lines += [
            "",
            f"`remat.fit` of a Llama-3-8B-shaped model on the meta device for {target} ({meta['layers']} layers, "
            f"bfloat16, batch 1 x {meta['tokens']} tokens): peak keeping nothing "
            f"{meta['peak_keeping_nothing'] / gib:.1f} GiB, keeping everything "
            f"{meta['peak_keeping_everything'] / gib:.1f} GiB; planned to {meta['target'] / gib:.1f} GiB "
            f"(predicted {meta['predicted_peak'] / gib:.1f} GiB) in {meta['plan_s']:.1f} s "
            f"(the first plan in the process, with its traces: {meta['first_plan_s']:.1f} s).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12, 48])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["gpt2", "llama"])
    parser.add_argument("--policy", default="dots_saveable")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "startup-cpu.json")
    parser.add_argument("--no-fit", action="store_true", help="leave out remat.fit's planning time")
    args = parser.parse_args(argv)
    result = run(args)
    if not args.no_fit:
        result["fit"] = run_fit(args)
        result["meta_llama"] = measure_meta_llama()
        if torch.backends.cuda.is_built():  # fake CUDA tensors: planned for a GPU, with or without one
            result["meta_llama_cuda"] = measure_meta_llama(device="cuda")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
