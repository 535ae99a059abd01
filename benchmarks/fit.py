"""`remat.fit` against its peers on whole training steps: step time against the measured peak.

    python -m benchmarks.fit [--models gpt llama resnet] [--targets 5] [--repeats 5] [--threads N]
                             [--keep-freed-memory] [--small] [--out benchmarks/results/fit-cpu.json]
    python -m benchmarks.fit --compiled --device cuda [--backend inductor] [--targets 5] [--repeats 5]

Every row is one training step (forward, loss, backward, the parameter gradients included) of a
model whose activations dominate its peak, on the same batch and weights:

- eager; `torch.utils.checkpoint` per block (non-reentrant); SAC per block, saving the op list SAC
  users write (matmuls, attention, convolutions); `torch_remat` per block with its regions around the
  linears and attention (the GPT model's blocks carry those marks);
- remat with one policy for every block (`checkpoint_modules`): save_nothing, dots_saveable,
  `budget(fraction=f)`, save_everything;
- at each target (spread from `torch.utils.checkpoint`'s measured peak to eager's): `remat.fit` of the
  model to that target, and `remat.checkpoint` of the whole model and its loss with
  `budget(peak_bytes=target)`, the one-function way to ask for a peak.

Peaks are measured with MemTracker (CPU) or the allocator's counters (CUDA), above what was live
before the step, after an untracked step that traces and plans. Step times are medians of
interleaved repeats (a new order each round); the spread column is the interquartile range over the
median, the run's noise. Every row's gradients are compared with eager's.

With `--compiled` (for a GPU: MemTracker does not see what inductor allocates on the CPU), only the
GPT model under `torch.compile`: the partitioner's own `activation_memory_budget` at several values,
against the model fitted to targets between their peaks and then compiled.

Then, within a fixed memory (eager's measured peak at batch 2 of the GPT model), each method's best
throughput over the batch sizes whose measured peak fits there; `fit` and the whole-model budget are
given that memory as their target and plan again at each batch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import optree
import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import remat
from remat import policies

from . import peers
from .harness import describe, environment
from .heap import DEFAULT, keep_freed_memory
from .workloads import Block, Classifier, Embedding, Head, ResidualConv

RESULTS = Path(__file__).parent / "results"
MIB = 2**20
FRACTIONS = (0.25, 0.5, 0.75)


# --- the models -----------------------------------------------------------------------------------


class LanguageModel(nn.Module):
    """GPT-2-shaped: embeddings, `layers` blocks (`block()`, by default GPT-2's), a head with the cross-entropy
    loss."""

    def __init__(
        self, layers: int, dim: int, heads: int, vocab: int, length: int, block: Callable[[], nn.Module] | None = None
    ):
        super().__init__()
        self.embedding = Embedding(vocab, length, dim)
        self.blocks = nn.ModuleList((block or (lambda: Block(dim, heads)))() for _ in range(layers))
        self.head = Head(dim, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h, targets)


class ResNet(nn.Module):
    """A stem convolution, `blocks` residual conv-BN-ReLU blocks, a classifier with its loss."""

    def __init__(self, channels: int, blocks: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(ResidualConv(channels) for _ in range(blocks))
        self.head = Classifier(channels, 10)

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.stem(images)
        for block in self.blocks:
            h = block(h)
        return self.head(h, targets)


@dataclasses.dataclass
class Case:
    """A model, the class of its blocks, and how to build a batch of it and take its loss."""

    name: str
    description: str
    model: nn.Module
    block: type[nn.Module]
    batch: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]  # batch size -> (args, kwargs)
    batch_size: int
    loss: Callable[[Any], torch.Tensor]

    def loss_of(self, model: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor:
        return self.loss(model(*args, **kwargs))


def _identity(output: torch.Tensor) -> torch.Tensor:
    return output


def gpt(device: torch.device, small: bool) -> Case:
    layers, dim, heads, vocab, length, batch = (2, 32, 4, 64, 16, 2) if small else (8, 256, 4, 512, 256, 8)
    model = LanguageModel(layers, dim, heads, vocab, length).to(device)

    def make(size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tokens = torch.randint(vocab, (size, length + 1), generator=torch.Generator().manual_seed(size)).to(device)
        return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), {}

    description = f"{layers}-layer GPT-2-shaped model, d={dim}, {heads} heads, vocab {vocab}, T={length}"
    return Case("gpt", description, model, Block, make, batch, _identity)


def llama(device: torch.device, small: bool) -> Case:
    import transformers

    layers, dim, vocab, length, batch = (2, 32, 64, 16, 2) if small else (8, 256, 512, 256, 4)
    config = transformers.LlamaConfig(
        hidden_size=dim,
        intermediate_size=dim * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=length,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device).train()

    def make(size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = torch.randint(vocab, (size, length), generator=torch.Generator().manual_seed(size)).to(device)
        return (ids,), {"labels": ids, "use_cache": False}  # as in training: no KV cache to fill

    description = (
        f"transformers LlamaForCausalLM, {layers} layers, d={dim}, 4 heads (2 KV), vocab {vocab}, T={length}; "
        "blocks: its GradientCheckpointingLayers"
    )
    return Case("llama", description, model, transformers.GradientCheckpointingLayer, make, batch, lambda out: out.loss)


def resnet(device: torch.device, small: bool) -> Case:
    channels, blocks, size, batch = (4, 2, 8, 2) if small else (32, 8, 32, 16)
    model = ResNet(channels, blocks).to(device)

    def make(count: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        generator = torch.Generator().manual_seed(count)
        images = torch.randn(count, 3, size, size, generator=generator).to(device)
        return (images, torch.randint(10, (count,), generator=generator).to(device)), {}

    description = (
        f"ResNet stack: stem, {blocks} residual conv-BN-ReLU blocks of {channels} channels, {size}x{size} images"
    )
    return Case("resnet", description, model, ResidualConv, make, batch, _identity)


CASES: dict[str, Callable[[torch.device, bool], Case]] = {"gpt": gpt, "llama": llama, "resnet": resnet}


# --- the methods ----------------------------------------------------------------------------------


def _blocks(model: nn.Module, block: type[nn.Module]) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, block)]


def _per_block(
    model: nn.Module, block: type[nn.Module], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Run each block's forward through `wrap(forward)` (an instance attribute, as a user patches it)."""
    for module in _blocks(model, block):
        module.forward = wrap(module.forward)  # type: ignore[method-assign]


@dataclasses.dataclass
class Row:
    """One method at one setting: the callable stepped, and what was measured of it."""

    method: str
    model: Callable[..., Any]
    parameters: list[nn.Parameter]
    target: int | None = None
    fit: remat.Fit | None = None
    measured: dict[str, Any] = dataclasses.field(default_factory=dict)


def _peer_rows(case: Case) -> list[Row]:
    rows = []

    def add(name: str, prepare: Callable[[nn.Module], Any]) -> None:
        model = copy.deepcopy(case.model)
        prepare(model)
        rows.append(Row(name, model, list(model.parameters())))

    add("eager", lambda model: None)
    add("checkpoint", lambda model: _per_block(model, case.block, peers.checkpointed))
    add("sac", lambda model: _per_block(model, case.block, peers.selective))
    if getattr(case.block, "supports_torch_remat", False) and peers.has_torch_remat():
        add("torch_remat", lambda model: _per_block(model, case.block, lambda f: peers.torch_remat_regions(f, "block")))
    uniform = {
        "remat save_nothing": policies.save_nothing,
        "remat dots_saveable": policies.dots_saveable,
        **{f"remat budget({f})": policies.budget(fraction=f) for f in FRACTIONS},
        "remat save_everything": policies.save_everything,
    }
    for name, policy in uniform.items():
        add(name, lambda model, policy=policy: remat.checkpoint_modules(model, case.block, policy=policy))
    return rows


def _whole(case: Case, target: int) -> Row:
    """`remat.checkpoint` of the model and its loss, asked for a peak of `target` bytes."""
    model = copy.deepcopy(case.model)

    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        return case.loss_of(model, args, kwargs)

    policy = policies.budget(peak_bytes=target)
    whole = _WholeModel(step, policy)
    return Row("remat whole-model budget", whole, list(model.parameters()), target)


class _WholeModel:
    """The checkpointed step, called as the model is (its output is already the loss)."""

    def __init__(self, step: Callable[..., torch.Tensor], policy: Any):
        self.step, self.policy = step, policy
        self.checkpointed = remat.checkpoint(step, policy=policy)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.checkpointed(*args, **kwargs)

    def replay_flops(self, args: Sequence[Any], kwargs: dict[str, Any]) -> float:
        return float(remat.report(self.step, *args, policy=self.policy, **kwargs).recompute_flops)


def _fitted(case: Case, target: int, args: Sequence[Any], kwargs: dict[str, Any]) -> Row:
    model = copy.deepcopy(case.model)
    plan = remat.fit(model, case.block, *args, kwargs=kwargs, peak_bytes=target, loss=case.loss)
    return Row("remat.fit", model, list(model.parameters()), target, plan)


# --- measuring ------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss(case: Case, row: Row, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    output = row.model(*args, **kwargs)
    return output if isinstance(row.model, _WholeModel) else case.loss(output)


def _step(case: Case, row: Row, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    for p in row.parameters:
        p.grad = None
    _loss(case, row, args, kwargs).backward()


def measure_peak(case: Case, row: Row, args: Sequence[Any], kwargs: dict[str, Any], device: torch.device) -> int:
    """The step's peak above what was live before it (no gradients at its start), after an untracked
    step that traces and plans."""
    _step(case, row, args, kwargs)
    for p in row.parameters:
        p.grad = None
    if device.type == "cuda":
        _synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _loss(case, row, args, kwargs).backward()
        _synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    tensors = [t for t in optree.tree_leaves((args, kwargs), none_is_leaf=False) if isinstance(t, torch.Tensor)]
    tracker = MemTracker()
    tracker.track_external(*row.parameters, *tensors)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[device]["Total"]
        _loss(case, row, args, kwargs).backward()
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"] - before)


def _grads_difference(row: Row, eager: Row) -> float:
    differences = [
        float((a.grad - b.grad).abs().max())  # type: ignore[operator]
        for a, b in zip(row.parameters, eager.parameters, strict=True)
        if a.grad is not None and b.grad is not None
    ]
    return max(differences, default=0.0)


def time_rows(
    case: Case, rows: Sequence[Row], args: Sequence[Any], kwargs: dict[str, Any], device: torch.device, repeats: int
) -> None:
    """Median and spread of the step time of each row, interleaved in a new order each round."""
    times: dict[int, list[float]] = {id(row): [] for row in rows}
    order, shuffle = list(rows), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for row in order:
            _synchronize(device)
            started = time.perf_counter()
            _step(case, row, args, kwargs)
            _synchronize(device)
            times[id(row)].append(time.perf_counter() - started)
    for row in rows:
        samples = sorted(times[id(row)])
        median = statistics.median(samples)
        quartiles = statistics.quantiles(samples, n=4) if len(samples) > 1 else [median, median, median]
        row.measured.update(times_s=samples, step_s=median, spread=(quartiles[2] - quartiles[0]) / median)


def _targets(low: int, high: int, count: int) -> list[int]:
    """`count` targets from `low` to `high`, evenly spread."""
    if count == 1:
        return [high]
    return [round(low + (high - low) * k / (count - 1)) for k in range(count)]


def _record(row: Row) -> dict[str, Any]:
    record: dict[str, Any] = {"method": row.method, "target_bytes": row.target, **row.measured}
    if row.fit is not None:
        record.update(
            predicted_peak_bytes=row.fit.predicted_peak,
            replay_flops=row.fit.replay_cost,  # fit's default cost model counts FLOPs
            plan_s=row.fit.seconds,
            labels=[block.label for block in row.fit.blocks],
        )
    return record


def run_case(
    case: Case, device: torch.device, targets: int, repeats: int, log: Callable[[str], None]
) -> dict[str, Any]:
    args, kwargs = case.batch(case.batch_size)
    rows = _peer_rows(case)
    for row in rows:
        row.measured["peak_bytes"] = measure_peak(case, row, args, kwargs, device)
        log(f"  {row.method}: peak {row.measured['peak_bytes'] / MIB:.1f} MiB")
    eager, checkpointed = rows[0], rows[1]
    low, high = checkpointed.measured["peak_bytes"], eager.measured["peak_bytes"]
    refused: list[dict[str, Any]] = []
    for target in _targets(low, high, targets):
        for make in (_fitted, lambda case, target, args, kwargs: _whole(case, target)):
            try:
                row = make(case, target, args, kwargs)
                row.measured["peak_bytes"] = measure_peak(case, row, args, kwargs, device)
            except ValueError as error:  # no plan fits this target
                name = "remat.fit" if make is _fitted else "remat whole-model budget"
                refused.append({"method": name, "target_bytes": target, "refused": str(error).splitlines()[0]})
                log(f"  {name} at {target / MIB:.1f} MiB: refused")
                continue
            if isinstance(row.model, _WholeModel):
                row.measured["replay_flops"] = row.model.replay_flops(args, kwargs)
            rows.append(row)
            log(f"  {row.method} at {target / MIB:.1f} MiB: peak {row.measured['peak_bytes'] / MIB:.1f} MiB")
    for row in rows:  # the gradients of the last measured step, against eager's
        row.measured["max_grad_difference"] = _grads_difference(row, eager)
    time_rows(case, rows, args, kwargs, device, repeats)
    return {
        "name": case.name,
        "description": f"{case.description}, batch {case.batch_size}",
        "rows": [_record(row) for row in rows] + refused,
    }


def largest_batch(
    case: Case, device: torch.device, repeats: int, batches: Sequence[int], log: Callable[[str], None]
) -> dict[str, Any]:
    """Within eager's peak at the first of `batches`: each method's best samples per second over the
    batch sizes whose measured peak fits."""
    first_args, first_kwargs = case.batch(batches[0])
    compared = ("eager", "checkpoint", "sac", "torch_remat", "remat dots_saveable")
    rows = [row for row in _peer_rows(case) if row.method in compared]
    memory = measure_peak(case, rows[0], first_args, first_kwargs, device)  # eager's
    rows.append(_fitted(case, memory, first_args, first_kwargs))
    rows.append(_whole(case, memory))
    results = []
    for row in rows:
        result = best_within(case, row, memory, batches, device, repeats)
        log(f"  {row.method}: {result}")
        results.append(result)
    return {"memory_bytes": memory, "batches": list(batches), "rows": results}


def best_within(
    case: Case, row: Row, memory: int, batches: Sequence[int], device: torch.device, repeats: int
) -> dict[str, Any]:
    """`row`'s largest batch of `batches` (in increasing order) whose measured peak is within `memory`, and
    its best samples per second among those."""
    best: dict[str, Any] | None = None
    largest = None
    for size in batches:
        args, kwargs = case.batch(size)
        try:
            peak = measure_peak(case, row, args, kwargs, device)
        except ValueError:  # a planner that finds no plan within the memory at this batch
            break
        if peak > memory:
            break
        largest = size
        time_rows(case, [row], args, kwargs, device, repeats)
        throughput = size / row.measured["step_s"]
        if best is None or throughput > best["samples_per_s"]:
            best = {"batch": size, "peak_bytes": peak, "samples_per_s": throughput, "spread": row.measured["spread"]}
    return {"method": row.method, "largest_batch": largest, **(best or {"batch": None})}


# --- under torch.compile --------------------------------------------------------------------------

BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)


def compiled_front(
    case: Case, device: torch.device, targets: int, repeats: int, backend: str, log: Callable[[str], None]
) -> dict[str, Any]:
    """`torch.compile(model)` with the partitioner's `activation_memory_budget` at each of `BUDGETS`,
    against `torch.compile` of the model fitted (eagerly) to targets spread between the lowest and the
    highest of those peaks. Each compiled row is measured and timed right after it compiles, before the
    next (Dynamo's caches are reset between them, so rows are not interleaved)."""
    import torch._dynamo
    import torch._functorch.config

    args, kwargs = case.batch(case.batch_size)
    reference = copy.deepcopy(case.model)
    eager = Row("eager", reference, list(reference.parameters()))
    _step(case, eager, args, kwargs)
    rows: list[Row] = []

    def measure(row: Row, model: nn.Module, budget: float | None) -> None:
        torch._dynamo.reset()
        row.model = torch.compile(model, backend=backend)
        patch = {} if budget is None else {"activation_memory_budget": budget}
        started = time.perf_counter()
        with torch._functorch.config.patch(**patch):
            row.measured["peak_bytes"] = measure_peak(case, row, args, kwargs, device)  # compiles first
            row.measured["compile_s"] = time.perf_counter() - started
            row.measured["max_grad_difference"] = _grads_difference(row, eager)
            time_rows(case, [row], args, kwargs, device, repeats)
        rows.append(row)
        log(f"  {row.method}: peak {row.measured['peak_bytes'] / MIB:.1f} MiB, {row.measured['step_s'] * 1e3:.2f} ms")

    for budget in BUDGETS:
        model = copy.deepcopy(case.model)
        measure(Row(f"torch.compile, budget {budget}", model, list(model.parameters())), model, budget)
    peaks = [row.measured["peak_bytes"] for row in rows]
    for target in _targets(min(peaks), max(peaks), targets):
        try:
            row = _fitted(case, target, args, kwargs)
        except ValueError as error:
            log(f"  remat.fit at {target / MIB:.1f} MiB: refused ({str(error).splitlines()[0]})")
            continue
        row.method = "remat.fit, compiled"
        measure(row, row.model, None)
    torch._dynamo.reset()
    return {
        "name": case.name,
        "description": f"{case.description}, batch {case.batch_size}; torch.compile(backend={backend!r})",
        "rows": [_record(row) for row in rows],
    }


# --- results --------------------------------------------------------------------------------------


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.compiled:
        torch.manual_seed(0)
        case = gpt(device, args.small)
        log(f"[{time.perf_counter() - started:6.0f} s] {case.name} under torch.compile({args.backend!r})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            front = compiled_front(case, device, args.targets, args.repeats, args.backend, log)
        return {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **environment(device, args.heap),
            "total_s": time.perf_counter() - started,
            "compiled": front,
        }
    cases = []
    for name in args.models:
        torch.manual_seed(0)
        case = CASES[name](device, args.small)
        log(f"[{time.perf_counter() - started:6.0f} s] {name}: {case.description}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' and checkpoint's advice, once per call
            cases.append(run_case(case, device, args.targets, args.repeats, log))
    torch.manual_seed(0)
    case = gpt(device, args.small)
    log(f"[{time.perf_counter() - started:6.0f} s] largest batch within eager's peak at batch {args.batches[0]}")
    batch = largest_batch(case, device, args.repeats, args.batches, log)
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **environment(device, args.heap),
        "total_s": time.perf_counter() - started,
        "cases": cases,
        "largest_batch": batch,
    }


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:.2f}"


def _gflop(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e9:.2f}"


def _fastest_peer_within(rows: Sequence[dict[str, Any]], target: int) -> dict[str, Any] | None:
    """The fastest row other than remat.fit whose measured peak is within `target`."""
    fitting = [r for r in rows if "step_s" in r and r["method"] != "remat.fit" and r["peak_bytes"] <= target]
    return min(fitting, key=lambda r: r["step_s"], default=None)


def compiled_markdown(results: dict[str, Any]) -> str:
    front = results["compiled"]
    rows = front["rows"]
    lines = [
        f"# remat.fit under torch.compile on `{results['device']}`",
        "",
        f"{describe(results)}; median of {results['config']['repeats']} steps per row, each row timed right after it compiled. "
        f"{front['description']}. `vs fastest budget`: the fitted model's step time over the fastest "
        "`activation_memory_budget` row whose measured peak is within the same target.",
        "",
        "| method | target (MiB) | measured peak (MiB) | predicted, eager (MiB) | step (ms) | spread | vs fastest budget | compile (s) | max grad diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    budgets = [r for r in rows if r["method"].startswith("torch.compile")]
    for r in rows:
        versus = "—"
        if r["target_bytes"] is not None:
            within = [b for b in budgets if b["peak_bytes"] <= r["target_bytes"]]
            fastest = min(within, key=lambda b: b["step_s"], default=None)
            versus = (
                "none fits"
                if fastest is None
                else f"{r['step_s'] / fastest['step_s']:.3f}x ({fastest['method'].split(', ')[1]})"
            )
        lines.append(
            f"| {r['method']} | {_mib(r['target_bytes'])} | {_mib(r['peak_bytes'])} | "
            f"{_mib(r.get('predicted_peak_bytes'))} | {r['step_s'] * 1e3:.2f} | {r['spread']:.1%} | {versus} | "
            f"{r['compile_s']:.1f} | {r['max_grad_difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, Any]) -> str:
    if "compiled" in results:
        return compiled_markdown(results)
    lines = [
        f"# remat.fit: whole training steps on `{results['device']}`",
        "",
        f"{describe(results)}; median of {results['config']['repeats']} interleaved steps. Peak: measured over forward, loss and backward, parameter gradients included, above "
        "what was live before. Spread: interquartile range over the median. `vs fastest peer`: fit's step time "
        "over the fastest other row whose measured peak is within the same target.",
    ]
    for case in results["cases"]:
        rows = case["rows"]
        eager = next(r for r in rows if r["method"] == "eager")
        lines += [
            "",
            f"## {case['name']}",
            "",
            case["description"] + ".",
            "",
            "| method | target (MiB) | measured peak (MiB) | predicted (MiB) | replay GFLOP | step (ms) | vs eager | spread | vs fastest peer | max grad diff |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if "refused" in r:
                lines.append(f"| {r['method']} | {_mib(r['target_bytes'])} | refused: {r['refused']} | | | | | | | |")
                continue
            versus = "—"
            if r["method"] == "remat.fit":
                peer = _fastest_peer_within(rows, r["target_bytes"])
                versus = "no peer fits" if peer is None else f"{r['step_s'] / peer['step_s']:.3f}x {peer['method']}"
            lines.append(
                f"| {r['method']} | {_mib(r['target_bytes'])} | {_mib(r['peak_bytes'])} | "
                f"{_mib(r.get('predicted_peak_bytes'))} | {_gflop(r.get('replay_flops'))} | {r['step_s'] * 1e3:.1f} | {r['step_s'] / eager['step_s']:.2f}x | "
                f"{r['spread']:.1%} | {versus} | {r['max_grad_difference']:.1e} |"
            )
    batch = results["largest_batch"]
    lines += [
        "",
        f"## Largest batch within {_mib(batch['memory_bytes'])} MiB (eager's peak at batch {batch['batches'][0]}, GPT model)",
        "",
        f"Batch sizes tried: {', '.join(map(str, batch['batches']))}; remat.fit and the whole-model budget are given "
        "the memory as their target and plan again at each batch.",
        "",
        "| method | largest batch that fits | fastest batch | its measured peak (MiB) | samples/s | spread |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in batch["rows"]:
        if r["batch"] is None:
            lines.append(f"| {r['method']} | none fits | | | | |")
            continue
        lines.append(
            f"| {r['method']} | {r['largest_batch']} | {r['batch']} | {_mib(r['peak_bytes'])} | "
            f"{r['samples_per_s']:.2f} | {r['spread']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Step time against measured peak, a panel per model: every method's point, fit's curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if "cases" not in results:
        return False
    cases = results["cases"]
    figure, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for axis, case in zip(axes[0], cases, strict=True):
        rows = [r for r in case["rows"] if "step_s" in r]
        eager = next(r for r in rows if r["method"] == "eager")
        for method in dict.fromkeys(r["method"] for r in rows):
            points = sorted(
                (r["peak_bytes"] / MIB, r["step_s"] / eager["step_s"]) for r in rows if r["method"] == method
            )
            xs, ys = zip(*points, strict=True)
            if method in ("remat.fit", "remat whole-model budget"):
                axis.plot(
                    xs,
                    ys,
                    "o-" if method == "remat.fit" else "s--",
                    label=method,
                    linewidth=2 if method == "remat.fit" else 1,
                )
            else:
                axis.scatter(xs, ys, label=method, marker="x" if method.startswith("remat") else "^")
        axis.set_title(case["name"])
        axis.set_xlabel("measured peak (MiB)")
        axis.set_ylabel("step time / eager's")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--targets", type=int, default=5, help="targets from checkpoint's peak to eager's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--small", action="store_true", help="tiny models: checks that the benchmark runs")
    parser.add_argument("--keep-freed-memory", action="store_true", help="CPU: glibc keeps freed memory")
    parser.add_argument(
        "--compiled", action="store_true", help="the GPT model under torch.compile: fit against the budget's front"
    )
    parser.add_argument("--backend", default="inductor", help="with --compiled: torch.compile's backend")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/fit-<device>.json")
    args = parser.parse_args(argv)
    args.heap = keep_freed_memory() if args.keep_freed_memory else DEFAULT
    name = "fit-compiled" if args.compiled else "fit"
    args.out = args.out or RESULTS / f"{name}-{args.device}.json"
    results = run(args, log=lambda line: print(line, flush=True))
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    plot(results, args.out.with_suffix(".png"))
    print(markdown(results))


if __name__ == "__main__":
    main()
