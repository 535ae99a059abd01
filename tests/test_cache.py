"""The trace cache of `remat.checkpoint`: what is traced once, what retraces, and what stays bounded."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat

DTYPE = torch.float64


def sines(x: torch.Tensor, n: int = 2, *, scale: float = 1.0) -> torch.Tensor:
    for _ in range(n):
        x = x.sin()
    return (x * scale).sum()


def leaf(*shape: int, dtype: torch.dtype = DTYPE, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def value_and_grad(fn, x: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = fn(x, *args, **kwargs)
    (grad,) = torch.autograd.grad(out, x)
    return out.detach(), grad


def assert_matches_eager(f, x: torch.Tensor, *args, **kwargs) -> None:
    out, grad = value_and_grad(f, x, *args, **kwargs)
    out_eager, grad_eager = value_and_grad(f.__wrapped__, x, *args, **kwargs)
    torch.testing.assert_close(out, out_eager)
    torch.testing.assert_close(grad, grad_eager)


class NormNet(nn.Module):
    """BatchNorm behaves differently in training (batch statistics) and eval (running statistics)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.lin(x)))


def _norm_net() -> NormNet:
    torch.manual_seed(0)
    model = NormNet().to(DTYPE)
    with torch.no_grad():  # running statistics far from the batch's, so that the two modes differ
        model.bn.running_mean.fill_(3.0)
        model.bn.running_var.fill_(0.25)
    return model


# --------------------------------------------------------------------------- hits


def test_same_signature_is_traced_once():
    f = remat.checkpoint(sines)
    assert f.cache_info() == remat.CacheInfo(hits=0, misses=0, traces=0, size=0, maxsize=64)
    assert_matches_eager(f, leaf(5))
    assert f.cache_info().traces == 1
    for calls in range(2, 5):
        assert_matches_eager(f, leaf(5))  # new values, same shape: the cached trace is reused
        info = f.cache_info()
        assert (info.traces, info.misses, info.hits, info.size) == (1, 1, calls - 1, 1)


def test_cached_trace_does_not_bake_in_values():
    f = remat.checkpoint(sines)
    x1, x2 = leaf(5), leaf(5)
    (g1,) = torch.autograd.grad(f(x1), x1)
    (g2,) = torch.autograd.grad(f(x2), x2)
    assert f.cache_info().traces == 1
    torch.testing.assert_close(g1, torch.cos(torch.sin(x1)) * torch.cos(x1))
    torch.testing.assert_close(g2, torch.cos(torch.sin(x2)) * torch.cos(x2))


# --------------------------------------------------------------------------- what retraces


def test_new_shape_retraces_and_old_shape_still_hits():
    f = remat.checkpoint(sines)
    assert_matches_eager(f, leaf(5))
    assert_matches_eager(f, leaf(2, 3))
    assert f.cache_info().traces == 2
    hits = f.cache_info().hits
    assert_matches_eager(f, leaf(5))
    assert f.cache_info().traces == 2
    assert f.cache_info().hits == hits + 1


def test_new_dtype_retraces():
    f = remat.checkpoint(sines)
    f(leaf(5))
    out = f(leaf(5, dtype=torch.float32))
    assert f.cache_info().traces == 2
    assert out.dtype == torch.float32
    assert_matches_eager(f, leaf(5, dtype=torch.float32))
    assert f.cache_info().traces == 2


