"""Objects handed to a checkpointed function: NOTE [objects handed to a checkpointed function].

Every gradient check compares with the function without checkpointing, in float64.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any

import pytest
import torch

import remat
from remat import policies
from remat.testing import assert_checkpoint_equivalent

POLICIES = [policies.save_nothing, policies.save_everything, policies.dots_saveable]


@dataclasses.dataclass
class Mixer:
    """A dataclass registered with no pytree library: tensors, a size and a function."""

    weight: torch.Tensor
    width: int
    activation: Any


class Plain:
    def __init__(self, bias: torch.Tensor, scale: float):
        self.bias = bias
        self.scale = scale


def mixed(x: torch.Tensor, mixer: Mixer, plain: Plain) -> torch.Tensor:
    return mixer.activation(x[:, : mixer.width] @ mixer.weight) * plain.scale + plain.bias


def randn(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=grad)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_tensors_of_objects_are_inputs_and_get_their_gradients(policy: Any) -> None:
    mixer, plain = Mixer(randn(3, 4), 3, torch.tanh), Plain(randn(4), 0.5)
    assert_checkpoint_equivalent(mixed, randn(5, 6), mixer, plain, policy=policy)


def test_objects_of_the_same_structure_take_one_trace_and_their_own_tensors() -> None:
    checkpointed = remat.checkpoint(mixed)
    for _ in range(3):
        mixer, plain, x = Mixer(randn(3, 4), 3, torch.tanh), Plain(randn(4), 0.5), randn(5, 6)
        expected = mixed(x, mixer, plain)
        torch.testing.assert_close(checkpointed(x, mixer, plain), expected, rtol=1e-12, atol=1e-12)
    assert checkpointed.cache_info().traces == 1
    checkpointed(x, Mixer(mixer.weight, 3, torch.tanh), Plain(plain.bias, 2.0))  # another static value
    checkpointed(x, Mixer(randn(2, 4), 2, torch.tanh), plain)  # another static value and shape
    assert checkpointed.cache_info().traces == 3


def test_a_function_argument_is_opened_into_the_tensors_it_closes_over() -> None:
    def scaled_by(weight: torch.Tensor) -> Any:
        return lambda x: x * weight.sin()

    def fn(x: torch.Tensor, scale: Any) -> torch.Tensor:
        return scale(x).exp().sum(0)

    checkpointed = remat.checkpoint(fn)
    for _ in range(2):  # a new closure over a new tensor each step: one trace, that tensor's values
        weight, x = randn(4), randn(3, 4)
        expected = torch.autograd.grad(fn(x, scaled_by(weight)).sum(), (x, weight))
        actual = torch.autograd.grad(checkpointed(x, scaled_by(weight)).sum(), (x, weight))
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    assert checkpointed.cache_info().traces == 1


def test_a_function_argument_keeps_its_attributes() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    double.offset = 3.0  # type: ignore[attr-defined]

    def fn(x: torch.Tensor, op: Any) -> torch.Tensor:
        return op(x) + op.offset

    assert_checkpoint_equivalent(fn, randn(3), double)


def test_an_object_the_function_writes_into_is_refused_naming_it() -> None:
    def fn(x: torch.Tensor, plain: Plain) -> torch.Tensor:
        plain.last = x.sum()  # a side effect remat would make once, on a copy
        return x * plain.scale

    with pytest.raises(TypeError, match=r"writes into the argument at args\[1\], a Plain.*read-only"):
        remat.checkpoint(fn)(randn(3), Plain(randn(3), 2.0))


def test_an_update_of_a_tensor_an_object_holds_is_an_update_of_the_input() -> None:
    def fn(x: torch.Tensor, plain: Plain) -> torch.Tensor:
        with torch.no_grad():
            plain.bias.add_(1.0)  # the tensor is an input: written back as eager writes it
        return x * plain.scale + plain.bias

    assert_checkpoint_equivalent(fn, randn(3), Plain(torch.randn(3, dtype=torch.float64), 2.0))


class SharedStates(collections.UserDict):  # type: ignore[type-arg]
    """Like transformers' `KVSharingDict`, which some layers of Gemma 3n write into and later ones read."""


