"""`remat.checkpoint` composes with `torch.func` and with higher-order autograd (issue 4).

The property under test, for every transform T and every policy p:

    T(remat.checkpoint(f, policy=p)) == T(f)

for a GPT-2-style block and an MLP in float64, under `save_nothing`,
`save_everything` and hypothesis-drawn `save_calls` subsets. Around it:
both nesting orders (`vmap(checkpoint(f))` and `checkpoint(vmap(f))`, a
checkpointed function that differentiates inside), vmap randomness, plain
double backward (through dropout, `no_grad` and `detach`), `gradcheck` and
`gradgradcheck`, forward-mode dual tensors, nested checkpoints with their own
policies, and the trace cache under transforms (one trace at the logical,
per-example shape, shared with plain calls).

The GPT-2 block uses `attention="softmax"`: `F.scaled_dot_product_attention`'s
CPU kernel has no vmap batching rule (a performance warning, an error under
`filterwarnings = error`) and no double backward even in eager, so it cannot
take part in most of these transforms with or without remat.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import models
import optree
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import _quirks, _torch, policies
from remat.testing import assert_checkpoint_equivalent

aten = torch.ops.aten
DTYPE = torch.float64

# float64, same aten kernels as eager: differences are round-off. Transforms that
# batch (vmap, jacrev, jacfwd, hessian) may pick other kernels (a batched matmul for
# a per-example mm) that sum in another order, so they get the same slack.
RTOL = 1e-9
ATOL = 1e-10

# Hypothesis examples per property: each example traces a fresh checkpointed function
# (about 0.1-0.5 s for the GPT-2 block), so the properties below take a fraction of the
# profile's budget. Under the `soak` profile this still scales up.
FEW = settings(max_examples=max(2, settings.default.max_examples // 5))
# For the property parametrized over the transforms (twelve of them): fewer still per transform.
FEWER = settings(max_examples=max(2, settings.default.max_examples // 10))

POLICIES = {"save_nothing": policies.save_nothing, "save_everything": policies.save_everything}
FIXED_POLICIES = pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
# A few more for the small functions (cheap to trace): one that saves some calls and not others.
SEVERAL_POLICIES = pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.save_everything, policies.save_ops(aten.mm, aten.addmm), policies.save_calls(0)],
    ids=["save_nothing", "save_everything", "save_mm_addmm", "save_calls_0"],
)


# --- models ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    """A module, an example input `x` of it, and a per-feature scale `s` (a small second argument)."""

    module: nn.Module
    x: torch.Tensor  # one example (a batch of sequences for the block, a batch of rows for the MLP)
    s: torch.Tensor

    def fn(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The function under test: two tensor arguments, module parameters closed over."""
        return self.module(x * s)

    def stacked(self, n: int = 3, seed: int = 11) -> torch.Tensor:
        """`n` examples shaped like `x`, stacked on a new leading dimension (for vmap)."""
        return models.randn(n, *self.x.shape, seed=seed, requires_grad=False)


@functools.cache
def model(name: str) -> Model:
    if name == "mlp":
        width = 8
        module: nn.Module = models.mlp(depth=3, width=width)
        x = models.randn(3, width, seed=1, requires_grad=False)
    else:
        width = 16
        module = models.GPT2Block(d=width, heads=2, attention="softmax")
        x = models.randn(2, 4, width, seed=1, requires_grad=False)
    s = (1.0 + 0.1 * models.randn(width, seed=2, requires_grad=False)).contiguous()
    return Model(module, x, s)


MODEL_NAMES = ["mlp", "gpt2"]


@functools.cache
def trace_length(name: str) -> int:
    m = model(name)
    return len(remat.trace(m.fn, m.x, m.s))


def random_policy(data: st.DataObject, n: int, label: str = "saved calls") -> policies.Policy:
    subset = data.draw(st.sets(st.integers(min_value=0, max_value=n - 1), max_size=n), label=label)
    return policies.save_calls(*sorted(subset))


# --- helpers ---------------------------------------------------------------------------------------


def assert_trees_close(actual: Any, expected: Any, *, rtol: float = RTOL, atol: float = ATOL) -> None:
    actual_leaves, actual_spec = optree.tree_flatten(actual)
    expected_leaves, expected_spec = optree.tree_flatten(expected)
    assert actual_spec == expected_spec, f"structure differs: {actual_spec} != {expected_spec}"
    assert expected_leaves, "nothing to compare"
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves, strict=True)):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, i=i: f"leaf {i}: {m}")


def cotangent_like(t: torch.Tensor, seed: int = 1234) -> torch.Tensor:
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed), dtype=t.dtype)


