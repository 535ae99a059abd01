"""Memory at the peak of backward: kept tensors are freed at their last use, not at the end of backward."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import models
import pytest
import torch
from conftest import assert_same_outputs_and_grads
from torch.distributed._tools.mem_tracker import MemTracker

import remat
from remat import policies

# A probe in the function: its backward runs after the backward of everything computed from its
# output, and reports how many of the tensors remat kept are still alive at that moment.
_alive_at_probe: list[int] = []
_kept: list[weakref.ref[torch.Tensor]] = []
_inputs: set[int] = set()  # storages of the inputs, which the caller holds anyway


@torch.library.custom_op("remat_test_peak::probe", mutates_args=())
def probe(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@probe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("remat_test_peak::count_alive", mutates_args=())
def count_alive(grad: torch.Tensor) -> torch.Tensor:
    _alive_at_probe.append(sum(ref() is not None for ref in _kept))
    return grad.clone()


@count_alive.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


probe.register_autograd(lambda ctx, grad: count_alive(grad))


def chain(x: torch.Tensor) -> torch.Tensor:
    h = probe(x)
    for _ in range(4):
        h = (h.sin() * 2).exp()
    return h


def _weakly(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.untyped_storage().data_ptr() not in _inputs:
        _kept.append(weakref.ref(tensor))
    return tensor


def _backward_counting_alive(fn: Callable[[torch.Tensor], torch.Tensor], **backward: bool) -> tuple[int, int]:
    """(tensors kept for backward, how many of them are alive when the backward reaches the probe)."""
    _alive_at_probe.clear()
    _kept.clear()
    x = models.randn(3, 4, seed=1)
    _inputs.clear()
    _inputs.add(x.untyped_storage().data_ptr())
    with torch.autograd.graph.saved_tensors_hooks(_weakly, lambda t: t):
        loss = fn(x).sum()  # the output itself is not held here: autograd may free it too
    n_kept = len(_kept)
    loss.backward(**backward)
    (alive,) = _alive_at_probe
    return n_kept, alive


def test_kept_tensors_are_freed_before_the_backward_ends() -> None:
    n_kept, alive = _backward_counting_alive(remat.checkpoint(chain, policy=policies.save_everything))
    assert n_kept >= 4  # a value per step: something to free
    assert alive == 0


def test_eager_autograd_frees_them_too() -> None:
    # What the test above holds remat to.
    n_kept, alive = _backward_counting_alive(chain)
    assert n_kept >= 4
    assert alive == 0


def test_retain_graph_keeps_them_for_the_next_backward() -> None:
    checkpointed = remat.checkpoint(chain, policy=policies.save_everything)
    n_kept, alive = _backward_counting_alive(checkpointed, retain_graph=True)
    assert alive == n_kept
    x = models.randn(3, 4, seed=1)
    out = checkpointed(x)
    first = torch.autograd.grad(out.sum(), x, retain_graph=True)
    second = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert_same_outputs_and_grads(chain, checkpointed, [x])


def _peak_bytes(fn: Callable[[torch.Tensor], torch.Tensor], module: torch.nn.Module, x: torch.Tensor) -> int:
    """Peak bytes above the start of forward+backward, on the CPU (MemTracker sees every storage)."""
    fn(x).sum().backward()  # traces (remat) and allocates the parameter gradients outside the measurement
    module.zero_grad(set_to_none=True)
    x.grad = None
    tracker = MemTracker()
    tracker.track_external(module, x)
    with tracker:
        before = int(tracker.get_tracker_snapshot("current")[x.device]["Total"])
        fn(x).sum().backward()
    return int(tracker.get_tracker_snapshot("peak")[x.device]["Total"]) - before


@pytest.mark.parametrize("policy", [policies.save_everything, policies.dots_saveable, policies.save_nothing])
def test_the_peak_of_a_gpt2_block_is_no_higher_than_eager(policy: remat.Policy) -> None:
    block = models.GPT2Block()
    x = models.gpt2_input(batch=4, seq=16)
    eager = _peak_bytes(block, block, x)
    checkpointed = _peak_bytes(remat.checkpoint(block, policy=policy), block, x)
    assert checkpointed <= 1.01 * eager