def test_requires_grad_retraces():
    f = remat.checkpoint(sines)
    x = leaf(5, requires_grad=False)
    out = f(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, sines(x))
    assert f.cache_info().traces == 1
    x.requires_grad_()
    out = f(x)
    assert f.cache_info().traces == 2
    assert out.requires_grad
    (grad,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(grad, torch.cos(torch.sin(x)) * torch.cos(x))


def test_new_static_argument_value_retraces():
    f = remat.checkpoint(sines)
    x = leaf(5)
    assert_matches_eager(f, x, 2)
    assert f.cache_info().traces == 1
    assert_matches_eager(f, x, 3)  # a different number of sines: must not reuse the n=2 trace
    assert f.cache_info().traces == 2
    assert not torch.allclose(f(x, 2), f(x, 3))
    assert f.cache_info().traces == 2
    assert_matches_eager(f, x, scale=2.0)
    assert f.cache_info().traces == 3
    torch.testing.assert_close(f(x, scale=2.0), 2 * f(x))


def test_keyword_and_positional_arguments_are_distinct_signatures():
    f = remat.checkpoint(sines)
    x = leaf(5)
    assert_matches_eager(f, x, 3)
    assert_matches_eager(f, x, n=3)
    assert f.cache_info().traces == 2
    assert f.cache_info().size == 2
    torch.testing.assert_close(f(x, 3), f(x, n=3))
    assert f.cache_info().traces == 2


def test_tensor_passed_by_keyword_retraces_and_gets_its_gradient():
    f = remat.checkpoint(sines)
    x = leaf(5)
    f(x)
    out = f(x=x)
    assert f.cache_info().traces == 2
    (grad,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(grad, torch.cos(torch.sin(x)) * torch.cos(x))


# --------------------------------------------------------------------------- bounded, cleared


def test_cache_is_bounded_and_drops_least_recently_used():
    f = remat.checkpoint(sines, cache_size=2)
    shapes = [(2,), (3,), (4,)]
    for shape in shapes * 2:
        assert_matches_eager(f, leaf(*shape))
        info = f.cache_info()
        assert info.size <= 2
        assert info.maxsize == 2
    # Cycling three shapes through two slots: every call missed.
    assert f.cache_info().traces == 6
    assert f.cache_info().hits == 0
    traces = f.cache_info().traces
    f(leaf(4))  # the most recently used shape is still cached
    assert f.cache_info().traces == traces
    f(leaf(2))  # the least recently used one was dropped
    assert f.cache_info().traces == traces + 1
    assert f.cache_info().size == 2


def test_cache_clear_resets_and_next_call_retraces():
    f = remat.checkpoint(sines, cache_size=8)
    x = leaf(5)
    f(x)
    f(x)
    f(leaf(3))
    assert f.cache_info() == remat.CacheInfo(hits=1, misses=2, traces=2, size=2, maxsize=8)
    f.cache_clear()
    assert f.cache_info() == remat.CacheInfo(hits=0, misses=0, traces=0, size=0, maxsize=8)
    assert_matches_eager(f, x)
    assert f.cache_info().traces == 1
    assert f.cache_info().size == 1


# --------------------------------------------------------------------------- state outside the arguments


def test_train_eval_toggle_retraces():
    model = _norm_net()
    eager = copy.deepcopy(model)
    f = remat.checkpoint(model)
    x = leaf(8, 4)

    def check(mode: str) -> None:
        getattr(model, mode)()
        getattr(eager, mode)()
        out = f(x)
        expected = eager(x)
        torch.testing.assert_close(out, expected)
        grads = torch.autograd.grad(out.sum(), [x, *model.parameters()])
        expected_grads = torch.autograd.grad(expected.sum(), [x, *eager.parameters()])
        torch.testing.assert_close(grads, expected_grads)
        torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean)
        torch.testing.assert_close(model.bn.num_batches_tracked, eager.bn.num_batches_tracked)

    check("train")
    assert f.cache_info().traces == 1
    check("eval")
    assert f.cache_info().traces == 2
    check("train")
    assert f.cache_info().traces == 2  # both modes are cached
    check("eval")
    assert f.cache_info().traces == 2
    assert model.bn.num_batches_tracked.item() == 2  # the two training calls; eval updates nothing
    # The modes really differ: a stale trace would have produced the other one's output.
    with torch.no_grad():
        assert not torch.allclose(model.train()(x), model.eval()(x))


def test_closed_over_parameter_requires_grad_change_retraces_with_correct_grads():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).to(DTYPE)

    def fn(x):
        return torch.tanh(lin(x)).pow(2).sum()

    f = remat.checkpoint(fn)
    x = leaf(5, 4)

    def grads(g):
        for t in (x, lin.weight, lin.bias):
            t.grad = None
        g(x).backward()
        out = [None if t.grad is None else t.grad.clone() for t in (x, lin.weight, lin.bias)]
        for t in (x, lin.weight, lin.bias):
            t.grad = None
        return out

    first = grads(f)
    assert first[1] is not None
    torch.testing.assert_close(first, grads(fn))
    assert f.cache_info().traces == 1

    lin.weight.requires_grad_(False)
    frozen = grads(f)
    assert f.cache_info().traces == 2
    assert frozen[1] is None
    expected = grads(fn)
    assert expected[1] is None
    torch.testing.assert_close(frozen[0], expected[0])
    torch.testing.assert_close(frozen[2], expected[2])

    lin.weight.requires_grad_(True)
    again = grads(f)
    assert again[1] is not None
    torch.testing.assert_close(again, grads(fn))


