"""Random ops replay bit-identically, and what that costs shows in `remat.report`.

What must hold: random ops replay bit-identically (the same dropout mask) and
leave the global RNG stream where eager execution would, and generator state is
kept only for calls that really draw random numbers (an attention call with
`dropout_p=0` draws none).

Every comparison here is exact (`torch.equal`): the checkpointed function runs
the same kernels in the same order as eager, from the same generator states, so
outputs, gradients, the numbers drawn after backward and the state of a user's
`torch.Generator` must all be bit-identical. Each test that takes `device` runs
on the CPU, and on CUDA where a GPU exists.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import bytes_seen_by_saved_tensors_hooks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat import policies

DTYPE = torch.float64
COTANGENT_SEED = 4321

# Bytes of one generator state: `torch.default_generator.get_state()` is 5,056
# bytes on the CPU; a CUDA (Philox) state is a seed and an offset, 16 bytes.
STATE_BYTES = {"cpu": 5056, "cuda": 16}

# `device` is a function-scoped fixture, but an immutable one (a torch.device):
# reusing it across hypothesis examples is safe.
FIXTURE_OK = settings(
    suppress_health_check=[*settings().suppress_health_check, HealthCheck.function_scoped_fixture],
)


def save_random(call: remat.Call) -> bool:
    """Save the random calls, recompute everything else."""
    return call.is_random


def save_all_but_random(call: remat.Call) -> bool:
    """Save everything except the random calls."""
    return not call.is_random


POLICIES = pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.save_everything, save_random, save_all_but_random],
    ids=["save_nothing", "save_everything", "save_random", "save_all_but_random"],
)


# --- the functions under test --------------------------------------------------------------------


def _randn(*shape: int, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=DTYPE).to(device).requires_grad_()


def _seeded(module: nn.Module, device: torch.device, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    module = module.to(DTYPE)
    with torch.no_grad():
        for param in module.parameters():
            scale = 1.0 / math.sqrt(param.shape[-1] if param.dim() > 1 else param.numel())
            param.copy_(torch.randn(param.shape, generator=generator, dtype=DTYPE) * scale)
    return module.to(device)


@dataclasses.dataclass
class Case:
    fn: Callable[..., Any]
    args: tuple[torch.Tensor, ...]
    n_random: int  # random calls in its trace
    params: tuple[torch.Tensor, ...] = ()
    generator: torch.Generator | None = None  # a user generator the function draws from


def dropout_mlp(device: torch.device) -> nn.Sequential:
    """Linear/Dropout/GELU/Linear/Dropout/Tanh/Linear, float64, in training mode."""
    net = nn.Sequential(
        nn.Linear(8, 16),
        nn.Dropout(0.3),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.Dropout(0.5),
        nn.Tanh(),
        nn.Linear(16, 4),
    )
    return _seeded(net, device).train()  # type: ignore[return-value]


def _dropout_functional(device: torch.device) -> Case:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(x @ w), p=0.4, training=True)
        return F.dropout(h, p=0.2) @ w.t()

    return Case(fn, (_randn(3, 8, device=device, seed=1), _randn(8, 8, device=device, seed=2)), n_random=2)


def _dropout_module(device: torch.device) -> Case:
    net = dropout_mlp(device)
    return Case(net, (_randn(5, 8, device=device, seed=1),), n_random=2, params=tuple(net.parameters()))


def _dropout_inplace(device: torch.device) -> Case:
    net = _seeded(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.4, inplace=True), nn.GELU(), nn.Linear(16, 4)), device)
    return Case(net.train(), (_randn(5, 8, device=device, seed=1),), n_random=1, params=tuple(net.parameters()))


def _bernoulli(device: torch.device) -> Case:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.bernoulli(torch.sigmoid(x)) * x.sin() + torch.bernoulli(x.detach(), p=0.7) * x.cos()

    return Case(fn, (_randn(4, 6, device=device, seed=1),), n_random=2)


def _rand_like(device: torch.device) -> Case:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        return h * torch.rand_like(h) + torch.randn_like(h) * torch.tanh(h)

    return Case(fn, (_randn(3, 8, device=device, seed=1), _randn(8, 8, device=device, seed=2)), n_random=2)


def _sdpa(device: torch.device, causal: bool) -> Case:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=causal)

    return Case(fn, tuple(_randn(2, 3, 5, 4, device=device, seed=s) for s in (1, 2, 3)), n_random=1)


def _rand_factory(device: torch.device) -> Case:
    def fn(x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, dtype=x.dtype, device=x.device)
        return x.sin() * noise + x * torch.randn(x.shape, dtype=x.dtype, device=x.device)

    return Case(fn, (_randn(4, 6, device=device, seed=1),), n_random=2)


def _generator_bernoulli(device: torch.device) -> Case:
    generator = torch.Generator(device=device)

    def fn(x: torch.Tensor) -> torch.Tensor:
        # One call on the user's generator, one on the global one.
        return torch.bernoulli(torch.sigmoid(x), generator=generator) * x.sin() + x * torch.rand_like(x)

    return Case(fn, (_randn(4, 6, device=device, seed=1),), n_random=2, generator=generator)


def _generator_rand(device: torch.device) -> Case:
    generator = torch.Generator(device=device)

    def fn(x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        return x.sin() * noise + x * torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)

    return Case(fn, (_randn(4, 6, device=device, seed=1),), n_random=2, generator=generator)


CASES: dict[str, Callable[[torch.device], Case]] = {
    "dropout_functional": _dropout_functional,
    "dropout_module": _dropout_module,
    "dropout_inplace": _dropout_inplace,
    "bernoulli": _bernoulli,
    "rand_like": _rand_like,
    "sdpa_dropout": lambda device: _sdpa(device, causal=False),
    "sdpa_dropout_causal": lambda device: _sdpa(device, causal=True),
    "rand_factory": _rand_factory,
    "generator_bernoulli": _generator_bernoulli,
    "generator_rand": _generator_rand,
}

_trace_lengths: dict[tuple[str, str], int] = {}


def trace_length(name: str, device: torch.device) -> int:
    key = (name, str(device))
    if key not in _trace_lengths:
        case = CASES[name](device)
        _trace_lengths[key] = len(remat.trace(case.fn, *case.args))
    return _trace_lengths[key]


# --- running eager and checkpointed from the same seeds ------------------------------------------


@dataclasses.dataclass
class Run:
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]  # of the inputs, then of the params
    next_draws: list[torch.Tensor]  # what the global generators give right after backward
    generator_state: torch.Tensor | None  # the user generator's state after backward


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)


def _cotangent(output: torch.Tensor, index: int) -> torch.Tensor:
    # From a private generator: drawing cotangents must not move the global stream.
    generator = torch.Generator().manual_seed(COTANGENT_SEED + index)
    return torch.randn(output.shape, generator=generator, dtype=output.dtype).to(output.device)


def _next_draws(device: torch.device) -> list[torch.Tensor]:
    draws = [torch.rand(8, dtype=DTYPE)]
    if device.type != "cpu":
        draws.append(torch.rand(8, dtype=DTYPE, device=device))
    return draws


def run(case: Case, fn: Callable[..., Any], *, seed: int = 0) -> Run:
    """Seed every generator, run `fn`, backpropagate seeded cotangents, then draw from the global stream."""
    device = case.args[0].device
    for param in case.params:
        param.grad = None
    args = [_fresh(a) for a in case.args]
    torch.manual_seed(seed)  # every device's default generator
    if case.generator is not None:
        case.generator.manual_seed(seed + 100)
    out = fn(*args)
    outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    torch.autograd.backward(outputs, [_cotangent(o, i) for i, o in enumerate(outputs)])
    return Run(
        outputs=[o.detach() for o in outputs],
        grads=[a.grad for a in args] + [None if p.grad is None else p.grad.clone() for p in case.params],
        next_draws=_next_draws(device),
        generator_state=None if case.generator is None else case.generator.get_state(),
    )


def assert_bit_identical(actual: Run, expected: Run) -> None:
    assert len(actual.outputs) == len(expected.outputs)
    for i, (a, e) in enumerate(zip(actual.outputs, expected.outputs, strict=True)):
        assert a.dtype == e.dtype and a.shape == e.shape, f"output {i}: {a.dtype}{a.shape} != {e.dtype}{e.shape}"
        assert torch.equal(a, e), f"output {i} differs from eager (max diff {(a - e).abs().max()})"
    assert any(g is not None for g in expected.grads), "vacuous comparison: eager computed no gradient"
    for i, (a, e) in enumerate(zip(actual.grads, expected.grads, strict=True)):
        if e is None:
            assert a is None, f"gradient {i}: expected None"
            continue
        assert a is not None, f"gradient {i}: expected a gradient, got None"
        assert torch.equal(a, e), f"gradient {i} differs from eager (max diff {(a - e).abs().max()})"
    for a, e in zip(actual.next_draws, expected.next_draws, strict=True):
        assert torch.equal(a, e), "the global RNG stream is not where eager execution leaves it"
    if expected.generator_state is not None:
        assert actual.generator_state is not None
        assert torch.equal(actual.generator_state, expected.generator_state), (
            "the user generator is not where eager execution leaves it"
        )


def check_bit_identical(name: str, device: torch.device, policy: Any) -> remat.Checkpointed[..., Any]:
    case = CASES[name](device)
    checkpointed = remat.checkpoint(case.fn, policy=policy)
    expected = run(case, case.fn)
    actual = run(case, checkpointed)
    assert_bit_identical(actual, expected)
    assert checkpointed.cache_info().traces == 1
    return checkpointed


def check_rng_state_bytes(report: remat.Report, device: torch.device) -> int:
    """Check the generator-state accounting of `report`; return the number of random calls replayed.

    A random call keeps its generator state when backward replays it, or when a kept activation
    depends on it (so that a higher-order derivative can recompute that activation exactly),
    unless its own output is kept and stands for it.
    """
    replayed_random = [row for row in report.rows if row.call.is_random and row.replayed]
    with_state = [row for row in report.rows if row.rng_state_kept]
    assert report.rng_state_bytes == STATE_BYTES[device.type] * len(with_state)
    assert all(row.call.is_random for row in with_state)
    assert all(row.rng_state_kept for row in replayed_random)
    assert not any(row.rng_state_kept and row.saved for row in report.rows)
    assert set(report.replayed_calls) == {row.call.index for row in report.rows if row.replayed}
    assert report.saved_bytes >= report.rng_state_bytes
    return len(replayed_random)


# --- the cases really are random -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_cases_draw_random_numbers(name: str, device: torch.device) -> None:
    case = CASES[name](device)
    assert sum(call.is_random for call in remat.trace(case.fn, *case.args)) == case.n_random
    # Different seeds give different outputs: the comparisons below are not blind to the masks.
    first, second = run(case, case.fn, seed=0), run(case, case.fn, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(first.outputs, second.outputs, strict=True))
    if case.generator is not None:
        before = torch.Generator(device=device).manual_seed(0 + 100).get_state()
        assert not torch.equal(first.generator_state, before), "the function must draw from the user generator"


# --- bit-identical outputs, gradients and streams ------------------------------------------------


@POLICIES
@pytest.mark.parametrize("name", list(CASES))
def test_random_calls_replay_bit_identically(name: str, policy: Any, device: torch.device) -> None:
    check_bit_identical(name, device, policy)


@FIXTURE_OK
@given(data=st.data())
@pytest.mark.parametrize("name", list(CASES))
def test_random_save_calls_policy_replays_bit_identically(name: str, device: torch.device, data: st.DataObject) -> None:
    n = trace_length(name, device)
    saved = data.draw(st.sets(st.integers(min_value=0, max_value=n - 1), max_size=n), label="saved calls")
    checkpointed = check_bit_identical(name, device, policies.save_calls(*sorted(saved)))
    case = CASES[name](device)
    check_rng_state_bytes(remat.report(checkpointed, *case.args), device)


def test_two_forwards_then_two_backwards(device: torch.device) -> None:
    """Two calls draw two different masks; each backward replays its own call's mask."""
    for policy in (policies.save_nothing, policies.save_everything):
        net = dropout_mlp(device)
        checkpointed = remat.checkpoint(net, policy=policy)
        x = _randn(5, 8, device=device, seed=1)

        def go(fn: Callable[..., Any], net: nn.Module = net, x: torch.Tensor = x) -> list[Any]:
            net.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            first, second = _fresh(x), _fresh(x)
            out_1, out_2 = fn(first), fn(second)
            out_2.backward(_cotangent(out_2, 2))
            params_after_second = [p.grad.clone() for p in net.parameters()]
            out_1.backward(_cotangent(out_1, 1))
            params_after_both = [p.grad.clone() for p in net.parameters()]
            return [
                out_1.detach(),
                out_2.detach(),
                second.grad,
                first.grad,
                *params_after_second,
                *params_after_both,
                *_next_draws(device),
            ]

        expected, actual = go(net), go(checkpointed)
        assert not torch.equal(expected[0], expected[1]), "the two calls must draw different masks"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert torch.equal(a, e), f"value {i} differs from eager"


