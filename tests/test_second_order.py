"""Derivatives of every order through `remat.checkpoint` equal eager's.

Eager runs a backward that will be differentiated (`create_graph=True`, `grad` of `grad`, `hessian`) with
grad mode on, where some gradient formulas switch to a twice-differentiable form, and never differentiates
what autograd leaves without a derivative (the buffer `empty_like` makes, the statistics batch norm
saves). Each test here is a class of program where remat once differed; each compares with eager in
float64 under the transforms that differentiate a gradient again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import remat
from remat import _quirks, _torch, policies
from remat.testing import RandomFunction, Step, assert_checkpoint_equivalent
from remat.testing._catalog import _NoisyScale  # a forward that draws random numbers

aten = torch.ops.aten

SECOND_ORDER = ["grad_of_grad", "double_backward", "grad_of_jvp", "grad_of_forward_ad"]


def _float64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def _create_graph_then_backward(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The second derivative as a gradient penalty takes it: `autograd.grad(create_graph=True)`, then
    backward through the gradient's norm."""
    x = x.detach().requires_grad_()
    torch.manual_seed(0)
    y = fn(x)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    (grad,) = torch.autograd.grad((y * weights).sum(), x, create_graph=True)
    grad.pow(2).sum().backward()
    assert x.grad is not None
    return x.grad


def _assert_second_order_equal(fn: Callable[..., torch.Tensor], x: torch.Tensor, policy: Any) -> None:
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=SECOND_ORDER)
    expected = _create_graph_then_backward(fn, x)
    got = _create_graph_then_backward(remat.checkpoint(fn, policy=policy), x)
    torch.testing.assert_close(got, expected)


# --- values autograd leaves without a derivative ----------------------------------------------------


def _dropout_of_a_centred_transpose(x: torch.Tensor) -> torch.Tensor:
    t = x.clone()
    with torch.no_grad():
        t.t()[:, 0] = 1.0
    t = t - t.mean(dim=1, keepdim=True)
    return F.dropout(t.t(), 0.5, training=True).sin()


def test_a_kept_buffer_that_a_random_fill_reads_has_no_derivative() -> None:
    # Dropout fills an `empty_like` buffer with `bernoulli_`. Kept (the policy saves it) it was a
    # differentiable output of remat's Function, so a second derivative reached the replayed `bernoulli`,
    # which torch cannot differentiate ("derivative for aten::bernoulli is not implemented"). Eager's
    # `empty_like` has no derivative at all.
    saves_the_buffer = policies.save_ops(aten.empty_like)
    _assert_second_order_equal(_dropout_of_a_centred_transpose, _float64(3, 4), saves_the_buffer)


def test_batch_norm_statistics_kept_for_backward_have_no_derivative() -> None:
    # With running statistics, batch norm is one call whose mean and inverse deviation the gradient
    # reads; kept, they must not ask double backward for a derivative eager's never takes ("the
    # derivative for 'native_batch_norm_backward save_invstd' is not implemented").
    weight = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def batch_norm(x: torch.Tensor) -> torch.Tensor:
        running_mean, running_var = torch.zeros(6, dtype=x.dtype), torch.ones(6, dtype=x.dtype)
        return F.batch_norm(x, running_mean, running_var, weight, training=True).tanh()

    for policy in (policies.save_nothing, policies.save_everything):
        _assert_second_order_equal(batch_norm, _float64(4, 6), policy)


# --- gradient formulas that eager switches where grad mode is on -----------------------------------------


def _group_norm(x: torch.Tensor) -> torch.Tensor:
    weight = torch.linspace(0.5, 1.5, 6, dtype=x.dtype)
    return F.group_norm(x.reshape(2, 6, 2), 3, weight)


def _instance_norm(x: torch.Tensor) -> torch.Tensor:
    running_mean, running_var = torch.zeros(6, dtype=x.dtype), torch.ones(6, dtype=x.dtype)
    return F.instance_norm(x.reshape(2, 6, 2), running_mean, running_var, use_input_stats=True)


TWICE_DIFFERENTIABLE_IN_GRAD_MODE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # Their backward ops (`silu_backward`, ...) have no derivative: eager calls other ops in grad mode.
    "silu": F.silu,
    "mish": F.mish,
    "logit": lambda x: torch.logit(x.sigmoid(), eps=1e-3),
    "group_norm": _group_norm,
    # Their backward ops have derivatives; here for the statistics they save.
    "instance_norm": _instance_norm,
    "layer_norm": lambda x: F.layer_norm(x, (6,)),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@pytest.mark.parametrize("name", TWICE_DIFFERENTIABLE_IN_GRAD_MODE)
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_second_derivatives_through_gradient_formulas_that_switch_in_grad_mode(name: str, policy: Any) -> None:
    # "derivative for aten::silu_backward is not implemented" (and mish's, logit's, group norm's): remat's
    # backward program ran the fused ops that eager's grad-mode formulas avoid. See NOTE [a backward that
    # will be differentiated].
    fn = TWICE_DIFFERENTIABLE_IN_GRAD_MODE[name]
    _assert_second_order_equal(lambda x: fn(x * 1.5).sin(), _float64(4, 6), policy)