def test_replaced_parameter_is_used_without_cache_clear():
    torch.manual_seed(0)
    block = nn.Linear(4, 3).to(DTYPE)

    def fn(x):
        return torch.tanh(block(x)).pow(2).sum()

    f = remat.checkpoint(fn)
    x = leaf(5, 4)
    f(x).backward()
    old = block.weight
    old.grad = None
    block.weight = nn.Parameter(torch.randn(3, 4, dtype=DTYPE))
    block.bias.grad = None
    x.grad = None

    out = f(x)
    out.backward()
    got = (out.detach(), x.grad.clone(), block.weight.grad.clone(), block.bias.grad.clone())
    assert old.grad is None  # the gradient went to the new parameter, not the traced one
    for t in (x, block.weight, block.bias):
        t.grad = None
    expected_out = fn(x)
    expected_out.backward()
    expected = (expected_out.detach(), x.grad, block.weight.grad, block.bias.grad)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(expected_out, torch.tanh(x @ old.detach().T + block.bias).pow(2).sum())


def test_no_grad_runs_fn_without_tracing():
    calls = []

    def fn(x):
        calls.append(torch.is_grad_enabled())
        return x.sin().sin().sum()

    f = remat.checkpoint(fn)
    x = leaf(5)
    with torch.no_grad():
        out = f(x)
    assert f.cache_info() == remat.CacheInfo(hits=0, misses=0, traces=0, size=0, maxsize=64)
    assert calls == [False]  # fn ran once, plainly
    torch.testing.assert_close(out, x.detach().sin().sin().sum())
    assert not out.requires_grad

    f(x)  # trace once with grad enabled
    info = f.cache_info()
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(f(x), out)
    assert f.cache_info() == info
    assert calls == [False]


W_GLOBAL = torch.ones(3, dtype=torch.float64, requires_grad=True)


def _reads_the_global(x: torch.Tensor) -> torch.Tensor:
    return x * W_GLOBAL


def test_a_rebound_closure_variable_is_read_anew_on_each_call() -> None:
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    f = remat.checkpoint(lambda x: (x * w).sin())
    x = torch.ones(3, dtype=torch.float64)
    f(x).sum().backward()
    assert w.grad is not None
    w = torch.full((3,), 2.0, dtype=torch.float64, requires_grad=True)
    out = f(x)
    torch.testing.assert_close(out, torch.full((3,), 2.0, dtype=torch.float64).sin())
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0, dtype=torch.float64).cos())
    assert f.cache_info().traces == 1  # same metadata: the trace is reused with the new tensor
    w = torch.full((5,), 3.0, dtype=torch.float64)  # another shape, no grad: a new trace
    torch.testing.assert_close(f(torch.ones(5, dtype=torch.float64)), torch.full((5,), 3.0, dtype=torch.float64).sin())


def test_a_rebound_global_is_read_anew_on_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    f = remat.checkpoint(_reads_the_global)
    x = torch.ones(3, dtype=torch.float64)
    torch.testing.assert_close(f(x), torch.ones(3, dtype=torch.float64))
    monkeypatch.setitem(globals(), "W_GLOBAL", torch.full((3,), 4.0, dtype=torch.float64, requires_grad=True))
    torch.testing.assert_close(f(x), torch.full((3,), 4.0, dtype=torch.float64))


def test_a_variable_rebound_to_a_non_tensor_raises_and_says_what_to_do() -> None:
    w = torch.ones(3, dtype=torch.float64)
    f = remat.checkpoint(lambda x: x * w)
    f(torch.ones(3, dtype=torch.float64, requires_grad=True))
    w = 2.0  # read by the lambda
    with pytest.raises(RuntimeError, match=r"variable `w` .* is float now\. Call `\.cache_clear\(\)`"):
        f(torch.ones(3, dtype=torch.float64, requires_grad=True))