# --- what replaying costs: remat.report -----------------------------------------------------------


@pytest.mark.slow
@POLICIES
@pytest.mark.parametrize("name", list(CASES))
def test_report_keeps_one_generator_state_per_replayed_random_call(
    name: str, policy: Any, device: torch.device
) -> None:
    case = CASES[name](device)
    report = remat.report(case.fn, *case.args, policy=policy)
    replayed = check_rng_state_bytes(report, device)
    if policy is policies.save_nothing:
        # Backward reads every mask, so every random call is replayed, each from its own state;
        # nothing but those states is kept (inputs cost nothing).
        assert replayed == case.n_random
        assert report.rng_state_bytes == STATE_BYTES[device.type] * case.n_random
        assert report.saved_bytes == report.rng_state_bytes
    if policy is policies.save_everything:
        assert replayed == 0 and report.rng_state_bytes == 0


def test_rng_state_bytes_on_cpu_are_5056_per_replayed_call() -> None:
    net = dropout_mlp(torch.device("cpu"))
    x = _randn(5, 8, device=torch.device("cpu"), seed=1)
    report = remat.report(net, x)
    assert report.rng_state_bytes == 2 * 5056
    assert report.saved_bytes == 2 * 5056
    assert "generator states" in str(report)


@pytest.mark.parametrize("name", list(CASES))
def test_saved_random_calls_keep_their_outputs_and_no_generator_state(name: str, device: torch.device) -> None:
    case = CASES[name](device)
    report = remat.report(case.fn, *case.args, policy=save_random)
    assert report.rng_state_bytes == 0
    random_rows = [row for row in report.rows if row.call.is_random]
    assert len(random_rows) == case.n_random
    for row in random_rows:
        assert row.decision is remat.SAVE
        assert row.saved, f"{row.call}: backward reads its output, so a SAVE keeps it"
        assert not row.replayed and not row.rng_state_kept
    # The random calls' outputs (or, for a multi-output call, those backward reads) are all that is kept.
    assert 0 < report.saved_bytes <= sum(row.call.nbytes for row in random_rows)
    if device.type == "cpu":
        assert report.saved_bytes == sum(row.call.nbytes for row in random_rows)
    # Under save_nothing the same calls keep their generator state instead.
    recomputed = remat.report(case.fn, *case.args, policy=policies.save_nothing)
    assert [row.rng_state_kept for row in recomputed.rows if row.call.is_random] == [True] * case.n_random
    assert not any(row.saved for row in recomputed.rows)