def scalar_loss(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A scalar of `fn`'s output with non-zero second derivatives."""
    return lambda x, s: fn(x, s).tanh().square().sum()


# --- the transforms: each maps (fn, model) to a pytree of tensors ------------------------------------


def _grad_argnums_has_aux(fn: Callable, m: Model) -> Any:
    def loss_and_aux(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = fn(x, s)
        return out.tanh().square().sum(), {"out": out, "mean": out.mean()}

    return grad(loss_and_aux, argnums=(0, 1), has_aux=True)(m.x, m.s)


def _grad_and_value(fn: Callable, m: Model) -> Any:
    return grad_and_value(scalar_loss(fn), argnums=1)(m.x, m.s)


def _vjp(fn: Callable, m: Model) -> Any:
    out, pullback = vjp(fn, m.x, m.s)
    return out, pullback(cotangent_like(out))


def _jacrev(fn: Callable, m: Model) -> Any:
    return jacrev(fn, argnums=(0, 1))(m.x, m.s)


def _jacfwd(fn: Callable, m: Model) -> Any:
    return jacfwd(fn, argnums=(0, 1))(m.x, m.s)


def _jvp(fn: Callable, m: Model) -> Any:
    return jvp(fn, (m.x, m.s), (cotangent_like(m.x, 1), cotangent_like(m.s, 2)))


def _jvp_of_vmap(fn: Callable, m: Model) -> Any:
    # Forward mode over a batch: the checkpoint's jvp rule runs on batched tensors.
    stacked = m.stacked()
    return jvp(vmap(fn, in_dims=(0, None)), (stacked, m.s), (cotangent_like(stacked, 1), cotangent_like(m.s, 2)))


def _forward_ad_of_vmap(fn: Callable, m: Model) -> Any:
    stacked = m.stacked()
    with fwAD.dual_level():
        dual = fwAD.make_dual(stacked, cotangent_like(stacked, 1))
        primal, tangent = fwAD.unpack_dual(vmap(fn, in_dims=(0, None))(dual, m.s))
    return primal, tangent


def _hessian(fn: Callable, m: Model) -> Any:
    # A scalar function of the small input `s` (8 or 16 numbers): a 16 x 16 Hessian at most.
    return hessian(scalar_loss(fn), argnums=1)(m.x, m.s)


def _jacrev_of_jacfwd(fn: Callable, m: Model) -> Any:
    # Reverse over forward: the checkpoint's jvp rule, under vmap, differentiated by an outer grad level.
    return jacrev(jacfwd(scalar_loss(fn), argnums=1), argnums=1)(m.x, m.s)


def _vmap_in_dims_out_dims(fn: Callable, m: Model) -> Any:
    return vmap(fn, in_dims=(0, None), out_dims=1)(m.stacked(), m.s)


def _vmap_in_dim_1(fn: Callable, m: Model) -> Any:
    # The batch dimension in the middle: per-example tensors are not contiguous views.
    return vmap(fn, in_dims=(1, None))(m.stacked().movedim(0, 1), m.s)


def _vmap_grad(fn: Callable, m: Model) -> Any:
    # Per-sample gradients, with respect to the example and to the shared scale.
    return vmap(grad(scalar_loss(fn), argnums=(0, 1)), in_dims=(0, None))(m.stacked(), m.s)


def _grad_grad(fn: Callable, m: Model) -> Any:
    def of_gradient(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        gx, gs = grad(scalar_loss(fn), argnums=(0, 1))(x, s)
        return gx.sin().sum() + gs.square().sum()

    return grad(of_gradient, argnums=(0, 1))(m.x, m.s)


def _grad_grad_inner_wrt_s_only(fn: Callable, m: Model) -> Any:
    # The outer grad differentiates `x`, which the inner grad does not: at the inner level
    # `x` does not require grad, but the outer level needs the derivative through it.
    def of_gradient(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return grad(scalar_loss(fn), argnums=1)(x, s).sin().sum()

    return grad(of_gradient, argnums=(0, 1))(m.x, m.s)


TRANSFORMS: dict[str, Callable[[Callable, Model], Any]] = {
    "grad_argnums_has_aux": _grad_argnums_has_aux,
    "grad_and_value": _grad_and_value,
    "vjp": _vjp,
    "jacrev": _jacrev,
    "jacfwd": _jacfwd,
    "jvp": _jvp,
    "jvp_of_vmap": _jvp_of_vmap,
    "forward_ad_of_vmap": _forward_ad_of_vmap,
    "hessian": _hessian,
    "jacrev_of_jacfwd": _jacrev_of_jacfwd,
    "vmap_in_dims_out_dims": _vmap_in_dims_out_dims,
    "vmap_in_dim_1": _vmap_in_dim_1,
    "vmap_grad": _vmap_grad,
    "grad_grad": _grad_grad,
    "grad_grad_inner_wrt_s_only": _grad_grad_inner_wrt_s_only,
}


def _jacrev_of_jacrev(fn: Callable, m: Model) -> Any:
    return jacrev(jacrev(scalar_loss(fn), argnums=1), argnums=1)(m.x, m.s)


# Where eager's own result is off, the same derivative by a route eager takes exactly: eager's `jacrev` of
# `jacfwd` of a layer norm is off (NOTE [tangents that will be differentiated]); the Hessian by reverse
# over reverse is not.
EXACT_ROUTE = {"jacrev_of_jacfwd": _jacrev_of_jacrev}


def check_transform(transform: str, model_name: str, policy: Any) -> None:
    m = model(model_name)
    expected = EXACT_ROUTE.get(transform, TRANSFORMS[transform])(m.fn, m)
    checkpointed = remat.checkpoint(m.fn, policy=policy)
    actual = TRANSFORMS[transform](checkpointed, m)
    assert_trees_close(actual, expected)
    assert checkpointed.cache_info().traces >= 1  # it really ran through remat


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@FIXED_POLICIES
def test_transform_matches_eager(transform: str, model_name: str, policy: Any) -> None:
    check_transform(transform, model_name, policy)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@FEWER
@given(data=st.data(), model_name=st.sampled_from(MODEL_NAMES))
def test_transform_matches_eager_random_policy(transform: str, data: st.DataObject, model_name: str) -> None:
    check_transform(transform, model_name, random_policy(data, trace_length(model_name)))


def _second_tangent(fn: Callable, m: Model) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    def tangent(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return jvp(fn, (x, s), (cotangent_like(m.x, 1), cotangent_like(m.s, 2)))[1]

    return lambda x, s: jvp(tangent, (x, s), (cotangent_like(m.x, 3), cotangent_like(m.s, 4)))


def _jvp_of_jvp(fn: Callable, m: Model) -> Any:
    return _second_tangent(fn, m)(m.x, m.s)


def _jacfwd_of_jacfwd(fn: Callable, m: Model) -> Any:
    return jacfwd(jacfwd(scalar_loss(fn), argnums=1), argnums=1)(m.x, m.s)


def _grad_of_jvp_of_jvp(fn: Callable, m: Model) -> Any:
    return grad(lambda x, s: _second_tangent(fn, m)(x, s)[1].sin().sum(), argnums=(0, 1))(m.x, m.s)


FORWARD_OVER_FORWARD = {
    "jvp_of_jvp": _jvp_of_jvp,
    "jacfwd_of_jacfwd": _jacfwd_of_jacfwd,
    "grad_of_jvp_of_jvp": _grad_of_jvp_of_jvp,
}


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("transform", list(FORWARD_OVER_FORWARD))
@FIXED_POLICIES
def test_regression_forward_mode_over_forward_mode_runs_as_written(
    transform: str, model_name: str, policy: Any
) -> None:
    # torch does not differentiate an autograd.Function's jvp rule at an outer forward-mode level: the
    # checkpoint's second derivatives came out zero, without an error. Forward mode keeps nothing for a
    # backward: under two levels of it the function runs as written. NOTE [forward mode over forward mode]
    m = model(model_name)
    expected = FORWARD_OVER_FORWARD[transform](m.fn, m)
    assert max(t.abs().max() for t in optree.tree_leaves(expected)) > 1e-3  # the zeros would show
    checkpointed = remat.checkpoint(m.fn, policy=policy)
    assert_trees_close(FORWARD_OVER_FORWARD[transform](checkpointed, m), expected)
    assert checkpointed.cache_info().traces == 0
    jvp(checkpointed, (m.x, m.s), (cotangent_like(m.x, 1), cotangent_like(m.s, 2)))  # one level: traced
    assert checkpointed.cache_info().traces == 1


def _backward_of_forward_ad(fn: Callable, x: torch.Tensor, s: torch.Tensor, *, batched: bool) -> Any:
    s = s.detach().requires_grad_()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, cotangent_like(x, 1))
        out = fwAD.unpack_dual(vmap(fn, in_dims=(0, None))(dual, s) if batched else fn(dual, s))
    loss = out.tangent.sin().sum() + out.primal.square().sum()
    return out.tangent, torch.autograd.grad(loss, s)


def _backward_of_a_finite_difference_tangent(fn: Callable, x: torch.Tensor, s: torch.Tensor, *, batched: bool) -> Any:
    """`_backward_of_forward_ad` with the tangent taken by central differences: exact where eager's tangent
    formula is not differentiated exactly (layer norm's: NOTE [tangents that will be differentiated])."""
    s = s.detach().requires_grad_()
    mapped = vmap(fn, in_dims=(0, None)) if batched else fn
    step, direction = 1e-6, cotangent_like(x, 1)
    primal = mapped(x, s)
    tangent = (mapped(x + step * direction, s) - mapped(x - step * direction, s)) / (2 * step)
    loss = tangent.sin().sum() + primal.square().sum()
    return tangent, torch.autograd.grad(loss, s)


def _layer_norm(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x * s, s.shape).tanh()


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "under_vmap"])
@pytest.mark.parametrize("fn", ["mlp", "layer_norm"])
@SEVERAL_POLICIES
def test_regression_backward_of_a_forward_ad_tangent(fn: str, batched: bool, policy: Any) -> None:
    # The jvp rule detached what it kept, so that autograd met a tangent without history (an error
    # beside eager's result, or a gradient missing the tangent's part); differentiating vector-Jacobian
    # products instead of running forward mode made layer norm's second derivatives wrong, without an
    # error. Under vmap the tangents are read beneath the batching: NOTE [forward-mode tangents under vmap].
    m = model("mlp")
    f, x, s = (m.fn, m.x, m.s) if fn == "mlp" else (_layer_norm, models.randn(3, 5, seed=3), models.randn(5, seed=4))
    x = x.detach()
    if batched:
        x = torch.stack([x, x.flip(0).sin()])
    expected = _backward_of_forward_ad(f, x, s, batched=batched)
    assert expected[1][0].abs().max() > 1e-3
    got = _backward_of_forward_ad(remat.checkpoint(f, policy=policy), x, s, batched=batched)
    if fn == "mlp":
        assert_trees_close(got, expected)
        return
    # Eager's derivative of layer norm's tangent is off: remat's is the finite differences' (and the
    # tangent itself eager's).
    exact = _backward_of_a_finite_difference_tangent(f, x, s, batched=batched)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1][0], exact[1][0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected[1][0], exact[1][0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("transform", ["grad_of_jvp", "grad_of_forward_ad"])
def test_the_checker_holds_a_detached_value_constant_where_eager_is_off(transform: str) -> None:
    # The 2.13 soak's find: eager's derivative of batch norm's tangent is off, and remat's exact (it equals
    # eager's over a batch norm written by hand), but the checker's finite-difference reference saw through
    # the `detach` (its step moved the detached value too) and reported remat as differing.
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        b = b.abs()
        stacked = torch.stack([b * b.detach().sin(), 0.5 * a + 1.0]).transpose(1, 2)
        return F.batch_norm(stacked, None, None, training=True)

    a = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([[-2.1788, 0.5684]], dtype=torch.float64)
    assert_checkpoint_equivalent(fn, a, b, transforms=[transform])


def _log_softmax_of_a_returned_constant(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log_softmax(x, 1) + s, x


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "under_vmap"])
@SEVERAL_POLICIES
def test_regression_backward_of_a_forward_ad_tangent_through_an_input_without_grad(batched: bool, policy: Any) -> None:
    # `x` carries a tangent but does not require grad, and is returned: remat kept it as the Function's
    # output, which requires grad because `s` does, so autograd recorded log_softmax's tangent formula,
    # which eager never records and torch cannot differentiate (it updates a saved `exp` in place).
    x, s = models.randn(3, 5, seed=10, requires_grad=False), models.randn(5, seed=11)
    if batched:
        x = torch.stack([x, x.flip(0).cos()])
    f = _log_softmax_of_a_returned_constant

    def backward_of_forward_ad(fn: Callable) -> Any:
        return _backward_of_forward_ad(lambda x, s: fn(x, s)[0], x, s, batched=batched)

    expected = backward_of_forward_ad(f)
    assert expected[1][0].abs().max() > 1e-3
    assert_trees_close(backward_of_forward_ad(remat.checkpoint(f, policy=policy)), expected)
    fn = remat.testing.RandomFunction(
        (1, 2), 2, (remat.testing.Step("log_softmax", 1, 1), remat.testing.Step("add", 2, 0)), (3, 1)
    )
    args = models.randn(1, 2, seed=12), models.randn(1, 2, seed=13, requires_grad=False)
    assert_checkpoint_equivalent(fn, *args, policy=policy, transforms=["grad_of_forward_ad"])


def _write_through_a_row(x: torch.Tensor) -> torch.Tensor:
    t = x.clone()
    t[:, 0].mul_(2.0)
    return t.sin()


def _write_through_a_row_then_var_mean(x: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(_write_through_a_row(x), dim=1, keepdim=True)
    return (x - mean) / (var + 1.0).sqrt()


# functorch's own warning (eager's too): no batching rule for the `copy` of the in-place write.
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize("fn", [_write_through_a_row, _write_through_a_row_then_var_mean])
@SEVERAL_POLICIES
def test_regression_reverse_over_forward_over_vmap_of_a_write_through_a_row(fn: Callable, policy: Any) -> None:
    # The write functionalizes into `select_scatter`, whose forward-mode derivative under vmap torch gets
    # wrong to an outer grad (found by the checker's "grad_of_jvp_of_vmap"). NOTE [a select scatter runs
    # as a slice scatter]
    x = models.randn(3, 4, seed=5)
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=["grad_of_jvp_of_vmap", "jvp_of_vmap", "vmap_of_jvp"])
    stacked = models.randn(2, 3, 4, seed=6, requires_grad=False)
    tangents, cotangents = models.randn(2, 3, 4, seed=7), models.randn(2, 3, 4, seed=8)

    def reverse_over_forward(f: Callable) -> torch.Tensor:
        return grad(lambda x: (jvp(vmap(f), (x,), (tangents.detach(),))[1] * cotangents.detach()).sum())(stacked)

    assert_trees_close(reverse_over_forward(remat.checkpoint(fn, policy=policy)), reverse_over_forward(fn))


@pytest.mark.parametrize("op", sorted(remat.testing.AS_STRIDED_WRITES))
@SEVERAL_POLICIES
def test_regression_reverse_over_forward_of_a_write_through_as_strided(op: str, policy: Any) -> None:
    # torch's forward-mode derivative of `as_strided_scatter` is wrong to an outer grad: grad(jvp(f))
    # differed from eager's without an error (found by the checker's "grad_of_jvp"). NOTE [a write
    # through as_strided runs as one]
    fn = remat.testing.RandomFunction((3, 4), 1, (remat.testing.Step(op, 0, 0), remat.testing.Step("sin", 1, 1)), (2,))
    assert_checkpoint_equivalent(fn, models.randn(3, 4, seed=9), policy=policy, transforms=["grad_of_jvp", "jvp"])


def _trace_of_sin(x: torch.Tensor) -> torch.Tensor:
    return torch.trace(x.sin()) * x


@pytest.mark.parametrize("fn", [torch.trace, _trace_of_sin], ids=["trace", "trace_of_sin"])
@SEVERAL_POLICIES
def test_regression_vmap_of_a_fill_by_the_batched_gradient(fn: Callable, policy: Any) -> None:
    # `trace`'s gradient fills zeros by the incoming gradient (`index_fill`), batched under vmap; torch's
    # batching rule gave every example the last example's gradient, without an error (found by the
    # checker's "vmap" over OpInfo). NOTE [an index fill of a batched value]
    x = models.randn(5, 5, seed=10)
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=["vmap", "grad_of_jvp_of_vmap", "vmap_of_jvp"])
    stacked = models.randn(2, 5, 5, seed=11)
    weights = torch.tensor([1.0, 10.0], dtype=torch.float64).reshape(2, *[1] * fn(x).dim())  # one per example
    (got,) = torch.autograd.grad((vmap(remat.checkpoint(fn, policy=policy))(stacked) * weights).sum(), stacked)
    (expected,) = torch.autograd.grad((vmap(fn)(stacked) * weights).sum(), stacked)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@SEVERAL_POLICIES
def test_regression_vmap_of_a_write_through_a_slice_that_ends_before_the_end(policy: Any) -> None:
    # `t[:, 1:-1]` functionalizes into a `slice_scatter` ending at -1, which torch's batching rule refuses
    # ("upper bound and lower bound inconsistent with step sign"). NOTE [slice scatters count from the start]
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x * 2
        t[:, 1:-1][1:].mul_(2)
        t[-3:-1, :-2].add_(1)
        return t.sin()

    assert_checkpoint_equivalent(fn, models.randn(5, 4, seed=14), policy=policy, transforms=["vmap", "jvp_of_vmap"])


_B = models.randn(4, 2, seed=12, requires_grad=False)
LU_FACTORED = {
    "solve": lambda a: torch.linalg.solve(a, _B).sin().sum(),
    "det": lambda a: torch.linalg.det(a),
    "slogdet": lambda a: torch.linalg.slogdet(a).logabsdet,
}


def _well_conditioned() -> torch.Tensor:
    return (models.randn(4, 4, seed=13, requires_grad=False) + 4 * torch.eye(4, dtype=torch.float64)).requires_grad_()


@pytest.mark.parametrize("name", sorted(LU_FACTORED))
@SEVERAL_POLICIES
def test_second_derivatives_through_gradients_that_read_lu_factors_equal_eager(name: str, policy: Any) -> None:
    # The traced gradient formula reuses the forward's LU factors, which autograd does not differentiate:
    # differentiated again, it came out silently wrong, then was refused. A backward that will be
    # differentiated now runs eager's formulas in grad mode (NOTE [a backward that will be differentiated]).
    fn = LU_FACTORED[name]
    checkpointed = remat.checkpoint(fn, policy=policy)
    a = _well_conditioned()
    for second in (
        lambda f: hessian(f)(a.detach()),
        lambda f: jacrev(jacrev(f))(a.detach()),
        lambda f: grad(lambda x: grad(f)(x).square().sum())(a.detach()),
        lambda f: torch.autograd.grad(torch.autograd.grad(f(a), a, create_graph=True)[0].square().sum(), a),
    ):
        torch.testing.assert_close(second(checkpointed), second(fn), rtol=1e-10, atol=1e-10)
    # First derivatives, by any route, are eager's (a gradient made with grad mode on too, used as it is),
    # laid out as eager's: under `grad` eager's det formula, with grad mode on, lays its gradient out
    # otherwise than `.backward()`'s.
    assert_checkpoint_equivalent(fn, a, policy=policy, transforms=["jvp", "vmap"])
    for first in (
        lambda f: grad(f)(a.detach()),
        lambda f: vjp(f, a.detach())[1](torch.tensor(1.5, dtype=torch.float64))[0],
        lambda f: torch.autograd.grad(f(a), a, create_graph=True)[0],
        lambda f: torch.autograd.grad(f(a), a)[0],
    ):
        ours, eager = first(checkpointed), first(fn)
        torch.testing.assert_close(ours, eager, rtol=1e-12, atol=1e-12)
        assert ours.stride() == eager.stride()


def test_a_single_grad_through_a_gradient_that_reads_lu_factors_runs_the_traced_backward() -> None:
    # Found by the 2.15 soak (`bernoulli_transposed_attention_`, then `slogdet`): under one `torch.func.grad`
    # the backward's input requires grad only at the level running it, so nothing differentiates it again;
    # it took autograd's route over the pure forward all the same, laid its gradient out as the trace had
    # it, (1, 2), where eager's is (2, 1). The traced backward runs there now, as for `.backward()`.
    fn = remat.testing.RandomFunction(
        (2, 2),
        1,
        (remat.testing.Step("bernoulli_transposed_attention_", 0, 0), remat.testing.Step("slogdet", 1, 1)),
        (2,),
    )
    x = torch.tensor([[1.5410, -0.2934], [-2.1788, 0.5684]], dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["grad", "grad_of_grad", "double_backward"])


@pytest.mark.parametrize("name", sorted(LU_FACTORED))
def test_the_vjp_of_a_pullback_called_inside_it_through_gradients_that_read_lu_factors(name: str) -> None:
    # A Hessian-vector product by two `vjp`s: the inner pullback runs after its level has ended, inside the
    # outer `vjp`. Its backward takes autograd's route over the pure forward, whose `torch.func.vjp` got the
    # kept input still wrapped at the ended level: torch's internal assert "level <= current_level".
    fn = LU_FACTORED[name]
    checkpointed = remat.checkpoint(fn)
    a, v = _well_conditioned().detach(), models.randn(4, 4, seed=15, requires_grad=False)

    def hessian_vector_product(f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        def gradient(x: torch.Tensor) -> torch.Tensor:
            value, pullback = vjp(f, x)
            return pullback(torch.ones_like(value))[0]

        return vjp(gradient, a)[1](v)[0]

    torch.testing.assert_close(hessian_vector_product(checkpointed), hessian_vector_product(fn), rtol=1e-10, atol=1e-10)


def test_transforms_are_not_blind() -> None:
    # The comparisons above would pass vacuously if the transforms gave zeros, or if the
    # scale did not reach the output: the model and the jacobian must be non-trivial.
    for name in MODEL_NAMES:
        m = model(name)
        jac_s = jacrev(m.fn, argnums=1)(m.x, m.s)
        assert jac_s.abs().max() > 1e-3
        assert trace_length(name) >= 5


# --- functional_call: per-sample gradients of a checkpointed module ----------------------------------


def _per_sample_grads(module: nn.Module, params: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor) -> Any:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(module, params, (x.unsqueeze(0),))
        return F.mse_loss(out, y.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, ys)


def check_per_sample_grads(model_name: str, policy: Any) -> None:
    m = model(model_name)
    checkpointed = remat.checkpoint(m.module, policy=policy)
    assert isinstance(checkpointed, remat.CheckpointedModule)
    names = [name for name, _ in m.module.named_parameters()]
    assert [name for name, _ in checkpointed.named_parameters()] == names
    # Parameters other than the module's own: functional_call must use these values.
    params = {
        name: (p.detach() + 0.05 * cotangent_like(p, seed=k)).contiguous()
        for k, (name, p) in enumerate(m.module.named_parameters())
    }
    xs = m.stacked(4, seed=21)[:, 0]  # 4 examples, each shaped like one row/sequence of `x`
    ys = m.stacked(4, seed=22)[:, 0]
    expected = _per_sample_grads(m.module, params, xs, ys)
    actual = _per_sample_grads(checkpointed, params, xs, ys)
    assert list(actual) == names
    assert_trees_close(actual, expected)
    assert checkpointed.cache_info().traces >= 1
    # Per-sample gradients differ from sample to sample, and differ from those at the module's own parameters.
    some = names[0]
    assert not torch.allclose(actual[some][0], actual[some][1])
    at_own = _per_sample_grads(m.module, dict(m.module.named_parameters()), xs, ys)
    assert not torch.allclose(actual[some], at_own[some])


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@FIXED_POLICIES
def test_per_sample_grads_with_functional_call(model_name: str, policy: Any) -> None:
    check_per_sample_grads(model_name, policy)


@FEW
@given(data=st.data(), model_name=st.sampled_from(MODEL_NAMES))
def test_per_sample_grads_with_functional_call_random_policy(data: st.DataObject, model_name: str) -> None:
    m = model(model_name)
    n = len(remat.trace(m.module, m.x[:1]))
    check_per_sample_grads(model_name, random_policy(data, n))


@FIXED_POLICIES
def test_per_sample_grads_sum_to_the_batch_gradient(policy: Any) -> None:
    m = model("mlp")
    checkpointed = remat.checkpoint(m.module, policy=policy)
    params = dict(m.module.named_parameters())
    xs, ys = m.stacked(4, seed=21)[:, 0], m.stacked(4, seed=22)[:, 0]
    per_sample = _per_sample_grads(checkpointed, params, xs, ys)
    batch_loss = F.mse_loss(checkpointed(xs), ys, reduction="none").mean(dim=1).sum()
    batch_grads = torch.autograd.grad(batch_loss, list(params.values()))
    for (name, total), g in zip(per_sample.items(), batch_grads, strict=True):
        torch.testing.assert_close(total.sum(0), g, rtol=RTOL, atol=ATOL, msg=lambda msg, name=name: f"{name}: {msg}")


# --- nesting orders ----------------------------------------------------------------------------------


def check_checkpoint_of_vmap(model_name: str, policy: Any) -> None:
    m = model(model_name)
    batched = vmap(m.fn, in_dims=(0, None))
    xs = m.stacked().requires_grad_()
    s = m.s.clone().requires_grad_()
    assert_checkpoint_equivalent(batched, xs, s, policy=policy, params=m.module.parameters())


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@FIXED_POLICIES
def test_checkpoint_of_vmap_backward_matches_eager(model_name: str, policy: Any) -> None:
    check_checkpoint_of_vmap(model_name, policy)


@FEW
@given(data=st.data(), model_name=st.sampled_from(MODEL_NAMES))
def test_checkpoint_of_vmap_random_policy(data: st.DataObject, model_name: str) -> None:
    m = model(model_name)
    n = len(remat.trace(vmap(m.fn, in_dims=(0, None)), m.stacked().requires_grad_(), m.s))
    check_checkpoint_of_vmap(model_name, random_policy(data, n))


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@FIXED_POLICIES
def test_vmap_of_checkpoint_then_backward_matches_eager(model_name: str, policy: Any) -> None:
    # vmap outside, plain autograd around it: the gradients reach the batched input, the
    # shared scale and the module's parameters, as in eager.
    m = model(model_name)
    checkpointed = remat.checkpoint(m.fn, policy=policy)
    xs = m.stacked().requires_grad_()
    s = m.s.clone().requires_grad_()
    assert_checkpoint_equivalent(
        vmap(m.fn, in_dims=(0, None)),
        xs,
        s,
        checkpointed=vmap(checkpointed, in_dims=(0, None)),
        params=m.module.parameters(),
    )


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@FIXED_POLICIES
def test_checkpoint_of_vmap_with_parameters_as_arguments(model_name: str, policy: Any) -> None:
    # checkpoint(vmap(f)) where nothing is closed over: the parameters come in through functional_call.
    m = model(model_name)

    def batched(params: dict[str, torch.Tensor], xs: torch.Tensor) -> torch.Tensor:
        return vmap(lambda x: functional_call(m.module, params, (x,)))(xs)

    params = {name: p.detach().clone().requires_grad_() for name, p in m.module.named_parameters()}
    assert_checkpoint_equivalent(batched, params, m.stacked().requires_grad_(), policy=policy)


@FIXED_POLICIES
def test_grad_of_checkpoint_of_vmap_matches_eager(policy: Any) -> None:
    m = model("mlp")
    batched = vmap(m.fn, in_dims=(0, None))
    checkpointed = remat.checkpoint(batched, policy=policy)
    xs = m.stacked()
    expected = grad(scalar_loss(batched), argnums=(0, 1))(xs, m.s)
    actual = grad(scalar_loss(checkpointed), argnums=(0, 1))(xs, m.s)
    assert_trees_close(actual, expected)


def _gradient_of_module(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> a function of d(sum tanh(module(x))^2)/dx, computed with torch.func.grad inside."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return grad(lambda x: module(x).tanh().square().sum())(x).sin()

    return fn


@FIXED_POLICIES
def test_checkpoint_of_a_function_that_calls_torch_func_grad(policy: Any) -> None:
    # The function differentiates a module it closes over with torch.func.grad; its own
    # gradient (a second derivative, for the input and for the module's parameters) must
    # equal eager's.
    m = model("mlp")
    fn = _gradient_of_module(m.module)
    assert_checkpoint_equivalent(fn, m.x.clone().requires_grad_(), policy=policy, params=m.module.parameters())


@FIXED_POLICIES
def test_checkpoint_of_a_function_that_calls_torch_func_grad_on_its_arguments(policy: Any) -> None:
    # The same, with the parameters passed in (functional_call) rather than closed over.
    m = model("mlp")

    def fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return grad(lambda x: functional_call(m.module, params, (x,)).tanh().square().sum())(x).sin()

    params = {name: p.detach().clone().requires_grad_() for name, p in m.module.named_parameters()}
    assert_checkpoint_equivalent(fn, params, m.x.clone().requires_grad_(), policy=policy)


@FIXED_POLICIES
def test_checkpoint_of_a_function_that_calls_autograd_grad(policy: Any) -> None:
    # A gradient penalty: the checkpointed function differentiates inside with create_graph=True.
    m = model("mlp")

    def fn(x: torch.Tensor) -> torch.Tensor:
        (gx,) = torch.autograd.grad(m.module(x).tanh().square().sum(), x, create_graph=True)
        return gx.square().sum(dim=1)

    assert_checkpoint_equivalent(fn, m.x.clone().requires_grad_(), policy=policy, params=m.module.parameters())


# --- vmap randomness ---------------------------------------------------------------------------------


def _dropout_fn(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x.tanh(), p=0.5, training=True).sin() * 2


def _seeded(thunk: Callable[[], Any], seed: int = 0) -> tuple[Any, torch.Tensor]:
    """Run `thunk` from a seeded global generator; return its result and the numbers drawn next."""
    torch.manual_seed(seed)
    result = thunk()
    return result, torch.rand(8, dtype=DTYPE)


def _assert_trees_equal(actual: Any, expected: Any) -> None:
    actual_leaves, actual_spec = optree.tree_flatten(actual)
    expected_leaves, expected_spec = optree.tree_flatten(expected)
    assert actual_spec == expected_spec
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        assert torch.equal(a, e), f"not bit-identical: max difference {(a - e).abs().max()}"


@SEVERAL_POLICIES
def test_vmap_randomness_different_dropout_is_bit_identical(policy: Any) -> None:
    xs = models.randn(4, 3, 8, seed=5, requires_grad=False)
    checkpointed = remat.checkpoint(_dropout_fn, policy=policy)
    expected, expected_next = _seeded(lambda: vmap(_dropout_fn, randomness="different")(xs))
    actual, actual_next = _seeded(lambda: vmap(checkpointed, randomness="different")(xs))
    assert torch.equal(actual, expected)
    assert torch.equal(actual_next, expected_next)
    # Different masks per example (the comparison is not blind): some example differs from the first.
    zeros = expected == 0
    assert zeros.any() and not all(torch.equal(zeros[0], zeros[i]) for i in range(1, 4))


def _vmapped_backward(fn: Callable, randomness: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`vmap(fn)` of a batch of 4 and backward: the outputs and the gradient of the batch."""
    xs = models.randn(4, 3, 8, seed=5)
    out = vmap(fn, randomness=randomness)(xs)
    out.backward(cotangent_like(out))
    return out.detach(), xs.grad


_WEIGHT = models.randn(3, 8, seed=6, requires_grad=False)


def _dropout_of_an_unbatched_weight(x: torch.Tensor) -> torch.Tensor:
    # Eager draws each example's mask (out of place, into the batch); remat's fill in place of a tensor the
    # vmap does not batch raised "Cannot ask for different inplace randomness on an unbatched tensor".
    return (F.dropout(_WEIGHT, 0.5) * x).tanh()


@pytest.mark.parametrize("fn", [_dropout_fn, _dropout_of_an_unbatched_weight], ids=["batched", "unbatched weight"])
@SEVERAL_POLICIES
def test_vmap_randomness_different_dropout_backward_replays_the_same_masks(fn: Callable, policy: Any) -> None:
    checkpointed = remat.checkpoint(fn, policy=policy)

    run = functools.partial(_vmapped_backward, randomness="different")
    (expected, expected_grad), expected_next = _seeded(lambda: run(fn))
    (actual, actual_grad), actual_next = _seeded(lambda: run(checkpointed))
    assert torch.equal(actual, expected)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=RTOL, atol=ATOL)
    assert torch.equal(actual_next, expected_next)
    zeros = expected == 0  # different masks per example (the comparison is not blind)
    assert zeros.any() and not all(torch.equal(zeros[0], zeros[i]) for i in range(1, 4))


@SEVERAL_POLICIES
def test_per_sample_grads_through_dropout_with_randomness_different(policy: Any) -> None:
    checkpointed = remat.checkpoint(_dropout_fn, policy=policy)
    xs = models.randn(4, 3, 8, seed=5, requires_grad=False)

    def per_sample(fn: Callable) -> Any:
        return vmap(grad_and_value(lambda x: fn(x).square().sum()), randomness="different")(xs)

    (expected_grads, expected_values), expected_next = _seeded(lambda: per_sample(_dropout_fn))
    (actual_grads, actual_values), actual_next = _seeded(lambda: per_sample(checkpointed))
    assert torch.equal(actual_values, expected_values)
    torch.testing.assert_close(actual_grads, expected_grads, rtol=RTOL, atol=ATOL)
    assert torch.equal(actual_next, expected_next)


def _unbatched_draw_fn(x: torch.Tensor) -> torch.Tensor:
    # The draw's shape does not depend on the batched input: legal under randomness="same".
    return (x * torch.rand(x.shape[-1], dtype=x.dtype)).tanh()


@SEVERAL_POLICIES
def test_vmap_randomness_same_with_an_unbatched_draw_is_bit_identical(policy: Any) -> None:
    checkpointed = remat.checkpoint(_unbatched_draw_fn, policy=policy)
    xs = models.randn(4, 3, 8, seed=5, requires_grad=False)
    expected, expected_next = _seeded(lambda: vmap(_unbatched_draw_fn, randomness="same")(xs))
    actual, actual_next = _seeded(lambda: vmap(checkpointed, randomness="same")(xs))
    assert torch.equal(actual, expected)
    assert torch.equal(actual_next, expected_next)


@SEVERAL_POLICIES
def test_per_sample_grads_through_an_unbatched_draw_with_randomness_same(policy: Any) -> None:
    checkpointed = remat.checkpoint(_unbatched_draw_fn, policy=policy)
    xs = models.randn(4, 3, 8, seed=5, requires_grad=False)

    def per_sample(fn: Callable) -> Any:
        return vmap(grad_and_value(lambda x: fn(x).square().sum()), randomness="same")(xs)

    (expected_grads, expected_values), expected_next = _seeded(lambda: per_sample(_unbatched_draw_fn))
    (actual_grads, actual_values), actual_next = _seeded(lambda: per_sample(checkpointed))
    assert torch.equal(actual_values, expected_values)
    torch.testing.assert_close(actual_grads, expected_grads, rtol=RTOL, atol=ATOL)
    assert torch.equal(actual_next, expected_next)


@SEVERAL_POLICIES
def test_vmap_randomness_same_backward_replays_the_same_draw(policy: Any) -> None:
    checkpointed = remat.checkpoint(_unbatched_draw_fn, policy=policy)

    run = functools.partial(_vmapped_backward, randomness="same")
    (expected, expected_grad), expected_next = _seeded(lambda: run(_unbatched_draw_fn))
    (actual, actual_grad), actual_next = _seeded(lambda: run(checkpointed))
    assert torch.equal(actual, expected)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=RTOL, atol=ATOL)
    assert torch.equal(actual_next, expected_next)


SAME_RANDOMNESS_ERROR = "Vmap does not currently support same randomness with a batched tensor input"


@FIXED_POLICIES
def test_vmap_randomness_same_with_dropout_on_a_batched_input_draws_eagers_mask(policy: Any) -> None:
    # Dropout on a contiguous input traces as an in-place `bernoulli_`, which remat runs as eager
    # does: functorch's rule for in-place random ops draws one mask for the whole batch.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, p=0.5, training=True)

    run = functools.partial(_vmapped_backward, randomness="same")
    (expected, expected_grad), expected_next = _seeded(lambda: run(fn))
    (actual, actual_grad), actual_next = _seeded(lambda: run(remat.checkpoint(fn, policy=policy)))
    assert torch.equal(expected[0] == 0, expected[1] == 0)  # one mask for every example
    assert torch.equal(actual, expected)
    assert torch.equal(actual_grad, expected_grad)
    assert torch.equal(actual_next, expected_next)


@FIXED_POLICIES
def test_vmap_randomness_same_with_dropout_on_a_transposed_batched_input_raises_under_remat_only(
    policy: Any,
) -> None:
    # A documented limitation, not a wish: under a transform, eager `F.dropout` draws its mask
    # from an unbatched tensor, which "same" randomness allows; for a non-contiguous input
    # remat's trace draws it out of place into a tensor shaped like the (batched) input (see
    # NOTE [dropout under torch.func]), and functorch refuses "same" randomness there.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x.transpose(0, 1), p=0.5, training=True)

    xs = models.randn(4, 3, 8, seed=5, requires_grad=False)
    torch.manual_seed(0)
    eager = vmap(fn, randomness="same")(xs)
    assert torch.equal(eager[0] == 0, eager[1] == 0)  # eager: the same mask for every example
    checkpointed = remat.checkpoint(fn, policy=policy)
    with pytest.raises(RuntimeError, match=re.escape(SAME_RANDOMNESS_ERROR)):
        vmap(checkpointed, randomness="same")(xs)


# --- plain autograd: double backward, retain_graph, gradcheck, forward AD ----------------------------


def _double_backward(fn: Callable, m: Model) -> dict[str, Any]:
    """Gradients of a function of the gradient (create_graph=True, then a second backward)."""
    params = list(m.module.parameters())
    for p in params:
        p.grad = None
    x, s = m.x.clone().requires_grad_(), m.s.clone().requires_grad_()
    out = fn(x, s)
    loss = out.tanh().square().sum()
    gx, gs = torch.autograd.grad(loss, (x, s), create_graph=True)
    (gx.sin().sum() + gs.square().sum()).backward()
    result = {
        "out": out.detach(),
        "gx": gx.detach(),
        "gs": gs.detach(),
        "x.grad": x.grad,
        "s.grad": s.grad,
        "params.grad": [p.grad.clone() for p in params],
    }
    for p in params:
        p.grad = None
    return result


def check_double_backward(model_name: str, policy: Any) -> None:
    m = model(model_name)
    expected = _double_backward(m.fn, m)
    actual = _double_backward(remat.checkpoint(m.fn, policy=policy), m)
    assert_trees_close(actual, expected)


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@FIXED_POLICIES
def test_double_backward_matches_eager(model_name: str, policy: Any) -> None:
    check_double_backward(model_name, policy)


@FEW
@given(data=st.data(), model_name=st.sampled_from(MODEL_NAMES))
def test_double_backward_matches_eager_random_policy(data: st.DataObject, model_name: str) -> None:
    check_double_backward(model_name, random_policy(data, trace_length(model_name)))


_W = models.randn(8, 8, seed=3)


def _dropout_mlp(x: torch.Tensor) -> torch.Tensor:
    h = F.dropout((x @ _W).tanh(), p=0.3, training=True)
    return F.dropout((h @ _W.t()).sin(), p=0.2, training=True)


def _stops_gradients(x: torch.Tensor) -> torch.Tensor:
    # Second derivatives must treat what fn hides from autograd as constants.
    a = (x @ _W).sin()
    with torch.no_grad():
        b = (a * x).exp()  # computed from x, but a constant to autograd
    c = a.detach().cos()
    d = a * b + a.tanh() * c
    return d.square()


def _double_backward_with_seed(fn: Callable) -> tuple[dict[str, Any], torch.Tensor]:
    def thunk() -> dict[str, Any]:
        _W.grad = None
        x = models.randn(3, 8, seed=1)
        out = fn(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        gx.square().sum().backward()
        result = {"out": out.detach(), "gx": gx.detach(), "x.grad": x.grad, "w.grad": _W.grad}
        _W.grad = None
        return result

    return _seeded(thunk)


@pytest.mark.parametrize("fn", [_dropout_mlp, _stops_gradients], ids=["dropout", "no_grad_and_detach"])
@SEVERAL_POLICIES
def test_double_backward_of_small_functions(fn: Callable, policy: Any) -> None:
    expected, expected_next = _double_backward_with_seed(fn)
    actual, actual_next = _double_backward_with_seed(remat.checkpoint(fn, policy=policy))
    assert torch.equal(actual["out"], expected["out"])
    assert_trees_close(actual, expected)
    assert torch.equal(actual_next, expected_next)
    assert expected["x.grad"].abs().max() > 1e-3 and expected["w.grad"].abs().max() > 1e-3


def test_double_backward_really_depends_on_no_grad_and_detach() -> None:
    # Guard for the test above: ignoring the no_grad block and the detach changes the second derivative.
    def without_stops(x: torch.Tensor) -> torch.Tensor:
        a = (x @ _W).sin()
        return (a * (a * x).exp() + a.tanh() * a.cos()).square()

    with_stops, _ = _double_backward_with_seed(_stops_gradients)
    without, _ = _double_backward_with_seed(without_stops)
    torch.testing.assert_close(with_stops["out"], without["out"])
    assert not torch.allclose(with_stops["x.grad"], without["x.grad"])


@pytest.mark.parametrize("fn", [_dropout_mlp, _stops_gradients], ids=["dropout", "no_grad_and_detach"])
@SEVERAL_POLICIES
def test_autograd_grad_twice_with_retain_graph(fn: Callable, policy: Any) -> None:
    checkpointed = remat.checkpoint(fn, policy=policy)

    def twice(f: Callable) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        x = models.randn(3, 8, seed=1)
        loss = f(x).sum()
        first = torch.autograd.grad(loss, (x, _W), retain_graph=True)
        second = torch.autograd.grad(loss, (x, _W))
        return first, second

    (expected, _), expected_next = _seeded(lambda: twice(fn))
    (first, second), actual_next = _seeded(lambda: twice(checkpointed))
    _assert_trees_equal(second, first)  # the same programs, replayed from the same kept values and states
    assert_trees_close(first, expected)
    assert torch.equal(actual_next, expected_next)


def _small_mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) @ w.t()).sin()


def _small_attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q, k = x @ w, x @ w.t()
    return (q @ k.t() / 2).softmax(dim=-1) @ x.exp()


def _small_layer_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.layer_norm(x @ w, (w.shape[1],), weight=w[0], bias=w[1]))


SMALL_FUNCTIONS = pytest.mark.parametrize(
    "fn", [_small_mlp, _small_attention, _small_layer_norm], ids=["mlp", "attention", "layer_norm"]
)


def _small_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    # Few numbers: gradgradcheck perturbs each input and each cotangent entry one by one.
    return models.randn(2, 3, seed=1), (0.5 * models.randn(3, 3, seed=2)).detach().requires_grad_()


# gradgradcheck is the slowest check here: a smaller set of policies than SEVERAL_POLICIES.
GRADGRAD_POLICIES = pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.save_everything, policies.save_ops(aten.mm)],
    ids=["save_nothing", "save_everything", "save_mm"],
)


@SMALL_FUNCTIONS
@SEVERAL_POLICIES
def test_gradcheck(fn: Callable, policy: Any) -> None:
    checkpointed = remat.checkpoint(fn, policy=policy)
    assert torch.autograd.gradcheck(checkpointed, _small_inputs(), check_batched_grad=True)
    assert checkpointed.cache_info().traces >= 1


@SMALL_FUNCTIONS
@GRADGRAD_POLICIES
def test_gradgradcheck(fn: Callable, policy: Any) -> None:
    checkpointed = remat.checkpoint(fn, policy=policy)
    assert torch.autograd.gradgradcheck(checkpointed, _small_inputs())
    assert checkpointed.cache_info().traces >= 1


@FEW
@given(data=st.data(), fn=st.sampled_from([_small_mlp, _small_attention, _small_layer_norm]))
def test_gradgradcheck_random_policy(data: st.DataObject, fn: Callable) -> None:
    n = len(remat.trace(fn, *_small_inputs()))
    checkpointed = remat.checkpoint(fn, policy=random_policy(data, n))
    assert torch.autograd.gradgradcheck(checkpointed, _small_inputs())


def _forward_ad(fn: Callable, primals: tuple[torch.Tensor, ...], seed: int = 0) -> tuple[Any, torch.Tensor]:
    tangents = [cotangent_like(p, seed=100 + i) for i, p in enumerate(primals)]

    def thunk() -> tuple[torch.Tensor, torch.Tensor]:
        with fwAD.dual_level():
            duals = [fwAD.make_dual(p.detach(), t) for p, t in zip(primals, tangents, strict=True)]
            out = fwAD.unpack_dual(fn(*duals))
            return out.primal.clone(), out.tangent.clone()

    return _seeded(thunk, seed)


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@FIXED_POLICIES
def test_forward_ad_dual_tensors_match_eager(model_name: str, policy: Any) -> None:
    m = model(model_name)
    (expected, expected_tangent), _ = _forward_ad(m.fn, (m.x, m.s))
    (actual, actual_tangent), _ = _forward_ad(remat.checkpoint(m.fn, policy=policy), (m.x, m.s))
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(actual_tangent, expected_tangent, rtol=RTOL, atol=ATOL)


@SEVERAL_POLICIES
def test_forward_ad_through_dropout_matches_eager(policy: Any) -> None:
    x = models.randn(3, 8, seed=1, requires_grad=False)
    (expected, expected_tangent), expected_next = _forward_ad(_dropout_mlp, (x,))
    (actual, actual_tangent), actual_next = _forward_ad(remat.checkpoint(_dropout_mlp, policy=policy), (x,))
    assert torch.equal(actual, expected)
    torch.testing.assert_close(actual_tangent, expected_tangent, rtol=RTOL, atol=ATOL)
    assert torch.equal(actual_next, expected_next)


# --- nested checkpoints ------------------------------------------------------------------------------


class BackwardOpCounter(TorchDispatchMode):
    """Counts the aten ops (by OpOverloadPacket) that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[Any] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def _inner_plain(x: torch.Tensor) -> torch.Tensor:
    return x.exp().sin()


def _outer_plain(inner: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x.tanh()).cos().sum()

    return outer


# The outer trace: tanh (outer), exp and sin (inner), cos and sum (outer).
OUTER_OPS = [aten.tanh.default, aten.exp.default, aten.sin.default, aten.cos.default, aten.sum.default]
INNER_CALLS = (1, 2)


def _nested(inner_policy: Any, outer_policy: Any) -> remat.Checkpointed:
    inner = remat.checkpoint(_inner_plain, policy=inner_policy)
    return remat.checkpoint(_outer_plain(inner), policy=outer_policy)


@pytest.mark.parametrize("inner_policy", list(POLICIES.values()), ids=[f"inner_{n}" for n in POLICIES])
@pytest.mark.parametrize("outer_policy", list(POLICIES.values()), ids=[f"outer_{n}" for n in POLICIES])
def test_nested_checkpoint_gradients_match_eager(inner_policy: Any, outer_policy: Any) -> None:
    x = models.randn(5, seed=1)
    eager = _outer_plain(_inner_plain)
    nested = _nested(inner_policy, outer_policy)
    assert_checkpoint_equivalent(eager, x, checkpointed=nested)
    assert_trees_close(grad(nested)(x.detach()), grad(eager)(x.detach()))
    assert_trees_close(
        grad(lambda x: grad(nested)(x).square().sum())(x.detach()),
        grad(lambda x: grad(eager)(x).square().sum())(x.detach()),
    )


def test_nested_report_shows_the_inner_policy_decisions() -> None:
    x = models.randn(5, seed=1)
    nested = _nested(policies.save_everything, policies.save_nothing)
    rep = remat.report(nested, x)
    assert [row.call.op for row in rep.rows] == OUTER_OPS
    decisions = [row.decision for row in rep.rows]
    assert decisions == [remat.RECOMPUTE, remat.SAVE, remat.SAVE, remat.RECOMPUTE, remat.RECOMPUTE]
    for i in INNER_CALLS:  # backward reads exp's output (exp, sin) and sin's output (cos): kept, not replayed
        assert rep.rows[i].saved and not rep.rows[i].replayed
    assert rep.replayed_calls == (0,)  # tanh: its backward reads its output

    # The other way round: the outer saves everything, the inner nothing.
    rep = remat.report(_nested(policies.save_nothing, policies.save_everything), x)
    assert [row.decision for row in rep.rows] == [remat.SAVE, remat.RECOMPUTE, remat.RECOMPUTE, remat.SAVE, remat.SAVE]
    assert rep.replayed_calls == INNER_CALLS


def test_nested_inner_policy_indexes_its_own_calls_from_zero() -> None:
    # save_calls(0) of the inner function is its exp (call 1 of the outer trace), not the outer tanh.
    x = models.randn(5, seed=1)
    rep = remat.report(_nested(policies.save_calls(0), policies.save_nothing), x)
    assert [row.decision for row in rep.rows] == [
        remat.RECOMPUTE,
        remat.SAVE,
        remat.RECOMPUTE,
        remat.RECOMPUTE,
        remat.RECOMPUTE,
    ]


@pytest.mark.parametrize(
    "select",
    [lambda x: x[x > 0], lambda x: x.nonzero().double(), lambda x: x.repeat_interleave((x > 0).long() + 1)],
    ids=["boolean mask", "nonzero", "repeat_interleave"],
)
@pytest.mark.parametrize(
    "inner_policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"]
)
def test_a_nested_checkpoint_of_a_value_dependent_size(select: Callable[..., Any], inner_policy: Any) -> None:
    # The nested region was noted by the graph nodes around it, and make_fx then removed size arithmetic it
    # no longer needed among them: `KeyError: 'mul'` from the trace. The region is noted node by node now.
    inner = remat.checkpoint(lambda t: (t * 2).sin(), policy=inner_policy)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return inner(select(x)).sum() + x.cos().sum()

    assert_checkpoint_equivalent(fn, models.randn(6, seed=3), checkpointed=remat.checkpoint(fn))


def _backward_counts(fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[collections.Counter, torch.Tensor]:
    x = models.randn(5, seed=1)
    loss = fn(x)
    with BackwardOpCounter() as counter:
        loss.backward()
    return counter.counts, x.grad


@pytest.mark.parametrize(
    ("inner_policy", "replayed"),
    [
        (policies.save_everything, {aten.tanh: 1}),
        (policies.save_nothing, {aten.tanh: 1, aten.exp: 1, aten.sin: 1}),
        (policies.save_calls(0), {aten.tanh: 1, aten.sin: 1}),
    ],
    ids=["inner_save_everything", "inner_save_nothing", "inner_save_exp"],
)
def test_nested_inner_saved_calls_are_not_replayed(inner_policy: Any, replayed: dict[Any, int]) -> None:
    eager_counts, eager_grad = _backward_counts(_outer_plain(_inner_plain))
    nested = _nested(inner_policy, policies.save_nothing)
    nested(models.randn(5, seed=1))  # trace outside the counter
    counts, actual_grad = _backward_counts(nested)
    torch.testing.assert_close(actual_grad, eager_grad, rtol=RTOL, atol=ATOL)
    # Eager's backward runs no tanh or exp (and one sin: the derivative of cos);
    # the checkpointed backward runs those plus exactly the replayed calls.
    assert (eager_counts[aten.tanh], eager_counts[aten.exp], eager_counts[aten.sin]) == (0, 0, 1)
    for op in (aten.tanh, aten.exp, aten.sin):
        expected = eager_counts[op] + replayed.get(op, 0)
        assert counts[op] == expected, f"{op}: ran {counts[op]} times in backward, expected {expected}"
    assert counts[aten.cos] == eager_counts[aten.cos]  # the gradient formulas themselves run once


@FEW
@given(data=st.data())
def test_nested_checkpoints_with_random_policies(data: st.DataObject) -> None:
    # A checkpointed MLP inside a checkpointed function around a GPT-2 block, each with its own policy.
    block = model("gpt2").module
    mlp = models.mlp(depth=2, width=16, seed=3)
    x = models.randn(2, 4, 16, seed=1)

    def outer_plain(inner: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: block(x + inner(x)).tanh()

    inner_policy = random_policy(data, len(remat.trace(mlp, x)), "inner saved calls")
    inner = remat.checkpoint(mlp, policy=inner_policy)
    outer_policy = random_policy(data, len(remat.trace(outer_plain(mlp), x)), "outer saved calls")
    nested = remat.checkpoint(outer_plain(inner), policy=outer_policy)
    params = (*block.parameters(), *mlp.parameters())
    assert_checkpoint_equivalent(outer_plain(mlp), x, checkpointed=nested, params=params)


# --- the trace cache under transforms ----------------------------------------------------------------


def _recording(log: list[remat.Call]) -> Callable[[remat.Call], bool]:
    def policy(call: remat.Call) -> bool:
        log.append(call)
        return call.op is aten.addmm.default

    return policy


def test_vmap_traces_at_the_per_example_shape_and_shares_the_trace() -> None:
    m = model("mlp")
    log: list[remat.Call] = []
    checkpointed = remat.checkpoint(m.fn, policy=_recording(log))
    xs = m.stacked(5)
    out = vmap(checkpointed, in_dims=(0, None))(xs, m.s)
    torch.testing.assert_close(out, vmap(m.fn, in_dims=(0, None))(xs, m.s), rtol=RTOL, atol=ATOL)
    assert checkpointed.cache_info().traces == 1
    # The policy saw the per-example (logical) shapes, exactly the trace of one example.
    reference = remat.trace(m.fn, m.x, m.s)
    assert [(c.op, c.inputs, c.outputs) for c in log] == [(c.op, c.inputs, c.outputs) for c in reference]
    assert all(meta.shape[0] != 5 for c in log for meta in c.outputs)

    # Outside vmap at the per-example shape, and under vmap at another batch size: the same trace.
    torch.testing.assert_close(checkpointed(m.x, m.s), m.fn(m.x, m.s), rtol=RTOL, atol=ATOL)
    vmap(checkpointed, in_dims=(0, None))(m.stacked(7), m.s)
    info = checkpointed.cache_info()
    assert (info.traces, info.misses, info.hits) == (1, 1, 2)
    assert len(log) == len(reference)  # the policy was asked once per call, once


def test_reverse_mode_transforms_share_one_trace_and_a_plain_call_another() -> None:
    # torch.func's reverse mode runs backward in grad mode, where eager's gradient formulas take another
    # form than under `.backward()`: its trace is another (NOTE [a backward traced as it will run]).
    m = model("mlp")
    checkpointed = remat.checkpoint(m.fn)
    x = m.x.clone().requires_grad_()
    s = m.s.clone().requires_grad_()
    loss = scalar_loss(checkpointed)
    loss(x, s).backward()
    assert checkpointed.cache_info().traces == 1
    g = grad(loss, argnums=(0, 1))(m.x, m.s)
    assert_trees_close(g, (x.grad, s.grad))
    assert checkpointed.cache_info().traces == 2
    per_sample = vmap(grad(loss, argnums=(0, 1)), in_dims=(0, None))(m.stacked(5), m.s)
    assert per_sample[0].shape == (5, *m.x.shape)
    # Transforms that differentiate the same inputs (requires_grad is part of the key).
    jacrev(checkpointed, argnums=(0, 1))(m.x, m.s)
    grad(lambda x, s: sum(g.sum() for g in grad(loss, argnums=(0, 1))(x, s)), argnums=(0, 1))(m.x, m.s)
    loss(x, s).backward()  # the plain call's trace again
    info = checkpointed.cache_info()
    assert info.traces == 2, info
    assert info.hits == 5  # every call after the first: the key's second variant is a hit


def test_regression_vmap_of_an_in_place_update_of_a_differentiable_input() -> None:
    # Under vmap, setup_context marked the batched views of the updated input dirty, which autograd
    # refused: "Some elements marked as dirty during the forward method were not returned as output".
    update = remat.checkpoint(lambda y, b: y.add_(b.sin()))

    def fn(update: Any, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.clone()
        returned = update(y, b)
        return returned * 2, y

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    eager = torch.func.vmap(functools.partial(fn, lambda y, b: y.add_(b.sin())))(x, b)
    checkpointed = torch.func.vmap(functools.partial(fn, update))(x, b)
    for actual, expected in zip(checkpointed, eager, strict=True):
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    grads = torch.autograd.grad(sum(o.sum() for o in checkpointed), (x, b))
    expected_grads = torch.autograd.grad(sum(o.sum() for o in eager), (x, b))
    for actual, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


def _slice_assigned(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = x.clone()
    t[1:] = y[1:] * 2.0
    return t


def _slice_filled(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t[:, :1] = 3.0
    return t * y


@pytest.mark.parametrize("fn", [_slice_assigned, _slice_filled], ids=["assigned", "filled"])
def test_regression_forward_mode_through_a_slice_assignment(fn: Callable) -> None:
    # A slice assignment functionalizes into `aten.copy`, which has no forward-mode derivative: under
    # torch.func.jvp the pure forward failed with a raw "derivative for aten::copy is not implemented".
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randn(3, 2, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(2))
    assert_checkpoint_equivalent(fn, x, y, transforms=["jvp", "vjp"])
    tangents = (torch.ones_like(x), torch.full_like(y, 0.5))
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p.detach(), t) for p, t in zip((x, y), tangents, strict=True)]
        expected = fwAD.unpack_dual(fn(*duals)).tangent
        actual = fwAD.unpack_dual(remat.checkpoint(fn)(*duals)).tangent
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def _slice_assigned_into_a_transposed_clone(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = x.t().clone()  # keeps the transposed strides, which the view below needs
    t[1:] = y.t()[1:].sin()
    return t.t().view(-1) * y.view(-1)


@pytest.mark.parametrize(
    "fn",
    [_slice_assigned, _slice_filled, _slice_assigned_into_a_transposed_clone],
    ids=["assigned", "filled", "transposed"],
)
@pytest.mark.parametrize("policy", [remat.policies.save_nothing, remat.policies.save_everything])
def test_regression_double_backward_through_a_slice_assignment(fn: Callable, policy: Any) -> None:
    # A slice assignment's gradient formula is itself a slice assignment, one more `aten.copy`, which
    # has no derivative: a second derivative (autograd's create_graph=True, grad of grad) failed with a
    # raw "derivative for aten::copy is not implemented" where eager runs.
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randn(3, 2, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(2))
    assert_checkpoint_equivalent(fn, x, y, policy=policy, transforms=["grad_of_grad"])

    def second_derivative(f: Callable) -> tuple[torch.Tensor, ...]:
        (gx,) = torch.autograd.grad((f(x, y) ** 2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.sin().sum(), (x, y))

    expected = second_derivative(fn)
    for actual, wanted in zip(second_derivative(remat.checkpoint(fn, policy=policy)), expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)


def test_regression_forward_ad_of_an_intermediate_updated_through_a_transposed_view() -> None:
    # The checkpoint's output is a view (of its transposed update) and its tangent came from
    # differentiating the pure forward twice, in another layout: torch.autograd.forward_ad failed an
    # internal assert ("the tangent have the same layout as primal"). NOTE [tangents in their outputs' layouts]
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.tanh().exp()
        with torch.no_grad():
            y.t()[1:].mul_(0.5)
        return y

    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["forward_ad", "jvp"])


_LOG_SIGMOID_RESIZE = "An output with one or more elements was resized"


@pytest.mark.filterwarnings(f"ignore:{_LOG_SIGMOID_RESIZE}")
def test_regression_forward_mode_over_vmap_of_a_draw_followed_by_log_sigmoid() -> None:
    # torch.func.jvp of a draw followed by a log-sigmoid under vmap warns of a deprecated resize of an
    # `out=` tensor: a warning of torch's, which eager's vmap(jvp(f)) gives. The jvp rule ran inside the
    # batching under jvp(vmap(f)) too, and warned where eager does not (NOTE [forward mode outside vmap]).
    # The values are eager's. (The rule once differentiated by vjps under vmap to avoid the
    # warning, which made the derivatives of its tangents wrong: NOTE [forward mode over forward mode].)
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.logsigmoid(torch.normal(x.sigmoid(), 0.5)) * x

    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    with pytest.warns(UserWarning, match=_LOG_SIGMOID_RESIZE):
        vmap(lambda x: jvp(fn, (x,), (torch.ones_like(x),)), randomness="different")(x.detach())
    assert_checkpoint_equivalent(fn, x, transforms=["jvp_of_vmap", "jvp", "forward_ad"])


def test_regression_grad_layout_of_an_input_returned_as_a_view() -> None:
    fn = remat.testing.RandomFunction(
        (2, 2), 1, (remat.testing.Step("chunk_view", 0, 0), remat.testing.Step("batch_norm_transposed", 1, 0)), (2, 1)
    )
    assert_checkpoint_equivalent(fn, models.randn(2, 2, seed=14), transforms=["grad"])


# An input's gradient under torch.func.grad (or of an input that is not a leaf) is laid out as its
# first contribution to arrive. `transposed` sends one laid out (1, 3), the returned view `x[1:]` one
# laid out (3, 1); whichever eager recorded last arrives first. NOTE [where views of inputs are rebuilt]
def _view_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    view = x[1:]
    return view, x.t().contiguous().sin()


def _view_last(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    transposed = x.t().contiguous().sin()
    return x[1:], transposed


def _view_between(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    before = x.cos()
    view = x[1:]
    return view, before * x.t().contiguous().sin()


def _views_around(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    first = x[1:]
    transposed = x.t().contiguous().sin()
    return first, transposed, x[:, 1:]


@pytest.mark.parametrize("fn", [_view_first, _view_last, _view_between, _views_around])
@pytest.mark.parametrize("policy", [None, remat.policies.save_everything])
def test_an_input_s_gradient_is_laid_out_as_eager_s_whichever_read_comes_first(fn: Any, policy: Any) -> None:
    x = models.randn(3, 3, seed=1)
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=["grad", "vjp"])
    strides = []
    for f in (fn, remat.checkpoint(fn, policy=policy)):
        leaf = x.clone().requires_grad_()
        not_a_leaf = leaf * 1.0
        outputs = f(not_a_leaf)
        cotangents = [torch.ones_like(o) for o in outputs]
        (grad,) = torch.autograd.grad(outputs, not_a_leaf, cotangents)
        strides.append(grad.stride())
    assert strides[0] == strides[1]


# `fn` detaches (a view of) a tensor it updated in place, or updates it after detaching: functionalization
# records the detach again where the detached tensor is next read. NOTE [detaches functionalization replays]
def _detach_after_update(x: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.mul_(2.0)
    return (t.detach() * x).sin()


def _detach_a_split_after_update(x: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.mul_(2.0)
    return t.split(2, 1)[0].detach()


def _detach_a_slice_after_a_sliced_update(x: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t[:, :1].mul_(2.0)
    return (t.t().detach() * x.t()).sin()


def _detach_then_update(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = x.sin()
    t.mul_(2.0)
    u = t.detach()
    t.mul_(3.0)
    return (u * x).sin(), t


def _view_of_a_detach_then_update(x: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.mul_(2.0)
    v = t.detach()[:, :1]
    t.mul_(3.0)
    return (v * x).sin()


DETACHES_AFTER_UPDATES = [
    _detach_after_update,
    _detach_a_split_after_update,
    _detach_a_slice_after_a_sliced_update,
    _detach_then_update,
    _view_of_a_detach_then_update,
]


@pytest.mark.parametrize("fn", DETACHES_AFTER_UPDATES)
def test_regression_a_detach_functionalization_records_again_stops_forward_mode_and_double_backward(
    fn: Any,
) -> None:
    x = models.randn(1, 2, seed=3)
    assert_checkpoint_equivalent(fn, x, transforms=["jvp", "grad_of_jvp", "forward_ad"])

    def second_order(f: Any) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        loss = sum((out.square() * leaf.sin()).sum() for out in optree.tree_leaves(f(leaf)))  # detached ones too
        (grad,) = torch.autograd.grad(loss, leaf, create_graph=True)
        (second,) = torch.autograd.grad(grad.sin().sum(), leaf)
        return second

    torch.testing.assert_close(second_order(remat.checkpoint(fn)), second_order(fn), rtol=1e-10, atol=1e-12)


def test_regression_jvp_of_a_detached_split_of_an_updated_intermediate() -> None:
    fn = remat.testing.RandomFunction(
        (1, 2),
        1,
        (
            remat.testing.Step("mul_as_strided_of_view_", 0, 0),
            remat.testing.Step("split_view", 1, 1),
            remat.testing.Step("detach", 2, 2),
        ),
        (3,),
    )
    x = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["jvp"])


def test_a_view_of_an_input_updated_in_place_is_rebuilt_after_the_update() -> None:
    def fn(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        view = x[1:]
        x.mul_(s)
        return view, x.t().contiguous().sin()

    assert_checkpoint_equivalent(
        lambda x, s: fn(x * 1.0, s), models.randn(3, 3, seed=2), models.randn(3, 3, seed=3), transforms=["grad"]
    )
    assert_checkpoint_equivalent(fn, models.randn(3, 3, seed=2), models.randn(3, 3, seed=3), backprop=[1])


def _scaled_without_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x.mul_(0.5)
    return (x.sin() * x).sum()


def _scaled_through_a_transposed_slice_without_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x.t()[1:].mul_(0.5)
    return (x**3).sum()


def _assigned_through_a_transposed_column_without_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x.t()[-1] = 2.0  # `__setitem__`: an update, as the in-place methods are
    return (x**3).sum()


def _scaled_through_a_diagonal_of_a_view_without_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x.view(-1, 1).t().diagonal().add_(1.0)
    return (x.exp() * x).sum()


def _updated_intermediate_through_a_transposed_slice_without_grad(x: torch.Tensor) -> torch.Tensor:
    t = x * 2.0
    with torch.no_grad():
        t.t()[1:].clamp_(max=0.5)
    return (t * x.cos()).sum()


def _updated_intermediate_without_grad(x: torch.Tensor) -> torch.Tensor:
    t = x * 2.0  # (saves nothing that the update overwrites: eager would refuse it)
    with torch.no_grad():
        t[:, :1].clamp_(max=1.0)
    return (t * x.cos()).sum()


@pytest.mark.parametrize(
    "fn",
    [
        _scaled_without_grad,
        _scaled_through_a_transposed_slice_without_grad,
        _assigned_through_a_transposed_column_without_grad,
        _scaled_through_a_diagonal_of_a_view_without_grad,
        _updated_intermediate_without_grad,
        _updated_intermediate_through_a_transposed_slice_without_grad,
    ],
    ids=[
        "input",
        "input_through_a_view",
        "input_assigned_through_a_view",
        "input_through_a_diagonal",
        "intermediate",
        "intermediate_through_a_view",
    ],
)
@pytest.mark.parametrize(
    "policy",
    [remat.policies.save_nothing, remat.policies.save_everything],
    ids=["save_nothing", "save_everything"],
)
def test_regression_a_tensor_updated_under_no_grad_keeps_its_history_for_second_derivatives(
    fn: Callable, policy: Any
) -> None:
    # In eager, an update under no_grad is invisible to autograd: the tensor's new value keeps its old
    # history, and a second derivative flows through it. remat's programs detached the new value, so
    # grad of grad was zero without an error (and autograd's create_graph gradient needed no grad).
    weights = torch.tensor([[0.3, -0.7]], dtype=torch.float64)
    x = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64)

    def grad_of_grad(f: Callable) -> torch.Tensor:
        return torch.func.grad(lambda x: (torch.func.grad(f)(x) * weights).sum())(x.clone())

    torch.testing.assert_close(
        grad_of_grad(remat.checkpoint(fn, policy=policy)), grad_of_grad(fn), rtol=1e-12, atol=1e-12
    )

    def second_derivative(f: Callable) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        (first,) = torch.autograd.grad(f(leaf * 1.0), leaf, create_graph=True)
        return torch.autograd.grad((first * weights).sum(), leaf)[0]

    torch.testing.assert_close(
        second_derivative(remat.checkpoint(fn, policy=policy)), second_derivative(fn), rtol=1e-12, atol=1e-12
    )


def test_regression_grad_of_grad_of_an_input_scaled_under_no_grad_then_batch_normed() -> None:
    # The random program the soak found it with.
    steps = (
        remat.testing.Step("scale_transposed_slice_without_grad_", 0, 0),
        remat.testing.Step("batch_norm_transposed", 1, 0),
    )
    fn = remat.testing.RandomFunction((1, 2), 1, steps, (2,))
    x = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["grad", "vmap", "grad_of_grad"])


def test_regression_grad_of_grad_through_a_kept_value_and_a_replay_from_one_input() -> None:
    # The random program and policy a CI run found it with: the first backward replays `stack(v1, v0)` from
    # the inputs and reads the kept stack of batch_norm_transposed, so v0's second derivative arrives by
    # two paths, summed into a fresh tensor; eager's single path returns a strided view (`select`). The
    # values agree, and `grad_of_grad` compares them by value: a second derivative's layout is not the
    # program's.
    steps = (remat.testing.Step("stack", 1, 0), remat.testing.Step("batch_norm_transposed", 2, 1))
    fn = remat.testing.RandomFunction((1, 2), 2, steps, (3,))

    def keep_the_stack(call: remat.Call) -> bool:  # of batch_norm_transposed
        return call.index == 5

    x = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([[-2.1788, 0.5684]], dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, y, policy=keep_the_stack, transforms=["grad", "grad_of_grad"])

    def grad_of_grad(f: Callable) -> torch.Tensor:
        inner = torch.func.grad(lambda x, y: f(x, y).sum())
        return torch.func.grad(lambda x, y: (inner(x, y) * torch.tensor([[0.3, -0.7]])).sum())(x.detach(), y.detach())

    expected = grad_of_grad(fn)
    torch.testing.assert_close(
        grad_of_grad(remat.checkpoint(fn, policy=keep_the_stack)), expected, rtol=1e-12, atol=1e-12
    )


def _normal_fill_of_an_embedding(x: torch.Tensor) -> torch.Tensor:
    e = F.embedding(torch.tensor([1, 0]), x)
    t = e.sin()
    t[:, ::2].normal_()
    return t * e


def _bernoulli_fill_through_a_transposed_embedding(x: torch.Tensor) -> torch.Tensor:
    e = F.embedding(torch.tensor([1, 0, 1]), x)
    t = e.cos()
    t.t()[1:].bernoulli_(0.5)
    return t * e


@pytest.mark.parametrize("fn", [_normal_fill_of_an_embedding, _bernoulli_fill_through_a_transposed_embedding])
@pytest.mark.parametrize(
    "policy", [remat.policies.save_nothing, remat.policies.save_everything], ids=["save_nothing", "save_everything"]
)
@pytest.mark.parametrize("transform", ["jvp_of_vmap", "vmap_of_jvp", "grad_of_jvp_of_vmap"])
def test_regression_a_random_fill_after_an_embedding_under_forward_mode_of_vmap(
    fn: Callable, policy: Any, transform: str
) -> None:
    # Found by the soak with torch 2.15. Under vmap, an embedding keeps the batch dimension in the middle of
    # memory, and a random fill draws in memory order: the tangent's replay of the fill, under a gradient
    # level of its own, made its fresh tensor with the batch dimension first, and drew the same numbers into
    # other elements. The values equalled eager's, the tangents did not, without an error.
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=[transform])


def test_regression_forward_mode_through_an_update_of_a_detached_alias_of_an_input() -> None:
    # Found by the soak (pre-existing: failed on e4c524b too, on 2.13 and 2.15). `x.detach()` aliases `x`;
    # updating the alias changes `x`'s values, but not its tangent, which forward mode keeps as in eager.
    # remat's tangent of the updated `x` was zero, without an error.
    steps = (
        remat.testing.Step("detach", 0, 0),
        remat.testing.Step("scale_transposed_slice_without_grad_", 1, 1),
        remat.testing.Step("abs", 0, 0),
    )
    fn = remat.testing.RandomFunction((1, 2), 1, steps, (3,))
    x = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["forward_ad"])


@pytest.mark.parametrize("op", ["exp", "rsqrt", "sin"])
def test_regression_a_detach_of_a_value_autograd_saves_keeps_its_second_derivative(op: str) -> None:
    """`v * v.detach()` with `v = x.exp()`: make_fx records two `detach` nodes of `v` during the user's
    `v.detach()`; the one that is not its result stands for `v` itself where backward reads exp's saved
    result. Both were noted as stopping the gradient, so the second derivative through exp's backward was
    lost (`grad` of `grad` differed from eager; `autograd.grad(create_graph=True)` gave a gradient that did
    not require grad). Found by the three-way policy property (tests/test_offload.py) in a clean run."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        v = getattr(x, op)()
        return v * v.detach()

    x = torch.tensor([[0.5, 0.3]], dtype=torch.float64, requires_grad=True)
    for policy in (remat.policies.save_everything, remat.policies.save_nothing):
        remat.testing.assert_checkpoint_equivalent(fn, x, policy=policy, transforms=("grad_of_grad", "grad"))
    (grad,) = torch.autograd.grad(remat.checkpoint(fn)(x).sum(), x, create_graph=True)
    (eager,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    assert grad.requires_grad
    torch.testing.assert_close(torch.autograd.grad(grad.sum(), x)[0], torch.autograd.grad(eager.sum(), x)[0])


# NOTE [in-place ops whose meta kernels fail under forward AD]: `lerp_` with a tensor weight (which `quantile`
# calls) could not be traced while a forward-mode level was active.
_LERP_UNDER_FORWARD_MODE = {
    "quantile": lambda t: torch.quantile(t.sin(), 0.3, dim=1) * 2,
    "nanquantile": lambda t: torch.nanquantile(t, torch.tensor([0.2, 0.7], dtype=t.dtype), dim=0).sum(0),
    "lerp_of_transposed": lambda t: t.t().exp().lerp_(t.t().sin(), t.t().sigmoid()).t(),
}


@pytest.mark.parametrize("name", sorted(_LERP_UNDER_FORWARD_MODE))
@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_lerp_with_a_tensor_weight_under_forward_mode_equals_eager(name: str, policy: Any) -> None:
    if "quantile" in name and _quirks.QUANTILE_COMPARES_TENSORS.applies(_torch.RELEASE):
        pytest.skip(f"torch {_torch.RELEASE}: {_quirks.QUANTILE_COMPARES_TENSORS.differs} (refused: test_trace)")
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    transforms = ["jvp", "forward_ad", "jvp_of_vmap", "vmap_of_jvp", "grad_of_jvp", "grad_of_forward_ad"]
    assert_checkpoint_equivalent(_LERP_UNDER_FORWARD_MODE[name], x, policy=policy, transforms=transforms)


def test_lerp_into_a_smaller_tensor_under_forward_mode_raises_as_eager() -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        return t[:1].exp().lerp_(t.sin(), t.cos())  # the broadcast shape is larger than the updated tensor

    x, tangent = torch.randn(3, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"output with shape \[1, 4\] doesn't match the broadcast shape \[3, 4\]"):
        jvp(fn, (x,), (tangent,))
    with pytest.raises(RuntimeError, match=r"output with shape \[1, 4\] doesn't match the broadcast shape \[3, 4\]"):
        jvp(remat.checkpoint(fn), (x,), (tangent,))


def test_select_scatter_under_vmap_gives_the_per_example_gradient_where_torch_does_not() -> None:
    # Eager's own `vmap` of `select_scatter` gives its source a wrong gradient (torch 2.13 to 2.15: off from
    # the per-example gradients, which are exact); remat's traced backward gives the per-example ones. The
    # OpInfo sweep under transforms leaves this pair out for that reason (`EAGER_WRONG` in test_opinfo.py).
    generator = torch.Generator().manual_seed(0)
    x, src = (
        torch.randn(2, 5, 5, 5, dtype=torch.float64, generator=generator),
        torch.randn(2, 5, 5, dtype=torch.float64),
    )
    cotangent = torch.randn(2, 5, 5, 5, dtype=torch.float64, generator=generator)

    def scatter(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return torch.select_scatter(x, src, 1, 2)

    def source_gradient(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        source = src.clone().requires_grad_()
        (gradient,) = torch.autograd.grad((vmap(fn)(x, source) * cotangent).sum(), source)
        return gradient

    exact = cotangent[:, :, 2]  # each example's source lands in row 2 of dim 1
    assert torch.equal(source_gradient(remat.checkpoint(scatter)), exact)
    assert not torch.allclose(
        source_gradient(scatter), exact
    )  # torch's batching rule; if it is fixed, drop EAGER_WRONG


def test_a_value_computed_through_integers_gets_no_tangent_as_in_eager() -> None:
    # A count of NaNs (`isnan`, `sum`) is an integer: what is computed from it alone has no derivative, and
    # eager's forward mode attaches no tangent to it. remat followed the derivative through the integers
    # and attached zeros.
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.isnan().sum(1) * torch.tensor(1.5, dtype=torch.float64), x.sin()

    x = torch.randn(3, 4, dtype=torch.float64)
    for f in (fn, remat.checkpoint(fn)):
        with fwAD.dual_level():
            outputs = f(fwAD.make_dual(x, torch.ones_like(x)))
            tangents = [fwAD.unpack_dual(o).tangent for o in outputs]
        assert tangents[0] is None
        assert tangents[1] is not None


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_batch_norm_with_running_statistics_under_vmap_in_eager_layout(policy: Any) -> None:
    # NOTE [batch norm under vmap]: the functional form remat traces has no batching rule, and torch's
    # fallback stacked a contiguous output, where eager's rule folds the batch into the channels and keeps
    # that layout: strides (25, 50, 5, 1), not (125, 25, 5, 1).
    def fn(x: torch.Tensor, w: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor) -> Any:
        return F.batch_norm(x, running_mean, running_var, w, w.cos(), training=True, momentum=0.5)

    x, w = torch.randn(5, 5, 5, dtype=torch.float64, requires_grad=True), torch.randn(5, dtype=torch.float64)
    stats = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    transforms = ["vmap", "jvp_of_vmap", "vmap_of_jvp", "grad_of_jvp_of_vmap"]
    assert_checkpoint_equivalent(fn, x, w, *stats, policy=policy, transforms=transforms)
    batched = torch.randn(2, 5, 5, 5, dtype=torch.float64)
    out = vmap(remat.checkpoint(fn, policy=policy))(batched, w.expand(2, 5), *(s.expand(2, 5).clone() for s in stats))
    assert out.stride() == (25, 50, 5, 1)


_RUN_EXAMPLE_BY_EXAMPLE = {
    "stft": lambda x: torch.stft(x, 6, window=torch.ones(6, dtype=x.dtype), return_complex=True).abs(),
    "ihfft2": lambda x: torch.fft.ihfft2(x).real,
    "ihfftn": lambda x: torch.fft.ihfftn(x, dim=(0, 1)).imag,
}


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's, of its fallback
@pytest.mark.parametrize("name", sorted(_RUN_EXAMPLE_BY_EXAMPLE))
def test_ops_vmap_runs_example_by_example_in_eager_layout(name: str) -> None:
    # NOTE [ops vmap runs example by example]: under vmap, eager runs `stft` and `fft.ihfft2` per example and
    # stacks a contiguous result; remat's program batched their ops one by one (`stft`'s output transposed,
    # strides (372, 124, 1, 4) for (372, 124, 31, 1)). Where a level inside the vmap splits the op first
    # (`vmap` of `jvp`, `vmap` of `grad`), eager's layout is its ops' and so is remat's.
    fn = _RUN_EXAMPLE_BY_EXAMPLE[name]
    x = torch.randn(3, 30, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["vmap", "jvp_of_vmap", "vmap_of_jvp", "grad"])
    batch = torch.randn(2, 3, 30, dtype=torch.float64)
    checkpointed = remat.checkpoint(fn)
    assert vmap(checkpointed)(batch).stride() == vmap(fn)(batch).stride()
    expected = vmap(grad(lambda x: fn(x).sin().sum()))(batch)
    per_example = vmap(grad(lambda x: checkpointed(x).sin().sum()))(batch)
    assert torch.equal(per_example, expected)
    assert per_example.stride() == expected.stride()


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's, of its fallback
def test_a_gradient_formula_writing_into_a_slice_of_a_complex_buffer_under_grad() -> None:
    # NOTE [complex writes through views]: under `vmap` of `grad`, `fft.ihfft2`'s grad-mode backward copies
    # into a slice of complex zeros; remat's functional `slice_scatter` has no complex derivative ("does not
    # support automatic differentiation for outputs with complex dtype"), where eager's `copy_` has one.
    def per_example_gradients(fn: Callable[..., torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
        return vmap(grad(lambda x: fn(x).sin().sum()))(batch)

    fn = lambda x: torch.fft.ihfft2(x).real  # noqa: E731
    batch = torch.randn(2, 3, 30, dtype=torch.float64)
    expected = per_example_gradients(fn, batch)
    torch.testing.assert_close(per_example_gradients(remat.checkpoint(fn), batch), expected, rtol=1e-12, atol=1e-12)


def _dropout_gradient_of(grad: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # An op with no forward-mode formula that vmap runs as others that have one: NOTE [forward mode outside
    # vmap] (from the OpInfo sweep under transforms).
    return torch.ops.aten.native_dropout_backward(grad.sin(), mask, 2.0).cos()


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_forward_mode_of_a_vmap_batches_first_as_eager(policy: Any) -> None:
    # Under `jvp` of `vmap`, the Function's forward-mode rule ran inside a vmap of its own, its ops'
    # tangents formed before vmap saw them: torch's "forward AD with native_dropout_backward ... not
    # implemented" where eager's vmap runs the op as a product first. Under `vmap` of `jvp` eager raises
    # that too, and so must remat.
    grad_, tangent = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    mask = torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) > 0.5
    checkpointed = remat.checkpoint(_dropout_gradient_of, policy=policy)
    assert_checkpoint_equivalent(
        _dropout_gradient_of, grad_, mask, policy=policy, transforms=["jvp_of_vmap", "vmap_of_jvp"]
    )
    expected = jvp(lambda g: vmap(_dropout_gradient_of)(g, mask), (grad_,), (tangent,))
    got = jvp(lambda g: vmap(checkpointed)(g, mask), (grad_,), (tangent,))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got[1].stride() == expected[1].stride()
    expected_jacobian = jacfwd(lambda g: vmap(_dropout_gradient_of)(g, mask))(grad_)
    torch.testing.assert_close(jacfwd(lambda g: vmap(checkpointed)(g, mask))(grad_), expected_jacobian, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="native_dropout_backward"):
        vmap(lambda g, m: jvp(lambda h: _dropout_gradient_of(h, m), (g,), (g,)))(grad_, mask)
    with pytest.raises(NotImplementedError, match="native_dropout_backward"):
        vmap(lambda g, m: jvp(lambda h: checkpointed(h, m), (g,), (g,)))(grad_, mask)


def test_grad_of_jvp_through_layer_norm_matches_finite_differences_where_eager_does_not() -> None:
    # torch.func's `grad` of `jvp` through `F.layer_norm` is not its finite differences on torch 2.13 and
    # 2.15 (seen while testing compression); remat's checkpoint of the same function is. If eager ever
    # agrees, this test says so, and `remat.testing`'s comparisons with eager hold there again.
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.layer_norm(x, (16,)) @ w).tanh()

    generator = torch.Generator().manual_seed(0)
    x, w, tx, tw = (torch.randn(*s, dtype=torch.float64, generator=generator) for s in [(6, 16), (16, 16)] * 2)

    def grad_of_jvp(f: Any) -> torch.Tensor:
        return torch.func.grad(lambda x, w: torch.func.jvp(f, (x, w), (tx, tw))[1].sum())(x, w)

    def tangent_sum(x: torch.Tensor) -> float:
        return float(torch.func.jvp(fn, (x, w), (tx, tw))[1].sum())

    eps = 1e-6
    finite = torch.zeros_like(x)
    for i in range(x.numel()):
        step = torch.zeros_like(x).view(-1)
        step[i] = eps
        finite.view(-1)[i] = (tangent_sum(x + step.view_as(x)) - tangent_sum(x - step.view_as(x))) / (2 * eps)
    remat_error = (grad_of_jvp(remat.checkpoint(fn)) - finite).abs().max()
    eager_error = (grad_of_jvp(fn) - finite).abs().max()
    assert remat_error < 1e-6
    assert eager_error > 0.1  # torch's, not remat's
