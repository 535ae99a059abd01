"""What eager does that a functional trace must keep: random draws in eager's layout, kernels
that choose their output layout, exact write-backs through views, output metadata.

Each test is one class of difference an independent random-program fuzzer found (issue 22),
reduced to its smallest program, and checks remat against eager on it: values (random draws
bit for bit), where the random stream is left, output metadata (strides, `requires_grad`,
memory shared with inputs), gradients, and errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

import remat
from remat import policies
from remat.testing import TRANSFORMS, assert_checkpoint_equivalent

POLICIES = pytest.mark.parametrize(
    "policy", [policies.save_nothing, policies.save_everything], ids=["save_nothing", "save_everything"]
)


def _seeded(thunk: Callable[[], Any]) -> tuple[Any, torch.Tensor]:
    """`thunk()` from a seeded generator, and the numbers the generator draws next."""
    torch.manual_seed(0)
    result = thunk()
    return result, torch.rand(4)


def _seeded_call(fn: Callable[..., Any], *args: Any) -> tuple[Any, torch.Tensor]:
    return _seeded(lambda: fn(*args))


def _assert_draws_as_eager(fn: Callable[..., Any], *args: Any, policy: Any, **vmap_options: Any) -> None:
    run = (lambda f: vmap(f, **vmap_options)) if vmap_options else (lambda f: f)
    expected, expected_next = _seeded(lambda: run(fn)(*args))
    actual, actual_next = _seeded(lambda: run(remat.checkpoint(fn, policy=policy))(*args))
    assert torch.equal(actual, expected)
    assert torch.equal(actual_next, expected_next)


# --- random fills draw in eager's layout ----------------------------------------------------------


@POLICIES
@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.dropout(x.t(), p=0.5),
        lambda x: x.t().sin().bernoulli_(0.5),
        lambda x: x.t().sin().uniform_(-1, 1) * 2,
        lambda x: x.t().cos().exponential_() * 2,
    ],
    ids=["dropout", "bernoulli_", "uniform_", "exponential_"],
)
def test_regression_random_fills_of_transposed_tensors_draw_eagers_numbers(fn: Callable, policy: Any) -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    _assert_draws_as_eager(fn, x, policy=policy)
    assert_checkpoint_equivalent(fn, x, policy=policy)


@POLICIES
def test_regression_normal_fill_of_a_strided_view_draws_eagers_numbers_and_count(policy: Any) -> None:
    # normal_ takes another kernel path on a non-contiguous tensor, drawing another count.
    y = torch.randn(3, 3, 4, dtype=torch.float64, requires_grad=True)
    _assert_draws_as_eager(lambda y: y.abs()[..., ::2].normal_() * 1, y, policy=policy)


@POLICIES
def test_regression_dropout_on_a_contiguous_copy_still_draws_eagers_numbers(policy: Any) -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    _assert_draws_as_eager(lambda x: F.dropout(x.t().contiguous(), p=0.5), x, policy=policy)


@POLICIES
def test_regression_in_place_normal_under_vmap_different_randomness_draws_eagers_numbers(policy: Any) -> None:
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    _assert_draws_as_eager(lambda x: x.sin().normal_() * x, x, policy=policy, randomness="different")
    # Its result unused: the stream is still left where eager leaves it.
    _assert_draws_as_eager(lambda x: (x.sin().normal_(), x * 2)[1], x, policy=policy, randomness="different")


def test_regression_replayed_transposed_dropout_gives_eagers_gradient() -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda x: F.dropout(x.t().sin(), p=0.5).cos()  # noqa: E731
    (expected,), _ = _seeded(lambda: torch.autograd.grad(fn(x).sum(), x))
    (actual,), _ = _seeded(lambda: torch.autograd.grad(remat.checkpoint(fn)(x).sum(), x))
    assert torch.equal(actual, expected)


def test_the_trace_still_names_the_functional_random_op() -> None:
    trace = remat.trace(lambda x: x.t().sin().bernoulli_(0.5), torch.randn(3, 4))
    assert [call.op for call in trace] == [torch.ops.aten.sin.default, torch.ops.aten.bernoulli.p]
    assert trace[1].is_random


# --- kernels that choose their output layout --------------------------------------------------------


@POLICIES
def test_regression_view_of_a_cpu_batch_norm_output_whose_input_was_transposed(policy: Any) -> None:
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4).double()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return bn(x.transpose(1, 2)).view(-1)

    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, policy=policy)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_outputs_have_eagers_strides(training: bool) -> None:
    bn = torch.nn.BatchNorm2d(3).double().train(training)
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64, requires_grad=True)
    for layout in (
        lambda x: x.transpose(1, 2),
        lambda x: x.transpose(1, 2).contiguous(memory_format=torch.channels_last),
    ):
        fn = lambda x, layout=layout: bn(layout(x))  # noqa: E731
        expected = fn(x)
        assert remat.checkpoint(fn)(x).stride() == expected.stride()
        assert remat.trace(fn, x)[-1].outputs[0].shape == tuple(expected.shape)


def _slice_assigned_then_log_sigmoid(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    t3 = torch.addmm(x1[:, 0], x0, x1.T).view(-1, 2).t()  # (2, 8), strides (1, 2)
    t5 = F.mish(t3).clone()
    t5[..., :3] = t3[..., :3] * 2
    t9 = torch.maximum(t5, t3)
    flat = F.logsigmoid(t9).view(-1)  # the CPU kernel's output is contiguous, whatever its input's layout
    return torch.mm(torch.tanh(t9), t5.t()) + flat.sum()


@POLICIES
def test_regression_log_sigmoid_of_a_transposed_tensor_is_contiguous_as_in_eager(policy: Any) -> None:
    # The fake kernel followed the input's layout, so a `view` that eager accepts failed with a raw
    # ValueError. NOTE [kernels that choose their output layout]
    x0, x1 = (torch.randn(4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert_checkpoint_equivalent(_slice_assigned_then_log_sigmoid, x0, x1, policy=policy, transforms=["grad", "vjp"])
    for layout in (lambda x: x.mT, lambda x: x.contiguous(memory_format=torch.channels_last)):
        x = layout(torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True))
        assert_checkpoint_equivalent(lambda x: F.logsigmoid(x).view(-1), x, policy=policy)


def _transposed(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=torch.float64, generator=generator).mT


# Ops whose CPU kernel gives another layout than their fake kernel says (PyTorch's OpInfo database,
# swept), each followed by a `view` that only eager's layout allows.
KERNEL_LAYOUTS = {
    "floor_divide": lambda a, b: torch.floor_divide(a.contiguous(), b + 3.0).view(-1) * a.reshape(-1),
    "copysign": lambda a, b: torch.copysign(a.contiguous(), b).view(-1).sin() * a.reshape(-1),
    "xlogy": lambda a, b: torch.xlogy(a.contiguous(), b * b + 1.0).view(-1),
    "heaviside": lambda a, b: torch.heaviside(a[:, :1].contiguous(), b).mT.view(-1) + a.reshape(-1),
    "pow_scalar": lambda a, b: torch.pow(2.0, a).view(-1),
    "reflection_pad3d": lambda a, b: (
        F.pad(
            a.reshape(1, 1, 2, 3, 2).contiguous(memory_format=torch.channels_last_3d),
            (1, 1, 1, 1, 1, 1),
            mode="reflect",
        )
        .permute(0, 2, 3, 4, 1)
        .view(-1)
        .sum()
        * a
    ),
}


@pytest.mark.parametrize("fn", KERNEL_LAYOUTS.values(), ids=KERNEL_LAYOUTS.keys())
def test_regression_ops_whose_cpu_kernel_chooses_their_layout_are_traced_with_it(fn: Callable) -> None:
    a = _transposed((4, 3), seed=0).requires_grad_()
    b = _transposed((4, 3), seed=1).requires_grad_()
    assert_checkpoint_equivalent(fn, a, b)


def _attention_over_a_filled_transpose(x: torch.Tensor) -> torch.Tensor:
    t = torch.cos(x).mT
    t.bernoulli_(0.5)
    return F.scaled_dot_product_attention(t, t.sin(), t, is_causal=True)


@POLICIES
def test_regression_ops_after_a_random_fill_of_a_transposed_tensor_see_its_eager_layout(policy: Any) -> None:
    # The functional `bernoulli.p` is contiguous, while the fill runs in eager's (transposed) layout:
    # traced for the wrong layout, attention chose a kernel that read the transposed tensor as if it
    # were contiguous (values off by up to 1.0 on torch 2.15). NOTE [random fills draw in eager's layout]
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    _assert_draws_as_eager(_attention_over_a_filled_transpose, x, policy=policy)
    assert_checkpoint_equivalent(_attention_over_a_filled_transpose, x, policy=policy, seed=1)
    fill = remat.trace(lambda x: torch.cos(x).mT.bernoulli_(0.5) * 1, x)[1]
    assert fill.op is torch.ops.aten.bernoulli.p


# --- writes through views -----------------------------------------------------------------------------


def test_regression_fill_through_an_expand_that_expands_nothing_is_bit_exact() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x.expand(*x.shape).uniform_(-1, 1)
        return w * 2

    w = torch.ones(2, dtype=torch.float64, requires_grad=True)
    x = torch.randn(1000, dtype=torch.float64)
    xa, xb = x.clone(), x.clone()
    _, expected_next = _seeded(lambda: fn(xa, w))
    _, actual_next = _seeded(lambda: remat.checkpoint(fn)(xb, w))
    assert torch.equal(xb, xa)
    assert torch.equal(actual_next, expected_next)
    assert [call.op for call in remat.trace(fn, x, w)] == [torch.ops.aten.uniform.default, torch.ops.aten.mul.Tensor]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "update",
    [lambda t: t.expand(1, *t.shape)[0, :, ::2].normal_(), lambda t: t.expand(1, 1, *t.shape).mul_(1.7)],
    ids=["fill_of_a_slice", "product"],
)
def test_regression_update_through_an_expand_adding_dims_of_one_is_bit_exact(update: Callable, dtype: Any) -> None:
    # Functionalization writes it back as `base + (new - base)`, one rounding off eager's (a bfloat16 soak's
    # find, where an `amax` of the result then chose another element); it is traced as the view it is.
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.sin()
        update(t)
        return t * x

    x = torch.randn(3, 6, dtype=dtype)
    expected, _ = _seeded(lambda: fn(x))
    got, _ = _seeded(lambda: remat.checkpoint(fn)(x.requires_grad_()))
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "update",
    [
        lambda t: t.unfold(0, 2, 1).uniform_(-1, 1),
        lambda t: t[:1].expand(4, 3).fill_(1.0),
        lambda t: t[:, :1].expand(4, 3).zero_(),
    ],
    ids=["unfold", "expand_fill", "expand_zero"],
)
def test_regression_in_place_update_of_a_self_overlapping_view_is_a_trace_error(update: Callable) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x * 2
        update(t)
        return t + x

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    fn(x.detach().clone().requires_grad_())  # eager allows it
    with pytest.raises(remat.TraceError, match=r"updates in place at .*test_fidelity.py:\d+ .*share memory"):
        remat.checkpoint(fn)(x)


@POLICIES
@pytest.mark.parametrize(
    "update",
    [
        lambda t: t.as_strided((3, 2), (2, 3)).mul_(2.0),  # offsets 0 3 2 5 4 7: interleaved, distinct
        lambda t: t.view(-1).as_strided((2, 3), (5, 1), 1).normal_(),
        lambda t: t.expand(1, *t.shape)[0, :, ::2].uniform_(),
    ],
    ids=["interleaved_as_strided", "strided_rows", "leading_expand"],
)
def test_regression_in_place_update_of_a_view_whose_elements_share_nothing_runs(update: Callable, policy: Any) -> None:
    # Each stride of the interleaved view is within the other's extent: remat took it to overlap.
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.sin().repeat(2, 1)  # (4, 3)
        update(t)
        return t * 2

    assert_checkpoint_equivalent(fn, torch.randn(2, 3, dtype=torch.float64, requires_grad=True), policy=policy)


def _unfold_of_one_window(update: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = torch.sigmoid(x).repeat(2, 1, 1, 1)  # (2, 2, 3, 4): dimension 0 holds one window of 2
        update(t.unfold(-4, 2, 1))  # shape (1, 2, 3, 4, 2), strides (24, 12, 4, 1, 24): no overlap
        return (t * x).sum()

    return fn


@POLICIES
@pytest.mark.parametrize(
    "update",
    [lambda v: v.mul_(2), lambda v: v.normal_(), lambda v: v.add_(v.detach() * 0.5)],
    ids=["mul_", "normal_", "add_"],
)
def test_regression_in_place_update_of_an_unfold_of_one_window_runs_as_in_eager(update: Callable, policy: Any) -> None:
    # Functionalization refuses a write through any `unfold` whose window is longer than its step,
    # with a raw RuntimeError, even where its one window overlaps nothing. NOTE [writes through views]
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(_unfold_of_one_window(update), x, policy=policy, transforms=["grad", "vjp"])


@pytest.mark.slow
@POLICIES
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize(("length", "size", "step"), [(4, 1, 2), (6, 2, 3), (7, 2, 3), (5, 2, 2), (3, 1, 2)], ids=str)
def test_regression_a_write_through_an_unfold_with_gaps_leaves_the_gaps_alone(
    length: int, size: int, step: int, policy: Any
) -> None:
    # Functionalization writes back through an unfold as the sum of its windows: the elements no
    # window holds came back as zeros, silently. NOTE [writes through views]
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.sin()
        t.unfold(1, size, step).mul_(2.0)
        return t * x

    x = torch.randn(2, length, dtype=torch.float64, requires_grad=True)
    ragged = ((length - size) // step + 1) * step > length  # traced as an as_strided: see the NOTE
    transforms = (
        ["grad", "vjp", "jvp", "grad_of_jvp"] if ragged else list(TRANSFORMS)
    )  # see remat.testing.transforms_for
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=transforms)


def test_an_unfold_of_one_window_keeps_the_shape_and_strides_of_its_elements() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.cos()
        window = t.unfold(1, 3, 2)  # one window of 3 over a dimension of 3, step 2
        window.add_(1.0)
        return t * x, window

    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    expected = fn(x)[1]
    actual = remat.checkpoint(fn)(x)[1]
    assert actual.shape == expected.shape
    # The stride of the dimension of 1 is the one thing that differs: no kernel reads it.
    assert [s for s, n in zip(actual.stride(), actual.shape, strict=True) if n > 1] == [
        s for s, n in zip(expected.stride(), expected.shape, strict=True) if n > 1
    ]
    assert_checkpoint_equivalent(fn, x)


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_regression_a_write_through_a_transposed_slice_keeps_the_layout_under_vmap() -> None:
    # vmap's batching rule for `slice_scatter` returns a contiguous tensor, where eager's write keeps the
    # layout of the tensor it writes into (the soak found it: strides (4, 1, 2) for eager's (4, 2, 1)).
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.abs()
        with torch.no_grad():
            y.t()[1:].mul_(0.5)
        return y

    x = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["vmap", "grad"])


_ROWS = torch.tensor([1, 0, 2])
FILLS_OF_A_TENSOR_BATCHED_IN_ITS_MIDDLE = {
    "bernoulli_ of a transposed reshape": lambda x: (
        F.embedding(_ROWS, x).cos().reshape(3, 2, 2).mT.bernoulli_(0.5).mT.reshape(3, 4) * x
    ),
    "normal_": lambda x: F.embedding(_ROWS, x).sin().normal_() * x,
    "normal_ of a strided slice": lambda x: ((t := F.embedding(_ROWS, x).sin())[:, ::2].normal_(), t * x)[1],
    "dropout": lambda x: F.dropout(F.embedding(_ROWS, x), 0.5, training=True),
    "dropout of a transpose": lambda x: F.dropout(F.embedding(_ROWS, x).t(), 0.5, training=True),
}


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize(
    "fn", FILLS_OF_A_TENSOR_BATCHED_IN_ITS_MIDDLE.values(), ids=FILLS_OF_A_TENSOR_BATCHED_IN_ITS_MIDDLE.keys()
)
def test_regression_a_random_fill_under_vmap_draws_in_the_batched_tensors_memory_order(fn: Callable) -> None:
    # Under vmap an embedding's output keeps its batch dimension in the middle of memory, and eager's
    # in-place fill draws the batch's numbers in that order; remat filled a fresh tensor with the batch
    # first: other numbers, silently (the soak found it). A dropout's mask under vmap is contiguous.
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["vmap"])


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_regression_a_write_into_a_tensor_batched_in_its_middle_dimension_keeps_that_layout_under_vmap() -> None:
    # Under vmap, embedding's output keeps the batch dimension in the middle of
    # memory; eager's write through a view keeps it there, and remat's scatter made it contiguous: the
    # per-example strides of a batched tensor (here (4, 1) of a (2, 2) example) are not a dense layout
    # of their own, so the check that restores the layout missed it (the soak found it).
    rows = torch.tensor([1, 0])

    def fn(x: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.embedding(rows, x).clone()
        t[:, 0].mul_(2.0)
        return t

    x = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, transforms=["vmap", "grad"])


# --- aliasing and in-place updates of inputs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "view",
    [lambda x: x.unbind(0)[1], lambda x: x.chunk(2)[1], lambda x: x.split(1)[1]],
    ids=["unbind", "chunk", "split"],
)
@pytest.mark.parametrize("mutate_first", [False, True], ids=["view_then_update", "update_then_view"])
def test_regression_multi_output_view_of_an_input_updated_in_place_stays_a_view(
    view: Callable, mutate_first: bool
) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if mutate_first:
            x.mul_(2)
        out = view(x)
        if not mutate_first:
            x.mul_(2)
        return out

    x1, x2 = torch.ones(2, 3), torch.ones(2, 3)
    a, b = fn(x1), remat.checkpoint(fn)(x2)
    assert torch.equal(a, b) and torch.equal(x1, x2)
    x1.add_(1)
    x2.add_(1)
    assert torch.equal(a, b)  # a view of the input in eager, so under remat too
    assert b.untyped_storage().data_ptr() == x2.untyped_storage().data_ptr()


@POLICIES
@pytest.mark.parametrize(
    "update",
    [lambda x: x.detach().uniform_(-1, 1), lambda x: x.data.mul_(2)],
    ids=["detach", "data"],
)
def test_regression_update_of_a_leaf_input_that_autograd_does_not_see(update: Callable, policy: Any) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        update(x)
        return x * 3 + x.sin()

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, policy=policy)
    checkpointed = remat.checkpoint(fn, policy=policy)
    y = x.detach().clone().requires_grad_()
    checkpointed(y).sum().backward()
    assert y.is_leaf and y.grad_fn is None and y.grad is not None


@POLICIES
def test_regression_update_of_a_leaf_input_under_no_grad(policy: Any) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x.mul_(2)
        return x * 3

    assert_checkpoint_equivalent(fn, torch.randn(3, dtype=torch.float64, requires_grad=True), policy=policy)


@POLICIES
@pytest.mark.parametrize("randomness", ["error", "different"])
def test_regression_in_place_update_of_a_split_output_under_vmap(policy: Any, randomness: str) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.sin().split([1, 3])
        b.neg_()
        return a, b

    x = torch.randn(2, 4, 4, dtype=torch.float64)
    expected = vmap(fn, randomness=randomness)(x)
    actual = vmap(remat.checkpoint(fn, policy=policy), randomness=randomness)(x)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)
    # Requiring grad, eager refuses the update: so does remat.
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        fn(x[0].clone().requires_grad_())
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        remat.checkpoint(fn, policy=policy)(x[0].clone().requires_grad_())


# --- output metadata ---------------------------------------------------------------------------------


@POLICIES
@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.normal(torch.bernoulli(x.sigmoid()), 0.5),
        lambda x: x.sin().bernoulli_(0.5),
        lambda x: torch.normal(x.exp(), 0.5).mul_(2)[1:],
    ],
    ids=["normal_of_bernoulli", "bernoulli_", "normal_mul_view"],
)
def test_regression_outputs_of_zero_derivative_random_ops_require_grad_as_in_eager(fn: Callable, policy: Any) -> None:
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (expected, (expected_grad,)), _ = _seeded(lambda: (lambda o: (o, torch.autograd.grad(o.sum(), x)))(fn(x)))
    checkpointed = remat.checkpoint(fn, policy=policy)
    (actual, (actual_grad,)), _ = _seeded(lambda: (lambda o: (o, torch.autograd.grad(o.sum(), x)))(checkpointed(x)))
    assert expected.requires_grad and actual.requires_grad
    assert torch.equal(actual, expected)
    assert torch.equal(actual_grad, expected_grad)  # zeros


def test_random_factories_still_give_outputs_that_need_no_grad() -> None:
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    fn = lambda x: (torch.rand_like(x.sin()), x * 2)  # noqa: E731
    assert [o.requires_grad for o in remat.checkpoint(fn)(x)] == [o.requires_grad for o in fn(x)] == [False, True]


@pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.save_everything, policies.save_calls(0)],
    ids=["save_nothing", "save_everything", "save_sin"],
)
def test_regression_view_of_a_saved_value_without_grad_needs_no_grad(policy: Any) -> None:
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.sin()  # x needs no grad; t is kept for w's gradient
        return t * w, t[1:]

    x = torch.randn(3, dtype=torch.float64)
    assert [o.requires_grad for o in remat.checkpoint(fn, policy=policy)(x)] == [True, False]
    assert_checkpoint_equivalent(fn, x, policy=policy, params=[w])


def test_view_of_a_saved_value_with_grad_still_takes_second_derivatives() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.sin()
        return t * t, t[1:]

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradgradcheck(lambda x: remat.checkpoint(fn, policy=policies.save_everything)(x), (x,))


# --- traces with no calls ---------------------------------------------------------------------------------


def _sac_recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


# Every built-in policy, each factory with some arguments: (name in `remat.policies`, policy).
BUILT_IN_POLICIES = [
    ("budget", policies.budget(fraction=0.5)),
    ("budget", policies.budget(max_bytes=0)),
    ("budget", policies.budget(fraction=0.5, exact=True)),
    ("dots_saveable", policies.dots_saveable),
    ("dots_with_no_batch_dims_saveable", policies.dots_with_no_batch_dims_saveable),
    ("budget", policies.budget(fraction=0.5, cost="roofline:h100", offload=True)),
    ("budget", policies.budget(fraction=0.5, compress="fp8")),
    ("compress", policies.compress(policies.save_everything, "fp8")),
    ("from_sac", policies.from_sac(_sac_recompute_everything)),
    ("offload", policies.offload(policies.save_everything)),
    ("offload_dots", policies.offload_dots),
    ("offload_dots_with_no_batch_dims", policies.offload_dots_with_no_batch_dims),
    ("offload_tagged", policies.offload_tagged("hidden")),
    ("pack", policies.pack(policies.dots_saveable)),
    ("pack_everything", policies.pack_everything),
    ("save_and_offload_tagged", policies.save_and_offload_tagged(save=["a"], offload=["hidden"])),
    ("save_tagged_except", policies.save_tagged_except("hidden")),
    ("save_all_of", policies.save_all_of(policies.dots_saveable, policies.save_everything)),
    ("save_any_of", policies.save_any_of(policies.dots_saveable, policies.save_nothing)),
    ("save_by_cost", policies.save_by_cost(1e-12)),
    ("save_calls", policies.save_calls()),
    ("save_everything", policies.save_everything),
    ("save_modules", policies.save_modules("mlp.*")),
    ("save_nothing", policies.save_nothing),
    ("save_ops", policies.save_ops(torch.ops.aten.mm)),
    ("save_scopes", policies.save_scopes("Gelu*")),
    ("save_tagged", policies.save_tagged("hidden")),
    ("save_unless", policies.save_unless(policies.save_everything, policies.dots_saveable)),
]


def test_the_list_of_built_in_policies_is_complete() -> None:
    factories = {name for name in policies.__all__ if name[0].islower()}
    assert {name for name, _ in BUILT_IN_POLICIES} == factories


@pytest.mark.parametrize("policy", [p for _, p in BUILT_IN_POLICIES], ids=[repr(p) for _, p in BUILT_IN_POLICIES])
def test_regression_a_trace_without_calls_under_a_policy(policy: Any) -> None:
    fn = lambda x: x.unbind(0)[1].view(-1)  # noqa: E731  # only views: no call to decide about
    x = torch.randn(2, 3, 4, requires_grad=True)
    assert len(remat.trace(fn, x)) == 0
    assert remat.report(fn, x, policy=policy).saved_bytes == 0
    assert_checkpoint_equivalent(fn, x, policy=policy)


# --- forward-mode AD sees through no_grad --------------------------------------------------------------


def _scale_under_no_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = x * 2  # forward-mode AD still carries x's tangent here, as in eager
    return y * x


def test_regression_jvp_sees_through_no_grad_regions() -> None:
    x, t = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    expected = torch.func.jvp(_scale_under_no_grad, (x,), (t,))
    actual = torch.func.jvp(remat.checkpoint(_scale_under_no_grad), (x,), (t,))
    torch.testing.assert_close(actual, expected)
    # A detach stops it, in both.
    detached = lambda x: x.detach() * 2 + x  # noqa: E731
    torch.testing.assert_close(
        torch.func.jvp(remat.checkpoint(detached), (x,), (t,)), torch.func.jvp(detached, (x,), (t,))
    )


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.mul_(2),
        lambda x: x.mul_(2).sin(),
        lambda x: (_in_place_without_grad(x), x * 3)[1],
    ],
    ids=["returned", "read", "under_no_grad"],
)
def test_forward_ad_of_an_in_place_update_of_an_input_updates_its_tangent(fn: Callable) -> None:
    import torch.autograd.forward_ad as fwAD

    results = []
    for f in (fn, remat.checkpoint(fn)):
        with fwAD.dual_level():
            x = fwAD.make_dual(torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([1.0, -1.0]).double())
            out = f(x)
            results.append((out.detach(), fwAD.unpack_dual(out).tangent, fwAD.unpack_dual(x).tangent))
    for actual, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(actual, expected)


def _in_place_without_grad(x: torch.Tensor) -> None:
    with torch.no_grad():
        x.mul_(0.5)


def _updates_its_input(x: torch.Tensor) -> torch.Tensor:
    x.mul_(2)
    return x.sin()


def _updates_its_input_without_grad(x: torch.Tensor) -> torch.Tensor:
    _in_place_without_grad(x)
    return x * x.sin()


def _updates_its_input_through_a_detach(x: torch.Tensor) -> torch.Tensor:
    x.detach().mul_(2)
    return x * x.sin()


_UNDER_FUNC_JVP: dict[str, Callable[[Callable, torch.Tensor, torch.Tensor], Any]] = {
    "jvp": lambda f, x, t: torch.func.jvp(f, (x,), (t,)),
    "vmap_of_jvp": lambda f, x, t: vmap(lambda x, t: torch.func.jvp(f, (x,), (t,)))(x, t),
    "jvp_of_vmap": lambda f, x, t: torch.func.jvp(vmap(f), (x,), (t,)),
}


@pytest.mark.parametrize(
    "fn", [_updates_its_input, _updates_its_input_without_grad, _updates_its_input_through_a_detach]
)
@pytest.mark.parametrize("transform", list(_UNDER_FUNC_JVP))
def test_torch_func_jvp_of_an_in_place_update_of_an_input_is_a_clear_error(fn: Callable, transform: str) -> None:
    # Eager runs each; under `vmap` of `jvp`, remat raised torch's raw "Some elements marked as dirty ...".
    x, t = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"torch.func.jvp .* updates an input in place.*clone"):
        _UNDER_FUNC_JVP[transform](remat.checkpoint(fn), x, t)


# --- dropout under torch.func ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dropout", "traces"),
    [
        (lambda x: F.dropout(x.t(), 0.3, training=True).t(), 3),
        (lambda x: F.alpha_dropout(x.t(), 0.3, training=True).t(), 3),
        # A mask per channel, contiguous whatever the input's layout: vmap shares the plain trace.
        (lambda x: F.dropout1d(x.t().unsqueeze(0), 0.3, training=True).squeeze(0).t(), 2),
    ],
    ids=["dropout", "alpha_dropout", "dropout1d"],
)
def test_regression_dropout_of_a_transposed_input_draws_eagers_mask_with_and_without_transforms(
    dropout: Callable, traces: int
) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return dropout(x) * x

    weight = torch.randn(3, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    runs = {
        "plain": (lambda f: f, x),
        "grad": (lambda f: torch.func.grad(lambda x: (f(x) * weight).sum()), x),
        "vmap": (lambda f: vmap(f, randomness="different"), torch.stack([x, 2 * x])),
    }
    checkpointed = remat.checkpoint(fn)
    for transform, argument in runs.values():
        expected, expected_next = _seeded_call(transform(fn), argument)
        actual, actual_next = _seeded_call(transform(checkpointed), argument)
        assert torch.equal(actual, expected)
        assert torch.equal(actual_next, expected_next)
    # vmap's signature is the plain call's, but its masks may be drawn otherwise: then a trace of
    # its own (as grad's, whose input requires grad), kept beside the plain one.
    assert checkpointed.cache_info().traces == traces
    for transform, argument in runs.values():
        transform(checkpointed)(argument)
    assert checkpointed.cache_info().traces == traces


def test_dropout_of_a_contiguous_input_shares_one_trace_with_and_without_transforms() -> None:
    fn = lambda x: F.dropout(x, 0.3, training=True) * x  # noqa: E731
    checkpointed = remat.checkpoint(fn)
    x = torch.randn(3, 4, dtype=torch.float64)
    for transform, argument in ((lambda f: f, x), (lambda f: vmap(f, randomness="different"), torch.stack([x, x]))):
        expected, _ = _seeded_call(transform(fn), argument)
        actual, _ = _seeded_call(transform(checkpointed), argument)
        assert torch.equal(actual, expected)
    assert checkpointed.cache_info().traces == 1


def _detach_of_an_updated_tensor(x: torch.Tensor) -> torch.Tensor:
    v = x.clone().add_(x).mul_(0.5)  # updated in place: its detached alias is recreated when next read
    return v * v.detach().sin()


def test_regression_detach_of_a_tensor_updated_in_place_stops_forward_and_second_derivatives() -> None:
    x, t = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    checkpointed = remat.checkpoint(_detach_of_an_updated_tensor, policy=policies.save_everything)
    torch.testing.assert_close(
        torch.func.jvp(checkpointed, (x,), (t,)), torch.func.jvp(_detach_of_an_updated_tensor, (x,), (t,))
    )
    hessian = torch.func.hessian(lambda x: _detach_of_an_updated_tensor(x).sum())(x)
    torch.testing.assert_close(torch.func.hessian(lambda x: checkpointed(x).sum())(x), hessian)
    second = torch.func.jacrev(torch.func.jacrev(lambda x: _detach_of_an_updated_tensor(x).sum()))(x)
    torch.testing.assert_close(torch.func.jacrev(torch.func.jacrev(lambda x: checkpointed(x).sum()))(x), second)


# --- error checks of linalg ops -------------------------------------------------------------------

_CHECKED_LINALG = [
    pytest.param(torch.linalg.inv, id="inv"),
    pytest.param(lambda a: torch.linalg.solve(a, a.sum(-1)), id="solve"),
    pytest.param(lambda a: torch.linalg.cholesky(a @ a.mT + torch.eye(3, dtype=a.dtype)), id="cholesky"),
    pytest.param(lambda a: torch.linalg.slogdet(a).logabsdet, id="slogdet"),
    pytest.param(lambda a: torch.linalg.lu_factor(a).LU, id="lu_factor"),
]


def _well_conditioned() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 3, generator=generator, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
    return a.requires_grad_()


@POLICIES
@pytest.mark.parametrize("fn", _CHECKED_LINALG)
def test_linalg_ops_that_check_their_results_trace_and_match_eager(fn: Callable, policy: Any) -> None:
    assert_checkpoint_equivalent(fn, _well_conditioned(), policy=policy, transforms=["grad", "vmap"])


def test_the_linalg_error_check_is_a_call_of_the_trace_and_runs_once_in_forward() -> None:
    from conftest import CountOps

    check = torch.ops.aten._linalg_check_errors.default
    assert [call.op for call in remat.trace(torch.linalg.inv, _well_conditioned())] == [
        torch.ops.aten.linalg_inv_ex.default,
        check,
    ]
    f = remat.checkpoint(torch.linalg.inv, policy=policies.save_nothing)
    a = _well_conditioned()
    f(a)  # traced: what is counted below is the cached call
    with CountOps() as forward:
        out = f(a)
    with CountOps() as backward:
        out.sum().backward()
    assert forward.counts[check] == 1
    assert backward.counts[check] == 0  # the replayed `linalg_inv_ex` is not checked again


@pytest.mark.parametrize("calls", [1, 2], ids=["tracing call", "cached call"])
def test_a_singular_matrix_raises_in_forward_as_in_eager(calls: int) -> None:
    f = remat.checkpoint(torch.linalg.inv)
    singular = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(torch.linalg.LinAlgError, match="singular") as eager:
        torch.linalg.inv(singular)
    if calls == 2:
        f(_well_conditioned()[0])  # traces the signature with an invertible matrix
    with pytest.raises(torch.linalg.LinAlgError) as checkpointed:
        f(singular)
    assert str(checkpointed.value) == str(eager.value)


def test_regression_a_slice_assignment_counts_the_same_bytes_on_every_trace() -> None:
    # FakeTensorMode's cache made the functional copy of a slice assignment into a transposed clone anew
    # at offset 0, with a smaller storage than eager's: the first trace in a process counted 8 bytes more
    # than the next (a flaky accounting property in CI). NOTE [fake results from the cache lose their
    # storage offset]
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = x.contiguous().t().clone()
        t[1:] = y.t()[1:] * 2.0
        return t.t().sin()

    x, y = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    torch._subclasses.fake_tensor.FakeTensorMode.cache_clear()
    traces = [remat.trace(fn, x, y) for _ in range(2)]  # the second finds the copy in the cache
    counted = []
    for trace in traces:
        (copy,) = [call.index for call in trace if call.op is torch.ops.aten.copy.default]
        counted.append(trace.dataflow.nbytes[(copy, 0)])  # type: ignore[union-attr]
    eager = torch.ops.aten.copy.default(x.contiguous().t().clone()[1:], y.t()[1:].detach())
    assert eager.storage_offset() == 1
    assert counted == [eager.untyped_storage().nbytes()] * 2


@pytest.mark.parametrize("grad_dtype", [torch.float32, None], ids=["float32", "any"])
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=str)
def test_regression_a_parameter_with_a_grad_dtype_of_its_own_gets_its_gradient_as_in_eager(
    grad_dtype: torch.dtype | None, policy: Any
) -> None:
    # FSDP2's mixed precision (torch 2.15) sets `grad_dtype` to float32 on its bfloat16 parameters, so the
    # float32 gradient rms_norm computes for its weight reaches the reduction unrounded. remat's traced
    # backward rounded it to bfloat16 (the engine's cast on the fake parameter): torchtitan's losses
    # drifted from eager's at the fourth step.
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    norm.weight.grad_dtype = grad_dtype

    def fn(x: torch.Tensor) -> torch.Tensor:
        return norm(x).float().square().sum()

    grads = []
    for run in (fn, remat.checkpoint(fn, policy=policy)):
        norm.weight.grad = None
        run(x).backward()
        grads.append(norm.weight.grad)
    assert grads[0].dtype == torch.float32
    assert grads[1].dtype == grads[0].dtype
    assert torch.equal(grads[1], grads[0])


def test_the_ops_vmap_runs_example_by_example_are_asked_of_the_dispatcher() -> None:
    # NOTE [ops vmap runs example by example]: composite ops with neither a batching rule nor a vmap
    # decomposition; `matmul` and `fft_rfft` have decompositions vmap uses, `_fft_r2c` a rule.
    from remat._torch import runs_per_example_under_vmap

    assert all(runs_per_example_under_vmap(name) for name in ("stft", "fft_ihfft2", "fft_ihfftn"))
    assert not any(runs_per_example_under_vmap(name) for name in ("matmul", "fft_rfft", "_fft_r2c", "not_an_op"))


def test_rrelu_gradient_in_the_noise_layout_as_the_cpu_kernel_gives_it() -> None:
    # Found by the 2.13 soak: in training, the CPU kernel of `rrelu_with_noise_backward` multiplies the noise
    # by the gradient, so its output takes the noise's layout (contiguous after a transposed input), where
    # the fake kernel gave the gradient's; a `view` the backward then took of it was refused while tracing.
    from remat.testing import RandomFunction, Step

    steps = ("branch_on_generator", "reshape", "rrelu_transposed_then_dropout", "advanced_index")
    fn = RandomFunction((2, 2), 1, tuple(Step(op, i, i) for i, op in enumerate(steps)), (4,), seed=0)
    x = torch.tensor([[1.5410, -0.2934], [-2.1788, 0.5684]], dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, seed=0)


# --- NaN and infinities -----------------------------------------------------------------------------------


@POLICIES
@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_regression_a_fill_through_an_expand_keeps_a_nan_out_of_the_gradient(special: float, policy: Any) -> None:
    # The fill's zero derivative is written into the gradient through the `expand` it filled, which the
    # backward's functionalization wrote back as `base + (new - base)`: a NaN or infinity the gradient held
    # there came out NaN, where eager's is finite (issue 69). NOTE [writes through views]
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x * 1.0
        t.expand(*t.shape).uniform_(-1.0, 1.0)
        return t * x

    x = torch.tensor([[special, 1.0], [-0.0, 2.0]], dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=["grad", "vmap", "double_backward"])
