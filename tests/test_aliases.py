"""Outputs that alias inputs or each other come back with eager's identity and autograd metadata.

A returned `x.detach()` is a new tensor that shares `x`'s memory and version counter, needs no grad
and has no history; a view `fn` took under `no_grad` requires grad as a leaf of its own; an input
`fn` updated in place and returned is the input itself. Each is compared with eager, field by field,
and gradients with eager's in float64, under plain backward and `torch.func`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from conftest import ATOL, RTOL

import remat
import remat.testing
from remat import policies

DTYPE = torch.float64

POLICIES = pytest.mark.parametrize(
    "policy", [policies.save_nothing, policies.save_everything], ids=["save_nothing", "save_everything"]
)


def _without_grad(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return make()


def _identity(output: torch.Tensor, outputs: list[torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """What eager says about an output's identity: which input it is, which tensor its `_base` is, and
    its autograd metadata; the version counter's value where it is shared with an input."""

    def which(tensor: torch.Tensor | None) -> str:
        for i, t in enumerate(inputs):
            if tensor is t:
                return f"input {i}"
        for i, t in enumerate(outputs):
            if tensor is t:
                return f"output {i}"
        return "none" if tensor is None else "another tensor"

    shares_memory = [
        i for i, t in enumerate(inputs) if t.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
    ]
    return (
        which(output),
        which(output._base),
        output._is_view(),
        output.requires_grad,
        output.grad_fn is None,
        output.is_leaf,
        shares_memory,
        output._version if shares_memory else None,
    )


def _run(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> tuple[list[Any], list[torch.Tensor | None]]:
    """Call `fn`, backpropagate a weighted sum of the float outputs that require grad (each output its
    own weight, so a gradient sent through the wrong output shows), and describe what it returned."""
    for t in inputs:
        t.grad = None
    outputs = optree.tree_leaves(fn(*inputs))
    identities = [_identity(o, outputs, inputs) for o in outputs]
    loss = sum((o * (k + 2)).sum() for k, o in enumerate(outputs) if o.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    return identities, [None if t.grad is None else t.grad.clone() for t in inputs]


def _assert_as_in_eager(fn: Callable[..., Any], policy: Any, *inputs: torch.Tensor) -> None:
    expected_identities, expected_grads = _run(fn, inputs)
    identities, grads = _run(remat.checkpoint(fn, policy=policy), inputs)
    assert identities == expected_identities
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert (grad is None) == (expected is None)
        if expected is not None:
            torch.testing.assert_close(grad, expected, rtol=RTOL, atol=ATOL)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=DTYPE, generator=generator, requires_grad=True)
    w = torch.randn(3, 4, dtype=DTYPE, generator=generator, requires_grad=True)
    return x, w


DETACHED_ALIASES = {
    "detach of an input": lambda x, w: (x.detach(), (x * w).sum()),
    "view of a detached input": lambda x, w: (x.detach()[1:], (x * w).sum()),
    "reshape of a detached input": lambda x, w: (x.detach().view(4, 3), (x * w).sum()),
    "detach of a view of an input": lambda x, w: (x[1:].detach(), (x * w).sum()),
    "detach of a returned intermediate": lambda x, w: ((y := x * w), y.detach()),
    "view of a detach of a returned intermediate": lambda x, w: ((y := x * w), y.detach()[1:]),
    "detach of an intermediate": lambda x, w: ((x * w).detach(), (x * w).sum()),
    "detached aliases in a pytree": lambda x, w: {"a": x.detach(), "b": [(x * w).sum(), x.detach().t()]},
    "two detaches of one input": lambda x, w: (x.detach(), x.detach(), (x * w).sum()),
}

NO_GRAD_VIEWS = {
    "view of an input under no_grad": lambda x, w: (_without_grad(lambda: x[1:]), (x * w).sum()),
    "view of a returned intermediate under no_grad": lambda x, w: ((y := x * w), _without_grad(lambda: y[1:])),
    "view of an intermediate under no_grad": lambda x, w: (_without_grad(lambda: (x * w)[1:]), (x * w).sum()),
}


@POLICIES
@pytest.mark.parametrize("fn", DETACHED_ALIASES.values(), ids=DETACHED_ALIASES.keys())
def test_regression_a_returned_detach_is_eagers_detach_and_stops_the_gradient(fn: Callable, policy: Any) -> None:
    # torch 2.15 traces `x.detach()` as `aten.alias`: rebuilt as that, the output required grad and
    # backward sent its gradient into `x`. NOTE [a detach runs as a detach]
    _assert_as_in_eager(fn, policy, *_inputs())


@POLICIES
@pytest.mark.parametrize("fn", NO_GRAD_VIEWS.values(), ids=NO_GRAD_VIEWS.keys())
def test_regression_a_view_taken_under_no_grad_is_a_leaf_that_requires_grad_as_in_eager(
    fn: Callable, policy: Any
) -> None:
    # Tracing failed: autograd was asked to differentiate the view, which has no history.
    _assert_as_in_eager(fn, policy, *_inputs())


def test_a_returned_detach_shares_the_inputs_version_counter() -> None:
    x, w = _inputs()
    detached, _ = remat.checkpoint(lambda x, w: (x.detach(), (x * w).sum()))(x, w)
    with torch.no_grad():
        x.add_(1.0)
    assert detached._version == x._version == 1
    assert torch.equal(detached, x)


@pytest.mark.parametrize("fn", DETACHED_ALIASES.values(), ids=DETACHED_ALIASES.keys())
def test_detached_aliases_under_torch_func_grad_and_vjp(fn: Callable) -> None:
    def scalar(fn: Callable) -> Callable:
        def weighted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return sum((o * (k + 2)).sum() for k, o in enumerate(optree.tree_leaves(fn(x, w))))  # type: ignore[return-value]

        return weighted

    x, w = (t.detach() for t in _inputs())
    expected = torch.func.grad(scalar(fn), argnums=(0, 1))(x, w)
    actual = torch.func.grad(scalar(remat.checkpoint(fn)), argnums=(0, 1))(x, w)
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)

    outputs, pullback = torch.func.vjp(fn, x, w)
    actual_outputs, actual_pullback = torch.func.vjp(remat.checkpoint(fn), x, w)
    torch.testing.assert_close(actual_outputs, outputs, rtol=RTOL, atol=ATOL)
    cotangents = optree.tree_map(torch.ones_like, outputs)
    torch.testing.assert_close(actual_pullback(cotangents), pullback(cotangents), rtol=RTOL, atol=ATOL)


