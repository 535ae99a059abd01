"""remat quickstart: checkpoint a small transformer block under three policies.

For each policy it prints the activation bytes kept between forward and
backward, the calls replayed in backward, and checks that the gradients equal
those of the block without checkpointing.

Run: python examples/quickstart.py
"""

import math

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


def main() -> None:
    torch.manual_seed(0)
    block = Block().double()
    x = torch.randn(2, 16, 64, dtype=torch.float64, requires_grad=True)
    expected = gradients(block, block, x)

    print(remat.trace(block, x))
    print()
    for name, policy in [
        ("save_nothing", policies.save_nothing),
        ("save_ops(mm, addmm)", policies.save_ops(torch.ops.aten.mm, torch.ops.aten.addmm)),
        ("save_everything", policies.save_everything),
    ]:
        checkpointed = remat.checkpoint(block, policy=policy)
        got = gradients(checkpointed, block, x)
        error = max((a - b).abs().max().item() for a, b in zip(got, expected, strict=False))
        report = remat.report(block, x, policy=policy)
        status = "OK" if error < 1e-10 else "MISMATCH"
        print(
            f"{name:22} kept {report.saved_bytes:>7,} bytes, replays {len(report.replayed_calls):2} calls "
            f"({report.recompute_flops / 1e6:.2f} MFLOP); gradients vs. no checkpoint: max error {error:.1e} {status}"
        )
        if status != "OK":
            raise SystemExit(f"gradient mismatch under {name}")
    print()
    print(remat.report(block, x, policy=policies.save_ops(torch.ops.aten.addmm)))
    assert math.isfinite(error)


if __name__ == "__main__":
    main()
