"""Kept values in fewer bytes: `remat.fit` with and without exact packing (`remat.PACK`) at the same targets.

    python -m benchmarks compression [--targets 4] [--repeats 5] [--small] [--out benchmarks/results/compression-cpu.json]

Two whole training steps (forward, loss, backward) whose kept values include what packing holds exactly:

- `gpt-dropout`: a GPT-2-shaped language model whose blocks drop out attention probabilities (SDPA with
  `dropout_p`, its math path on the CPU, which keeps a B x H x T x T mask) and both residual branches;
- `relu-mlp`: a stack of pre-LayerNorm MLP blocks, ReLU then dropout then the second linear, so that only
  the ReLU's own backward reads its output (as `result <= 0`) and the dropout's product is what the linear's
  weight gradient reads.

For each: the bytes each kind of kept value takes as it is, packed and compressed, on one block's trace
(`remat.report`); every block keeping everything, as it is and packed (no replays either way); at targets spread from the lowest peak `fit` reaches to eager's, `fit(pack=False)` and
`fit()` side by side: measured peak (MemTracker), predicted peak, replayed FLOPs and step time (medians of
interleaved repeats); and, within eager's measured peak at batch 2, the largest batch and best throughput of
eager, save-nothing blocks and both fits. A residual convolution block's report says what packing saves
there: nothing (the next convolution's weight gradient reads each ReLU's output in full).
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import policies

from .fit import MIB, Case, LanguageModel, Row, best_within, measure_peak, time_rows
from .harness import environment
from .workloads import ResidualConv

RESULTS = Path(__file__).parent / "results"


class DropoutBlock(nn.Module):
    """GPT-2 block with attention dropout (in SDPA) and residual dropout."""

    def __init__(self, dim: int, heads: int, p: float = 0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (
            t.reshape(batch, length, self.heads, dim // self.heads).transpose(1, 2)
            for t in self.c_attn(self.ln_1(x)).split(dim, dim=-1)
        )
        p = self.p if self.training else 0.0
        attention = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        attention = attention.transpose(1, 2).reshape(batch, length, dim)
        x = x + F.dropout(self.c_proj(attention), p, self.training)
        hidden = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + F.dropout(self.mlp_proj(hidden), p, self.training)


class ReluBlock(nn.Module):
    """Pre-LayerNorm MLP block: ReLU, then dropout, then the second linear."""

    def __init__(self, dim: int, p: float = 0.1):
        super().__init__()
        self.p = p
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.dropout(F.relu(self.up(self.norm(x))), self.p, self.training))


def _tokens(vocab: int, length: int) -> Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]:
    def make(size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tokens = torch.randint(vocab, (size, length + 1), generator=torch.Generator().manual_seed(size))
        return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), {}

    return make


def gpt_dropout(small: bool) -> Case:
    layers, dim, heads, vocab, length, batch = (2, 32, 4, 64, 16, 2) if small else (4, 128, 4, 256, 128, 4)
    torch.manual_seed(0)
    model = LanguageModel(layers, dim, heads, vocab, length, lambda: DropoutBlock(dim, heads))
    description = f"{layers}-layer GPT-2-shaped model with attention and residual dropout 0.1, d={dim}, T={length}"
    return Case("gpt-dropout", description, model, DropoutBlock, _tokens(vocab, length), batch, lambda loss: loss)


def relu_mlp(small: bool) -> Case:
    layers, dim, vocab, length, batch = (2, 32, 64, 16, 2) if small else (4, 256, 256, 128, 4)
    torch.manual_seed(0)
    model = LanguageModel(layers, dim, 1, vocab, length, lambda: ReluBlock(dim))
    description = f"{layers} ReLU MLP blocks (ReLU, dropout 0.1, linear), d={dim}, hidden {4 * dim}, T={length}"
    return Case("relu-mlp", description, model, ReluBlock, _tokens(vocab, length), batch, lambda loss: loss)


CASES = {"gpt-dropout": gpt_dropout, "relu-mlp": relu_mlp}


# --- bytes per kind --------------------------------------------------------------------------------


def _kind(row: remat.ReportRow) -> str:
    """What a kept value packed as bits is, by the op that made it."""
    name = row.call.name
    if name in ("aten.div.Scalar", "aten.mul.Scalar") or name.startswith("aten.bernoulli"):
        return "dropout masks (Bernoulli draws, scaled)"
    if row.call.outputs and row.call.outputs[0].dtype is torch.bool:
        return "booleans"
    return "read through a test (ReLU's output)"


def bytes_by_kind(block: nn.Module, example: torch.Tensor) -> dict[str, Any]:
    """On one block's trace: what save_everything keeps, what packing each kind frees, and what each
    compressed format keeps."""
    kept = remat.report(block, example, policy=policies.save_everything)
    packed = remat.report(block, example, policy=policies.pack_everything)
    freed: dict[str, int] = {}
    for row in packed.rows:
        if row.storage == "bits":
            kind = _kind(row)
            freed[kind] = freed.get(kind, 0) + kept.rows[row.call.index].saved_bytes - row.saved_bytes
    compressed = {
        format: remat.report(block, example, policy=policies.compress(policies.save_everything, format)).saved_bytes
        for format in ("bfloat16", "fp8")
    }
    return {
        "kept_bytes": kept.saved_bytes,
        "packed_bytes": packed.saved_bytes,
        "freed_by_kind": freed,
        "compressed_bytes": compressed,
    }


def _block_input(case: Case) -> torch.Tensor:
    """An activation entering the first block at the case's batch."""
    (tokens, _), _ = case.batch(case.batch_size)
    with torch.no_grad():
        h = case.model.embedding(tokens)  # type: ignore[operator]
    return h.requires_grad_()