FORWARD_MODE = ["jvp", "forward_ad", "jvp_of_vmap", "vmap_of_jvp"]


@pytest.mark.parametrize(
    "fn",
    [*DETACHED_ALIASES.values(), lambda x, w: (x.abs().detach()[:1].expand(x.shape), x * w)],
    ids=[*DETACHED_ALIASES.keys(), "expand of a detach, returned"],
)
def test_regression_detached_outputs_have_no_tangent_in_forward_mode(fn: Callable) -> None:
    # The checkpoint gave a detached output a tangent (of zeros): for an `expand` of one, torch's
    # Function machinery then wrote the tangent into the overlapping output, a raw torch error. As in
    # eager, a detached output has no derivative with respect to any input, and no tangent.
    remat.testing.assert_checkpoint_equivalent(fn, *_inputs(), transforms=FORWARD_MODE)
    x, w = (t.detach() for t in _inputs())
    with torch.autograd.forward_ad.dual_level():
        duals = [torch.autograd.forward_ad.make_dual(t, torch.ones_like(t)) for t in (x, w)]
        expected = [torch.autograd.forward_ad.unpack_dual(o).tangent is None for o in optree.tree_leaves(fn(*duals))]
        outputs = optree.tree_leaves(remat.checkpoint(fn)(*duals))
        assert [torch.autograd.forward_ad.unpack_dual(o).tangent is None for o in outputs] == expected


SHARED_MEMORY_VIEWS = {
    "expand of a row of an intermediate": lambda x, w: (x * w)[:1].expand(3, 4),
    "overlapping windows of an intermediate": lambda x, w: (x * w).flatten().unfold(0, 4, 2),
    "as_strided of an intermediate onto itself": lambda x, w: (x * w).as_strided((3, 3), (1, 1)),
    "two expands of one intermediate": lambda x, w: ((y := (x * w)[:1]).expand(3, 4), y.t().expand(4, 4) * 1),
    "expand of a transposed intermediate's row": lambda x, w: (x.exp().t() * w.t())[0].expand(2, 3),
    "expand of an intermediate, the intermediate returned too": lambda x, w: ((y := x * w), y[:1].expand(2, 4)),
    "expand of an intermediate under no_grad": lambda x, w: (
        (y := x * w),
        _without_grad(lambda: y.sin()[:1].expand(2, 4)),
    ),
    # Its base (the detach) traces as a second detach node beside the view's (found by the soak).
    "expand of a detach of an intermediate updated under no_grad": lambda x, w: _expand_of_a_detach(x.abs() * w),
}


