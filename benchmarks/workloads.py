"""The models the benchmark runs, each built locally with a fixed seed, in float32.

A workload is a model cut into checkpoint units: an optional `prologue` (embeddings, a stem
convolution), the `units` a method wraps one by one, and an optional `epilogue` with the loss.
Every method wraps the same units of the same model instance, so the comparison is like for like.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import remat

aten = torch.ops.aten

# The attention kernels SDPA dispatches to, on CPU and on CUDA.
ATTENTION_OPS = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)

# NOTE [torch_remat annotations]
# torch_remat saves what the model code marks with `torch_remat.region(fn, name, recompute=False)`,
# so the GPT-2 block carries those marks, switched on only while the `torch_remat` method runs (this
# context variable), so that every other method, and remat's tracing, sees plain model code.
_annotate_for_torch_remat: contextvars.ContextVar[bool] = contextvars.ContextVar("annotate", default=False)


@contextlib.contextmanager
def torch_remat_annotations() -> Iterator[None]:
    """Turn on the `torch_remat.region` marks in the model code while the block runs."""
    token = _annotate_for_torch_remat.set(True)
    try:
        yield
    finally:
        _annotate_for_torch_remat.reset(token)


def _saved_region(fn: Callable[..., torch.Tensor], name: str, *args: torch.Tensor) -> torch.Tensor:
    """`fn(*args)`, marked as a torch_remat save region when the torch_remat method runs."""
    if not _annotate_for_torch_remat.get():
        return fn(*args)
    import torch_remat

    output = torch_remat.region(fn, name, recompute=False)(*args)
    torch_remat.recompute_needs_tensor(output)
    return output


class Block(nn.Module):
    """GPT-2 block: pre-LayerNorm causal self-attention (SDPA) and a GELU(tanh) MLP."""

    supports_torch_remat = True

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def _attention(self, qkv: torch.Tensor) -> torch.Tensor:
        batch, length, width = qkv.shape
        dim = width // 3
        q, k, v = (
            t.reshape(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in qkv.split(dim, dim=-1)
        )
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attention.transpose(1, 2).reshape(batch, length, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = _saved_region(self.c_attn, "c_attn", self.ln_1(x))
        attention = _saved_region(self._attention, "attention", qkv)
        x = x + _saved_region(self.c_proj, "c_proj", attention)
        hidden = _saved_region(self.c_fc, "c_fc", self.ln_2(x))
        return x + _saved_region(self.mlp_proj, "mlp_proj", F.gelu(hidden, approximate="tanh"))


class MatmulAttentionBlock(nn.Module):
    """A pre-LayerNorm GPT-2 block with attention spelled out (unlike `Block`, which calls SDPA), float32.

    Attention is `q @ k^T / sqrt(d_head)`, a causal mask, softmax, `@ v`, so that remat's trace
    and torch.compile's decomposed graph contain the same matmuls (`bmm`/`addmm`), which is what
    the FLOP comparison counts.
    """

    def __init__(self, d: int, heads: int, generator: torch.Generator):
        super().__init__()
        self.d, self.heads = d, heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        with torch.no_grad():
            for param in self.parameters():
                fan_in = param.shape[-1] if param.dim() > 1 else param.numel()
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        head_dim = d // self.heads
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        y = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).reshape(batch, seq, d))
        return x + self.mlp(self.ln_2(x))


def matmul_attention_stack(layers: int, d: int, heads: int, *, seed: int = 0) -> nn.Sequential:
    """`layers` `MatmulAttentionBlock`s in sequence, initialized from a private seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return nn.Sequential(*[MatmulAttentionBlock(d, heads, generator) for _ in range(layers)])


def stack_input(batch: int, seq: int, d: int, *, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, d, generator=generator).requires_grad_(True)


