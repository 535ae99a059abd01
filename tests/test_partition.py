"""Partition: what a checkpointed function keeps after forward and replays in backward.

Everything here is measured from the outside, independently of remat's own
bookkeeping: ops that run during backward are counted with a dispatch mode,
kept bytes with `saved_tensors_hooks`, side effects by reading buffers.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import policies

aten = torch.ops.aten
DTYPE = torch.float64

# Ops that only name memory (views, aliases): replaying them is free and the
# tracer is free to emit more or fewer of them than eager autograd does.
_ALIASING = frozenset({aten._unsafe_view, aten.alias, aten.detach, aten.lift_fresh})


# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(torch.tanh(self.fc1(x)))))


class Block(nn.Module):
    """A pre-norm transformer block: attention (no dropout) and an MLP."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.lin(x))))


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MLP().to(DTYPE), torch.randn(5, 8, dtype=DTYPE, requires_grad=True)


def _block() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Block().to(DTYPE), torch.randn(2, 5, 16, dtype=DTYPE, requires_grad=True)


MODELS = {"mlp": _mlp, "block": _block}


# --------------------------------------------------------------------------- measuring


class BackwardOpCounter(TorchDispatchMode):
    """Counts the aten ops (by OpOverloadPacket) that run while it is active, aliasing ops excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[torch._ops.OpOverloadPacket] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        packet = func.overloadpacket
        if not func.is_view and packet not in _ALIASING:
            self.counts[packet] += 1
        return func(*args, **(kwargs or {}))


def backward_op_counts(fn: Callable[..., torch.Tensor], *leaves: torch.Tensor, args: Sequence[torch.Tensor] = ()):
    """Run `fn(*args)` (or `fn(*leaves)`), then count the ops its backward runs; return (counts, grads)."""
    for leaf in leaves:
        leaf.grad = None
    out = fn(*(args or leaves))
    loss = out.sum() if out.dim() else out
    with BackwardOpCounter() as counter:
        loss.backward()
    grads = [leaf.grad.clone() for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    return counter.counts, grads


def replayed_ops(rep: remat.Report) -> collections.Counter:
    return collections.Counter(rep.trace[i].op.overloadpacket for i in rep.replayed_calls)


def kept_activation_bytes(fn: Callable[..., object], args: Sequence[torch.Tensor], state: Sequence[torch.Tensor] = ()):
    """Bytes of the distinct storages autograd keeps for `fn(*args)`, minus inputs' and `state`'s storages.

    Returns the bytes and the output (the output keeps the saved tensors alive).
    """
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(*args)
    excluded = {t.untyped_storage().data_ptr() for t in (*args, *state)}
    storages: dict[int, int] = {}
    for tensor in packed:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), out


def _state(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _warm(f: remat.Checkpointed, *args: torch.Tensor) -> remat.Checkpointed:
    """Trace `f` at `args` outside any hooks, so that a measured call runs the cached programs."""
    f(*args)
    assert f.cache_info().traces == 1
    return f


# --------------------------------------------------------------------------- replays in backward


def test_save_nothing_replays_a_needed_call_exactly_once():
    def fn(x):
        return x.sin().sin().sum()

    x = torch.randn(7, dtype=DTYPE, requires_grad=True)
    eager, eager_grads = backward_op_counts(fn, x)
    f = remat.checkpoint(fn, policy=policies.save_nothing)
    counts, grads = backward_op_counts(f, x)
    # The outer sin's backward reads its input, the inner sin's output: one sin replayed.
    assert counts == eager + collections.Counter({aten.sin: 1})
    assert eager[aten.sin] == 0 and counts[aten.sin] == 1
    assert counts[aten.cos] == eager[aten.cos] == 2
    assert remat.report(fn, x, policy=policies.save_nothing).replayed_calls == (0,)
    torch.testing.assert_close(grads, eager_grads)


def test_call_whose_output_no_gradient_formula_reads_is_not_replayed():
    def fn(x):
        return (x.sin() * 2).sum()  # mul-by-scalar and sum backward read no activation

    x = torch.randn(7, dtype=DTYPE, requires_grad=True)
    eager, eager_grads = backward_op_counts(fn, x)
    counts, grads = backward_op_counts(remat.checkpoint(fn), x)
    assert counts == eager
    assert counts[aten.sin] == 0
    assert counts[aten.cos] == 1
    assert remat.report(fn, x).replayed_calls == ()
    torch.testing.assert_close(grads, eager_grads)


def test_op_whose_backward_reads_its_output_is_replayed_but_the_sum_is_not():
    def fn(x):
        y = x.exp()
        return y.sum()

    x = torch.randn(7, dtype=DTYPE, requires_grad=True)
    eager, eager_grads = backward_op_counts(fn, x)
    counts, grads = backward_op_counts(remat.checkpoint(fn), x)
    assert counts == eager + collections.Counter({aten.exp: 1})
    assert counts[aten.sum] == eager[aten.sum]
    rep = remat.report(fn, x)
    assert [rep.trace[i].op for i in rep.replayed_calls] == [aten.exp.default]
    torch.testing.assert_close(grads, eager_grads)


def test_value_read_by_two_gradient_formulas_is_replayed_once():
    def fn(x):
        return x.exp().sin().sum()  # exp's output: read by exp's backward and sin's backward

    x = torch.randn(7, dtype=DTYPE, requires_grad=True)
    eager, eager_grads = backward_op_counts(fn, x)
    counts, grads = backward_op_counts(remat.checkpoint(fn), x)
    assert counts == eager + collections.Counter({aten.exp: 1})
    assert counts[aten.sin] == eager[aten.sin] == 0
    assert remat.report(fn, x).replayed_calls == (0,)
    torch.testing.assert_close(grads, eager_grads)


def test_mlp_save_nothing_replays_exactly_the_calls_backward_reads():
    model, x = _mlp()
    leaves = [x, *model.parameters()]
    eager, eager_grads = backward_op_counts(model, *leaves, args=[x])
    counts, grads = backward_op_counts(remat.checkpoint(model), *leaves, args=[x])
    # fc1 and fc2 (inputs of tanh / gelu and of the next matmul), tanh and gelu
    # are replayed once each; fc3's output is read by no gradient formula.
    extra = collections.Counter({aten.addmm: 2, aten.tanh: 1, aten.gelu: 1})
    assert counts == eager + extra
    assert replayed_ops(remat.report(model, x)) == extra
    torch.testing.assert_close(grads, eager_grads)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_saved_matmuls_are_not_replayed(model_name):
    model, x = MODELS[model_name]()
    policy = policies.save_ops(aten.mm, aten.addmm)
    leaves = [x, *model.parameters()]
    eager, eager_grads = backward_op_counts(model, *leaves, args=[x])
    f = remat.checkpoint(model, policy=policy)
    counts, grads = backward_op_counts(f, *leaves, args=[x])
    assert counts[aten.addmm] == eager[aten.addmm] == 0
    assert counts[aten.mm] == eager[aten.mm]
    rep = remat.report(model, x, policy=policy)
    assert aten.addmm not in replayed_ops(rep) and aten.mm not in replayed_ops(rep)
    assert counts == eager + replayed_ops(rep)
    torch.testing.assert_close(grads, eager_grads)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.save_everything, policies.save_ops(aten.mm, aten.addmm, aten.bmm)],
    ids=repr,
)
def test_report_replayed_calls_are_what_backward_runs(model_name, policy):
    model, x = MODELS[model_name]()
    leaves = [x, *model.parameters()]
    eager, eager_grads = backward_op_counts(model, *leaves, args=[x])
    counts, grads = backward_op_counts(remat.checkpoint(model, policy=policy), *leaves, args=[x])
    rep = remat.report(model, x, policy=policy)
    assert counts == eager + replayed_ops(rep)
    assert len(set(rep.replayed_calls)) == len(rep.replayed_calls)
    if policy is policies.save_everything:
        assert rep.replayed_calls == ()
    if policy is policies.save_nothing:
        assert rep.replayed_calls != ()
        assert replayed_ops(rep)[aten.addmm] < sum(1 for c in rep.trace if c.op is aten.addmm.default)
    torch.testing.assert_close(grads, eager_grads)


# --------------------------------------------------------------------------- bytes kept after forward


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_save_nothing_keeps_zero_activation_bytes(model_name):
    model, x = MODELS[model_name]()
    f = _warm(remat.checkpoint(model, policy=policies.save_nothing), x)
    kept, out = kept_activation_bytes(f, [x], _state(model))
    assert kept == 0
    assert remat.report(model, x, policy=policies.save_nothing).saved_bytes == 0
    out.sum().backward()  # what was kept is enough for backward
    assert x.grad is not None


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_save_everything_keeps_no_more_than_eager(model_name):
    model, x = MODELS[model_name]()
    eager, _ = kept_activation_bytes(model, [x], _state(model))
    assert eager > 0
    f = _warm(remat.checkpoint(model, policy=policies.save_everything), x)
    kept, _ = kept_activation_bytes(f, [x], _state(model))
    assert 0 < kept <= eager


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.save_everything, policies.save_ops(aten.mm, aten.addmm)],
    ids=repr,
)
def test_report_saved_bytes_equals_measured_bytes(model_name, policy):
    model, x = MODELS[model_name]()
    f = _warm(remat.checkpoint(model, policy=policy), x)
    kept, _ = kept_activation_bytes(f, [x], _state(model))
    assert remat.report(model, x, policy=policy).saved_bytes == kept
    assert remat.report(f, x).saved_bytes == kept


def test_saving_matmuls_keeps_less_than_everything_and_more_than_nothing():
    model, x = _block()
    measured = {}
    for policy in (policies.save_nothing, policies.save_ops(aten.mm, aten.addmm), policies.save_everything):
        f = _warm(remat.checkpoint(model, policy=policy), x)
        measured[repr(policy)], _ = kept_activation_bytes(f, [x], _state(model))
    assert measured["save_nothing"] < measured["save_ops(aten.mm, aten.addmm)"] < measured["save_everything"]


@functools.cache
def _block_calls() -> int:
    return len(remat.trace(*_block()))


@settings(examples(ci=8, soak=200), derandomize=True)
@given(st.data())
def test_report_saved_bytes_equals_measured_bytes_for_random_save_calls(data):
    model, x = _block()
    indices = data.draw(st.sets(st.integers(0, _block_calls() - 1)), label="saved calls")
    policy = policies.save_calls(*sorted(indices))
    f = _warm(remat.checkpoint(model, policy=policy), x)
    kept, out = kept_activation_bytes(f, [x], _state(model))
    assert remat.report(f, x).saved_bytes == kept
    grad = torch.autograd.grad(out.sum(), x)[0]
    x_eager = x.detach().requires_grad_()
    torch.testing.assert_close(grad, torch.autograd.grad(model(x_eager).sum(), x_eager)[0])


def test_tracing_does_not_call_users_saved_tensors_hooks():
    """The first (tracing) call shows the hooks exactly what a cached call does: real tensors only."""

    def fn(x):
        return x.sin().sin().sum()

    def seen_by_hooks(f, x):
        packed: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            f(x)
        return packed

    x = torch.randn(6, dtype=DTYPE, requires_grad=True)
    f = remat.checkpoint(fn)
    first = seen_by_hooks(f, x)
    second = seen_by_hooks(f, x)
    assert f.cache_info().traces == 1
    assert [type(t).__name__ for t in first] == ["Tensor"] * len(second)
    assert [(t.shape, t.dtype) for t in first] == [(t.shape, t.dtype) for t in second]


# --------------------------------------------------------------------------- side effects happen once


def _batchnorm_pair() -> tuple[NormNet, NormNet, torch.Tensor]:
    torch.manual_seed(0)
    model = NormNet().to(DTYPE).train()
    return model, copy.deepcopy(model), torch.randn(8, 4, dtype=DTYPE)


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=repr)
def test_batchnorm_running_stats_update_once_per_step(policy):
    model, eager, x = _batchnorm_pair()
    f = remat.checkpoint(model, policy=policy)
    for step in (1, 2):
        xr = x.clone().requires_grad_()
        xe = x.clone().requires_grad_()
        f(xr).sum().backward()
        eager(xe).sum().backward()
        assert model.bn.num_batches_tracked.item() == step
        assert eager.bn.num_batches_tracked.item() == step
        torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean, rtol=0, atol=0)
        torch.testing.assert_close(model.bn.running_var, eager.bn.running_var, rtol=0, atol=0)
        torch.testing.assert_close(xr.grad, xe.grad)
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
        x = x * 1.5 + 0.25  # a different batch for the second step
    assert f.cache_info().traces == 1


def test_trace_and_report_change_no_buffer():
    model, _, x = _batchnorm_pair()
    x.requires_grad_()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    remat.trace(model, x)
    remat.report(model, x, policy=policies.save_nothing)
    remat.report(model, x, policy=policies.save_everything)
    remat.report(remat.checkpoint(model), x)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    assert model.bn.num_batches_tracked.item() == 0


def test_the_pure_forward_is_built_only_when_a_second_derivative_needs_it() -> None:
    # First derivatives never run the pure forward: it is built on its first call, once.
    from remat._api._inspect import _joint_of

    f = remat.checkpoint(lambda x: x.exp().sin().sum(), policy=remat.policies.save_everything)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    torch.autograd.grad(f(x), x)
    _, _, executable = _joint_of(f, (x,), {}, "test")
    assert executable is not None
    programs = executable.programs
    assert programs.pure_with_outputs is not None  # (a backward that will be differentiated is autograd's)
    assert "module" not in vars(programs.pure) and "module" not in vars(programs.pure_with_outputs)
    (second,) = torch.autograd.grad(torch.autograd.grad(f(x), x, create_graph=True)[0].sum(), x)
    built = vars(programs.pure_with_outputs)["module"]
    torch.testing.assert_close(second, (-(x.exp().sin()) * x.exp() ** 2 + x.exp().cos() * x.exp()))
    torch.autograd.grad(torch.autograd.grad(f(x), x, create_graph=True)[0].sum(), x)
    assert vars(programs.pure_with_outputs)["module"] is built