def test_a_mapping_the_function_reads_is_opened_and_one_it_writes_into_is_refused() -> None:
    def reads(x: torch.Tensor, states: SharedStates) -> torch.Tensor:
        return x * states["keys"].sin()

    assert_checkpoint_equivalent(reads, randn(3), SharedStates(keys=randn(3)))

    def writes(x: torch.Tensor, states: SharedStates) -> torch.Tensor:
        states["keys"] = x.cos()
        return x.sin()

    with pytest.raises(TypeError, match=r"writes into the argument at kwargs\['states'\], a SharedStates"):
        remat.checkpoint(writes)(randn(3), states=SharedStates())


def test_objects_that_keep_state_outside_their_dict_are_still_refused() -> None:
    class Slotted:
        __slots__ = ("scale",)

        def __init__(self, scale: float):
            self.scale = scale

    with pytest.raises(TypeError, match=r"args\[1\] is a .*Slotted, which is neither a tensor nor a static value"):
        remat.checkpoint(lambda x, s: x * s.scale)(randn(3), Slotted(2.0))


# --- FlexAttention ------------------------------------------------------------------------------------------

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, T, D = 2, 2, 128, 8


@pytest.fixture
def flex_backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's Python wrapper refuses flex attention's backward on the CPU (the op itself runs): lifted in
    these tests only, for eager and remat alike."""
    if hasattr(flex, "_validate_device"):
        monkeypatch.setattr(flex, "_validate_device", lambda *args: None)


def document_mask(seed: int, device: str = "cpu") -> Any:
    """Document masking: a causal mask within documents whose ids a `mask_mod` closure holds."""
    documents = torch.randint(0, 3, (T,), generator=torch.Generator().manual_seed(seed)).sort().values.to(device)

    def mask_mod(b: Any, h: Any, q_index: Any, kv_index: Any) -> Any:
        return (documents[q_index] == documents[kv_index]) & (q_index >= kv_index)

    return flex.create_block_mask(mask_mod, None, None, T, T, device=device)


def relative_bias(score: Any, b: Any, h: Any, q_index: Any, kv_index: Any) -> Any:
    return score + (q_index - kv_index).to(score.dtype) * 0.01


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    return flex.flex_attention(q, k, v, score_mod=relative_bias, block_mask=block_mask)


ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.usefixtures("flex_backward_on_cpu")
@pytest.mark.parametrize(
    ("device", "compiled"),
    [("cpu", False), pytest.param("cuda", False, marks=ON_CUDA), pytest.param("cuda", True, marks=ON_CUDA)],
    ids=["cpu", "cuda", "cuda-torch.compile"],  # inductor's flex kernels are for GPUs
)
@pytest.mark.parametrize("policy", POLICIES)
def test_flex_attention_with_a_block_mask_checkpoints_with_eagers_gradients(
    policy: Any, device: str, compiled: bool
) -> None:
    # It was `TypeError: ... args[3] is a BlockMask, which is neither a tensor nor a static value`.
    checkpointed = remat.checkpoint(attention, policy=policy)
    run, reference = (torch.compile(checkpointed), torch.compile(attention)) if compiled else (checkpointed, attention)
    dtype, tolerance = (torch.float64, 1e-12) if device == "cpu" else (torch.float32, 1e-4)
    for step in range(3):  # a new mask each step, over other documents: one trace, each mask's values
        q, k, v = (torch.randn(B, H, T, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        block_mask = document_mask(step, device)
        expected = reference(q, k, v, block_mask)
        expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
        actual = run(q, k, v, block_mask)
        grads = torch.autograd.grad(actual.square().sum(), (q, k, v))
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
        for a, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(a, e, rtol=tolerance, atol=tolerance)
    assert checkpointed.cache_info().traces == 1
    assert [call.op.name() for call in remat.trace(attention, q, k, v, block_mask)] == ["flex_attention"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.usefixtures("flex_backward_on_cpu")
def test_flex_attention_under_torch_func_grad_is_a_clear_error() -> None:
    # Eager flex attention fails under torch.func.grad too (torch has no rule for it); remat said KeyError.
    q = randn(1, H, T, D, grad=False)
    block_mask = document_mask(0)
    with pytest.raises(NotImplementedError, match=r"`flex_attention`, a higher-order op that torch.func's grad"):
        torch.func.grad(lambda q: remat.checkpoint(attention)(q, q, q, block_mask).sum())(q)


class FlexLayer(torch.nn.Module):
    """Self-attention through flex attention, handed the step's block mask."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, block_mask: Any) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, d // H).permute(2, 0, 3, 1, 4)
        y = flex.flex_attention(q, k, v, score_mod=relative_bias, block_mask=block_mask)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


class FlexModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(FlexLayer() for _ in range(3))

    def forward(self, x: torch.Tensor, block_mask: Any) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, block_mask=block_mask)
        return x


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
# Eager flex attention compiles its op with Dynamo, which reads `.grad` of non-leaf inputs, and imports
# modules that warn of `torch.jit` on some releases: torch's warnings, not remat's.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.usefixtures("flex_backward_on_cpu")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
def test_layers_handed_a_block_mask_checkpoint_in_place(compiled: bool) -> None:
    torch.manual_seed(0)
    model = FlexModel()
    checkpointed = remat.checkpoint_modules(copy.deepcopy(model), FlexLayer, policy=policies.dots_saveable)
    run = torch.compile(checkpointed) if compiled else checkpointed
    for step in range(2):
        x, block_mask = torch.randn(2, T, 16), document_mask(step)
        grads = []
        for m, call in ((model, model), (checkpointed, run)):
            m.zero_grad(set_to_none=True)
            out = call(x, block_mask)
            out.square().sum().backward()
            grads.append((out.detach(), [p.grad for p in m.parameters()]))
        torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
        for a, e in zip(grads[1][1], grads[0][1], strict=True):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    # The first layer's input needs no grad, the others' do: two traces, the third layer takes the second's.
    assert [layer.forward.cache_info().traces for layer in checkpointed.layers] == [1, 1, 0]


@pytest.fixture
def transformers_flex_uncompiled(monkeypatch: pytest.MonkeyPatch) -> Any:
    """transformers compiles flex attention with inductor, which fails on the CPU for eager models too:
    in these tests, its layers call `flex_attention` as it is."""
    transformers = pytest.importorskip("transformers")
    integration = pytest.importorskip("transformers.integrations.flex_attention")
    monkeypatch.setattr(integration.WrappedFlexAttention, "__call__", lambda self: flex.flex_attention)
    return transformers


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:_compile flag on create_block_mask:DeprecationWarning")  # transformers'
@pytest.mark.usefixtures("flex_backward_on_cpu")
@pytest.mark.parametrize("policy", POLICIES)
def test_a_transformers_model_with_flex_attention_trains_as_in_eager(
    transformers_flex_uncompiled: Any, policy: Any
) -> None:
    transformers = transformers_flex_uncompiled
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=256,
    )
    config._attn_implementation = "flex_attention"  # each layer is handed the model's BlockMask
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    checkpointed = remat.checkpoint_modules(
        copy.deepcopy(model), transformers.GradientCheckpointingLayer, policy=policy
    )
    ids = torch.randint(0, 100, (2, 128), generator=torch.Generator().manual_seed(0))
    runs = []
    for m in (model, checkpointed):
        out = m(ids, labels=ids, use_cache=False)
        out.loss.backward()
        runs.append((out.loss.detach(), {name: p.grad for name, p in m.named_parameters()}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    layers = checkpointed.model.layers
    assert [(layer.forward.cache_info().traces, layer.forward.cache_info().shared) for layer in layers] == [
        (1, 0),
        (0, 1),
    ]
