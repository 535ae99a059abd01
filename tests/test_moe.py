"""Mixture-of-experts layers: grouped products, routing and data-dependent sizes.

The models are transformers' own MoE code at small local configs, in their default configuration
(the grouped-product experts, `torch._grouped_mm`, which also runs on CPU) and with the eager experts
(a loop over the experts the router chose).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import remat
import remat.testing
from remat import _torch, policies

transformers = pytest.importorskip("transformers")
from benchmarks.models import DECODER, MOE  # noqa: E402  (the configs the models benchmark runs)

_COMMON = {**DECODER, "use_cache": False}
POLICIES = {
    "save_nothing": policies.save_nothing,
    "dots_saveable": policies.dots_saveable,
    "budget": policies.budget(fraction=0.5),
}
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2}}


def moe_model(name: str, experts: str, dtype: torch.dtype) -> torch.nn.Module:
    config_class, extra = MOE[name]
    config = getattr(transformers, config_class)(**{**_COMMON, **extra})
    config._experts_implementation = experts
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).train()


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


# Before torch 2.11, Hugging Face's grouped_mm experts read their operands' data pointers on the CPU (to check
# their alignment), which remat refuses (test_the_grouped_mm_experts_on_torch_2_10_are_refused_naming_the_way_out).
_GROUPED_MM_READS_ADDRESSES = _torch.RELEASE == "2.10"


def assert_trains_like_eager(name: str, experts: str, dtype: torch.dtype, policy: Any, steps: int = 1) -> None:
    """Loss and every gradient of the model with checkpointed decoder layers equal those without,
    for `steps` batches of new tokens (so new routing), with one trace per layer structure."""
    if experts == "grouped_mm" and _GROUPED_MM_READS_ADDRESSES:
        pytest.skip("torch 2.10: Hugging Face's grouped_mm experts read data pointers on the CPU (refused)")
    model = moe_model(name, experts, dtype)
    checkpointed = copy.deepcopy(model)
    layers = checkpointed.model.layers
    remat.checkpoint_modules(checkpointed, type(layers[0]), policy=policy)
    for step in range(steps):
        ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(step))
        expected_loss, expected_grads = loss_and_grads(model, ids)
        loss, grads = loss_and_grads(checkpointed, ids)
        torch.testing.assert_close(loss, expected_loss, **TOLERANCE[dtype])
        assert grads.keys() == expected_grads.keys()
        for parameter, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[parameter], **TOLERANCE[dtype], msg=parameter)
    assert [(layer.forward.cache_info().traces, layer.forward.cache_info().shared) for layer in layers] == [
        (1, 0) if i == first_alike(layers, i) else (0, 1) for i in range(len(layers))
    ]


def first_alike(layers: Sequence[torch.nn.Module], i: int) -> int:
    """The first layer of the same class and parameter shapes as `layers[i]`: the one that traces
    for both (DeepSeek-V3's first layer is dense, the others mixtures of experts)."""

    def shapes(layer: torch.nn.Module) -> tuple[Any, ...]:
        return type(layer), tuple((name, p.shape) for name, p in layer.named_parameters())

    return next(j for j, layer in enumerate(layers) if shapes(layer) == shapes(layers[i]))


def families_and_policies() -> list[tuple[str, str]]:
    """Every family under every policy would repeat the same paths: DeepSeek-V3 (a dense first layer,
    then mixtures of experts) runs under each policy, and each other family under one, in turn."""
    others = [name for name in MOE if name != "deepseek_v3"]
    policy_names = list(POLICIES)
    return [("deepseek_v3", policy) for policy in policy_names] + [
        (name, policy_names[i % len(policy_names)]) for i, name in enumerate(others)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "policy"), families_and_policies())
def test_moe_models_train_like_eager_in_their_default_configuration(name: str, policy: str) -> None:
    assert_trains_like_eager(name, "grouped_mm", torch.float32, POLICIES[policy], steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_moe_models_train_like_eager_in_bfloat16(name: str) -> None:
    assert_trains_like_eager(name, "grouped_mm", torch.bfloat16, policies.save_nothing)


def test_the_grouped_mm_experts_on_torch_2_10_are_refused_naming_the_way_out() -> None:
    if not _GROUPED_MM_READS_ADDRESSES:
        pytest.skip(f"torch {_torch.RELEASE}: Hugging Face's grouped_mm experts read no data pointers")
    model = moe_model("mixtral", "grouped_mm", torch.float32)
    remat.checkpoint_modules(model, type(model.model.layers[0]))
    with pytest.raises(remat.TraceError, match=r"memory address at .*moe\.py.*_experts_implementation = \"eager\""):
        model(torch.randint(0, 100, (2, 8)))


@pytest.mark.slow
def test_the_eager_experts_train_like_eager_in_bfloat16() -> None:
    """The eager experts of every family run in float32 below; in bfloat16 one family stands for all."""
    assert_trains_like_eager("mixtral", "eager", torch.bfloat16, policies.save_nothing)


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_moe_models_with_the_eager_experts_train_like_eager_without_retracing(name: str) -> None:
    """The eager experts loop over the experts the router picked (`nonzero` of the expert mask) and
    index by each: one trace per set of picked experts, not per routing, so three batches of
    new tokens (new routing, every expert picked) run on one trace."""
    assert_trains_like_eager(name, "eager", torch.float32, policies.save_nothing, steps=3)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dots_saveable", "budget"])
def test_the_eager_experts_under_other_policies(policy: str) -> None:
    assert_trains_like_eager("mixtral", "eager", torch.float32, POLICIES[policy])


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_offloaded_expert_products_train_like_eager(experts: str) -> None:
    """Offloaded values of data-dependent size (the tokens each expert got) make the round trip too."""
    with remat.testing.offloading_on_cpu():
        assert_trains_like_eager("mixtral", experts, torch.float32, policies.offload_dots, steps=2)


# --- grouped products ---------------------------------------------------------------------------------


def grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offsets).tanh()


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything, policies.dots_saveable])
def test_a_grouped_product_in_float32_on_cpu(policy: remat.Policy) -> None:
    """`_grouped_mm`'s fake kernel accepts only bfloat16 (the CUDA kernel's rule); the CPU kernel
    takes float32, and so does remat."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(6, 8, generator=generator, requires_grad=True)
    b = torch.randn(3, 8, 4, generator=generator, requires_grad=True)
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32)  # the second group is empty
    remat.testing.assert_checkpoint_equivalent(grouped, a, b, offsets, policy=policy, rtol=0, atol=0)
    (call, _) = remat.trace(grouped, a, b, offsets)
    assert call.op is torch.ops.aten._grouped_mm.default
    assert call.flops == 2 * 6 * 8 * 4
    assert policies.dots_saveable(call) is remat.SAVE