@pytest.mark.parametrize("solve", [torch.linalg.solve, lambda a, b: torch.linalg.det(a) * b], ids=["solve", "det"])
def test_second_derivatives_through_a_formula_reading_lu_factors_beside_a_random_call(solve: Callable) -> None:
    # A second derivative through `linalg.solve` runs the pure forward (its formula reads LU factors); a
    # random call after it, whose state backward did not need, was not kept, and the derivative was
    # refused (2.13 soak). The rules keep what the pure forward reads wherever only it is exact.
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = torch.eye(2, dtype=x.dtype) * 3 + x.reshape(2, 2)
        y = solve(a, x.reshape(2, 2).abs())
        return y + torch.randn_like(y)

    x = _float64(4)
    assert_checkpoint_equivalent(fn, x, policy=policies.save_nothing, transforms=["grad_of_grad", "double_backward"])


def test_a_first_order_backward_keeps_the_fused_gradient_ops() -> None:
    # The decompositions are for backward that will be differentiated only: a plain `.backward()` runs
    # the fused kernel, as eager does.
    ran: list[Any] = []

    class Recording(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ran.append(func)
            return func(*args, **(kwargs or {}))

    x = _float64(4, 6)
    y = remat.checkpoint(F.silu)(x).sum()
    with Recording():
        y.backward()
    assert aten.silu_backward.default in ran
    ran.clear()
    z = remat.checkpoint(F.silu)(x)
    with Recording():
        (grad,) = torch.autograd.grad(z.sum(), x, create_graph=True)
    assert aten.silu_backward.default not in ran
    assert grad.requires_grad


# --- gradient formulas that autograd differentiates wrongly in their first form ------------------------


def _with_zeros(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone()
    x.view(-1)[::3] = 0.0
    return x.requires_grad_()


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.cumprod(x, 1),
        lambda x: torch.cumprod(x * (x > 0.3), 1),
        lambda x: torch.cumprod(F.dropout(x, 0.5), 1).exp(),
    ],
    ids=["zeros in the input", "masked", "after dropout"],
)
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_cumprod_second_derivatives_where_its_input_has_zeros(fn: Callable[..., Any], policy: Any) -> None:
    # cumprod's first-form gradient divides by its input where it has no zero; differentiated, it gave
    # NaN or infinity at a zero where eager's (the grad-mode form) is finite. NOTE [a backward that will
    # be differentiated]
    _assert_second_order_equal(fn, _with_zeros(_float64(3, 5)), policy)


# --- rrelu ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.rrelu(x, training=True).square(),
        lambda x: F.rrelu(x.t(), training=True).sin(),
        lambda x: F.dropout(F.rrelu(x.t(), training=True), 0.5),
        lambda x: F.rrelu(x, training=False).square(),
    ],
    ids=["training", "transposed", "then dropout", "evaluation"],
)
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_rrelu_at_every_order(fn: Callable[..., Any], policy: Any) -> None:
    # The functional rrelu remat traces lays its output out as its input, where eager's is contiguous
    # (a dropout after it drew another mask), and torch's derivative of it reads an uninitialized input
    # (second derivatives were refused, forward mode raised). NOTE [rrelu runs as eager's]
    x = _float64(3, 5)
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=["grad", "jvp", "vmap", *SECOND_ORDER])
    expected = _create_graph_then_backward(fn, x)
    torch.testing.assert_close(_create_graph_then_backward(remat.checkpoint(fn, policy=policy), x), expected)


# --- custom autograd Functions ---------------------------------------------------------------------------


class _Cos(torch.autograd.Function):
    """Old style: `forward` takes `ctx` (eager applies it under plain autograd only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.cos()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return -grad * x.sin()


class _Cube(torch.autograd.Function):
    """New style (`setup_context`), as torch.func needs: a hand-written derivative."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * x * x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 3 * x * x


