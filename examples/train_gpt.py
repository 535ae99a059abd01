"""Train a small character-level GPT with every block checkpointed by a per-call policy.

The corpus is generated here (sums such as ``37+5=42;``, from a seeded random
generator), so nothing is downloaded and the loss can fall: the digits after
``=`` are predictable from those before it. Each transformer block is
checkpointed in place with ``remat.checkpoint_modules(model, Block, policy=...)``
under a policy written as a plain function of ``remat.Call``: keep the attention
output and the MLP's first matmul, replay the rest (layernorms, the other
projections, GELU) in backward. The script prints the loss as it trains, then the
activation bytes one training step keeps with and without checkpointing, measured
with ``torch.autograd.graph.saved_tensors_hooks``, and checks that the loss fell
and that checkpointing keeps less.

Run: python examples/train_gpt.py [--steps 300]
"""

import argparse
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

import remat

aten = torch.ops.aten


def corpus(sums: int = 4000, seed: int = 0) -> str:
    """``a+b=c;`` for random a and b below 100: a text whose answers follow from its questions."""
    rng = random.Random(seed)
    return "".join(f"{a}+{b}={a + b};" for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(sums)))


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        q, k, v = (t.reshape(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attention.transpose(1, 2).reshape(batch, length, dim))


class MLP(nn.Module):
    """Two linear layers around a GELU."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A GPT-2-style block: pre-layernorm attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, heads), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, a stack of blocks, a final layernorm and a tied output head."""

    def __init__(self, vocab: int, length: int = 64, dim: int = 128, heads: int = 4, layers: int = 4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)  # small, as GPT-2 does: the output head shares them

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (batch, length) -> (batch, length, vocab)
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        x = self.blocks(self.tokens(tokens) + self.positions(positions))
        return self.ln(x) @ self.tokens.weight.T


def keep_attention_and_first_mlp_matmul(call: remat.Call) -> bool:
    """The policy: save what attention returns and the MLP's first matmul; replay everything else.

    Module paths are relative to the checkpointed block (``attn``, ``mlp.fc``).
    """
    is_attention = call.module == "attn" and "scaled_dot_product" in call.name
    return is_attention or (call.module == "mlp.fc" and call.op is aten.addmm.default)


def saved_activation_bytes(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward, parameters and inputs excluded."""
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()} | {tokens.untyped_storage().data_ptr()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(kept.values())


def progress(step: int, steps: int, loss: float, width: int = 30) -> str:
    done = width * step // steps
    return f"[{'#' * done}{'.' * (width - done)}] step {step:4}/{steps}  loss {loss:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # steadier than two threads on a shared, loaded machine
    text = corpus()
    alphabet = sorted(set(text))
    data = torch.tensor([alphabet.index(c) for c in text])
    length = 64
    model = GPT(vocab=len(alphabet), length=length)
    print(f"corpus: {len(text):,} characters over a vocabulary of {len(alphabet)} ({''.join(alphabet)!r})")
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, {len(model.blocks)} blocks")

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(data) - length - 1, (args.batch,))
        chunks = torch.stack([data[s : s + length + 1] for s in starts.tolist()])
        return chunks[:, :-1], chunks[:, 1:]

    tokens, targets = batch()
    eager_bytes = saved_activation_bytes(model, tokens, targets)
    remat.checkpoint_modules(model, Block, policy=keep_attention_and_first_mlp_matmul)
    remat_bytes = saved_activation_bytes(model, tokens, targets)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    every = max(1, args.steps // 10)
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, targets = batch()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 1 or step % every == 0 or step == args.steps:
            print(progress(step, args.steps, sum(losses[-every:]) / len(losses[-every:])), flush=True)
    seconds = time.perf_counter() - start
    print(f"trained {args.steps} steps in {seconds:.1f} s ({seconds / args.steps * 1000:.0f} ms per step)")

    block = model.blocks[0]
    report = remat.report(block.forward, torch.randn(args.batch, length, block.ln1.normalized_shape[0]))
    print(
        f"per block, remat.report: keeps {report.saved_bytes:,} bytes, replays {len(report.replayed_calls)} calls "
        f"({report.replayed_fraction:.0%} of the block's forward FLOPs)"
    )
    print(
        f"activation memory per step (saved_tensors_hooks): eager {eager_bytes:,} bytes, "
        f"remat {remat_bytes:,} bytes ({remat_bytes / eager_bytes:.0%} of eager)"
    )
    first, last = sum(losses[:every]) / every, sum(losses[-every:]) / every
    assert last < first, f"the loss did not fall: {first:.3f} over the first steps, {last:.3f} over the last"
    assert remat_bytes < eager_bytes, f"remat keeps {remat_bytes:,} bytes, no fewer than eager's {eager_bytes:,}"
    print(f"OK: loss fell from {first:.3f} to {last:.3f}; remat keeps {eager_bytes - remat_bytes:,} bytes fewer")


if __name__ == "__main__":
    main()
