"""Give remat a memory budget and let it choose what to keep: `policies.budget` and `remat.pareto`.

For a GPT-2-style block, `remat.pareto(block, x)` sweeps byte budgets from what
`save_nothing` keeps to what `save_everything` keeps and gives, for each, the
fewest FLOPs backward must replay (the exact planner's optimum), with the
built-in policies beside the curve. The script prints the curve, saves its plot
as a PNG, then checkpoints the block with `policies.budget(fraction=0.3)` (keep at
most 30% of what `save_everything` keeps), prints what it keeps against the
budget, and checks that it stays within it and that the gradients equal those of
the block without checkpointing (float64). Needs highspy and matplotlib.

Run: python examples/budget.py [--out DIR]
"""

import argparse
import os
import tempfile

import matplotlib

matplotlib.use("Agg")  # write files only; no display needed

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import policies


class Block(nn.Module):
    """A GPT-2-style transformer block: pre-layernorm attention and GELU MLP."""

    def __init__(self, dim: int = 64, heads: int = 4):
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


def gradients(fn, block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x.grad = None
    fn(x).square().mean().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=tempfile.gettempdir(), help="folder for pareto.png (default: temp dir)")
    parser.add_argument("--fraction", type=float, default=0.3, help="budget, of save_everything's bytes (0.3)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    block = Block().double()
    x = torch.randn(2, 32, 64, dtype=torch.float64, requires_grad=True)

    curve = remat.pareto(block, x)
    print(curve)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pareto.png")
    curve.plot().savefig(path, dpi=100)
    print(f"plot: {path}\n")

    policy = policies.budget(fraction=args.fraction)
    everything = remat.report(block, x, policy=policies.save_everything).saved_bytes
    limit = int(args.fraction * everything)
    report = remat.report(block, x, policy=policy)
    print(
        f"{policy!r}: keeps {report.saved_bytes:,} of a {limit:,}-byte budget ({args.fraction:.0%} of "
        f"save_everything's {everything:,}), replays {len(report.replayed_calls)} calls, "
        f"{report.recompute_flops:,} FLOPs ({report.replayed_fraction:.0%} of the forward)"
    )
    print("kept:", ", ".join(f"#{row.call.index} {row.call.name}" for row in report.rows if row.saved))

    expected = gradients(block, block, x)
    got = gradients(remat.checkpoint(block, policy=policy), block, x)
    error = max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))
    assert report.saved_bytes <= limit, f"over budget: {report.saved_bytes:,} > {limit:,} bytes"
    assert error < 1e-10, f"gradients differ from the block's without checkpointing by {error:.1e}"
    print(f"OK: within budget; gradients vs. no checkpoint: max error {error:.1e}")


if __name__ == "__main__":
    main()