# --- fit with and without packing ---------------------------------------------------------------------


def _eager(case: Case) -> Row:
    model = copy.deepcopy(case.model)
    return Row("eager", model, list(model.parameters()))


def _uniform(case: Case, name: str, policy: remat.Policy) -> Row:
    model = copy.deepcopy(case.model)
    remat.checkpoint_modules(model, case.block, policy=policy)
    return Row(f"{name} blocks", model, list(model.parameters()))


def _save_nothing(case: Case) -> Row:
    return _uniform(case, "save_nothing", policies.save_nothing)


def _fitted(case: Case, target: int, args: Sequence[Any], kwargs: dict[str, Any], pack: bool) -> Row:
    model = copy.deepcopy(case.model)
    plan = remat.fit(model, case.block, *args, kwargs=kwargs, peak_bytes=target, loss=case.loss, pack=pack)
    return Row("fit" if pack else "fit(pack=False)", model, list(model.parameters()), target, plan)


def _targets(low: int, high: int, count: int) -> list[int]:
    return [round(low + (high - low) * (k + 1) / (count + 1)) for k in range(count)]


def _record(row: Row) -> dict[str, Any]:
    record: dict[str, Any] = {"method": row.method, "target_bytes": row.target, **row.measured}
    record.pop("times_s", None)
    if row.fit is not None:
        record.update(
            predicted_peak_bytes=row.fit.predicted_peak,
            replay_flops=row.fit.replay_cost,
            packed_calls=sum(d is remat.PACK for block in row.fit.blocks for d in block.decisions),
        )
    return record


def run_case(
    case: Case, targets: int, repeats: int, batches: Sequence[int], log: Callable[[str], None]
) -> dict[str, Any]:
    args, kwargs = case.batch(case.batch_size)
    block = next(m for m in case.model.modules() if isinstance(m, case.block))
    kinds = bytes_by_kind(block, _block_input(case))
    log(f"  bytes: {kinds}")
    eager, lowest = _eager(case), _save_nothing(case)
    # Keeping everything, as it is and packed: no replays either way.
    kept = [
        _uniform(case, "save_everything", policies.save_everything),
        _uniform(case, "pack_everything", policies.pack_everything),
    ]
    rows = [eager, lowest, *kept]
    for row in rows:
        row.measured["peak_bytes"] = measure_peak(case, row, args, kwargs, torch.device("cpu"))
    for target in _targets(lowest.measured["peak_bytes"], eager.measured["peak_bytes"], targets):
        for pack in (False, True):
            row = _fitted(case, target, args, kwargs, pack)
            row.measured["peak_bytes"] = measure_peak(case, row, args, kwargs, torch.device("cpu"))
            log(f"  {row.method} at {target / MIB:.2f} MiB: peak {row.measured['peak_bytes'] / MIB:.2f} MiB")
            rows.append(row)
    time_rows(case, rows, args, kwargs, torch.device("cpu"), repeats)
    return {
        "name": case.name,
        "description": f"{case.description}, batch {case.batch_size}",
        "bytes": kinds,
        "rows": [_record(row) for row in rows],
        "largest_batch": largest_batch(case, repeats, batches, log),
    }


