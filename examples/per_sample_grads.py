"""Per-sample gradient norms of a checkpointed transformer, with torch.func.

A small GPT-2-style language model (two pre-layernorm blocks) is checkpointed
with `remat.checkpoint(model, policy=...)`. The result is a module that shares
the model's parameters under the same names, so `torch.func.functional_call`
takes the same parameter dictionary for both, and per-sample gradients are
`vmap(grad(loss), in_dims=(None, 0, 0))`. The script checks that the per-sample
gradient norms equal those of the model without checkpointing (it exits
non-zero if not), and prints them with the bytes `remat.report` says are kept.

Run: python examples/per_sample_grads.py
"""

import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import remat
from remat import policies

aten = torch.ops.aten


class Block(nn.Module):
    """A GPT-2-style block: pre-layernorm causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (length, dim), one sequence
        length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.reshape(length, self.heads, dim // self.heads).transpose(0, 1) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(0, 1).reshape(length, dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, a few blocks, a final layernorm and a tied output head."""

    def __init__(self, vocab: int = 64, length: int = 16, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (length,) -> logits: (length, vocab)
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        x = self.blocks(self.tokens(tokens) + self.positions(positions))
        return self.ln(x) @ self.tokens.weight.T


def per_sample_gradient_norms(model: nn.Module, params: dict, tokens: torch.Tensor, targets: torch.Tensor):
    """The norm of each sequence's gradient with respect to all parameters."""

    def loss(params: dict, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, params, (tokens,)), targets)

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, tokens, targets)  # {name: (batch, *shape)}
    return torch.cat([g.flatten(1) for g in grads.values()], dim=1).norm(dim=1)


def main() -> None:
    # torch 2.15 has no vmap rule for its CPU attention kernel: a correct but slow per-example loop,
    # with and without remat, which torch warns about.
    warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
    torch.manual_seed(0)
    model = TinyGPT()
    batch, length, vocab = 8, 16, 64
    tokens = torch.randint(vocab, (batch, length))
    targets = torch.randint(vocab, (batch, length))

    # Keep the matmul outputs; recompute layernorms, GELUs, attention and the rest in backward.
    policy = policies.save_ops(aten.mm, aten.addmm)
    checkpointed = remat.checkpoint(model, policy=policy)
    params = {name: p.detach() for name, p in model.named_parameters()}
    assert list(params) == [name for name, _ in checkpointed.named_parameters()]  # the same names

    expected = per_sample_gradient_norms(model, params, tokens, targets)
    got = per_sample_gradient_norms(checkpointed, params, tokens, targets)

    # Under vmap, remat traces the model at the per-example shape: report at that shape too.
    kept = remat.report(checkpointed, tokens[0]).saved_bytes
    everything = remat.report(model, tokens[0], policy=policies.save_everything).saved_bytes
    print("per-sample gradient norms (remat):   ", " ".join(f"{n:.4f}" for n in got.tolist()))
    print("per-sample gradient norms (unwrapped):", " ".join(f"{n:.4f}" for n in expected.tolist()))
    print(f"remat.report: keeps {kept:,} activation bytes per sequence ({everything:,} under save_everything)")
    error = (got - expected).abs().max().item()
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-6):
        sys.exit(f"per-sample gradient norms differ from the unwrapped model's: max error {error:.1e}")
    print(f"per-sample gradient norms match the unwrapped model's (max error {error:.1e})")


if __name__ == "__main__":
    main()