class ResidualConv(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input, then ReLU."""

    supports_torch_remat = False

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class MLP(nn.Sequential):
    """Linear-ReLU layers of one width."""

    supports_torch_remat = False

    def __init__(self, width: int, layers: int):
        super().__init__(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())))


class Embedding(nn.Module):
    def __init__(self, vocab: int, length: int, dim: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(length, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Classifier(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(x.mean(dim=(2, 3))), targets)


@dataclasses.dataclass
class Workload:
    """A model cut into checkpoint units, its inputs, and the per-call policy written for it."""

    name: str
    description: str
    model: nn.Module  # holds prologue, units and epilogue, so that .parameters() covers them all
    units: list[nn.Module]
    x: torch.Tensor  # the input of the prologue (or of the first unit)
    targets: torch.Tensor | None
    prologue: nn.Module | None
    epilogue: nn.Module | None
    custom_policy: Callable[[remat.Call], bool]
    custom_policy_text: str

    def step(self, units: list[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        """The loss of one forward, through `units` (the wrapped units)."""
        h = self.prologue(self.x) if self.prologue is not None else self.x
        for unit in units:
            h = unit(h)
        if self.epilogue is not None:
            return self.epilogue(h, self.targets)
        return h.sum()

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.x.grad = None


def _block_policy(call: remat.Call) -> bool:
    return call.op in ATTENTION_OPS or (call.op is aten.addmm.default and call.module == "c_fc")


_BLOCK_POLICY_TEXT = "attention kernel, and the `addmm` of `c_fc`"


def mlp(device: torch.device, width: int, layers: int, batch: int) -> Workload:
    model = MLP(width, layers).to(device)
    x = torch.randn(batch, width, device=device, requires_grad=True)
    return Workload(
        name=f"mlp {layers}x{width} B={batch}",
        description=f"{layers}-layer x {width}-wide ReLU MLP, batch {batch}; one checkpoint around the whole MLP",
        model=model,
        units=[model],
        x=x,
        targets=None,
        prologue=None,
        epilogue=None,
        custom_policy=lambda call: call.op is aten.addmm.default and call.occurrence % 2 == 0,
        custom_policy_text="every other `addmm` (occurrence 0, 2, ...)",
    )


def gpt2_block(device: torch.device, dim: int, heads: int, batch: int, length: int) -> Workload:
    model = Block(dim, heads).to(device)
    x = torch.randn(batch, length, dim, device=device, requires_grad=True)
    return Workload(
        name=f"gpt2 block d={dim} B={batch} T={length}",
        description=f"one GPT-2 block, d={dim}, {heads} heads, B={batch}, T={length}, SDPA causal attention",
        model=model,
        units=[model],
        x=x,
        targets=None,
        prologue=None,
        epilogue=None,
        custom_policy=_block_policy,
        custom_policy_text=_BLOCK_POLICY_TEXT,
    )


def gpt2_model(
    device: torch.device, dim: int, heads: int, layers: int, vocab: int, batch: int, length: int
) -> Workload:
    prologue, epilogue = Embedding(vocab, length, dim), Head(dim, vocab)
    blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
    model = nn.ModuleDict({"embedding": prologue, "blocks": blocks, "head": epilogue}).to(device)
    tokens = torch.randint(vocab, (batch, length + 1), device=device)
    return Workload(
        name=f"gpt2 {layers}L d={dim} B={batch} T={length}",
        description=(
            f"{layers}-layer GPT-2-shaped model, d={dim}, vocab {vocab}, B={batch}, T={length}, "
            "cross-entropy training step; one checkpoint per block"
        ),
        model=model,
        units=list(blocks),
        x=tokens[:, :-1].contiguous(),
        targets=tokens[:, 1:].contiguous(),
        prologue=prologue,
        epilogue=epilogue,
        custom_policy=_block_policy,
        custom_policy_text=_BLOCK_POLICY_TEXT + " (per block)",
    )


def resnet(device: torch.device, channels: int, blocks: int, batch: int, size: int) -> Workload:
    stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
    units = nn.ModuleList(ResidualConv(channels) for _ in range(blocks))
    classifier = Classifier(channels, 10)
    model = nn.ModuleDict({"stem": stem, "blocks": units, "head": classifier}).to(device)
    return Workload(
        name=f"resnet {blocks}x{channels}ch {size}px B={batch}",
        description=(
            f"{blocks} residual conv-BN-ReLU blocks, {channels} channels, {size}x{size} images, batch {batch}; "
            "one checkpoint per block"
        ),
        model=model,
        units=list(units),
        x=torch.randn(batch, 3, size, size, device=device),
        targets=torch.randint(10, (batch,), device=device),
        prologue=stem,
        epilogue=classifier,
        custom_policy=lambda call: call.op is aten.convolution.default and call.module == "conv1",
        custom_policy_text="the first convolution of each block (`conv1`)",
    )


Builder = Callable[[torch.device], Workload]

SUITES: dict[str, list[Builder]] = {
    "smoke": [
        lambda device: mlp(device, width=64, layers=4, batch=8),
        lambda device: gpt2_block(device, dim=64, heads=4, batch=2, length=16),
        lambda device: gpt2_model(device, dim=64, heads=4, layers=2, vocab=64, batch=2, length=16),
        lambda device: resnet(device, channels=8, blocks=2, batch=2, size=8),
    ],
    "cpu": [
        lambda device: mlp(device, width=1024, layers=4, batch=256),
        lambda device: gpt2_block(device, dim=768, heads=12, batch=4, length=128),
        lambda device: gpt2_block(device, dim=768, heads=12, batch=4, length=512),
        lambda device: gpt2_model(device, dim=768, heads=12, layers=12, vocab=1024, batch=2, length=128),
        lambda device: resnet(device, channels=64, blocks=8, batch=16, size=32),
    ],
    "cuda": [
        lambda device: mlp(device, width=1024, layers=4, batch=4096),
        lambda device: gpt2_block(device, dim=768, heads=12, batch=8, length=512),
        lambda device: gpt2_block(device, dim=768, heads=12, batch=8, length=1024),
        lambda device: gpt2_block(device, dim=768, heads=12, batch=8, length=2048),
        lambda device: gpt2_model(device, dim=768, heads=12, layers=12, vocab=1024, batch=8, length=1024),
        lambda device: resnet(device, channels=64, blocks=8, batch=128, size=32),
    ],
}
