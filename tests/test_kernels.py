"""remat's backward runs autograd's own kernels: float32 gradients equal eager's bit for bit.

A traced backward that decomposed a fused kernel (`silu_backward` into sigmoid, sub, mul and
add) would round differently, by a few ulps, and run several kernels where eager runs one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import models
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import remat

POLICIES = {"save_everything": remat.policies.save_everything, "save_nothing": remat.policies.save_nothing}

OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "mish": F.mish,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "softplus": F.softplus,
    "elu": F.elu,
    "hardswish": F.hardswish,
    "logsigmoid": F.logsigmoid,
    "softmax": lambda t: F.softmax(t, -1),
    "log_softmax": lambda t: F.log_softmax(t, -1),
    "layer_norm": lambda t: F.layer_norm(t, t.shape[-1:]),
    "rms_norm": lambda t: F.rms_norm(t, t.shape[-1:]),
    "attention": lambda t: F.scaled_dot_product_attention(t[None], t[None], t[None], is_causal=True),
    "cross_entropy": lambda t: F.cross_entropy(t, torch.arange(t.shape[0]) % t.shape[1], reduction="none"),
    "glu": lambda t: F.glu(t, -1),
    "logsumexp": lambda t: t.logsumexp(-1),
}
# Not here: `prod`, whose formula takes its composite path (for zeros) on traced tensors and rounds
# differently from eager's `grad * result / input`, by a few ulps (docs/benchmarks.md).


def gradients(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(fn(x), [weight])
    return grad


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("op", OPS)
def test_the_backward_of_an_op_equals_eager_bit_for_bit(op: str, policy: str) -> None:
    generator = models.make_generator(0)
    weight = torch.randn(32, 32, generator=generator).requires_grad_()
    x = torch.randn(16, 32, generator=generator)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return OPS[op](x @ weight).sum()

    expected = gradients(fn, x, weight)
    actual = gradients(remat.checkpoint(fn, policy=POLICIES[policy]), x, weight)
    assert torch.equal(actual, expected), (actual - expected).abs().max()


class SiLUMLP(nn.Module):
    """A Llama-style gated MLP: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, d: int = 32, hidden: int = 64):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def assert_bit_identical(reference: nn.Module, model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> None:
    expected_loss = run(reference)
    expected_loss.backward()
    loss = run(model)
    loss.backward()
    assert torch.equal(loss, expected_loss)
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert actual.grad is not None and expected.grad is not None, name
        assert torch.equal(actual.grad, expected.grad), (name, (actual.grad - expected.grad).abs().max())


@pytest.mark.parametrize("policy", POLICIES)
def test_a_silu_mlp_has_the_gradients_of_eager_bit_for_bit(policy: str) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(SiLUMLP(), SiLUMLP())
    model = remat.checkpoint_modules(copy.deepcopy(reference), SiLUMLP, policy=POLICIES[policy])
    x = torch.randn(4, 8, 32, generator=models.make_generator(1))
    assert_bit_identical(reference, model, lambda m: m(x).square().mean())


@pytest.mark.parametrize("policy", POLICIES)
def test_a_llama_model_has_the_gradients_of_eager_bit_for_bit(policy: str) -> None:
    reference = models.hf_model("llama", dtype=torch.float32)
    reference.config.use_cache = False
    model = copy.deepcopy(reference)
    remat.checkpoint_modules(model, transformers.GradientCheckpointingLayer, policy=POLICIES[policy])
    ids = models.hf_input_ids()
    assert_bit_identical(reference, model, lambda m: m(ids, labels=ids).loss)
