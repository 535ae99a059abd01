"""Outputs and gradients of `remat.checkpoint(fn, policy)` equal those of `fn`, for every policy.

What must hold: gradients equal those of `fn` itself for every policy (in
float64, to within round-off), for inputs and for tensors `fn` closes over
(module parameters' `.grad`), with `loss.backward()`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
import torch.nn.functional as F
from conftest import ATOL, RTOL
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import remat
from remat import policies
from remat.testing import assert_checkpoint_equivalent

aten = torch.ops.aten

# --- the functions under test --------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    params: tuple[torch.Tensor, ...] = ()


def _module_case(module: nn.Module, *args: Any) -> Case:
    return Case(module, args, params=tuple(module.parameters()))


CASES: dict[str, Callable[[], Case]] = {
    "mlp": lambda: _module_case(models.mlp(depth=4, width=16), models.mlp_input()),
    "gpt2_sdpa": lambda: _module_case(models.GPT2Block(attention="sdpa"), models.gpt2_input()),
    "gpt2_softmax": lambda: _module_case(models.GPT2Block(attention="softmax"), models.gpt2_input()),
    "conv": lambda: _module_case(models.conv_net(), models.conv_input()),
    "pytree": lambda: Case(models.pytree_fn, (models.pytree_inputs(),)),
}

POLICIES = {
    "default": None,
    "save_nothing": policies.save_nothing,
    "save_everything": policies.save_everything,
    "save_mm_addmm": policies.save_ops(aten.mm, aten.addmm),
}

# The same small set of policies, for the tests of specific features.
FEATURE_POLICIES = pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.save_everything, policies.save_ops(aten.mm, aten.addmm)],
    ids=["save_nothing", "save_everything", "save_mm_addmm"],
)


@functools.cache
def trace_length(name: str) -> int:
    case = CASES[name]()
    return len(remat.trace(case.fn, *case.args, **case.kwargs))


def check_case(case: Case, policy: Any) -> None:
    assert_checkpoint_equivalent(case.fn, *case.args, policy=policy, kwargs=case.kwargs, params=case.params)


# --- every model under every built-in policy -----------------------------------------------------


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("case_name", list(CASES))
def test_outputs_and_grads_match_eager(case_name: str, policy_name: str) -> None:
    check_case(CASES[case_name](), POLICIES[policy_name])


@pytest.mark.parametrize("case_name", list(CASES))
def test_traces_are_not_trivial(case_name: str) -> None:
    # The random-policy properties below only mean something if there are calls to decide about.
    assert trace_length(case_name) >= 5


# --- random per-call policies --------------------------------------------------------------------


@given(data=st.data(), case_name=st.sampled_from(list(CASES)))
def test_random_save_calls_policy(data: st.DataObject, case_name: str) -> None:
    n = trace_length(case_name)
    # Indices may be negative (counted from the end), as `save_calls` documents.
    subset = data.draw(st.sets(st.integers(min_value=-n, max_value=n - 1), max_size=n), label="saved calls")
    check_case(CASES[case_name](), policies.save_calls(*sorted(subset)))


@given(data=st.data(), case_name=st.sampled_from(list(CASES)))
def test_random_callable_policy(data: st.DataObject, case_name: str) -> None:
    n = trace_length(case_name)
    save = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="save per call")
    asked: list[int] = []

    def policy(call: remat.Call) -> bool:
        asked.append(call.index)
        return save[call.index]

    check_case(CASES[case_name](), policy)
    assert sorted(set(asked)) == list(range(n)), "the policy must be asked about every call of the trace"


@given(data=st.data(), case_name=st.sampled_from(["mlp", "gpt2_softmax"]))
def test_random_decision_policy(data: st.DataObject, case_name: str) -> None:
    # A policy may answer with `remat.Decision`s as well as with booleans.
    n = trace_length(case_name)
    answers = data.draw(st.lists(st.sampled_from([remat.SAVE, remat.RECOMPUTE, True, False]), min_size=n, max_size=n))
    check_case(CASES[case_name](), lambda call: answers[call.index])


# --- how the module reaches the checkpointed function ---------------------------------------------


@FEATURE_POLICIES
@pytest.mark.parametrize("attention", ["sdpa", "softmax"])
def test_module_passed_directly(attention: str, policy: Any) -> None:
    block = models.GPT2Block(attention=attention)
    assert_checkpoint_equivalent(block, models.gpt2_input(), policy=policy)


@FEATURE_POLICIES
def test_module_closed_over_by_lambda(policy: Any) -> None:
    block = models.GPT2Block()
    head = nn.Linear(32, 3).double()
    fn = lambda x: head(block(x)).sum(dim=1)  # noqa: E731
    params = [*block.parameters(), *head.parameters()]
    assert_checkpoint_equivalent(fn, models.gpt2_input(), policy=policy, params=params)


@FEATURE_POLICIES
def test_bound_module_method(policy: Any) -> None:
    block = models.GPT2Block(attention="softmax")
    assert_checkpoint_equivalent(block.forward, models.gpt2_input(), policy=policy, params=block.parameters())


class _DecoratedBlock(models.GPT2Block):
    """A block whose `forward` is checkpointed by decorating the method."""

    @remat.checkpoint(policy=policies.save_ops(aten.mm, aten.addmm))
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class _MLPWithHead(nn.Module):
    """A module with a checkpointed helper method (bare decorator) called from `forward`."""

    def __init__(self) -> None:
        super().__init__()
        self.body = models.mlp(depth=3, width=16, seed=3)
        self.head = nn.Linear(16, 4).double()

    @remat.checkpoint
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.body(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def test_decorated_forward_method() -> None:
    block = _DecoratedBlock(attention="softmax")
    eager = functools.partial(models.GPT2Block.forward, block)
    assert isinstance(type(block).__dict__["forward"], remat.Checkpointed)
    assert_checkpoint_equivalent(eager, models.gpt2_input(), checkpointed=block, params=block.parameters())


def test_decorated_method_two_instances_keep_their_own_parameters() -> None:
    first, second = _DecoratedBlock(seed=1), _DecoratedBlock(seed=2)
    x = models.gpt2_input()
    for block in (first, second, first):
        eager = functools.partial(models.GPT2Block.forward, block)
        assert_checkpoint_equivalent(eager, x, checkpointed=block, params=block.parameters())


def test_decorated_helper_method() -> None:
    model = _MLPWithHead()

    def eager(x: torch.Tensor) -> torch.Tensor:
        return model.head(_MLPWithHead.features.__wrapped__(model, x))

    assert_checkpoint_equivalent(eager, models.mlp_input(), checkpointed=model, params=model.parameters())
    # The helper's closed-over parameters (the body) and the head outside it both got gradients.
    assert all(p.grad is not None for p in model.parameters())


# --- parameters' .grad ---------------------------------------------------------------------------


@FEATURE_POLICIES
def test_parameter_grads_equal_eager_and_input_without_grad(policy: Any) -> None:
    model = models.mlp()
    x = models.mlp_input(requires_grad=False)
    run = assert_checkpoint_equivalent(model, x, policy=policy)
    assert run is not None
    assert run.input_grads == (None,)
    assert all(g is not None for g in run.param_grads)


@FEATURE_POLICIES
def test_gradients_accumulate_over_two_forwards_and_two_backwards(policy: Any) -> None:
    model = models.GPT2Block(attention="softmax")
    checkpointed = remat.checkpoint(model, policy=policy)
    x1, x2 = models.gpt2_input(seed=11), models.gpt2_input(seed=12)
    generator = torch.Generator().manual_seed(0)
    cot1 = torch.randn(x1.shape, generator=generator, dtype=torch.float64)
    cot2 = torch.randn(x2.shape, generator=generator, dtype=torch.float64)

    def accumulate(fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        a, b = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
        y1, y2 = fn(a), fn(b)  # two forwards, both alive before either backward
        y1.backward(cot1)
        y2.backward(cot2)
        return [p.grad.clone() for p in model.parameters()], a.grad, b.grad

    expected = accumulate(model)
    actual = accumulate(checkpointed)
    for a, e in zip(actual[0], expected[0], strict=True):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(actual[1], expected[1], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(actual[2], expected[2], rtol=RTOL, atol=ATOL)

    # And the accumulated gradient is the sum of the two single-backward gradients.
    singles = []
    for x, cot in ((x1, cot1), (x2, cot2)):
        model.zero_grad(set_to_none=True)
        checkpointed(x.detach()).backward(cot)
        singles.append([p.grad.clone() for p in model.parameters()])
    for total, g1, g2 in zip(actual[0], *singles, strict=True):
        torch.testing.assert_close(total, g1 + g2, rtol=RTOL, atol=ATOL)


@FEATURE_POLICIES
def test_grad_accumulates_onto_existing_grad(policy: Any) -> None:
    model = models.mlp(depth=3)
    x = models.mlp_input()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    once = [p.grad.clone() for p in model.parameters()]
    remat.checkpoint(model, policy=policy)(x).sum().backward()
    for p, g in zip(model.parameters(), once, strict=True):
        torch.testing.assert_close(p.grad, 2 * g, rtol=RTOL, atol=ATOL)


# --- gradcheck -----------------------------------------------------------------------------------


def _small(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(a @ b)
    return (h.sin() * a.sum(dim=1, keepdim=True)) @ b.t() + F.gelu(a)


@pytest.mark.parametrize(
    "policy",
    [None, policies.save_everything, policies.save_calls(0, 2), policies.save_ops(aten.mm)],
    ids=["default", "save_everything", "save_calls_0_2", "save_mm"],
)
def test_gradcheck(policy: Any) -> None:
    a = models.randn(3, 4, seed=5)
    b = models.randn(4, 2, seed=6)
    assert torch.autograd.gradcheck(remat.checkpoint(_small, policy=policy), (a, b))


# --- signatures and outputs ----------------------------------------------------------------------


def _with_kwargs(
    x: torch.Tensor, *, w: torch.Tensor, bias: torch.Tensor | None = None, scale: float = 1.0, act: str = "sin"
) -> torch.Tensor:
    y = (x @ w) * scale
    if bias is not None:
        y = y + bias
    return y.sin() if act == "sin" else F.gelu(y)


@FEATURE_POLICIES
@pytest.mark.parametrize("act", ["sin", "gelu"])
def test_keyword_arguments(policy: Any, act: str) -> None:
    x, w, bias = models.randn(3, 4, seed=1), models.randn(4, 5, seed=2), models.randn(5, seed=3)
    checkpointed = remat.checkpoint(_with_kwargs, policy=policy)
    kwargs = {"w": w, "bias": bias, "scale": 0.5, "act": act}
    assert_checkpoint_equivalent(_with_kwargs, x, kwargs=kwargs, checkpointed=checkpointed)
    assert_checkpoint_equivalent(_with_kwargs, x, kwargs={"w": w, "scale": 2.0, "act": act}, checkpointed=checkpointed)
    # Passed positionally-or-by-keyword in a different way: still the same function.
    assert_checkpoint_equivalent(_with_kwargs, kwargs={"x": x, "w": w, "act": act}, checkpointed=checkpointed)


def _three_outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = x @ w
    a = F.gelu(h)
    b = (h.sin() @ w.t()) * x
    c = (a * b.sum(dim=1, keepdim=True)).cos()
    return a, b, c


@FEATURE_POLICIES
@pytest.mark.parametrize("which", [0, 1, 2])
def test_only_one_output_receives_a_gradient(policy: Any, which: int) -> None:
    x, w = models.randn(3, 4, seed=1), models.randn(4, 4, seed=2)
    assert_checkpoint_equivalent(_three_outputs, x, w, policy=policy, backprop=[which])


@FEATURE_POLICIES
def test_outputs_used_partially_in_a_loss(policy: Any) -> None:
    x, w = models.randn(3, 4, seed=1), models.randn(4, 4, seed=2)
    checkpointed = remat.checkpoint(_three_outputs, policy=policy)
    xa, wa = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _, b, _ = checkpointed(xa, wa)
    b.square().sum().backward()
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _, b, _ = _three_outputs(xe, we)
    b.square().sum().backward()
    torch.testing.assert_close(xa.grad, xe.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(wa.grad, we.grad, rtol=RTOL, atol=ATOL)


@FEATURE_POLICIES
def test_output_that_does_not_require_grad(policy: Any) -> None:
    model = models.mlp()

    def logits_and_prediction(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(x)
        return logits, logits.argmax(dim=-1)

    run = assert_checkpoint_equivalent(
        logits_and_prediction, models.mlp_input(), policy=policy, params=model.parameters()
    )
    assert run is not None
    logits, prediction = run.outputs
    assert logits.requires_grad
    assert prediction.dtype == torch.int64
    assert not prediction.requires_grad


@FEATURE_POLICIES
def test_output_not_depending_on_grad_inputs(policy: Any) -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x @ y).sin(), y.exp().sum(dim=0)  # the second output depends only on y

    run = assert_checkpoint_equivalent(
        fn, models.randn(3, 4, seed=1), models.randn(4, 2, seed=2, requires_grad=False), policy=policy
    )
    assert run is not None
    assert run.outputs[0].requires_grad
    assert not run.outputs[1].requires_grad
    assert run.input_grads[1] is None


@FEATURE_POLICIES
def test_input_that_does_not_require_grad(policy: Any) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w)
        return h.gather(1, idx) * x.sum(dim=1, keepdim=True)

    x = models.randn(3, 4, seed=1, requires_grad=False)
    w = models.randn(4, 5, seed=2)
    idx = torch.tensor([[0, 4], [1, 1], [3, 2]])
    run = assert_checkpoint_equivalent(fn, x, w, idx, policy=policy)
    assert run is not None
    assert run.input_grads[0] is None
    assert run.input_grads[1] is not None
    assert run.input_grads[2] is None


@FEATURE_POLICIES
def test_output_that_backward_reads(policy: Any) -> None:
    # `tanh`'s and `exp`'s gradients read their own outputs, which are also returned to the user.
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.tanh()
        return y, (y * 2).exp()

    assert_checkpoint_equivalent(fn, models.randn(3, 4), policy=policy)
    assert_checkpoint_equivalent(fn, models.randn(3, 4), policy=policy, backprop=[0])


@FEATURE_POLICIES
def test_pytree_arguments_and_outputs(policy: Any) -> None:
    inputs = models.pytree_inputs()
    run = assert_checkpoint_equivalent(models.pytree_fn, inputs, policy=policy)
    assert run is not None
    out = run.outputs
    assert out["nested"][1] is None
    assert isinstance(out["nested"][2][1], models.Pair)
    assert all(g is not None for g in run.input_grads)


def test_checkpointed_function_reused_across_calls() -> None:
    # The cached trace is reused (and gives the same gradients) for new inputs of the same signature.
    model = models.GPT2Block(attention="softmax")
    checkpointed = remat.checkpoint(model, policy=policies.save_ops(aten.mm, aten.addmm))
    for seed in (1, 2, 3):
        assert_checkpoint_equivalent(model, models.gpt2_input(seed=seed), checkpointed=checkpointed)
    info = checkpointed.cache_info()
    assert info.traces == 1
    assert info.hits >= 2


# --- outputs that alias inputs or closed-over tensors --------------------------------------------


def _returns_input_backward_reads(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, (x @ w).sin()  # mm's gradient with respect to w reads x


def _returns_input_backward_ignores(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, (x + w).sin()


def _returns_inputs_in_a_dict(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": x, "w": w, "y": (x * w).exp()}


@FEATURE_POLICIES
@pytest.mark.parametrize(
    "fn",
    [_returns_input_backward_reads, _returns_input_backward_ignores, _returns_inputs_in_a_dict],
    ids=lambda f: f.__name__,
)
def test_input_returned_unchanged(fn: Callable[..., Any], policy: Any) -> None:
    # An input returned unchanged as an output trips autograd.Function's aliasing check unless remat
    # handles outputs that alias inputs.
    x, w = models.randn(3, 3, seed=1), models.randn(3, 3, seed=2)
    run = assert_checkpoint_equivalent(fn, x, w, policy=policy)
    assert run is not None
    assert all(g is not None for g in run.input_grads)


@FEATURE_POLICIES
def test_closed_over_parameter_returned_as_output(policy: Any) -> None:
    # E.g. a tied embedding matrix returned next to the activations.
    linear = nn.Linear(3, 4).double()

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return linear(x).tanh(), linear.weight

    assert_checkpoint_equivalent(fn, models.randn(2, 3), policy=policy, params=linear.parameters())


# --- custom autograd Functions that return views -------------------------------------------------------


class _FirstColumnTwice(torch.autograd.Function):
    """A view of the input, with a backward that is not the view's derivative (as a straight-through
    estimator's is not): eager's gradient is this backward's, whatever the view would give."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.narrow(-1, 0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        full = grad.new_zeros((*grad.shape[:-1], 3))
        full[..., :1] = grad * 2
        return full


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: _FirstColumnTwice.apply(x),
        lambda x: (x.sin(), _FirstColumnTwice.apply(x)),
        lambda x: ((x * 2), _FirstColumnTwice.apply(x * 2)),
    ],
    ids=["of an input", "of an input, beside an output", "of an output"],
)
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_a_custom_function_returning_a_view_runs_its_backward(fn: Callable[..., Any], policy: Any) -> None:
    # Such an output was rebuilt after remat's Function as a view of the input, taken where the custom
    # forward runs (under no_grad): `x.grad` stayed None where eager runs the Function's backward.
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, policy=policy, transforms=["grad", "vjp", "vmap"])
    out = remat.checkpoint(fn, policy=policy)(x)
    view = out[-1] if isinstance(out, tuple) else out
    view.sum().backward()
    assert x.grad is not None and bool((x.grad[:, 0] != 0).all())
