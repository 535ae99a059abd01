"""Small deterministic models, input builders and the model comparison shared by the tests.

Everything is float64 on CPU and has no dropout, so a model is a pure function
of its inputs and parameters (and, for the vision models with BatchNorm, of its
running statistics, which training updates): running it twice gives identical
results, and checkpointed runs can be compared exactly with eager ones.
"""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.testing import CheckpointedRun, assert_checkpoint_equivalent

__all__ = [
    "DTYPE",
    "BasicBlock",
    "DepthwiseSeparable",
    "GPT2Block",
    "InvertedResidual",
    "Pair",
    "compare",
    "conv_input",
    "conv_net",
    "efficientnet_like",
    "gpt2_input",
    "hf_input_ids",
    "hf_model",
    "make_generator",
    "mlp",
    "mlp_input",
    "pytree_fn",
    "pytree_inputs",
    "randn",
    "resnet18_like",
    "vision_input",
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


# --- Vision models with BatchNorm ----------------------------------------------------------------
# Local replicas of torchvision's ResNet `BasicBlock` and timm's EfficientNet blocks, op for op
# (in-place ReLU and `out += identity` included), for torch releases where torchvision and timm
# cannot be imported. tests/test_compile_vision.py runs the real ones too where they import.


def _vision_seeded(module: nn.Module, seed: int) -> nn.Module:
    """`module` in float64 with its default initialization drawn from `seed` (the global RNG is left
    as it was), and BatchNorm weights and biases moved off 1 and 0 so that their gradients differ."""
    generator = make_generator(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for submodule in module.modules():
            if isinstance(submodule, (nn.Conv2d, nn.Linear)):
                submodule.reset_parameters()
    module = module.to(DTYPE)
    with torch.no_grad():
        for submodule in module.modules():
            if isinstance(submodule, nn.BatchNorm2d):
                submodule.weight.add_(0.1 * torch.randn(submodule.weight.shape, generator=generator, dtype=DTYPE))
                submodule.bias.add_(0.1 * torch.randn(submodule.bias.shape, generator=generator, dtype=DTYPE))
    return module


class BasicBlock(nn.Module):
    """torchvision's ResNet `BasicBlock`: conv3x3-BN-ReLU-conv3x3-BN, plus the identity (or a
    downsampling conv1x1-BN), then ReLU; in-place ReLU and addition as torchvision writes them."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class _ResNet(nn.Module):
    def __init__(self, width: int, num_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, inplanes = [], width
        for i in range(4):  # ResNet-18: four stages of two blocks, the last three downsampling
            planes, stride = width * 2**i, 1 if i == 0 else 2
            downsample = None
            if stride != 1 or inplanes != planes:
                downsample = nn.Sequential(
                    nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
                )
            stages.append(nn.Sequential(BasicBlock(inplanes, planes, stride, downsample), BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_like(width: int = 8, num_classes: int = 10, *, seed: int = 0) -> nn.Module:
    """torchvision's ResNet-18 (stem, four stages of two `BasicBlock`s, pool, fc) at a small width."""
    return _vision_seeded(_ResNet(width, num_classes), seed)


class _SqueezeExcite(nn.Module):
    """timm's `SqueezeExcite`: global mean, conv1x1-SiLU-conv1x1, sigmoid gate."""

    def __init__(self, channels: int, reduced: int):
        super().__init__()
        self.conv_reduce = nn.Conv2d(channels, reduced, 1)
        self.act1 = nn.SiLU(inplace=True)
        self.conv_expand = nn.Conv2d(reduced, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.conv_expand(self.act1(self.conv_reduce(x.mean((2, 3), keepdim=True))))
        return x * self.gate(scale)


class _BatchNormAct(nn.BatchNorm2d):
    """timm's `BatchNormAct2d`: BatchNorm, then an optional in-place SiLU."""

    def __init__(self, channels: int, act: bool = True):
        super().__init__(channels)
        self.act = nn.SiLU(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class DepthwiseSeparable(nn.Module):
    """timm's `DepthwiseSeparableConv` (EfficientNet-B0's first stage): depthwise conv-BN-SiLU,
    squeeze-excitation, pointwise conv-BN, residual when shapes allow (DropPath off)."""

    def __init__(self, in_chs: int, out_chs: int, kernel: int = 3, stride: int = 1):
        super().__init__()
        self.has_skip = stride == 1 and in_chs == out_chs
        self.conv_dw = nn.Conv2d(in_chs, in_chs, kernel, stride, kernel // 2, groups=in_chs, bias=False)
        self.bn1 = _BatchNormAct(in_chs)
        self.se = _SqueezeExcite(in_chs, max(1, in_chs // 4))
        self.conv_pw = nn.Conv2d(in_chs, out_chs, 1, bias=False)
        self.bn2 = _BatchNormAct(out_chs, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.bn2(self.conv_pw(self.se(self.bn1(self.conv_dw(x)))))
        return x + shortcut if self.has_skip else x


class InvertedResidual(nn.Module):
    """timm's `InvertedResidual` (the MBConv block of EfficientNet): pointwise expansion conv-BN-SiLU,
    depthwise conv-BN-SiLU, squeeze-excitation, pointwise projection conv-BN, residual when shapes
    allow (DropPath off)."""

    def __init__(self, in_chs: int, out_chs: int, kernel: int = 3, stride: int = 1, expansion: int = 6):
        super().__init__()
        mid_chs = in_chs * expansion
        self.has_skip = stride == 1 and in_chs == out_chs
        self.conv_pw = nn.Conv2d(in_chs, mid_chs, 1, bias=False)
        self.bn1 = _BatchNormAct(mid_chs)
        self.conv_dw = nn.Conv2d(mid_chs, mid_chs, kernel, stride, kernel // 2, groups=mid_chs, bias=False)
        self.bn2 = _BatchNormAct(mid_chs)
        self.se = _SqueezeExcite(mid_chs, max(1, in_chs // 4))  # timm reduces from the block's input width
        self.conv_pwl = nn.Conv2d(mid_chs, out_chs, 1, bias=False)
        self.bn3 = _BatchNormAct(out_chs, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.se(self.bn2(self.conv_dw(self.bn1(self.conv_pw(x)))))
        x = self.bn3(self.conv_pwl(x))
        return x + shortcut if self.has_skip else x


def efficientnet_like(num_classes: int = 10, *, seed: int = 0) -> nn.Module:
    """An EfficientNet-B0-shaped net, shortened: stem conv-BN-SiLU, a `DepthwiseSeparable` block,
    `InvertedResidual` blocks (stride 2, kernel 5, with and without the residual), head, pool, fc."""
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
        _BatchNormAct(8),
        DepthwiseSeparable(8, 8),
        InvertedResidual(8, 12, stride=2),
        InvertedResidual(12, 12, kernel=5),
        nn.Conv2d(12, 32, 1, bias=False),
        _BatchNormAct(32),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )
    return _vision_seeded(net, seed)


def vision_input(batch: int = 2, size: int = 64, *, seed: int = 1, requires_grad: bool = False) -> torch.Tensor:
    """Images for the vision models (64x64: ResNet-18's last stage still sees 2x2 per image, so
    training-mode BatchNorm normalizes over more than two values)."""
    return randn(batch, 3, size, size, seed=seed, requires_grad=requires_grad)


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


def compare(reference: nn.Module, model: nn.Module, *args: Any, seed: int = 0) -> CheckpointedRun:
    """`model` computes the outputs, input grads and parameter grads of `reference`, an unwrapped copy.

    The reference runs with the model's own parameters (by name, through
    `functional_call`), so that one `params` list serves both runs; `seed`
    seeds the global RNG before each call (for dropout). Returns the model's run.
    """
    parameters = dict(model.named_parameters())

    def run_reference(*inputs: Any) -> Any:
        return torch.func.functional_call(reference, parameters, inputs)

    run = assert_checkpoint_equivalent(
        run_reference, *args, checkpointed=model, params=list(parameters.values()), seed=seed
    )
    assert run is not None
    return run