def largest_batch(case: Case, repeats: int, batches: Sequence[int], log: Callable[[str], None]) -> dict[str, Any]:
    """Within eager's measured peak at the first of `batches`: each method's largest batch that fits and
    its best samples per second; the fits are given that memory as their target and plan at each batch."""
    cpu = torch.device("cpu")
    first_args, first_kwargs = case.batch(batches[0])
    memory = measure_peak(case, _eager(case), first_args, first_kwargs, cpu)
    rows = [
        _eager(case),
        _save_nothing(case),
        _fitted(case, memory, first_args, first_kwargs, pack=False),
        _fitted(case, memory, first_args, first_kwargs, pack=True),
    ]
    results = []
    for row in rows:
        result = best_within(case, row, memory, batches, cpu, repeats)
        log(f"  within eager's batch-{batches[0]} peak: {result}")
        results.append(result)
    return {"memory_bytes": memory, "batches": list(batches), "rows": results}


def convolution_bytes(small: bool) -> dict[str, int]:
    """What packing frees on a residual convolution block: its ReLUs' outputs feed convolutions."""
    channels, size = (8, 8) if small else (64, 32)
    block = ResidualConv(channels)
    x = torch.randn(4, channels, size, size, requires_grad=True)
    kept = remat.report(block, x, policy=policies.save_everything).saved_bytes
    packed = remat.report(block, x, policy=policies.pack_everything).saved_bytes
    return {"kept_bytes": kept, "packed_bytes": packed}


# --- the page ---------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Environment: {results['environment']['torch']}, {results['environment'].get('cpu', '')}", ""]
    for case in results["cases"]:
        kinds = case["bytes"]
        lines += [f"### {case['name']}: {case['description']}", ""]
        lines.append(
            f"One block keeps {kinds['kept_bytes'] / MIB:.2f} MiB saving everything; packed, "
            f"{kinds['packed_bytes'] / MIB:.2f} MiB. Freed by kind:"
        )
        lines.append("")
        lines += [f"- {kind}: {nbytes / MIB:.2f} MiB" for kind, nbytes in kinds["freed_by_kind"].items()]
        compressed = ", ".join(f"{f} {b / MIB:.2f} MiB" for f, b in kinds["compressed_bytes"].items())
        lines += [f"- compressed instead (opt-in, approximate): {compressed}", ""]
        lines.append("| method | target MiB | peak MiB | predicted MiB | replayed GFLOP | packed calls | step ms |")
        lines.append("|---|---|---|---|---|---|---|")
        for row in case["rows"]:
            target = "" if row["target_bytes"] is None else f"{row['target_bytes'] / MIB:.2f}"
            predicted = row.get("predicted_peak_bytes")
            predicted_mib = "" if predicted is None else f"{predicted / MIB:.2f}"
            replayed = row.get("replay_flops")
            replayed_gflop = "" if replayed is None else f"{replayed / 1e9:.3f}"
            lines.append(
                f"| {row['method']} | {target} | {row['peak_bytes'] / MIB:.2f} | {predicted_mib} | "
                f"{replayed_gflop} | {row.get('packed_calls', '')} | {row['step_s'] * 1e3:.1f} |"
            )
        within = case["largest_batch"]
        lines += ["", f"Within eager's batch-{within['batches'][0]} peak ({within['memory_bytes'] / MIB:.2f} MiB):", ""]
        lines.append("| method | largest batch | best samples/s (at batch) |")
        lines.append("|---|---|---|")
        for row in within["rows"]:
            best = "" if row.get("batch") is None else f"{row['samples_per_s']:.1f} ({row['batch']})"
            lines.append(f"| {row['method']} | {row['largest_batch']} | {best} |")
        lines.append("")
    conv = results["convolution"]
    lines.append(
        f"A residual convolution block keeps {conv['kept_bytes']:,} bytes saving everything and "
        f"{conv['packed_bytes']:,} packed."
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compression", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, default=4, help="targets between the lowest peak and eager's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--small", action="store_true", help="tiny models: checks that the benchmark runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "compression-cpu.json")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    log = lambda line: print(line, flush=True)  # noqa: E731
    cases = []
    for name, make in CASES.items():
        log(name)
        cases.append(run_case(make(options.small), options.targets, options.repeats, options.batches, log))
    results = {"environment": environment(), "cases": cases, "convolution": convolution_bytes(options.small)}
    options.out.write_text(json.dumps(results, indent=1) + "\n")
    options.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
