"""Property tests built on `remat.testing`, and tests that its checker can fail.

Random functions from the catalog, with random inputs and random per-call
policies, must checkpoint to the same outputs and gradients; and
`assert_checkpoint_equivalent` must catch a checkpoint that computes
something else, with a message that says what differs.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import DEVICES, NO_NUMPY_IS_FINE, examples
from hypothesis import given
from hypothesis import strategies as st

import remat
import remat.testing
from remat.testing import (
    CATALOG,
    RandomFunction,
    Step,
    assert_checkpoint_equivalent,
    functions,
    inputs,
    policies,
)


def _draw_policy(data: st.DataObject, fn: RandomFunction, args: tuple[Any, ...], *, save_calls: bool = True) -> Any:
    """A random policy for the trace of `fn`; the default one where `fn` cannot be traced: eager
    refuses such a program too (an in-place update of a value backward reads), and the checker
    then asserts that the checkpoint raises as eager does."""
    try:
        trace = remat.trace(fn, *args)
    except RuntimeError:
        return None
    return data.draw(policies(trace, save_calls=save_calls), label="policy")


def test_catalog_has_at_least_40_behaviours() -> None:
    assert len(CATALOG) >= 40


# The soak counts (`nox -s soak`) sum to well over 10,000 random functions.
@examples(ci=60, soak=10_000)
@given(st.data())
def test_random_functions_and_policies_checkpoint_equivalently(data: st.DataObject) -> None:
    fn = data.draw(functions(refusable=True), label="fn")
    args = data.draw(inputs(fn), label="args")
    policy = _draw_policy(data, fn, args)
    assert_checkpoint_equivalent(fn, *args, policy=policy, seed=data.draw(st.integers(0, 100), label="seed"))


@examples(ci=30, soak=2_000)
@given(st.data())
def test_random_functions_with_pytree_inputs(data: st.DataObject) -> None:
    fn = data.draw(functions(max_inputs=3, refusable=True), label="fn")
    args = data.draw(inputs(fn, pytree=True), label="args")
    policy = _draw_policy(data, fn, args)
    assert_checkpoint_equivalent(fn, *args, policy=policy)


@pytest.mark.parametrize("device", DEVICES)
@examples(ci=30, soak=2_000)
@given(st.data())
def test_random_functions_in_float32(device: str, data: st.DataObject) -> None:
    fn = data.draw(functions(max_ops=4, refusable=True), label="fn")
    args = data.draw(inputs(fn, dtype=torch.float32, device=device), label="args")
    policy = _draw_policy(data, fn, args)
    assert_checkpoint_equivalent(fn, *args, policy=policy)


@pytest.mark.parametrize("device", DEVICES)
@examples(ci=15, soak=1_000)
@given(st.data())
def test_random_functions_in_bfloat16(device: str, data: st.DataObject) -> None:
    fn = data.draw(functions(max_ops=3, refusable=True), label="fn")
    args = data.draw(inputs(fn, dtype=torch.bfloat16, device=device), label="args")
    policy = _draw_policy(data, fn, args)
    assert_checkpoint_equivalent(fn, *args, policy=policy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@examples(ci=30, soak=2_000)
@given(st.data())
def test_random_functions_in_float64_on_cuda(data: st.DataObject) -> None:
    fn = data.draw(functions(refusable=True), label="fn")
    args = data.draw(inputs(fn), label="args")
    policy = _draw_policy(data, fn, args)
    # The checker moves the inputs: both functions run on the GPU, compared in float64.
    assert_checkpoint_equivalent(fn, *args, policy=policy, device="cuda")


# functorch warns that it has no batching rule for the `copy` an in-place update of a view
# functionalizes into (a slow fallback, not a wrong result): the results are still compared.
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@examples(ci=30, soak=2_000)
@given(st.data())
def test_random_functions_under_torch_func_transforms(data: st.DataObject) -> None:
    fn = data.draw(functions(max_ops=4, refusable=True), label="fn")
    args = data.draw(inputs(fn), label="args")
    policy = _draw_policy(data, fn, args, save_calls=False)  # a transform may trace fewer calls
    # torch.func.jvp does not let a Function update an input's tangent in place (remat says so).
    allowed = ["grad", "vmap", "vjp"] if "scale_without_grad_" in fn.ops else ["grad", "vmap", "jvp", "vjp"]
    transforms = data.draw(st.lists(st.sampled_from(allowed), min_size=1, unique=True))
    assert_checkpoint_equivalent(fn, *args, policy=policy, transforms=transforms)


@pytest.mark.parametrize("op", sorted(CATALOG))
def test_every_catalog_op_checkpoints_equivalently(op: str) -> None:
    fn = RandomFunction((3, 4), 2, (Step(op, 0, 1), Step("sin", 2, 2)), (3,))
    generator = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(3, 4, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    for policy in (remat.policies.save_nothing, remat.policies.save_everything):
        assert_checkpoint_equivalent(fn, *args, policy=policy)


def test_module_parameter_gradients_are_compared() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    assert_checkpoint_equivalent(model, torch.randn(3, 4), policy=remat.policies.save_calls(0))


# --- the checker can fail ----------------------------------------------------------------------------


def _fn(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1.5


def test_checker_catches_wrong_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.testing, "_checkpoint", lambda fn, policy: lambda x: fn(x) + 1e-3)
    with pytest.raises(AssertionError, match=r"output 0 differs \(shape \(2, 3\), torch.float64.*max abs error 0.001"):
        assert_checkpoint_equivalent(_fn, torch.randn(2, 3, dtype=torch.float64, requires_grad=True))


def test_checker_catches_wrong_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.testing, "_checkpoint", lambda fn, policy: lambda x: fn(_ScaledGradient.apply(x)))
    with pytest.raises(AssertionError, match=r"gradient of input tensor 0 differs .*max rel error 0.5") as info:
        assert_checkpoint_equivalent(_fn, torch.randn(2, 3, dtype=torch.float64, requires_grad=True))
    assert "output 0" not in str(info.value)  # the outputs agree; only the gradient is reported


def test_checker_catches_wrong_gradients_under_a_transform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.testing, "_checkpoint", lambda fn, policy: lambda x: fn(_ScaledGradient.apply(x)))
    with pytest.raises(AssertionError, match=r"\[grad\] output 0 differs .*max rel error 0.5"):
        assert_checkpoint_equivalent(_fn, torch.randn(5, dtype=torch.float64), transforms=["grad"])


def test_checker_catches_a_missing_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.testing, "_checkpoint", lambda fn, policy: lambda x, y: fn(x, y.detach()))
    with pytest.raises(AssertionError, match=r"gradient of input tensor 1: expected a gradient, got None"):
        assert_checkpoint_equivalent(
            lambda x, y: _fn(x) + y, torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        )


def test_checker_catches_different_output_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.testing, "_checkpoint", lambda fn, policy: lambda x: (fn(x),))
    with pytest.raises(AssertionError, match="output structure differs"):
        assert_checkpoint_equivalent(_fn, torch.randn(3, requires_grad=True))


def test_checker_catches_unseeded_randomness() -> None:
    generator = torch.Generator().manual_seed(0)  # advances between the two runs: not reproducible by seed

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn(x.shape, generator=generator, dtype=x.dtype)

    with pytest.raises(AssertionError, match="output 0 differs"):
        assert_checkpoint_equivalent(noisy, torch.randn(3, dtype=torch.float64, requires_grad=True))


def test_checker_tolerances_follow_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.testing, "_checkpoint", lambda fn, policy: lambda x: fn(x) * (1 + 1e-5))
    assert_checkpoint_equivalent(_fn, torch.randn(3, dtype=torch.bfloat16, requires_grad=True))
    with pytest.raises(AssertionError, match=r"torch\.float64"):
        assert_checkpoint_equivalent(_fn, torch.randn(3, dtype=torch.float64, requires_grad=True))


def test_checker_rejects_unknown_transforms() -> None:
    with pytest.raises(ValueError, match="expected transforms from"):
        assert_checkpoint_equivalent(_fn, torch.randn(3), transforms=["hessian"])


# --- imports -----------------------------------------------------------------------------------------


def test_import_remat_does_not_import_hypothesis_but_remat_testing_works() -> None:
    code = (
        "import sys, remat\n"
        "assert 'hypothesis' not in sys.modules, 'import remat imported hypothesis'\n"
        "assert 'remat.testing' not in sys.modules\n"
        "import remat.testing\n"
        "assert 'hypothesis' in sys.modules and len(remat.testing.CATALOG) >= 40\n"
    )
    command = [sys.executable, "-W", "error", "-W", NO_NUMPY_IS_FINE, "-c", code]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


# --- regressions found by these property tests --------------------------------------------------


def test_regression_backward_of_pow_whose_exponent_needs_no_grad() -> None:
    # The forward part of the graph was taken as "every node up to the last one fn created";
    # that node (autograd's detach of pow's saved result) was dead code, so the whole graph,
    # backward included, was taken for the forward: KeyError tangents_1.
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, dtype=torch.float64)
    assert_checkpoint_equivalent(lambda x, y: x.exp().pow(y), x, y)


def test_regression_backward_of_an_in_place_update_of_a_view_of_an_intermediate() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.clone()
        t[:, 0].mul_(2.0)
        return t.sin()

    assert_checkpoint_equivalent(fn, torch.randn(3, 4, dtype=torch.float64, requires_grad=True))


def test_regression_jvp_of_an_output_indexing_an_input_returned_beside_it() -> None:
    # The copy of `x` kept because an output is a view of it was missing from the pure
    # forward's outputs under forward mode: jvp got one tangent too few.
    perm = torch.tensor([1, 0])
    x = torch.randn(2, dtype=torch.float64)
    assert_checkpoint_equivalent(lambda x: (x[perm], x), x, transforms=("jvp",))


def test_regression_vmap_of_an_output_that_needs_no_input_requiring_grad() -> None:
    # Under vmap, setup_context sees batched views of the outputs, and marking those
    # non-differentiable was silently ignored: the output came back requiring grad.
    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return b.abs(), (a * b).sum(0)

    a = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, dtype=torch.float64)
    independent, dependent = torch.func.vmap(remat.checkpoint(fn))(a, b)
    assert not independent.requires_grad
    assert dependent.requires_grad
    assert_checkpoint_equivalent(fn, a, b, transforms=["vmap"])


def test_regression_random_per_call_policy_on_a_longer_trace_recomputes_the_extra_calls() -> None:
    # A policy table drawn from the plain trace met a longer trace under `grad`.
    fn = RandomFunction((1, 2), 2, (Step("mul_", 1, 0),), (2,))
    a = torch.randn(1, 2, dtype=torch.float64)
    b = torch.randn(1, 2, dtype=torch.float64, requires_grad=True)
    policy = remat.testing._PerCallPolicy((True,), as_decision=False)
    call = remat.trace(fn, a, b)[0]
    assert policy(call) is True
    assert policy(dataclasses.replace(call, index=5)) is False
    assert_checkpoint_equivalent(fn, a, b, policy=policy, transforms=["grad"])
