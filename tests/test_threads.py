"""Threads: one checkpointed function called from several threads at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
import remat._core._rng
from remat import policies

DTYPE = torch.float64


def _run_in_threads(work: Callable[[int], Any], n_threads: int = 6, repeats: int = 5) -> list[Any]:
    results: list[Any] = [None] * n_threads
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def run(index: int) -> None:
        try:
            start.wait()
            results[index] = [work(index) for _ in range(repeats)]
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, f"{len(errors)} threads failed; first: {errors[0]!r}"
    return results


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 3)).to(DTYPE)


def test_concurrent_calls_with_first_traces_racing_give_eager_gradients() -> None:
    model = _model()
    checkpointed = remat.checkpoint(lambda x: model(x).tanh(), policy=policies.save_ops(torch.ops.aten.addmm))
    inputs = [torch.randn(2 + i % 3, 6, dtype=DTYPE, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def input_gradient(fn: Callable[[torch.Tensor], torch.Tensor], index: int) -> torch.Tensor:
        x = inputs[index].clone().requires_grad_()
        (gradient,) = torch.autograd.grad(fn(x).square().sum(), x)
        return gradient

    results = _run_in_threads(lambda i: input_gradient(checkpointed, i))
    for index, gradients in enumerate(results):
        expected = input_gradient(lambda x: model(x).tanh(), index)
        for gradient in gradients:
            torch.testing.assert_close(gradient, expected, rtol=1e-10, atol=1e-12)
    info = checkpointed.cache_info()
    assert info.size == 3  # three shapes, each traced and cached
    assert info.hits + info.misses == 6 * 5


def test_a_trace_is_not_confused_by_modules_running_on_other_threads() -> None:
    traced = _model()
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(DTYPE)
    stop = threading.Event()

    def keep_running_other_modules() -> None:
        x = torch.randn(2, 4, dtype=DTYPE)
        while not stop.is_set():
            other(x)

    background = threading.Thread(target=keep_running_other_modules)
    background.start()
    try:
        paths = set()
        for size in range(1, 9):  # several traces while the other thread runs its modules
            trace = remat.trace(traced, torch.randn(size, 6, dtype=DTYPE, requires_grad=True))
            paths |= {call.module for call in trace}
    finally:
        stop.set()
        background.join()
    assert paths <= {"0", "1", "2", ""}, f"calls attributed to modules of another thread: {paths}"
    assert {"0", "1", "2"} <= paths


class _SlowGenerator:
    """A generator whose state takes a while to read: another thread gets to draw meanwhile."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def get_state(self) -> torch.Tensor:
        state = self.generator.get_state()
        time.sleep(1e-4)
        return state

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


@pytest.fixture
def racy_generator_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widen the window between reading a generator's state and drawing from it."""
    resolve = remat._core._rng._resolve
    monkeypatch.setattr(remat._core._rng, "_resolve", lambda *args: _SlowGenerator(resolve(*args)))


@pytest.mark.usefixtures("racy_generator_reads")
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_ops(torch.ops.aten.sin)], ids=str)
def test_concurrent_dropout_replays_the_mask_each_thread_drew(policy: Any) -> None:
    # Each thread's backward must replay its own dropout mask, not one drawn by another
    # thread between reading the generator state and drawing. The mask is visible in
    # the output (where it is zero), which gives the exact gradient to expect.
    p = 0.5
    checkpointed = remat.checkpoint(lambda x: torch.nn.functional.dropout(x.sin(), p).exp(), policy=policy)
    inputs = [torch.rand(64, dtype=DTYPE, generator=torch.Generator().manual_seed(i)) + 0.5 for i in range(6)]

    def output_and_gradient(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = inputs[index].clone().requires_grad_()
        out = checkpointed(x)
        (gradient,) = torch.autograd.grad(out.sum(), x)
        return out.detach(), gradient

    results = _run_in_threads(output_and_gradient, repeats=20)
    for index, runs in enumerate(results):
        x = inputs[index]
        for out, gradient in runs:
            kept = (out != 1.0).to(DTYPE)  # exp(0) = 1 where dropped; sin(x) > 0 for x in [0.5, 1.5)
            torch.testing.assert_close(out, (kept * x.sin() / (1 - p)).exp(), rtol=1e-12, atol=0)
            torch.testing.assert_close(gradient, out * kept * x.cos() / (1 - p), rtol=1e-12, atol=1e-15)
