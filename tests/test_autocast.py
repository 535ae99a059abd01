"""Autocast around a checkpointed call is traced faithfully and is part of the cache key.

What must hold: the trace is keyed on the autocast state, and gradients equal
those of `fn` itself. Under autocast
the casts autocast inserts are explicit `_to_copy` calls of the trace (a policy
can save or recompute them like any other call), and the programs run with
autocast off, so nothing is cast twice.

Comparisons are exact (`torch.equal`): the checkpointed function runs the same
kernels, in the same dtypes and order, as eager autocast, and on the CPU
(bfloat16) every output and gradient is bit-identical. Tests that take `device`
also run on CUDA (float16 autocast) where a GPU exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat import policies

aten = torch.ops.aten

COTANGENT_SEED = 99

# `device` is a function-scoped fixture, but an immutable one (a torch.device):
# reusing it across hypothesis examples is safe.
FIXTURE_OK = settings(
    suppress_health_check=[*settings().suppress_health_check, HealthCheck.function_scoped_fixture],
)

POLICIES = pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.save_everything, policies.save_ops(aten._to_copy), policies.save_ops(aten.addmm)],
    ids=["save_nothing", "save_everything", "save_casts", "save_addmm"],
)


def autocast_dtype(device: torch.device) -> torch.dtype:
    """The usual autocast dtype: bfloat16 on the CPU, float16 on CUDA."""
    return torch.bfloat16 if device.type == "cpu" else torch.float16


def other_autocast_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cpu" else torch.bfloat16


class Net(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear, returning (softmax, logits); float32 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.l2 = nn.Linear(32, 8)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in self.parameters():
                scale = 1.0 / math.sqrt(param.shape[-1] if param.dim() > 1 else param.numel())
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
            self.ln.weight.add_(1.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln(F.gelu(self.l1(x)))
        logits = self.l2(h)
        return logits.softmax(dim=-1), logits


def make(device: torch.device) -> tuple[Net, torch.Tensor]:
    net = Net().to(device)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    return net, x


def run(
    fn: Callable[..., Any],
    net: nn.Module,
    x: torch.Tensor,
    dtype: torch.dtype | None,
    *,
    backward_under_autocast: bool = False,
) -> list[Any]:
    """Run `fn(x)` under autocast with `dtype` (None: no autocast), backpropagate seeded cotangents,
    and return the outputs, the input's gradient and every parameter's gradient."""
    net.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    device_type = x.device.type
    with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        outputs = list(fn(x))
        generator = torch.Generator().manual_seed(COTANGENT_SEED)
        cotangents = [torch.randn(o.shape, generator=generator).to(o.device, o.dtype) for o in outputs]
        if backward_under_autocast:
            torch.autograd.backward(outputs, cotangents)
    if not backward_under_autocast:
        torch.autograd.backward(outputs, cotangents)
    return [*(o.detach() for o in outputs), x.grad, *(p.grad for p in net.parameters())]


def assert_bit_identical(actual: list[Any], expected: list[Any]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert e is not None, f"value {i}: eager computed no gradient"
        assert a is not None, f"value {i}: expected a tensor, got None"
        assert a.dtype == e.dtype, f"value {i}: dtype {a.dtype} != eager's {e.dtype}"
        assert a.shape == e.shape
        assert torch.equal(a, e), f"value {i} differs from eager autocast (max diff {(a - e).abs().max()})"


def check(device: torch.device, policy: Any, dtype: torch.dtype | None, **kwargs: Any) -> remat.Checkpointed[..., Any]:
    net, x = make(device)
    checkpointed = remat.checkpoint(net, policy=policy)
    expected = run(net, net, x, dtype, **kwargs)
    actual = run(checkpointed, net, x, dtype, **kwargs)
    assert_bit_identical(actual, expected)
    if dtype is not None:
        # Autocast really applied: the logits (a Linear's output) are in its dtype, the gradients of float32
        # leaves in float32. (The softmax's dtype differs by device: CUDA autocast runs softmax in float32.)
        assert expected[1].dtype == dtype
        assert all(g.dtype == torch.float32 for g in expected[2:])
    return checkpointed


# --- outputs and gradients equal eager autocast --------------------------------------------------


@POLICIES
def test_autocast_matches_eager(policy: Any, device: torch.device) -> None:
    check(device, policy, autocast_dtype(device))


@POLICIES
def test_backward_inside_the_autocast_region_matches_eager(policy: Any, device: torch.device) -> None:
    check(device, policy, autocast_dtype(device), backward_under_autocast=True)


def test_other_autocast_dtype_matches_eager(device: torch.device) -> None:
    check(device, policies.save_nothing, other_autocast_dtype(device))


_trace_lengths: dict[str, int] = {}


def trace_length(device: torch.device) -> int:
    if str(device) not in _trace_lengths:
        net, x = make(device)
        with torch.autocast(device.type, dtype=autocast_dtype(device)):
            _trace_lengths[str(device)] = len(remat.trace(net, x))
    return _trace_lengths[str(device)]


@FIXTURE_OK
@given(data=st.data())
def test_random_save_calls_policy_matches_eager_autocast(device: torch.device, data: st.DataObject) -> None:
    n = trace_length(device)
    saved = data.draw(st.sets(st.integers(min_value=0, max_value=n - 1), max_size=n), label="saved calls")
    check(device, policies.save_calls(*sorted(saved)), autocast_dtype(device))


def test_autocast_disabled_inside_the_function_matches_eager(device: torch.device) -> None:
    """A region of `fn` that turns autocast off again is traced as such."""
    net, x = make(device)
    dtype = autocast_dtype(device)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, logits = net(x)
        with torch.autocast(x.device.type, enabled=False):
            full = logits.float() @ net.l2.weight  # float32 matmul inside the autocast region
        return probs, full

    expected = run(fn, net, x, dtype)
    actual = run(remat.checkpoint(fn), net, x, dtype)
    assert_bit_identical(actual, expected)
    assert expected[1].dtype == torch.float32


# --- autocast state is part of the cache key ------------------------------------------------------


def test_autocast_state_is_part_of_the_cache_key(device: torch.device) -> None:
    net, x = make(device)
    checkpointed = remat.checkpoint(net)
    dtype, other = autocast_dtype(device), other_autocast_dtype(device)

    def call_and_compare(autocast: torch.dtype | None) -> None:
        assert_bit_identical(run(checkpointed, net, x, autocast), run(net, net, x, autocast))

    call_and_compare(None)
    assert checkpointed.cache_info().traces == 1
    call_and_compare(dtype)
    assert checkpointed.cache_info().traces == 2, "turning autocast on must retrace"
    call_and_compare(None)
    call_and_compare(dtype)
    info = checkpointed.cache_info()
    assert (info.traces, info.hits) == (2, 2), f"both variants must now be cache hits: {info}"
    call_and_compare(other)
    assert checkpointed.cache_info().traces == 3, "a different autocast dtype must retrace"
    with torch.autocast(device.type, dtype=dtype, enabled=False):
        call_and_compare(None)  # autocast present but disabled is the same as no autocast
    info = checkpointed.cache_info()
    assert (info.traces, info.hits, info.size) == (3, 3, 3)


def test_trace_under_autocast_shows_the_casts(device: torch.device) -> None:
    net, x = make(device)
    dtype = autocast_dtype(device)
    plain = remat.trace(net, x)
    assert not any(call.op is aten._to_copy.default for call in plain)
    assert all(out.dtype == torch.float32 for call in plain for out in call.outputs)

    with torch.autocast(device.type, dtype=dtype):
        traced = remat.trace(net, x)
    casts = {
        (call.module, call.outputs[0].shape)
        for call in traced
        if call.op is aten._to_copy.default and call.outputs[0].dtype == dtype
    }
    # Each Linear casts its weight and bias; the first also casts its float32 input.
    assert casts >= {("l1", (32, 16)), ("l1", (32,)), ("l1", (4, 16)), ("l2", (8, 32)), ("l2", (8,))}, str(traced)
    matmuls = [call for call in traced if call.op is aten.addmm.default]
    assert len(matmuls) == 2
    assert all(call.outputs[0].dtype == dtype for call in matmuls)
    # The casts are calls a policy decides about: saving them keeps the low-precision copies backward reads.
    with torch.autocast(device.type, dtype=dtype):
        report = remat.report(net, x, policy=policies.save_ops(aten._to_copy))
    cast_rows = [row for row in report.rows if row.call.op is aten._to_copy.default]
    assert cast_rows and all(row.decision is remat.SAVE for row in cast_rows)
    weight_rows = [row for row in cast_rows if row.call.outputs[0].shape in ((32, 16), (8, 32))]
    assert len(weight_rows) == 2 and all(row.saved and not row.replayed for row in weight_rows)
    assert report.saved_bytes >= sum(row.call.nbytes for row in weight_rows)


def _bfloat16_region(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        product = (x.float() @ y.float().t()).tanh() @ y.float()
    return x + product.to(x.dtype)


def test_second_derivatives_through_a_bfloat16_region_differ_by_its_rounding_only() -> None:
    # docs/torch-func.md, "Second derivatives in low precision": eager sums a value's paths in bfloat16,
    # remat some of them in float64. First derivatives and tangents are exact.
    generator = torch.Generator().manual_seed(0)
    x, y, tangent = (torch.randn(3, 4, dtype=torch.float64, generator=generator) for _ in range(3))

    def grad_of_jvp(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        def scalar(x: torch.Tensor) -> torch.Tensor:
            out, out_tangent = torch.func.jvp(lambda x: fn(x, y), (x,), (tangent,))
            return (out.sin() + out_tangent.cos()).sum()

        return torch.func.grad(scalar)(x)

    def grad_of_grad(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        return torch.func.grad(lambda x: torch.func.grad(lambda x: fn(x, y).sin().sum())(x).cos().sum())(x)

    def grad_and_tangent(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        gradient = torch.func.grad(lambda x: fn(x, y).sin().sum())(x)
        return gradient, torch.func.jvp(lambda x: fn(x, y), (x,), (tangent,))[1]

    checkpointed = remat.checkpoint(_bfloat16_region)
    for exact, got in zip(grad_and_tangent(_bfloat16_region), grad_and_tangent(checkpointed), strict=True):
        assert torch.equal(got, exact)
    for second_order in (grad_of_grad, grad_of_jvp):
        expected, got = second_order(_bfloat16_region), second_order(checkpointed)
        assert not torch.equal(got, expected)  # the sums meet elsewhere: see the docs; if equal, update them
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())


def _layer_applied_twice(layer: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(torch.tanh(layer(x))).float()

    return fn


def test_a_weight_used_twice_in_a_region_is_cast_once_as_in_eager() -> None:
    # NOTE [autocast's cache of casts]: eager casts the leaf weight once and sums both uses' gradients in
    # bfloat16; a trace with autocast's cache off cast it twice and summed them in float32.
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    fn = _layer_applied_twice(layer)
    checkpointed = remat.checkpoint(fn)
    for x in (torch.randn(4, 8, requires_grad=True), torch.randn(4, 8).requires_grad_() * 1.0):
        expected = torch.autograd.grad(fn(x).pow(2).sum(), [x, layer.weight, layer.bias])
        got = torch.autograd.grad(checkpointed(x).pow(2).sum(), [x, layer.weight, layer.bias])
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(g, e)
    casts = [c for c in remat.trace(fn, x) if c.op is aten._to_copy.default and c.outputs[0].dtype == torch.bfloat16]
    assert len(casts) == 3  # the weight once, the bias once, the input once (the second input is the tanh)
    assert checkpointed.cache_info().traces == 2  # a leaf input and a non-leaf one: autocast caches only the first


def test_an_input_leaf_used_twice_in_a_region_is_cast_once_as_in_eager() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ((x @ x.t()).tanh() @ x).float()

    x = torch.randn(3, 4, requires_grad=True)
    (expected,) = torch.autograd.grad(fn(x).sum(), x)
    (got,) = torch.autograd.grad(remat.checkpoint(fn)(x).sum(), x)
    assert torch.equal(got, expected)
