"""Small deterministic models and input builders shared by the tests.

Everything is float64 on CPU, has no dropout and no BatchNorm, so a model is a
pure function of its inputs and parameters: running it twice gives identical
results, and checkpointed runs can be compared exactly with eager ones.
"""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DTYPE",
    "GPT2Block",
    "Pair",
    "conv_input",
    "conv_net",
    "gpt2_input",
    "hf_input_ids",
    "hf_model",
    "make_generator",
    "mlp",
    "mlp_input",
    "pytree_fn",
    "pytree_inputs",
    "randn",
]

DTYPE = torch.float64


def make_generator(seed: int = 0) -> torch.Generator:
    """A CPU generator with a fixed seed (never touches the global RNG)."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, requires_grad: bool = True) -> torch.Tensor:
    """A float64 CPU tensor of standard normals, drawn from its own seeded generator."""
    return torch.randn(*shape, generator=make_generator(seed), dtype=DTYPE).requires_grad_(requires_grad)


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialize `module`'s parameters from a private seeded generator, in float64."""
    generator = make_generator(seed)
    module = module.to(DTYPE)
    with torch.no_grad():
        for param in module.parameters():
            # Scaled normals: enough variety that a wrong gradient is visible,
            # small enough that tanh/softmax are not saturated.
            fan_in = param.shape[-1] if param.dim() > 1 else param.numel()
            scale = 1.0 / math.sqrt(max(fan_in, 1))
            param.copy_(torch.randn(param.shape, generator=generator, dtype=DTYPE) * scale)
    return module


# --- MLP -----------------------------------------------------------------------------------------


def mlp(depth: int = 4, width: int = 16, *, seed: int = 0) -> nn.Sequential:
    """`depth` Linear layers of `width`, alternating Tanh and GELU between them."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.Tanh() if i % 2 == 0 else nn.GELU())
    return _seeded(nn.Sequential(*layers), seed)  # type: ignore[return-value]


def mlp_input(batch: int = 3, width: int = 16, *, seed: int = 1, requires_grad: bool = True) -> torch.Tensor:
    return randn(batch, width, seed=seed, requires_grad=requires_grad)


# --- GPT-2 block ---------------------------------------------------------------------------------


class GPT2Block(nn.Module):
    """A pre-LayerNorm GPT-2 transformer block: causal self-attention and a GELU MLP, with residuals.

    `attention="sdpa"` uses `F.scaled_dot_product_attention(is_causal=True)`;
    `attention="softmax"` spells the same thing out: `q @ k^T / sqrt(d_head)`,
    a causal mask, softmax, `@ v`.
    """

    def __init__(self, d: int = 32, heads: int = 4, attention: str = "sdpa", *, seed: int = 0):
        super().__init__()
        if attention not in ("sdpa", "softmax"):
            raise ValueError(f"attention must be 'sdpa' or 'softmax', not {attention!r}")
        if d % heads:
            raise ValueError(f"d={d} is not divisible by heads={heads}")
        self.d, self.heads, self.attention = d, heads, attention
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        _seeded(self, seed)
        with torch.no_grad():  # LayerNorm weights around 1, like a trained model
            self.ln_1.weight.add_(1.0)
            self.ln_2.weight.add_(1.0)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        head_dim = d // self.heads
        q, k, v = self.c_attn(x).split(d, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
            mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            y = scores.softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(batch, seq, d)
        return self.c_proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def gpt2_input(batch: int = 2, seq: int = 5, d: int = 32, *, seed: int = 1, requires_grad: bool = True) -> torch.Tensor:
    return randn(batch, seq, d, seed=seed, requires_grad=requires_grad)


# --- Conv net ------------------------------------------------------------------------------------


def conv_net(*, seed: int = 0) -> nn.Sequential:
    """Conv2d/ReLU/MaxPool/Conv2d/Flatten/Linear on 1x8x8 images, 10 outputs (no BatchNorm)."""
    net = nn.Sequential(
        nn.Conv2d(1, 4, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, kernel_size=3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 10),
    )
    return _seeded(net, seed)  # type: ignore[return-value]


def conv_input(batch: int = 2, *, seed: int = 1, requires_grad: bool = True) -> torch.Tensor:
    return randn(batch, 1, 8, 8, seed=seed, requires_grad=requires_grad)


# --- A function of pytrees -----------------------------------------------------------------------

Pair = namedtuple("Pair", ["left", "right"])


def pytree_fn(inputs: dict[str, Any]) -> dict[str, Any]:
    """A function of a dict holding a tensor, a tuple and a namedtuple of tensors.

    Returns a nested pytree (dict of tuple/list/namedtuple) of several tensors
    with a `None` among them.
    """
    a = inputs["a"]
    b, c = inputs["bc"]
    pair = inputs["pair"]
    h = torch.tanh(a @ b)  # (3, 5)
    g = torch.sigmoid(h * c)  # (3, 5)
    left = (pair.left.exp() * g).sum(dim=0)  # (5,)
    right = pair.right.sin() @ h.transpose(0, 1)  # (2, 3)
    return {
        "h": h,
        "nested": (g.cos(), None, [left, Pair(right, (a * a).sum())]),
    }


def pytree_inputs(*, seed: int = 1, requires_grad: bool = True) -> dict[str, Any]:
    return {
        "a": randn(3, 4, seed=seed, requires_grad=requires_grad),
        "bc": (
            randn(4, 5, seed=seed + 1, requires_grad=requires_grad),
            randn(3, 5, seed=seed + 2, requires_grad=requires_grad),
        ),
        "pair": Pair(
            randn(3, 5, seed=seed + 3, requires_grad=requires_grad),
            randn(2, 5, seed=seed + 4, requires_grad=requires_grad),
        ),
    }


# --- Hugging Face transformers models, from small local configs -------------------------------------

HF_MODELS = ("llama", "gpt2", "t5")
HF_VOCAB = 100


def hf_model(name: str, *, seed: int = 0, dtype: torch.dtype = DTYPE) -> nn.Module:
    """A two-layer transformers model (`"llama"`, `"gpt2"` or `"t5"`, with a language-model head) in
    training mode, built from a small local config (no download), dropout off, `config.use_cache` left
    at its default (True)."""
    import transformers

    torch.manual_seed(seed)
    if name == "llama":
        config: Any = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=HF_VOCAB,
        )  # fmt: skip
        model: nn.Module = transformers.LlamaForCausalLM(config)
    elif name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=HF_VOCAB, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif name == "t5":
        config = transformers.T5Config(
            d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=HF_VOCAB,
            decoder_start_token_id=0, dropout_rate=0.0,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
    else:
        raise ValueError(f"hf_model: unknown model {name!r}; expected one of {HF_MODELS}")
    return model.to(dtype).train()


def hf_input_ids(batch: int = 2, seq: int = 8, *, seed: int = 1) -> torch.Tensor:
    """Token ids for `hf_model`, from a fixed seed."""
    return torch.randint(0, HF_VOCAB, (batch, seq), generator=make_generator(seed))