class _StraightThroughRound(torch.autograd.Function):
    """A backward that is not the forward's derivative (a straight-through estimator): eager's second
    derivatives go through it, not through the ops the forward ran."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (x * 4).round() / 4 + x.detach().sin() * 0

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * x.tanh()


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_second_derivatives_through_a_custom_function_whose_output_another_formula_reads(policy: Any) -> None:
    # The product's gradient formula reads the Function's output; eager differentiates it again through
    # the Function's backward. remat's replay of it (its forward's ops, under no_grad) had no derivative:
    # that part of the second derivative was lost. NOTE [custom Functions applied again]
    x = _float64(5)

    def old_style(x: torch.Tensor) -> torch.Tensor:
        return x * x * _Cos.apply(x)

    expected = _create_graph_then_backward(old_style, x)
    torch.testing.assert_close(_create_graph_then_backward(remat.checkpoint(old_style, policy=policy), x), expected)

    def straight_through(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * _StraightThroughRound.apply(x * 1.3)

    _assert_second_order_equal(straight_through, _float64(3, 4), policy)


class _NoisyGate(torch.autograd.Function):
    """A forward that draws twice from the generator it is given (or the default one), once after an op."""

    @staticmethod
    def forward(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:  # type: ignore[override]
        gate = torch.rand(x.shape, dtype=x.dtype, generator=generator) < 0.7
        return x.exp() * gate + 0.01 * torch.randn(x.shape, dtype=x.dtype, generator=generator)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, Any], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, y = ctx.saved_tensors
        return grad * (y != 0) * x.exp(), None


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_second_derivatives_through_a_custom_function_that_draws_random_numbers(policy: Any) -> None:
    # Applied again from the generator state kept before its forward's first draw, the Function draws
    # the numbers it drew in forward; the generator is left where eager leaves it. (It was refused.)
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * _NoisyScale.apply(x.sin()).cos()

    _assert_second_order_equal(fn, _float64(4), policy)
    x = _float64(4)
    torch.manual_seed(0)
    _create_graph_then_backward(fn, x)
    expected = torch.rand(3)
    torch.manual_seed(0)
    _create_graph_then_backward(remat.checkpoint(fn, policy=policy), x)
    torch.testing.assert_close(torch.rand(3), expected)


@pytest.mark.parametrize(
    "policy", [policies.save_everything, policies.budget(fraction=1.0)], ids=["everything", "budget"]
)
def test_a_kept_fill_of_a_value_with_a_derivative_beside_a_custom_function(policy: Any) -> None:
    # The 2.13 soak's find: the recomputation that applies the Function again recomputed the kept `normal_`
    # fill (of a value with a derivative), whose generator state the rules do not keep: refused, "please
    # report". A kept fill is read as kept there, connected to what it filled (NOTE [a fill's derivative]).
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * _NoisyScale.apply(x.cos() + 1.5)
        t = y.sin().t().contiguous().t()
        t.normal_()
        return y * t.sum(1, keepdim=True) + t.amax(0, keepdim=True)

    _assert_second_order_equal(fn, _float64(2, 3), policy)


@pytest.mark.parametrize(
    "policy", [policies.save_everything, policies.budget(fraction=1.0)], ids=["everything", "budget"]
)
def test_a_kept_fill_recomputed_for_a_second_derivative_through_kept_values_replays_its_draw(policy: Any) -> None:
    # The 2.13 soak's find: the second backward sends cotangents to the kept values, and the pure forward
    # differentiated for them recomputed the kept `normal_` fill without its generator state (the rules kept
    # none where a custom Function is applied): a fresh draw, the random stream left elsewhere than eager's.
    fn = RandomFunction(
        (1, 2),
        2,
        (
            Step("abs", 0, 0),
            Step("abs", 2, 2),
            Step("custom_noisy_scale", 3, 3),
            Step("normal_transposed_reduced_", 4, 4),
        ),
        (5, 0),
    )
    x = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([[-2.1788, 0.5684]], dtype=torch.float64)
    assert_checkpoint_equivalent(fn, x, y, policy=policy, transforms=["grad_of_grad", "double_backward"])


def test_second_derivatives_beside_a_random_custom_function_whose_output_nothing_reads() -> None:
    # Its random call stays in the trace (it moves the generator), read by nothing: it was refused as a
    # call inside a Function remat could not apply again.
    def fn(x: torch.Tensor) -> torch.Tensor:
        _NoisyScale.apply(x)
        return x * x.cos()

    _assert_second_order_equal(fn, _float64(4), policies.save_nothing)


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_second_derivatives_through_a_custom_function_that_only_takes_a_view_beside_a_random_call(
    policy: Any,
) -> None:
    # The Function calls no op of its own, so the rules did not count it as applied again: the random
    # call's state was not kept, the pure forward could not run, and the backward program, which reads
    # the Function's output as a constant, was differentiated: a second derivative off eager's (2.15 soak).
    def fn(x: torch.Tensor) -> torch.Tensor:
        v = x * _first_column(x.sin())
        return v + 0.1 * torch.rand_like(v)

    _assert_second_order_equal(fn, _float64(3, 2), policy)


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_second_derivatives_through_a_custom_function_drawing_from_a_generator_of_its_own(policy: Any) -> None:
    generator = torch.Generator().manual_seed(3)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = _NoisyGate.apply(x, generator)
        return x * x * y + _NoisyGate.apply(y, None)  # two applications, two generators

    def second_order(f: Callable[..., torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        generator.manual_seed(3)
        gradient = _create_graph_then_backward(f, x)
        return gradient, torch.rand(2, generator=generator)

    x = _float64(6)
    expected, after = second_order(fn, x)
    got, got_after = second_order(remat.checkpoint(fn, policy=policy), x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_after, after)


# --- a backward traced as it will run ------------------------------------------------------------------


def _group_norm_of_a_transposed_gradient(x: torch.Tensor) -> torch.Tensor:
    # The gradient reaching group norm is transposed (through `.t().contiguous()` after it); in grad mode
    # eager's formula keeps that layout, where `.backward()`'s fused kernel makes it contiguous.
    normed = F.group_norm(x.reshape(1, 2, 4), 2).reshape(2, 4)
    return F.silu(normed.t().contiguous())


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_under_torch_func_grad_the_backward_runs_eager_grad_mode_formulas_bit_for_bit(policy: Any) -> None:
    # NOTE [a backward traced as it will run]: torch.func.grad runs backward in grad mode, where group norm's
    # and SiLU's formulas take their differentiable form; a trace for `.backward()` ran the fused kernels,
    # which gave a contiguous gradient (eager's is transposed) and other round-off.
    x = torch.randn(2, 4, dtype=torch.float64)
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(4, 2)

    def gradient(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        return torch.func.grad(lambda x: (fn(x) * weights).sum())(x)

    checkpointed = remat.checkpoint(_group_norm_of_a_transposed_gradient, policy=policy)
    expected, got = gradient(_group_norm_of_a_transposed_gradient), gradient(checkpointed)
    assert got.stride() == expected.stride() == (1, 2)
    assert torch.equal(got, expected)
    # `.backward()` runs the fused kernels, as eager's does, from a trace of its own.
    leaf = x.clone().requires_grad_()
    (checkpointed(leaf) * weights).sum().backward()
    eager_leaf = x.clone().requires_grad_()
    (_group_norm_of_a_transposed_gradient(eager_leaf) * weights).sum().backward()
    assert leaf.grad is not None and eager_leaf.grad is not None
    assert leaf.grad.stride() == eager_leaf.grad.stride() == (4, 1)
    assert torch.equal(leaf.grad, eager_leaf.grad)
    assert checkpointed.cache_info().traces == 2


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_create_graph_runs_eager_grad_mode_formulas_bit_for_bit(policy: Any) -> None:
    # NOTE [a backward that will be differentiated]: `autograd.grad(create_graph=True)` cannot be known at
    # trace time; its backward was the trace's, with decompositions of the fused ops, which gave group
    # norm's gradient a contiguous layout (eager's grad-mode formula keeps the transposed one) and other
    # round-off in the second derivative. Now autograd differentiates the pure forward, eager's formulas.
    x = torch.randn(2, 4, dtype=torch.float64)
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(4, 2)

    def first_and_second(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad((fn(leaf) * weights).sum(), leaf, create_graph=True)
        (second,) = torch.autograd.grad((grad * grad.detach().cos()).sum(), leaf)
        return grad, second

    checkpointed = remat.checkpoint(_group_norm_of_a_transposed_gradient, policy=policy)
    (expected, expected_second), (got, got_second) = (
        first_and_second(_group_norm_of_a_transposed_gradient),
        (first_and_second(checkpointed)),
    )
    assert got.stride() == expected.stride() == (1, 2)
    assert torch.equal(got, expected)
    assert torch.equal(got_second, expected_second)


def test_create_graph_gives_zeros_where_eager_formulas_do() -> None:
    # `matrix_power(x, 0)` copies an identity over a clone of x: eager's `copy_` formula gives x a gradient
    # of zeros, where autograd over the pure forward (whose copy has no derivative) found none.
    assert_checkpoint_equivalent(lambda x: torch.linalg.matrix_power(x, 0), _float64(2, 2), transforms=SECOND_ORDER)


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_values_computed_through_integers_have_no_derivative(policy: Any) -> None:
    if _quirks.QUANTILE_COMPARES_TENSORS.applies(_torch.RELEASE):
        pytest.skip(f"torch {_torch.RELEASE}: {_quirks.QUANTILE_COMPARES_TENSORS.differs} (refused: test_trace)")
    # nanquantile's interpolation weights come from a count of the values that are not NaN (`isnan`,
    # `sum`): an integer has no derivative, and eager's gradient of it does not require grad. remat took the
    # saved weights for values with a derivative, so its create_graph gradient required grad.
    x = _float64(4, 5)
    q = torch.tensor([0.3, 0.6], dtype=torch.float64)
    assert_checkpoint_equivalent(lambda x: torch.nanquantile(x, q, dim=1), x, policy=policy, transforms=SECOND_ORDER)


def test_batch_norm_with_running_statistics_under_grad_and_forward_mode() -> None:
    # `_batch_norm_with_update` under `grad`: the kept copies of its running statistics, outputs of remat's
    # Function, required grad at the transform's level, and the replay in backward raised torch's "not
    # differentiable with respect to argument 'running_mean'". A copy of an input without a gradient has
    # no derivative now.
    def fn(x: torch.Tensor, w: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor) -> Any:
        return aten._batch_norm_with_update(x, w, w.cos(), running_mean, running_var, 0.5, 1e-5)[0].sin()

    for policy in (policies.save_nothing, policies.save_everything):
        stats = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
        assert_checkpoint_equivalent(
            fn, _float64(3, 5, 2), _float64(5), *stats, policy=policy, transforms=["grad", "vjp", *SECOND_ORDER]
        )


@torch.library.custom_op("remat_tests::cubed_with_gradient", mutates_args=())
def _cubed_with_gradient(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.pow(3), x.pow(2) * 3.0, x.new_zeros(0)


@_cubed_with_gradient.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(0)


def _save_gradient(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.gradient = output[1].detach()


_cubed_with_gradient.register_autograd(
    lambda ctx, grad, *_: grad * ctx.gradient,
    setup_context=_save_gradient,
)


def test_a_custom_op_whose_backward_reads_a_gradient_from_its_forward_is_differentiated_as_eager() -> None:
    # A custom op that computes its gradient in forward (as chunked `linear_cross_entropy` does) and an
    # output nothing reads: remat could not apply it again (that output was gone from the graph) and
    # differentiated its own backward, where eager's gradient has no derivative (it does not require grad).
    def fn(x: torch.Tensor) -> torch.Tensor:
        return _cubed_with_gradient(x)[0]

    for policy in (policies.save_nothing, policies.save_everything):
        assert_checkpoint_equivalent(fn, _float64(3, 2), policy=policy, transforms=["double_backward"])


def test_as_strided_scatter_of_an_element_has_the_finite_difference_gradient_under_create_graph() -> None:
    # Scattering a 0-d source over element 0 of x replaces it: the output does not depend on x[0]. Eager's
    # formula gives x[0] the output's gradient there anyway; with `create_graph=True` remat's backward is
    # autograd's over the program, which agrees with float64 finite differences (`.backward()` keeps eager's
    # formula, traced). The OpInfo sweep skips this pair (`test_opinfo.EAGER_WRONG`).
    def fn(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return torch.as_strided_scatter(x, source, (), (), storage_offset=0)

    x, source = torch.tensor([0.3, -1.2], dtype=torch.float64), torch.tensor(0.7, dtype=torch.float64)
    weights = torch.tensor([0.66, -0.4], dtype=torch.float64)

    def gradient(f: Callable[..., torch.Tensor]) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad((f(leaf, source) * weights).sum(), leaf, create_graph=True)
        return grad

    step = 1e-6
    finite_differences = torch.stack(
        [((fn(x + step * e, source) - fn(x - step * e, source)) * weights).sum() / (2 * step) for e in torch.eye(2)]
    )
    torch.testing.assert_close(gradient(remat.checkpoint(fn)), finite_differences)
    assert not torch.allclose(gradient(fn), finite_differences)


# --- tangents that will be differentiated -------------------------------------------------------------

_NORMS_OF_TRAINING = {
    "layer_norm": lambda t: F.layer_norm(t, (5,)).sin(),
    "batch_norm": lambda t: F.batch_norm(t, None, None, training=True).sin(),
    "instance_norm": lambda t: F.instance_norm(t).sin(),
}


@pytest.mark.parametrize("name", sorted(_NORMS_OF_TRAINING))
@pytest.mark.parametrize("batched", [False, True], ids=["grad_of_jvp", "grad_of_jvp_of_vmap"])
def test_reverse_mode_of_norm_tangents_matches_finite_differences_where_eager_does_not(
    name: str, batched: bool
) -> None:
    # NOTE [tangents that will be differentiated]: eager's tangent formulas for these norms read statistics
    # without a derivative, so `grad` of `jvp` misses terms (and under `vmap` eager and a per-example loop
    # differ too). remat differentiates decomposed formulas: it matches the derivative of finite-difference
    # tangents, and eager does not (if torch fixes it, TANGENT_FORMULAS_READ_STATISTICS's probe says so).
    fn = _NORMS_OF_TRAINING[name]
    generator = torch.Generator().manual_seed(0)
    shape = (2, 4, 3, 5) if batched else (4, 3, 5)
    x, tangent, weights = (torch.randn(*shape, dtype=torch.float64, generator=generator) for _ in range(3))
    mapped = (lambda f: torch.vmap(f)) if batched else (lambda f: f)

    def derivative(f: Callable[..., torch.Tensor]) -> torch.Tensor:
        return torch.func.grad(lambda t: (weights * torch.func.jvp(mapped(f), (t,), (tangent,))[1]).sum())(x)

    step = 1e-5
    reference = torch.func.grad(
        lambda t: (weights * (mapped(fn)(t + step * tangent) - mapped(fn)(t - step * tangent)) / (2 * step)).sum()
    )(x)
    got, expected = derivative(remat.checkpoint(fn)), derivative(fn)
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(expected, reference, rtol=1e-3, atol=1e-3)
    # First order stays eager's: the tangents themselves.
    torch.testing.assert_close(
        torch.func.jvp(mapped(remat.checkpoint(fn)), (x,), (tangent,))[1],
        torch.func.jvp(mapped(fn), (x,), (tangent,))[1],
        rtol=1e-12,
        atol=1e-12,
    )


# --- regions of a backward without grad ----------------------------------------------------------------


# The soak's find: the catalog's `once_differentiable` square, then a draw, both returned.
_ONCE_DIFFERENTIABLE_BESIDE_A_DRAW = RandomFunction(
    (1, 2), 1, (Step("custom_square_once_differentiable", 0, 0), Step("bernoulli", 1, 1)), (2, 1)
)


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_a_once_differentiable_backward_is_not_differentiated_as_in_eager(policy: Any) -> None:
    # NOTE [regions of a backward without grad]: under torch.func's `grad` of `grad`, eager takes the
    # derivative through a `once_differentiable` backward (computed under no_grad) as zero. remat's backward,
    # traced in grad mode, held its ops as plain ops and differentiated them (found by the 2.15 soak).
    x = _float64(1, 2)
    assert_checkpoint_equivalent(_ONCE_DIFFERENTIABLE_BESIDE_A_DRAW, x, policy=policy, transforms=["grad_of_grad"])


def test_create_graph_through_a_random_fill_of_a_view_is_connected_as_eager() -> None:
    # NOTE [a fill's derivative] (found by the 2.13 soak): autograd gives an in-place `bernoulli_` a zero
    # derivative with respect to the tensor it fills, so eager's create_graph gradient requires grad and its
    # derivative is zeros; remat's fill on a fresh tensor cut the tensor's history, and gave None.
    fn = RandomFunction((1, 2), 1, (Step("bernoulli_reshaped_transposed_", 0, 0),), (1,), seed=0)
    x = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["double_backward"])


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_create_graph_through_a_once_differentiable_function_beside_an_unkept_draw(policy: Any) -> None:
    # Under `create_graph=True` of a trace for `.backward()`, the backward that will be differentiated is
    # autograd's over a recomputation of the outputs that applies the custom Function again. Where the
    # policy keeps neither the value nor the state of a random call the outputs are computed from
    # (`save_everything`: the draw is saved, and no gradient formula reads it), that recomputation could not
    # be had: differentiating the traced backward gave -0.32 where eager gives 0.22, and then remat refused.
    # The state of such a call is kept now (NOTE [custom Functions applied again]).
    x = _float64(1, 2)
    assert_checkpoint_equivalent(_ONCE_DIFFERENTIABLE_BESIDE_A_DRAW, x, policy=policy, transforms=["double_backward"])


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 2.0 * x

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return 2.0 * grad


def _updates_its_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = _Twice.apply(x).sin() * x + scale
    scale.mul_(2.0)
    return out


def test_second_derivatives_through_a_custom_function_beside_an_input_updated_in_place() -> None:
    # The outputs are computed from `scale`, which `fn` then overwrites in place. Recomputing them to apply
    # the Function again reads `scale` as it was, which first derivatives need not keep (the sum's formula
    # does not read it): under torch.func's `grad` of `grad` the backward traced in grad mode ran instead
    # and differentiated the Function's forward ops, computed under `no_grad` (-1.75 for eager's -0.01),
    # and `create_graph` was refused. A copy of `scale` is kept where the trace applies a custom Function.
    x = _float64(2, 3)

    def grad_of_grad(function: Callable[..., torch.Tensor]) -> torch.Tensor:
        inner = torch.func.grad(lambda y, s: function(y, s).sum())
        return torch.func.grad(lambda y, s: inner(y, s).sum())(x, torch.ones(2, 3, dtype=torch.float64))

    checkpointed = remat.checkpoint(_updates_its_scale)
    torch.testing.assert_close(grad_of_grad(checkpointed), grad_of_grad(_updates_its_scale), rtol=0, atol=0)
    eager_scale, scale = torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    (eager,) = torch.autograd.grad(_updates_its_scale(leaf, eager_scale).sum(), leaf, create_graph=True)
    (grad,) = torch.autograd.grad(checkpointed(leaf, scale).sum(), leaf, create_graph=True)
    torch.testing.assert_close(grad, eager, rtol=0, atol=0)
    torch.testing.assert_close(scale, eager_scale, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.autograd.grad(grad.sum(), leaf)[0], torch.autograd.grad(eager.sum(), leaf)[0], rtol=0, atol=0
    )


def test_create_graph_gradients_meet_in_eager_order() -> None:
    # Found by the 2.13 soak: the input's gradient is the sum of a path through `abs` and one through a
    # transposed batch norm; eager's engine runs the later call's formula first, and the first gradient to
    # arrive gives the sum its layout (transposed). The recomputed forward was emitted output by output,
    # the batch norm first, and its gradient came out contiguous. It is emitted in `fn`'s order now.
    fn = RandomFunction((3, 2), 1, (Step("abs", 0, 0), Step("abs", 1, 1), Step("batch_norm_transposed", 0, 0)), (3, 2))
    x = torch.tensor([[1.5410, -0.2934], [-2.1788, 0.5684], [-1.0845, -1.3986]], dtype=torch.float64)
    assert_checkpoint_equivalent(fn, x.requires_grad_(), transforms=["double_backward"])


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_create_graph_through_a_kept_fill_and_what_is_computed_from_it(policy: Any) -> None:
    # NOTE [a fill's derivative]: where the policy keeps a fill of `x.cos()` and a `cumprod` of it, the
    # recomputed forward read both as constants, and the gradient lost the fill's zero derivative: None
    # for eager's zeros. What is computed from the fill is recomputed now, from the kept fill connected.
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.cos().t()
        t.bernoulli_(0.5)
        return t.t().cumprod(1) * x

    assert_checkpoint_equivalent(
        fn, _float64(3, 4), policy=policy, transforms=["grad", "grad_of_grad", "double_backward"]
    )


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_a_dropout_of_a_custom_functions_output_under_grad_of_grad(policy: Any) -> None:
    # Found by the 2.13 soak (`custom_cube`, `cumprod_at_zeros`, `rrelu_transposed_then_dropout`): dropout's
    # mask fills `empty_like` of the Function's output, and was taken for a value computed from that output
    # (so with a derivative through the Function's backward, to recompute); its draw had no kept state, and
    # the backward traced in grad mode ran instead, differentiating the kept `tanh` through the Function's
    # forward ops, computed under `no_grad`: a second derivative of 0.51 came out -0.22. A fill of an
    # output's shape has no derivative (NOTE [custom Functions applied again]).
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(_Cube.apply(x).tanh(), 0.3)

    assert_checkpoint_equivalent(fn, _float64(3, 2), policy=policy, transforms=["grad_of_grad", "double_backward"])
    soaked = RandomFunction(
        (3, 2),
        1,
        (Step("custom_cube", 0, 0), Step("cumprod_at_zeros", 1, 1), Step("rrelu_transposed_then_dropout", 2, 2)),
        (3, 0, 1),
        seed=5475,
    )
    x = torch.tensor([[1.5410, -0.2934], [-2.1788, 0.5684], [-1.0845, -1.3986]], dtype=torch.float64)
    assert_checkpoint_equivalent(soaked, x.requires_grad_(), policy=policy, transforms=["grad_of_grad"])


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_a_random_call_on_a_custom_functions_output_under_grad_of_grad(policy: Any) -> None:
    # `rrelu` in training draws its slopes and has a derivative: recomputing the outputs to apply the
    # Function again draws it again, from its generator state, which a trace for torch.func's `grad` of
    # `grad` kept only for a `.backward()` trace (where `create_graph` may come). Without it, the backward
    # traced in grad mode ran, and the second derivative differed (1.37 for 1.23). The state is kept in
    # every trace that applies a custom Function now.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.rrelu(_Cube.apply(x).tanh(), training=True)

    assert_checkpoint_equivalent(fn, _float64(3, 2), policy=policy, transforms=["grad_of_grad", "double_backward"])


class _FirstColumn(torch.autograd.Function):
    """Returns a view of its input: no op of its own in the trace."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.narrow(-1, 0, 1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.width = inputs[0].shape[-1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return F.pad(grad, (0, ctx.width - 1)) * 2.0  # not the view's derivative: eager's shows it