def _expand_of_a_detach(y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y.t()[1:].mul_(0.5)
    return y.detach()[:1].expand(y.shape)


@POLICIES
@pytest.mark.parametrize("fn", SHARED_MEMORY_VIEWS.values(), ids=SHARED_MEMORY_VIEWS.keys())
def test_regression_an_output_whose_elements_share_memory_under_forward_mode_over_vmap(
    fn: Callable, policy: Any
) -> None:
    # The Function returned the view itself: under a forward-mode transform over vmap, autograd could not
    # copy the jvp rule's tangent into memory its elements share (a raw torch error). Traced for forward
    # mode it returns the view's base and the epilogue takes the view again. NOTE [outputs whose elements
    # may share memory]
    expected = [o.stride() for o in optree.tree_leaves(fn(*_inputs()))]
    assert [o.stride() for o in optree.tree_leaves(remat.checkpoint(fn, policy=policy)(*_inputs()))] == expected
    remat.testing.assert_checkpoint_equivalent(fn, *_inputs(), policy=policy)  # every transform


# torch's own (eager's too): under vmap, `unfold`'s backward has no batching rule.
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize("fn", SHARED_MEMORY_VIEWS.values(), ids=SHARED_MEMORY_VIEWS.keys())
def test_second_derivatives_of_outputs_whose_elements_share_memory(fn: Callable) -> None:
    def weighted(x: torch.Tensor, w: torch.Tensor, fn: Callable = fn) -> torch.Tensor:
        return sum(((o * (k + 2)) ** 2).sum() for k, o in enumerate(optree.tree_leaves(fn(x, w))))  # type: ignore[return-value]

    x, w = (t.detach() for t in _inputs())
    for second in (torch.func.hessian, lambda f: torch.func.jacrev(torch.func.jacfwd(f)), torch.func.jacfwd):
        expected = second(weighted)(x, w)
        actual = second(lambda x, w: weighted(x, w, remat.checkpoint(fn)))(x, w)
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


def _update_the_input(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x.mul_(w.sigmoid())
    return (x.sin() * w).sum()


@POLICIES
@pytest.mark.parametrize("through", ["slice", "transposed view"])
def test_regression_an_input_that_is_a_view_updated_in_place_as_in_eager(policy: Any, through: str) -> None:
    # Autograd refused the Function ("If your Function modifies inplace an input that is a view of
    # another Tensor, your Function cannot return more than one Tensor"). NOTE [updated inputs that are views]
    def run(fn: Callable[..., Any]) -> tuple[Any, ...]:
        leaf, w = _inputs()
        base = leaf * 1.0
        x = base[1:] if through == "slice" else base.t()[:, 1:].t()
        loss = fn(x, w[1:])
        (loss + base.square().sum()).backward()
        return loss.detach(), base.detach(), x._version, type(x.grad_fn).__name__, leaf.grad, w.grad

    expected = run(_update_the_input)
    actual = run(remat.checkpoint(_update_the_input, policy=policy))
    assert actual[2:4] == expected[2:4]
    torch.testing.assert_close((actual[:2], actual[4:]), (expected[:2], expected[4:]), rtol=RTOL, atol=ATOL)


def _scale_without_grad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x.t()[:1].mul_(0.5)
    return x.sin() * w


def test_an_input_that_is_a_view_updated_in_place_under_forward_mode_is_refused_with_the_way_out() -> None:
    # A dual tensor of a tensor that requires grad is a view of it; under forward mode even an update
    # autograd does not record makes an input dirty. Autograd refused with its own words (found under the
    # checker's "grad_of_forward_ad"): remat says what to do. NOTE [updated inputs that are views]
    x = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
    w = torch.randn(3, 4, dtype=DTYPE)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        assert dual._is_view()
        eagers = torch.autograd.forward_ad.make_dual(x.detach().clone().requires_grad_(), torch.ones_like(x))
        _scale_without_grad(eagers, w)  # eager runs it
        with pytest.raises(NotImplementedError, match=r"an input that is a view .*Pass a tensor that is not a view"):
            remat.checkpoint(_scale_without_grad)(dual, w)
        out = remat.checkpoint(_scale_without_grad)(dual.clone(), w)  # the way out
        expected = _scale_without_grad(dual.clone(), w)
        torch.testing.assert_close(
            torch.autograd.forward_ad.unpack_dual(out).tangent, torch.autograd.forward_ad.unpack_dual(expected).tangent
        )


def _update_through_a_transposed_slice(x: torch.Tensor) -> torch.Tensor:
    view = x.t()[:, :1]
    view.mul_(0.5).add_(1.0)
    return view


UPDATED_INPUTS = {
    "returned": lambda x, w: (x, (_update_through_a_transposed_slice(x) * w[:1].t()).sum()),
    "returned with the view": lambda x, w: ((v := _update_through_a_transposed_slice(x)), x, (v * w[:1].t()).sum()),
    "a view of it returned": lambda x, w: ((_update_through_a_transposed_slice(x) * w[:1].t()).sum(), x[1:]),
    "returned in a dict, twice": lambda x, w: {"a": x, "b": (_update_through_a_transposed_slice(x) * 2).sum(), "c": x},
    "returned, updated in place directly": lambda x, w: (x.mul_(2), (x * w).sum()),
}


@POLICIES
@pytest.mark.parametrize("fn", UPDATED_INPUTS.values(), ids=UPDATED_INPUTS.keys())
@pytest.mark.parametrize("requires_grad", [False, True], ids=["input without grad", "non-leaf input with grad"])
def test_regression_an_input_updated_through_a_view_and_returned_is_the_input(
    fn: Callable, requires_grad: bool, policy: Any
) -> None:
    # Its final value is a view of the scatter that writes the update: remat returned that, a copy.
    x, w = _inputs()
    x = x.detach().requires_grad_(requires_grad)

    def fresh_inputs() -> tuple[torch.Tensor, torch.Tensor]:
        return (x * 1.0 if requires_grad else x.detach().clone()), w

    expected_input, w_ = fresh_inputs()
    expected_outputs = optree.tree_leaves(fn(expected_input, w_))
    actual_input, _ = fresh_inputs()
    actual_outputs = optree.tree_leaves(remat.checkpoint(fn, policy=policy)(actual_input, w_))
    assert [o is expected_input for o in expected_outputs] == [o is actual_input for o in actual_outputs]
    assert [o._base is expected_input for o in expected_outputs] == [o._base is actual_input for o in actual_outputs]
    torch.testing.assert_close(actual_input, expected_input, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(actual_outputs, expected_outputs, rtol=RTOL, atol=ATOL)
    if requires_grad:
        expected_grads = torch.autograd.grad(sum(o.sum() for o in expected_outputs), (x, w), allow_unused=True)
        actual_grads = torch.autograd.grad(sum(o.sum() for o in actual_outputs), (x, w), allow_unused=True)
        torch.testing.assert_close(actual_grads, expected_grads, rtol=RTOL, atol=ATOL)


@POLICIES
def test_regression_the_fuzzers_input_updated_through_a_transposed_slice_is_returned_as_itself(policy: Any) -> None:
    weight = torch.randn(3, 1, dtype=DTYPE, requires_grad=True)
    bias = torch.randn(3, dtype=DTYPE)

    def fn(x0: torch.Tensor, x1: torch.Tensor) -> dict[str, torch.Tensor]:
        t1 = x1.transpose(-1, -2)[..., :1]
        t1.sigmoid_()
        t3 = torch.kthvalue(x1, 1, dim=0).values
        t1.div_(2)
        t1.uniform_(-1, 1)
        return {"o0": t3, "o1": t3, "o2": x1, "o3": torch.nn.functional.linear(t1, weight, bias)}

    x0 = torch.randn(2, 4, dtype=DTYPE, requires_grad=True)
    x1 = torch.randn(3, 3, dtype=DTYPE)
    torch.manual_seed(0)
    expected_x1 = x1.clone()
    expected = fn(x0, expected_x1)
    torch.manual_seed(0)
    actual_x1 = x1.clone()
    actual = remat.checkpoint(fn, policy=policy)(x0, actual_x1)
    assert actual["o2"] is actual_x1 and expected["o2"] is expected_x1
    assert actual["o0"] is actual["o1"]
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


@POLICIES
def test_regression_a_detached_input_updated_in_place_and_returned_stays_detached(policy: Any) -> None:
    # The soak found it on torch 2.15: functionalization reads the updated tensor through a new alias of
    # its new value, which was not known as the detach it is, and was rebuilt as a view with grad.
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        detached = x.detach()
        with torch.no_grad():
            detached.t()[1:].mul_(0.5)  # updates x too, which autograd allows through a detach
        return detached, (x * w).sum()

    x, w = _inputs()
    expected_identities, expected_grads = _run(fn, (x.detach().clone().requires_grad_(), w))
    identities, grads = _run(remat.checkpoint(fn, policy=policy), (x.detach().clone().requires_grad_(), w))
    assert identities == expected_identities
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=RTOL, atol=ATOL)


def _assert_same_but_the_version(fn: Callable[..., Any], policy: Any) -> None:
    """`fn` of an input it updates and `w`, and its checkpoint, return and differentiate alike: all but the
    version counter's value (eager counts each update, remat writes the input back once)."""
    x, w = _inputs()
    expected_identities, expected_grads = _run(fn, (x.detach().clone().requires_grad_(), w))
    identities, grads = _run(remat.checkpoint(fn, policy=policy), (x.detach().clone().requires_grad_(), w))
    assert [identity[:-1] for identity in identities] == [identity[:-1] for identity in expected_identities]
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=RTOL, atol=ATOL)


def _scale_a_transposed_slice(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x.t()[1:].mul_(0.5)
    return x


@POLICIES
@pytest.mark.parametrize("updates_before", [1, 2])
def test_regression_a_detach_of_an_input_updated_in_place_before_and_after_stays_detached(
    policy: Any, updates_before: int
) -> None:
    # The soak found it on torch 2.15, a wrong gradient: with an update of the input before the detach,
    # functionalization returns the detached tensor as an alias of the input's last value, which was
    # rebuilt as a view of the input, with grad. `_gradient_stops.mark_replayed_detaches` knows it as
    # the detach it is.
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(updates_before):
            _scale_a_transposed_slice(x)
        return _scale_a_transposed_slice(x.detach()), (x * w).sum()

    _assert_same_but_the_version(fn, policy)


@POLICIES
@pytest.mark.parametrize("view", ["rows", "transposed_columns", "view"])
def test_regression_a_view_of_a_detach_updated_after_the_input_was_stays_detached(policy: Any, view: str) -> None:
    # The soak found it on torch 2.15, a wrong gradient: with the input updated before the detach, an
    # update through a view of the detach rebuilt the view's chain, whose views were told to pass the
    # input's history on, the detach among them; the view came back as a view of the input, with grad,
    # and backward sent gradient into the input.
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            x.mul_(2.0)
        views = {"rows": lambda d: d[:1], "transposed_columns": lambda d: d.t()[1:], "view": lambda d: d.view(d.shape)}
        detached = views[view](x.detach())
        with torch.no_grad():
            detached.mul_(0.5)
        return detached, (x * w).sum()

    _assert_same_but_the_version(fn, policy)
    x, w = _inputs()
    for transform in ("grad", "forward_ad", "grad_of_grad"):
        remat.testing.assert_checkpoint_equivalent(
            fn, x.detach().clone().requires_grad_(), w, policy=policy, transforms=[transform]
        )


def _scale_through_a_detached_view(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    view = y.detach().view(y.shape)
    with torch.no_grad():
        view.mul_(0.5)  # updates `y` where autograd does not see it
    return view * 1.0 + x, y


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
@pytest.mark.parametrize("returned", ["input", "input_and_view"])
def test_an_input_updated_through_a_detached_view_is_returned_as_itself(policy: Any, returned: str) -> None:
    # The soak (torch 2.15) found `y` returned as a new tensor, and the view not sharing its memory: the
    # final value of an updated input was taken for a view that a custom Function returns (NOTE [kept
    # activations are outputs]), and returned by remat's Function.
    def fn(x: torch.Tensor, y: torch.Tensor) -> Any:
        out, updated = _scale_through_a_detached_view(x, y)
        if returned == "input":
            return out, updated
        return y.detach().view(y.shape), updated

    x, y = (torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    remat.testing.assert_checkpoint_equivalent(fn, x, y, policy=policy)
    outputs = remat.checkpoint(fn, policy=policy)(x, y)
    assert outputs[1] is y and y.is_leaf


def test_a_view_of_an_updated_input_returned_beside_its_detach_stays_a_view() -> None:
    # Found by the 2.13 soak: after an update of the input under no_grad, `v.detach()` first brought `v` up
    # to date, replaying its views, and the replayed views were taken for the detach: `v`, returned beside
    # its detach, came back as a new tensor, not the view of the input eager returns.
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            x.t()[1:].mul_(0.5)
        v = x.unbind(0)[0].expand(x.shape)
        return v.detach(), v

    x = torch.tensor([[1.5410, -0.2934]], dtype=torch.float64, requires_grad=True)
    remat.testing.assert_checkpoint_equivalent(fn, x)
    leaf = x.detach().clone().requires_grad_()
    assert remat.checkpoint(fn)(leaf)[1]._base is leaf