def test_deterministic_function_keeps_nothing(device: torch.device) -> None:
    net = _seeded(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)), device)
    x = _randn(5, 8, device=device, seed=1)
    report = remat.report(net, x, policy=policies.save_nothing)
    assert not any(call.is_random for call in report.trace)
    assert report.saved_bytes == 0
    assert report.rng_state_bytes == 0
    assert not any(row.rng_state_kept for row in report.rows)
    assert len(report.replayed_calls) > 0  # backward does replay, from the inputs alone


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_without_dropout_is_not_random(causal: bool, device: torch.device) -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=causal)

    qkv = tuple(_randn(2, 3, 5, 4, device=device, seed=s) for s in (1, 2, 3))
    trace = remat.trace(fn, *qkv)
    assert not any(call.is_random for call in trace)
    tagged = [call for call in trace if torch.Tag.nondeterministic_seeded in getattr(call.op, "tags", ())]
    if device.type == "cpu":
        # The CPU attention op is tagged as seeded, yet with dropout_p=0 it draws nothing.
        assert tagged, f"expected a seeded attention op in\n{trace}"
    report = remat.report(fn, *qkv, policy=policies.save_nothing)
    assert report.saved_bytes == 0
    assert report.rng_state_bytes == 0
    assert not any(row.rng_state_kept for row in report.rows)
    # And it does not touch the global stream.
    case = Case(fn, qkv, n_random=0)
    assert_bit_identical(run(case, remat.checkpoint(fn)), run(case, fn))


