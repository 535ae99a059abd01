"""Third-party models checkpointed in one line, as a new user would: does each train like eager?

    python -m benchmarks.models [--policies save_nothing dots_saveable budget] [--moe-repeats 5]
                                [--threads N] [--out benchmarks/results/models-cpu.json]

Every model is transformers' own code at a small local config (no download), float32, in train
mode with dropout on, called the default way (`model(input_ids, labels=...)`, so with the default
`use_cache`). Each decoder/encoder layer is checkpointed with
`remat.checkpoint_modules(model, transformers.GradientCheckpointingLayer, policy=...)`. A model
passes under a policy when its loss and every parameter gradient equal those of the unwrapped model
(same seed, so the same dropout masks) to rtol 1e-5, atol 1e-6, over two steps with new tokens,
with one trace per layer structure. Trace time per layer is the first step's extra time over a
later step, divided by the traces taken.

The mixture-of-experts rows then compare, at a larger config, one training step of the model with
remat's layers against transformers' own gradient checkpointing (`torch.utils.checkpoint`,
non-reentrant) and against no checkpointing: bytes live after forward, peak bytes during
forward+backward (both by `MemTracker`, as in `measure.memory`) and the median step time.
Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from torch.distributed._tools.mem_tracker import MemTracker

import remat
from remat import policies

from .harness import describe, environment

RESULTS = Path(__file__).parent / "results"
POLICIES: dict[str, Callable[[], Any]] = {
    "save_nothing": lambda: policies.save_nothing,
    "dots_saveable": lambda: policies.dots_saveable,
    "budget": lambda: policies.budget(fraction=0.5),
}
BATCH, SEQ, VOCAB = 2, 16, 100
DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
}
MOE = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 0,
            "n_shared_experts": 1,
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
        },
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": None, "pad_token_id": None}),
}
SMALL_BERT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
# name: (config class, config arguments, auto-model class, inputs kind)
DENSE: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "gpt2": ("GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB}, "CausalLM", "ids"),
    "llama": ("LlamaConfig", DECODER, "CausalLM", "ids"),
    "mistral": ("MistralConfig", DECODER, "CausalLM", "ids"),
    "qwen2": ("Qwen2Config", DECODER, "CausalLM", "ids"),
    "qwen3": ("Qwen3Config", {**DECODER, "head_dim": 8}, "CausalLM", "ids"),
    "gemma2": ("Gemma2Config", {**DECODER, "head_dim": 8}, "CausalLM", "ids"),
    "gemma3": ("Gemma3TextConfig", {**DECODER, "head_dim": 8}, "CausalLM", "ids"),
    "phi3": ("Phi3Config", {**DECODER, "pad_token_id": 0}, "CausalLM", "ids"),
    "gpt_neox": ("GPTNeoXConfig", DECODER, "CausalLM", "ids"),
    "falcon": (
        "FalconConfig",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4},
        "CausalLM",
        "ids",
    ),
    "mamba": ("MambaConfig", {"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": VOCAB}, "CausalLM", "ids"),
    "bert": ("BertConfig", {**SMALL_BERT, "vocab_size": VOCAB}, "MaskedLM", "ids"),
    "roberta": ("RobertaConfig", {**SMALL_BERT, "vocab_size": VOCAB}, "MaskedLM", "ids"),
    "t5": (
        "T5Config",
        {
            "d_model": 32,
            "d_ff": 64,
            "d_kv": 8,
            "num_layers": 2,
            "num_heads": 4,
            "vocab_size": VOCAB,
            "decoder_start_token_id": 0,
        },
        "Seq2SeqLM",
        "ids",
    ),
    "bart": (
        "BartConfig",
        {
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "vocab_size": VOCAB,
        },
        "Seq2SeqLM",
        "ids",
    ),
    "vit": ("ViTConfig", {**SMALL_BERT, "image_size": 32, "patch_size": 8}, "ImageClassification", "pixels"),
}


def build(name: str, experts: str = "grouped_mm", **overrides: Any) -> transformers.PreTrainedModel:
    """The model `name` at its small config (MoE models with `experts`), seeded, in train mode."""
    if name in MOE:
        config_class, extra = MOE[name]
        config = getattr(transformers, config_class)(**{**DECODER, **extra, **overrides})
        config._experts_implementation = experts
        auto = "CausalLM"
    else:
        config_class, extra, auto, _ = DENSE[name]
        config = getattr(transformers, config_class)(**{**extra, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, f"AutoModelFor{auto}").from_config(config).train()


def inputs(name: str, step: int, batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    if name in DENSE and DENSE[name][3] == "pixels":
        return {
            "pixel_values": torch.randn(batch, 3, 32, 32, generator=generator),
            "labels": torch.randint(0, 2, (batch,), generator=generator),
        }
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    return {"input_ids": ids, "labels": ids}


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks for both models
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, transformers.GradientCheckpointingLayer)]


def largest_difference(actual: dict[str, Any], expected: dict[str, Any]) -> float:
    """The largest absolute gradient difference; infinite when one side lacks a gradient."""
    worst = 0.0
    for name, grad in expected.items():
        if (grad is None) != (actual[name] is None):
            return float("inf")
        if grad is not None:
            worst = max(worst, (actual[name] - grad).abs().max().item())
    return worst


def check(name: str, policy: str, experts: str = "grouped_mm", steps: int = 2) -> dict[str, Any]:
    """Train `name` with checkpointed layers next to the unwrapped model; pass, or why not."""
    row: dict[str, Any] = {"model": name, "policy": policy, "experts": experts if name in MOE else None}
    try:
        reference = build(name, experts)
        model = remat.checkpoint_modules(
            copy.deepcopy(reference), transformers.GradientCheckpointingLayer, policy=POLICIES[policy]()
        )
        seconds, differences, passed = [], [], True
        for step in range(steps):
            batch = inputs(name, step)
            expected_loss, expected = loss_and_grads(reference, batch)
            started = time.perf_counter()
            loss, actual = loss_and_grads(model, batch)
            seconds.append(time.perf_counter() - started)
            differences.append(largest_difference(actual, expected))
            passed &= torch.allclose(loss, expected_loss, rtol=1e-5, atol=1e-6) and all(
                torch.allclose(actual[k], g, rtol=1e-5, atol=1e-6) for k, g in expected.items() if g is not None
            )
        traces = sum(layer.forward.cache_info().traces for layer in layers_of(model))
        row |= {
            "passed": bool(passed),
            "layers": len(layers_of(model)),
            "traces": traces,
            "max_grad_difference": max(differences),
            "trace_seconds_per_layer": max(seconds[0] - min(seconds[1:]), 0.0) / max(traces, 1),
        }
    except Exception as error:  # a failure is a result here: record it and go on
        row |= {"passed": False, "error": "".join(traceback.format_exception_only(error)).strip()[:400]}
    return row


# --- mixture-of-experts: memory and time against torch.utils.checkpoint -----------------------------

MOE_SIZE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "moe_intermediate_size": 256}
MOE_BATCH, MOE_SEQ = 4, 256


def moe_methods(name: str, experts: str) -> dict[str, torch.nn.Module]:
    overrides = dict(MOE_SIZE)
    if name == "mixtral":  # its experts are `intermediate_size` wide
        del overrides["moe_intermediate_size"]
    eager = build(name, experts, **overrides)
    hf_checkpoint = copy.deepcopy(eager)
    hf_checkpoint.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    methods = {"eager": eager, "torch.utils.checkpoint": hf_checkpoint}
    for policy in ("save_nothing", "dots_saveable"):
        methods[f"remat {policy}"] = remat.checkpoint_modules(
            copy.deepcopy(eager), transformers.GradientCheckpointingLayer, policy=POLICIES[policy]()
        )
    return methods


def _tracked(tracker: MemTracker, which: str) -> int:
    return int(tracker.get_tracker_snapshot(which)[torch.device("cpu")]["Total"])


def memory(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(bytes live after forward, peak bytes of forward+backward), above what was live before."""
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(*model.parameters(), *batch.values())
    with tracker:
        before = _tracked(tracker, "current")
        loss = model(**batch).loss
        live = _tracked(tracker, "current") - before
        loss.backward()
        del loss
    return live, _tracked(tracker, "peak") - before


