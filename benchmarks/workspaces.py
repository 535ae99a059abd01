"""What CUDA kernels allocate beyond their outputs, per kernel family, on the GPU this runs on.

    python -m benchmarks.workspaces [--device cuda] [--out benchmarks/results/workspaces-cuda.json]
    python -m benchmarks.workspaces --dry-run     # the same calls at a toy size on the CPU

`remat.fit` predicts the bytes of tensors; `torch.cuda.max_memory_allocated` also counts what kernels
allocate for themselves through the caching allocator. Two kinds, measured apart for each family (cuBLAS
and cuBLASLt matmuls in float32 and bfloat16, cuDNN convolution forward and backward, SDPA's flash and
memory-efficient kernels forward and backward):

- **held**: allocated by the family's first call on a new stream and kept (cuBLAS keeps a workspace per
  handle and stream): measured as what stays allocated after a first call on a fresh stream, less its
  outputs. Memory held before a step is outside the step's peak, which `fit` and the benchmarks count
  above what was live before; a process's first step allocates it.
- **transient**: allocated during a call and freed before it returns (cuDNN's convolution workspace):
  the call's peak above what is allocated after it, after a warm-up call. This is what a step's peak
  sees and what the prediction leaves out (docs/fit.md).

The figures depend on the GPU, the torch and CUDA libraries' releases and the allocator settings, all
recorded beside them. The dry run checks the calls and the file on the CPU, where kernels allocate
nothing of their own (its figures are None).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .harness import environment

RESULTS = Path(__file__).parent / "results"


def _matmul(dtype: torch.dtype, bias: bool) -> Callable[[torch.device, int], Callable[[], Any]]:
    def make(device: torch.device, size: int) -> Callable[[], Any]:
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        c = torch.randn(size, device=device, dtype=dtype)
        return (lambda: torch.addmm(c, a, b)) if bias else (lambda: a @ b)

    return make


def _batched_matmul(device: torch.device, size: int) -> Callable[[], Any]:
    a, b = (torch.randn(8, size, size // 2, device=device, dtype=torch.bfloat16) for _ in range(2))
    return lambda: torch.bmm(a, b.transpose(1, 2))


def _convolution(backward: bool) -> Callable[[torch.device, int], Callable[[], Any]]:
    def make(device: torch.device, size: int) -> Callable[[], Any]:
        x = torch.randn(16, 64, size // 16, size // 16, device=device, requires_grad=backward)
        weight = torch.randn(64, 64, 3, 3, device=device, requires_grad=backward)
        if not backward:
            return lambda: F.conv2d(x, weight, padding=1)
        y = F.conv2d(x, weight, padding=1)
        grad = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, (x, weight), grad, retain_graph=True)

    return make


def _attention(backend: SDPBackend, backward: bool) -> Callable[[torch.device, int], Callable[[], Any]]:
    def make(device: torch.device, size: int) -> Callable[[], Any]:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        q, k, v = (torch.randn(2, 16, size, 64, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))

        def forward() -> torch.Tensor:
            with sdpa_kernel(backend if device.type == "cuda" else SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        if not backward:
            return forward
        out = forward()
        grad = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return make


FAMILIES: dict[str, Callable[[torch.device, int], Callable[[], Any]]] = {
    "cublas mm float32": _matmul(torch.float32, bias=False),
    "cublas mm bfloat16": _matmul(torch.bfloat16, bias=False),
    "cublaslt addmm bfloat16": _matmul(torch.bfloat16, bias=True),
    "cublas bmm bfloat16": _batched_matmul,
    "cudnn conv2d forward": _convolution(backward=False),
    "cudnn conv2d backward": _convolution(backward=True),
    "sdpa flash forward": _attention(SDPBackend.FLASH_ATTENTION, backward=False),
    "sdpa flash backward": _attention(SDPBackend.FLASH_ATTENTION, backward=True),
    "sdpa efficient forward": _attention(SDPBackend.EFFICIENT_ATTENTION, backward=False),
    "sdpa efficient backward": _attention(SDPBackend.EFFICIENT_ATTENTION, backward=True),
}


def measure(make: Callable[[torch.device, int], Callable[[], Any]], device: torch.device, size: int) -> dict[str, Any]:
    """The held and transient bytes of one family's call (None on a CPU, where they are not counted)."""
    on_cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if on_cuda else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        call = make(device, size)
        if on_cuda:
            torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device) if on_cuda else 0
        outputs = call()  # the first on this stream: what it keeps besides its outputs is held
        if not on_cuda:
            return {"held_bytes": None, "transient_bytes": None}
        torch.cuda.synchronize(device)
        output_bytes = sum(t.untyped_storage().nbytes() for t in _tensors(outputs))
        held = torch.cuda.memory_allocated(device) - before - output_bytes
        del outputs
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        settled = torch.cuda.memory_allocated(device)
        outputs = call()
        torch.cuda.synchronize(device)
        after = torch.cuda.memory_allocated(device)
        transient = torch.cuda.max_memory_allocated(device) - max(after, settled)
        del outputs
    return {"held_bytes": held, "transient_bytes": transient}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=4096, help="matrix side, sequence length, 16x the image side")
    parser.add_argument("--dry-run", action="store_true", help="the same calls at a toy size on the CPU")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else args.device)
    size = 64 if args.dry_run else args.size
    families = {}
    for name, make in FAMILIES.items():
        try:
            families[name] = measure(make, device, size)
        except RuntimeError as error:  # a kernel this GPU lacks (flash before sm80): say so, go on
            families[name] = {"error": str(error).splitlines()[0]}
        print(f"{name}: {families[name]}", flush=True)
    env = environment(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env |= {
            "compute_capability": f"{major}.{minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "allocator": torch.cuda.get_allocator_backend(),
        }
    out = args.out or RESULTS / f"workspaces-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "size": size, "families": families}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
