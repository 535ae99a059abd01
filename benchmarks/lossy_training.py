"""Training with compressed kept values: a small GPT-style model's loss with its MLP inputs kept in FP8 (or
16 bits) against keeping them exactly, over a few hundred steps on the CPU (NOTE [values kept lossy]).

The text is made here: sentences of a small grammar, read character by character. Every run starts from
the same weights and draws the same batches; only the format the MLP inputs (the second layer norm's
outputs) wait for backward in differs. Run: `python -m benchmarks lossy-training` (results in
benchmarks/results/lossy-training-cpu.json and docs/storage.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import policies

RESULTS = Path(__file__).resolve().parent / "results" / "lossy-training-cpu.json"

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "her sister", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "follows", "draws", "finds", "calls", "meets"]
_OBJECTS = ["the river", "a red ball", "the tall tree", "his book", "a quiet house", "the morning sun"]
_ENDINGS = [".", " today.", " again.", " at night.", " in the garden."]


def corpus(sentences: int = 4000, seed: int = 0) -> str:
    """Sentences of a small grammar: structure to learn, and no download."""
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        for _ in range(sentences)
    )


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.attn, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.attn(self.ln_1(x)).split(d, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int = 64, heads: int = 4, layers: int = 2, context: int = 64):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def mlp_inputs_in(format: str | None) -> remat.Policy:
    """Keep everything; the MLP inputs (`ln_2`'s outputs) in `format` (None: exactly)."""
    if format is None:
        return policies.save_everything
    mlp_inputs = policies.save_modules("ln_2")
    return policies.compress(mlp_inputs, format) | (policies.save_everything & ~mlp_inputs)


def train(format: str | None, steps: int = 300, batch: int = 16, context: int = 64, seed: int = 0) -> list[float]:
    """The loss at each step of training on `corpus()` with the MLP inputs kept in `format`."""
    text = corpus()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    torch.manual_seed(seed)
    model = GPT(len(vocab), context=context)
    remat.checkpoint_modules(model, Block, policy=mlp_inputs_in(format))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    draws = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=draws)
        x = torch.stack([data[s : s + context] for s in starts])
        y = torch.stack([data[s + 1 : s + context + 1] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def summary(losses: Sequence[float], exact: Sequence[float], window: int = 20) -> dict[str, float]:
    """The mean loss over the last `window` steps, and its difference from the exact run's."""
    last = sum(losses[-window:]) / window
    reference = sum(exact[-window:]) / window
    return {
        "final_loss": last,
        "difference": last - reference,
        "largest_step_difference": max(abs(a - b) for a, b in zip(losses, exact, strict=True)),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lossy-training", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    curves = {str(format): train(format, steps=options.steps) for format in (None, "bfloat16", "float16", "fp8")}
    exact = curves["None"]
    results = {"steps": options.steps, "curves": curves}
    results["summary"] = {name: summary(curve, exact) for name, curve in curves.items()}
    for name, row in results["summary"].items():  # type: ignore[union-attr]
        print(
            f"{name:>9}: final loss {row['final_loss']:.4f} ({row['difference']:+.4f} from exact), "
            f"largest difference at one step {row['largest_step_difference']:.4f}"
        )
    assert all(math.isfinite(v) for curve in curves.values() for v in curve)
    options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