def moe_rows(name: str, experts: str, repeats: int) -> list[dict[str, Any]]:
    methods = moe_methods(name, experts)
    batch = inputs(name, 0, MOE_BATCH, MOE_SEQ)
    for model in methods.values():  # warm-up: remat traces here
        model(**batch).loss.backward()
    rows = []
    for method, model in methods.items():
        live, peak = memory(model, batch)
        rows.append({"model": name, "experts": experts, "method": method, "live_bytes": live, "peak_bytes": peak})
    times: dict[str, list[float]] = {method: [] for method in methods}
    for _ in range(repeats):
        for method, model in methods.items():  # interleaved
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            model(**batch).loss.backward()
            times[method].append(time.perf_counter() - started)
    for row in rows:
        row["step_seconds"] = statistics.median(times[row["method"]])
    return rows


# --- rendering ----------------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# Third-party models under remat (CPU)",
        "",
        f"{describe(env)}; transformers {env['transformers']}.",
        "Produced by `python -m benchmarks.models`; see its docstring for the method.",
        "",
    ]
    policy_names = results["policies"]
    lines += ["| model | experts | " + " | ".join(policy_names) + " | traces / layers | trace s per layer |"]
    lines += ["|---" * (len(policy_names) + 4) + "|"]
    by_model: dict[tuple[str, Any], dict[str, dict[str, Any]]] = {}
    for row in results["checks"]:
        by_model.setdefault((row["model"], row["experts"]), {})[row["policy"]] = row
    for (model, experts), rows in by_model.items():
        cells = []
        for policy in policy_names:
            row = rows[policy]
            cells.append(f"pass ({row['max_grad_difference']:.0e})" if row["passed"] else "**fail**")
        first = rows[policy_names[0]]
        traces = f"{first.get('traces', '-')} / {first.get('layers', '-')}"
        per_layer = f"{first['trace_seconds_per_layer']:.2f}" if "trace_seconds_per_layer" in first else "-"
        lines.append(f"| {model} | {experts or '-'} | " + " | ".join(cells) + f" | {traces} | {per_layer} |")
    failures = [row for row in results["checks"] if "error" in row]
    if failures:
        lines += ["", "Failures:", ""]
        lines += [f"- {row['model']} ({row['policy']}): `{row['error'].splitlines()[-1]}`" for row in failures]
    lines += [
        "",
        "In parentheses: the largest absolute gradient difference against the unwrapped model.",
        "",
        f"## Mixture-of-experts layers: {MOE_SIZE['num_hidden_layers']} layers, hidden {MOE_SIZE['hidden_size']},"
        f" batch {MOE_BATCH} x {MOE_SEQ} tokens",
        "",
        "| model | experts | method | live after forward (MiB) | peak (MiB) | step (s) | step / torch.utils.checkpoint |",
        "|---|---|---|---|---|---|---|",
    ]
    peer = {(r["model"], r["experts"]): r for r in results["moe"] if r["method"] == "torch.utils.checkpoint"}
    for row in results["moe"]:
        ratio = row["step_seconds"] / peer[(row["model"], row["experts"])]["step_seconds"]
        lines.append(
            f"| {row['model']} | {row['experts']} | {row['method']} | {row['live_bytes'] / 2**20:.1f} |"
            f" {row['peak_bytes'] / 2**20:.1f} | {row['step_seconds']:.3f} | {ratio:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--models", nargs="+", choices=[*DENSE, *MOE], default=[*DENSE, *MOE])
    parser.add_argument("--moe-repeats", type=int, default=5, help="timed steps per method (0: skip the MoE rows)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS / "models-cpu.json"))
    options = parser.parse_args(argv)
    if options.threads:
        torch.set_num_threads(options.threads)
    warnings.simplefilter("ignore")  # the dropped-cache warning, once per layer
    checks = []
    for name in options.models:
        for experts in ("grouped_mm", "eager") if name in MOE else ("grouped_mm",):
            for policy in options.policies:
                row = check(name, policy, experts)
                print(json.dumps(row), flush=True)
                checks.append(row)
    moe = []
    if options.moe_repeats:
        for name in (m for m in options.models if m in MOE):
            for experts in ("grouped_mm", "eager"):
                for row in moe_rows(name, experts, options.moe_repeats):
                    print(json.dumps(row), flush=True)
                    moe.append(row)
    results = {
        "environment": environment(),
        "policies": options.policies,
        "checks": checks,
        "moe": moe,
    }
    out = Path(options.out)
    out.write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
