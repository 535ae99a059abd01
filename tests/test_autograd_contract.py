"""The autograd contract: what eager allows, remat allows; what eager refuses, remat refuses alike."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import remat
from remat import policies

DTYPE = torch.float64
POLICIES = pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=repr)


def _fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).tanh().exp().sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=DTYPE, generator=generator, requires_grad=True)
    w = torch.randn(4, 5, dtype=DTYPE, generator=generator, requires_grad=True)
    return x, w


@POLICIES
def test_backward_twice_without_retain_graph_fails_like_eager(policy: object) -> None:
    for fn in (_fn, remat.checkpoint(_fn, policy=policy)):
        loss = fn(*_inputs())
        loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()


@POLICIES
def test_backward_twice_with_retain_graph_accumulates_like_eager(policy: object) -> None:
    grads = []
    for fn in (_fn, remat.checkpoint(_fn, policy=policy)):
        x, w = _inputs()
        loss = fn(x, w)
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append((x.grad, w.grad))
    for actual, expected in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_overwriting_a_kept_input_before_backward_fails_like_eager() -> None:
    # Backward reads `w` (to differentiate `x @ w`), by reference: overwriting it in between is
    # caught by autograd's version counter, with or without remat.
    for fn in (_fn, remat.checkpoint(_fn, policy=policies.save_nothing)):
        x, w = _inputs()
        w_used = w.clone()  # a non-leaf, so that it may be updated in place
        loss = fn(x, w_used)
        with torch.no_grad():
            w_used.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_overwriting_a_kept_activation_is_impossible_from_outside() -> None:
    # What remat keeps is its own: the user gets outputs, and a kept output overwritten in
    # place is caught by the version counter as in eager.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.exp()  # exp's backward reads its output

    for checkpointed in (fn, remat.checkpoint(fn, policy=policies.save_everything)):
        x = torch.randn(3, dtype=DTYPE, requires_grad=True)
        out = checkpointed(x)
        with torch.no_grad():
            out.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def _updates_what_its_backward_reads(x: torch.Tensor) -> torch.Tensor:
    v = x.sin().exp()
    v.mul_(2)  # exp's gradient reads its output, which this changes: eager's backward raises
    return v * x


@pytest.mark.parametrize("policy", [None, policies.save_everything], ids=["recompute", "save"])
def test_a_function_whose_own_backward_is_invalid_runs_forward_and_raises_in_backward(policy: Any) -> None:
    # NOTE [a backward eager cannot run]: remat raised at the first call, where eager raises in backward.
    checkpointed = remat.checkpoint(_updates_what_its_backward_reads, policy=policy)
    x = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
    expected_out = _updates_what_its_backward_reads(x)
    out = checkpointed(x)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as eager_error:
        expected_out.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as remat_error:
        out.sum().backward()
    assert str(remat_error.value).split(";")[0] == str(eager_error.value).split(";")[0]
    # Forward mode reads no saved value: both run.
    tangent = torch.ones_like(x)
    expected = torch.func.jvp(_updates_what_its_backward_reads, (x.detach(),), (tangent,))
    got = torch.func.jvp(checkpointed, (x.detach(),), (tangent,))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class _Boom(Exception):
    pass


def test_an_exception_in_fn_while_tracing_reaches_the_user_and_leaves_no_cache_entry() -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        if len(calls) == 1:
            raise _Boom("raised by the user's function")  # the line the traceback must show
        return x.sin().sum()

    checkpointed = remat.checkpoint(fn)
    x = torch.randn(3, dtype=DTYPE, requires_grad=True)
    with pytest.raises(_Boom, match="raised by the user's function") as info:
        checkpointed(x)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "fn" and "raise _Boom" in (frames[-1].line or "")
    assert checkpointed.cache_info().size == 0
    checkpointed(x).backward()  # the next call traces afresh and works
    assert checkpointed.cache_info().size == 1
    torch.testing.assert_close(x.grad, x.detach().cos())
