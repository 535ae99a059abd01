"""Peak memory of a gradient-penalty step (a second derivative by `create_graph=True`), on the CPU.

    python -m benchmarks second-order [--blocks 4] [--out benchmarks/results/second-order-cpu.json]

A stack of `tests/models.GPT2Block`s (d=32, batch 8 x 128 tokens, float32, attention spelled out: the CPU
`scaled_dot_product_attention` kernel has no second derivative, in eager either) run as eager, under
`torch.utils.checkpoint` (non-reentrant, which supports a second derivative) and under
`remat.checkpoint` (default policy: recompute everything), each block checkpointed; the step takes the
gradient of the loss with respect to the input with `create_graph=True`, then `.backward()` of the
penalty `loss + gradient.square().sum()`, as WGAN-GP and R1 do. Where the gradient will be
differentiated, remat's backward is autograd's over the recomputed forward (docs/torch-func.md, "A
backward that will be differentiated"), which holds the recomputed forward's graph through the second
backward, as eager holds its own.

Memory is read off the CPU allocator's events (`torch.profiler` with `profile_memory=True`): the peak of
the bytes allocated during the step, above what was allocated before it, and what is left allocated
after forward (before the first `autograd.grad`). Nothing asserts on it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch.profiler import ProfilerActivity, profile

HERE = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))

import models  # noqa: E402  (the test models)

import remat  # noqa: E402

Block = Callable[[torch.Tensor], torch.Tensor]


def _wrapped(blocks: list[torch.nn.Module], method: str) -> list[Block]:
    if method == "eager":
        return list(blocks)
    if method == "torch.utils.checkpoint":
        return [
            lambda x, b=b: torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)  # type: ignore[misc]
            for b in blocks
        ]
    return [remat.checkpoint(b) for b in blocks]


def _peaks(step: Callable[[], None]) -> tuple[int, int]:
    """(the peak bytes above the start, the bytes held at the marker) of `step`'s CPU allocations."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),  # type: ignore[union-attr]
        key=lambda e: e.start_ns(),
    )
    marker = [e.start_ns() for e in prof.profiler.kineto_results.events() if e.name() == "after forward"]  # type: ignore[union-attr]
    total, peak, after_forward = 0, 0, 0
    for event in events:
        if marker and event.start_ns() <= marker[0]:
            after_forward = total + event.nbytes()
        total += event.nbytes()
        peak = max(peak, total)
    return peak, after_forward


def measure(method: str, n_blocks: int) -> dict[str, int]:
    torch.manual_seed(0)
    blocks = [models.GPT2Block(attention="softmax", seed=i) for i in range(n_blocks)]
    run = _wrapped(blocks, method)
    x = models.gpt2_input(batch=8, seq=128).requires_grad_()

    def step() -> None:
        h = x
        for block in run:
            h = block(h)
        loss = h.square().mean()
        with torch.profiler.record_function("after forward"):
            pass
        (gradient,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + gradient.square().sum()).backward()

    step()  # warm-up: traces and caches
    for block in blocks:
        block.zero_grad(set_to_none=True)
    x.grad = None
    peak, after_forward = _peaks(step)
    return {"peak_bytes": peak, "after_forward_bytes": after_forward}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks second-order", description=__doc__)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--out", default=str(HERE / "benchmarks" / "results" / "second-order-cpu.json"))
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {m: measure(m, options.blocks) for m in ("eager", "torch.utils.checkpoint", "remat")}
    eager = results["eager"]
    for method, found in results.items():
        print(
            f"{method:<24} peak {found['peak_bytes'] / 2**20:7.2f} MiB ({found['peak_bytes'] / eager['peak_bytes']:.2f}"
            f" of eager), after forward {found['after_forward_bytes'] / 2**20:7.2f} MiB"
        )
    report = {"torch": torch.__version__, "blocks": options.blocks, "results": results}
    pathlib.Path(options.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
