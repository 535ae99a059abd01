"""GPT-2-small block: bytes kept and fwd+bwd time of remat policies against eager, side by side.

Measures, in one process and interleaved:
- activation bytes kept between forward and backward (unique storages seen by
  `saved_tensors_hooks`, inputs and parameters excluded), and `remat.report`'s figure;
- fwd+bwd time as the median of interleaved repeats, and its ratio to eager;
- first-call trace time, and the per-call overhead of a cached call on a tiny function
  (against `torch.utils.checkpoint` on the same function).

Run: python -m benchmarks.block [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import remat
from remat import policies

aten = torch.ops.aten


class Block(nn.Module):
    """GPT-2 block: pre-layernorm causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, dim: int = 768, heads: int = 12):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.reshape(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def kept_bytes(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, exclude: list[torch.Tensor]) -> int:
    """Bytes of distinct storages autograd keeps for `fn(x)`, not counting `exclude`'s storages."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(storages.values())


def step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    fn(x).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--json", default=None, help="write the results to this file")
    options = parser.parse_args()

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(options.batch, options.length, 768, requires_grad=True)
    exclude = [x, *block.parameters(), *block.buffers()]

    start = time.perf_counter()
    first = remat.checkpoint(block)
    first(x)
    trace_seconds = time.perf_counter() - start

    methods: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "eager": block,
        "torch.utils.checkpoint": lambda x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False),
        "remat save_nothing": remat.checkpoint(block, policy=policies.save_nothing),
        "remat save_ops(mm)": remat.checkpoint(block, policy=policies.save_ops(aten.mm)),
        "remat save_ops(mm, addmm)": remat.checkpoint(block, policy=policies.save_ops(aten.mm, aten.addmm)),
        "remat save_everything": remat.checkpoint(block, policy=policies.save_everything),
    }
    kept = {name: kept_bytes(fn, x, exclude) for name, fn in methods.items()}
    reported = {
        name: remat.report(fn, x).saved_bytes
        for name, fn in methods.items()
        if isinstance(fn, (remat.Checkpointed, remat.CheckpointedModule))
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():
        step(fn, x)  # warm up (and trace)
    for _ in range(options.repeats):
        for name, fn in methods.items():  # interleaved, so that machine noise hits all alike
            block.zero_grad(set_to_none=True)
            x.grad = None
            start = time.perf_counter()
            step(fn, x)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}

    tiny = torch.randn(4, requires_grad=True)
    overhead = {
        "plain": lambda t: t.sin(),
        "remat.checkpoint": remat.checkpoint(lambda t: t.sin()),
        "torch.utils.checkpoint": lambda t: torch.utils.checkpoint.checkpoint(torch.sin, t, use_reentrant=False),
    }
    call_us: dict[str, list[float]] = {name: [] for name in overhead}
    for fn in overhead.values():
        fn(tiny)
    for _ in range(200):
        for name, fn in overhead.items():
            start = time.perf_counter()
            fn(tiny)
            call_us[name].append((time.perf_counter() - start) * 1e6)

    print(f"GPT-2-small block, B={options.batch} T={options.length} d=768 heads=12, float32, CPU")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"first-call trace (and partition) time: {trace_seconds:.3f} s")
    print()
    print(f"{'method':28} {'kept MiB':>9} {'report MiB':>11} {'fwd+bwd ms':>11} {'vs eager':>9}")
    for name in methods:
        report_mib = f"{reported[name] / 2**20:11.2f}" if name in reported else " " * 11
        print(
            f"{name:28} {kept[name] / 2**20:9.2f} {report_mib} {median[name] * 1e3:11.1f} "
            f"{median[name] / median['eager']:8.2f}x"
        )
    print()
    print("per-call time of a tiny function (4 floats, sin), forward only, median of 200:")
    for name, samples in call_us.items():
        print(f"  {name:24} {statistics.median(samples):8.1f} us")

    if options.json:
        result = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "shape": {"batch": options.batch, "length": options.length, "dim": 768, "heads": 12},
            "trace_seconds": trace_seconds,
            "kept_bytes": kept,
            "report_bytes": reported,
            "fwd_bwd_ms": {k: v * 1e3 for k, v in median.items()},
            "ratio_to_eager": {k: v / median["eager"] for k, v in median.items()},
            "tiny_call_us": {k: statistics.median(v) for k, v in call_us.items()},
        }
        with open(options.json, "w") as f:
            json.dump(result, f, indent=2)
    assert all(math.isfinite(v) for v in median.values())


if __name__ == "__main__":
    main()