# An `apply` taken once, as libraries define their ops (`my_op = MyFunction.apply`): tracing wraps
# `Function.apply` to note each application, which such a reference bypasses.
_first_column, _cube, _cos = _FirstColumn.apply, _Cube.apply, _Cos.apply


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_second_derivatives_through_an_apply_taken_before_tracing(policy: Any) -> None:
    # Such applications went unnoted: a Function returning a view of its input calls no op of its own, so
    # nothing in the trace showed it, and second derivatives went through the view, not the Function's
    # backward (eager's 1.53 came out -0.09); through `_Cube`, remat refused them. Tracing notes them through
    # the Functions' `forward`s too now (NOTE [custom Functions applied again]).
    x = _float64(3, 4)
    transforms = ["grad", "grad_of_grad", "double_backward"]
    assert_checkpoint_equivalent(lambda x: x.sin() * _first_column(x), x, policy=policy, transforms=transforms)
    assert_checkpoint_equivalent(lambda x: F.dropout(_cube(x).tanh(), 0.3), x, policy=policy, transforms=transforms)
    assert_checkpoint_equivalent(lambda x: x * _cos(x.tanh()), x, policy=policy, transforms=["double_backward"])
    assert torch.autograd.Function.forward is not _FirstColumn.forward  # the wrapping is undone
    assert vars(_FirstColumn)["forward"].__func__.__name__ == "forward"


