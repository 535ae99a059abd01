"""FP8 (e4m3) kept values: one scale per tensor against one per row, measured (NOTE [values kept lossy]).

The relative error ||x' - x|| / ||x|| of a value stored in FP8 and read back, over the whole value and for
the median token (row), for activations shaped as a transformer's (4096 tokens x 1024 features): plain
Gaussian, with 8 outlier tokens (rows 10^2 to 10^4 times larger, as attention sinks make), and with 8
outlier features (columns 100 times larger). Run: `python -m benchmarks fp8-scales` (results in
benchmarks/results/fp8_scales.txt).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

import remat
from remat import policies

E4M3_MAX = 448.0


def per_tensor(x: torch.Tensor) -> torch.Tensor:
    """One scale for the whole value (the alternative remat does not take)."""
    scale = E4M3_MAX / x.abs().amax()
    return (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale


def per_row(x: torch.Tensor) -> torch.Tensor:
    """What remat's FP8 storage gives back of `x`: `(x * 1) @ w`'s weight gradient is x^T @ grad, which reads
    the kept product (an input would be kept by reference); with the identity as grad, it is exactly the kept
    value, transposed."""
    w = torch.zeros(x.shape[1], x.shape[0], requires_grad=True)
    step = remat.checkpoint(lambda x, w: (x * 1.0) @ w, policy=policies.compress(policies.save_everything, "fp8"))
    (grad,) = torch.autograd.grad(step(x, w), w, torch.eye(x.shape[0]))
    return grad.t()


def activations(kind: str, scale: float, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 1024, generator=generator)
    if kind == "outlier tokens":
        x[torch.randperm(4096, generator=generator)[:8]] *= scale
    elif kind == "outlier features":
        x[:, torch.randperm(1024, generator=generator)[:8]] *= scale
    return x


def table() -> list[str]:
    lines = [f"{'activations':<26} {'per tensor':>22} {'per row':>22}"]
    lines.append(f"{'':<26} {'whole':>10} {'median row':>11} {'whole':>10} {'median row':>11}")
    cases = [("gaussian", 1.0), *(("outlier tokens", s) for s in (1e2, 1e3, 1e4)), ("outlier features", 1e2)]
    for kind, scale in cases:
        x = activations(kind, scale)
        cells = []
        for f in (per_tensor, per_row):
            back = f(x)
            whole = ((back - x).norm() / x.norm()).item()
            rows = ((back - x).norm(dim=1) / x.norm(dim=1)).median().item()
            cells.append(f"{whole:>10.4f} {rows:>11.4f}")
        label = kind if scale == 1.0 else f"{kind} x{scale:g}"
        lines.append(f"{label:<26} {cells[0]} {cells[1]}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks fp8-scales", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    options = parser.parse_args(argv)
    lines = table()
    print("\n".join(lines))
    if options.out is not None:
        options.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