def test_random_call_that_backward_does_not_read_keeps_no_state(device: torch.device) -> None:
    """Additive noise: backward never needs the noise, so nothing replays it and no state is kept."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 0.1 * torch.randn_like(x)

    x = _randn(4, 6, device=device, seed=1)
    report = remat.report(fn, x, policy=policies.save_nothing)
    (noise,) = [row for row in report.rows if row.call.is_random]
    assert not noise.replayed and not noise.rng_state_kept
    assert report.rng_state_bytes == 0 and report.saved_bytes == 0
    case = Case(fn, (x,), n_random=1)
    assert_bit_identical(run(case, remat.checkpoint(fn)), run(case, fn))


# --- report.saved_bytes against an independent measurement ---------------------------------------


@POLICIES
def test_saved_bytes_equal_what_saved_tensors_hooks_see(policy: Any, device: torch.device) -> None:
    net = dropout_mlp(device)
    x = _randn(5, 8, device=device, seed=1)
    checkpointed = remat.checkpoint(net, policy=policy)
    report = remat.report(checkpointed, x)  # traces it (cached)
    measured = bytes_seen_by_saved_tensors_hooks(checkpointed, x, [x, *net.parameters()])
    assert checkpointed.cache_info().traces == 1, "the measured call must not trace"
    assert measured == report.saved_bytes
    if policy is policies.save_nothing:
        assert measured == 2 * STATE_BYTES[device.type]  # two generator states, nothing else


# --- seeding inside a checkpointed function ----------------------------------------------------------


def _forks_and_seeds(x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():  # puts the state back on leaving: the seed still changes the draws
        torch.manual_seed(7)
        return F.dropout(x, 0.5)


def _seeds_with_the_state_it_finds(x: torch.Tensor) -> torch.Tensor:
    torch.set_rng_state(torch.get_rng_state())  # a no-op in eager, but not one remat can tell apart
    return F.dropout(x, 0.5)


@pytest.mark.parametrize("fn", [_forks_and_seeds, _seeds_with_the_state_it_finds], ids=["fork_rng", "set_rng_state"])
def test_seeding_the_global_generator_inside_is_refused_and_leaves_it_as_found(fn: Callable) -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    seeding = (torch.manual_seed, torch.random.manual_seed, torch.set_rng_state, torch.cuda.manual_seed_all)
    with pytest.raises(remat.TraceError, match=r"sets the state of the global random number generator"):
        remat.checkpoint(fn)(_randn(8, device=torch.device("cpu"), seed=1))
    assert torch.equal(torch.get_rng_state(), before)
    assert seeding == (torch.manual_seed, torch.random.manual_seed, torch.set_rng_state, torch.cuda.manual_seed_all)


def test_seeding_with_the_seed_the_generator_already_has_is_refused_too() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        return F.dropout(x, 0.5)

    torch.manual_seed(0)  # the trace would see no change of state; later calls would draw other numbers
    with pytest.raises(remat.TraceError, match=r"\(`torch\.manual_seed`\)"):
        remat.checkpoint(fn)(_randn(8, device=torch.device("cpu"), seed=1))


def test_a_generator_seeded_outside_and_closed_over_draws_as_eager_on_every_call() -> None:
    """What the refusal suggests instead: the function draws from a generator seeded outside it."""
    generator = torch.Generator()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rand(x.shape, generator=generator, dtype=x.dtype)

    f = remat.checkpoint(fn, policy=policies.save_nothing)
    x = _randn(8, device=torch.device("cpu"), seed=1)
    for seed in (3, 4):
        generator.manual_seed(seed)
        expected = fn(x)
        generator.manual_seed(seed)
        actual = f(x)
        assert torch.equal(actual, expected)
        assert torch.equal(torch.autograd.grad(actual.sum(), x)[0], torch.autograd.grad(expected.sum(), x)[0])


def test_seeding_on_another_thread_while_tracing_is_not_refused() -> None:
    import threading

    started, seeded = threading.Event(), threading.Event()

    def seed_elsewhere() -> None:
        started.wait()
        torch.manual_seed(5)  # the patched function calls through on other threads
        seeded.set()

    def fn(x: torch.Tensor) -> torch.Tensor:
        started.set()
        seeded.wait(timeout=10)
        return x.sin()

    thread = threading.Thread(target=seed_elsewhere)
    thread.start()
    out = remat.checkpoint(fn)(_randn(3, device=torch.device("cpu"), seed=1))
    thread.join()
    assert seeded.is_set()
    assert torch.equal(out, _randn(3, device=torch.device("cpu"), seed=1).sin())


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_backward_never_draws_to_give_a_value_updated_under_no_grad_its_history(policy: Any) -> None:
    # A value updated in place under no_grad keeps its old history (NOTE [updates under no_grad keep their
    # tensors' histories]); backward recomputed that history, a random call with no kept state among it,
    # and drew afresh: the random stream was left elsewhere than eager leaves it.
    def fn(x: torch.Tensor) -> torch.Tensor:
        v = F.dropout(F.rrelu(x.t(), training=True), 0.2).t()
        with torch.no_grad():
            v.mul_(2)
        return v.abs()

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    streams = []
    for f in (fn, remat.checkpoint(fn, policy=policy)):
        torch.manual_seed(0)
        out = f(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        streams.append((out, grad, torch.get_rng_state()))
    (expected, expected_grad, expected_stream), (actual, actual_grad, actual_stream) = streams
    assert torch.equal(actual, expected)
    torch.testing.assert_close(actual_grad, expected_grad)
    assert torch.equal(actual_stream, expected_stream)