@pytest.mark.parametrize("saved", [1, 2])
def test_create_graph_gradients_meet_in_eager_order_past_a_kept_value(saved: int) -> None:
    # Found by the 2.15 soak: a kept value (`0.5 * x + 1.0`) is recomputed by the pure forward too, and
    # copying what each output reads, output by output, put its calls before the `roll` that `fn` called
    # first: the two paths' gradients reached `x` in the other order, and their sum took the other layout.
    def fn(x: torch.Tensor) -> torch.Tensor:
        channels_first = torch.stack([torch.roll(x, 1, 0), 0.5 * x + 1.0]).transpose(1, 2)
        out = F.batch_norm(channels_first, None, None, training=True)
        return out.view(-1)[: x.numel()].view(x.shape[1], x.shape[0]).t()

    x = torch.tensor([[1.5410, -0.2934], [-2.1788, 0.5684]], dtype=torch.float64)
    assert_checkpoint_equivalent(
        fn, x.requires_grad_(), policy=policies.save_calls(saved), transforms=["double_backward"]
    )
    (grad,) = torch.autograd.grad(
        remat.checkpoint(fn, policy=policies.save_calls(saved))(x).sum(), x, create_graph=True
    )
    (expected,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    assert grad.stride() == expected.stride() == (1, 2)


# --- a kept copy of an input, differentiated again -------------------------------------------------------

_W = torch.linspace(-1.5, 2.0, 3, dtype=torch.float64).requires_grad_()


class _DoubledInPlace(torch.autograd.Function):
    """Doubles its input in place and marks it dirty."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


_inner = remat.checkpoint(lambda x: (x * _W).sin())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "policy", [policies.save_nothing, policies.save_everything], ids=["save_nothing", "save_everything"]
)
@pytest.mark.parametrize(
    ("fn", "n_args"),
    [
        (lambda x: (x * _W, x), 1),
        (lambda a, b: (b * _W, a.sin(), a), 2),
        (lambda a, b: (b * _W, a.sin(), a.unsqueeze(0).t()), 2),
        (lambda x: (x * _W, x[0]), 1),
        (lambda x: (_inner(x), x.unsqueeze(-1).permute(1, 0)), 1),
    ],
    ids=[
        "an input returned",
        "an input returned beside a sin",
        "a transposed view returned",
        "an element returned",
        "nested",
    ],
)
def test_regression_a_second_derivative_beside_a_returned_input_ends(
    fn: Callable[..., Any], n_args: int, policy: Any
) -> None:
    # An input the function returns is kept as a copy, an output of the Function; the backward that will be
    # differentiated differentiated with respect to it, which led autograd back into the same backward,
    # without end (issue 69). NOTE [kept activations are outputs]
    args = [_float64(3) for _ in range(n_args)]
    assert_checkpoint_equivalent(
        fn, *args, policy=policy, params=[_W], transforms=["grad", "grad_of_grad", "double_backward"]
    )


@pytest.mark.timeout(60)
def test_regression_a_second_derivative_of_an_input_returned_runs_the_backward_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from remat._running import _execute

    runs = []
    backward = _execute._CheckpointFunction._backward
    monkeypatch.setattr(
        _execute._CheckpointFunction, "_backward", staticmethod(lambda ctx, *g: runs.append(1) or backward(ctx, *g))
    )
    start = _float64(3).detach()

    def second_derivative(f: Callable[..., Any]) -> list[torch.Tensor]:
        x = start.clone().requires_grad_()
        _W.grad = None
        a, b = f(x)
        (grad,) = torch.autograd.grad(a.sum() + b.square().sum(), x, create_graph=True)
        grad.sum().backward()
        return [grad.detach(), x.grad, _W.grad]

    expected = second_derivative(lambda x: (x * _W, x))
    got = second_derivative(remat.checkpoint(lambda x: (x * _W, x)))
    assert 1 <= len(runs) <= 3
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "policy", [policies.save_nothing, policies.save_everything], ids=["save_nothing", "save_everything"]
)
def test_regression_a_function_that_doubles_its_input_in_place_is_applied_again_on_its_input(policy: Any) -> None:
    # Its argument was placed in the graph after its forward had updated it: it was its own output, and
    # building the program that applies it again never ended (issue 69).
    def fn(x: torch.Tensor) -> torch.Tensor:
        s = F.softsign(x)
        t = s * s.exp()
        return _DoubledInPlace.apply(s) * _W + t

    assert_checkpoint_equivalent(fn, _float64(3), policy=policy, params=[_W], transforms=SECOND_ORDER)
