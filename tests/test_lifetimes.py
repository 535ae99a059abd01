"""Lifetimes: what remat keeps is freed when it should be, and the cache stays bounded."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import remat
from remat import policies

DTYPE = torch.float64


@contextmanager
def gc_disabled() -> Iterator[None]:
    """With the cycle collector off, only reference counting frees: a cycle shows as a leak."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _block() -> Callable[[torch.Tensor], torch.Tensor]:
    linear = torch.nn.Linear(8, 8).to(DTYPE)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(linear(x).tanh(), 0.3).exp().sum()

    fn.parameters = list(linear.parameters())  # type: ignore[attr-defined]
    return fn


@contextmanager
def watching_kept_storages(exclude: list[torch.Tensor]) -> Iterator[list[StorageWeakRef]]:
    """Weak references to the storages of what autograd saves, inputs excluded.

    The pack hook returns a detached alias, not the tensor: a hook that returns a saved
    output itself would tie the output to its own graph node, a cycle of the test's making.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: list[StorageWeakRef] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in excluded:
            storages.append(StorageWeakRef(tensor.untyped_storage()))
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield storages


@pytest.mark.parametrize(
    "policy", [policies.save_nothing, policies.save_everything, policies.save_ops(torch.ops.aten.addmm)]
)
def test_everything_kept_for_backward_is_freed_after_backward(policy: Any) -> None:
    fn = _block()
    checkpointed = remat.checkpoint(fn, policy=policy)
    x = torch.randn(4, 8, dtype=DTYPE, requires_grad=True)
    checkpointed(x)  # trace first: only the cached call is measured
    with gc_disabled():
        with watching_kept_storages([x, *fn.parameters]) as kept:  # type: ignore[attr-defined]
            loss = checkpointed(x)
        assert kept, "the dropout masks' generator states at least are kept"
        loss.backward()
        del loss
        alive = [ref for ref in kept if not ref.expired()]
    assert alive == [], f"{len(alive)} of {len(kept)} kept storages outlived backward"


def test_dropping_the_output_without_backward_frees_what_was_kept() -> None:
    fn = _block()
    checkpointed = remat.checkpoint(fn, policy=policies.save_everything)
    x = torch.randn(4, 8, dtype=DTYPE, requires_grad=True)
    checkpointed(x)
    with gc_disabled():
        with watching_kept_storages([x, *fn.parameters]) as kept:  # type: ignore[attr-defined]
            loss = checkpointed(x)
        assert kept and not any(ref.expired() for ref in kept)  # held by the graph until backward
        del loss
        assert all(ref.expired() for ref in kept)


def test_deleting_a_checkpointed_function_frees_its_traces() -> None:
    # FX graphs are cyclic by construction (doubly linked nodes), so this needs the collector.
    checkpointed = remat.checkpoint(lambda x: x.sin().sum())
    checkpointed(torch.randn(3, dtype=DTYPE, requires_grad=True))
    (entries,) = checkpointed._cache._entries.values()
    program = weakref.ref(entries[0].executable.programs.forward)
    del checkpointed, entries
    gc.collect()
    assert program() is None


def test_deleting_a_checkpointed_module_frees_its_traces_and_not_the_module() -> None:
    module = torch.nn.Linear(3, 3).to(DTYPE)
    checkpointed = remat.checkpoint(module)
    checkpointed(torch.randn(2, 3, dtype=DTYPE, requires_grad=True))
    (entries,) = checkpointed.checkpointed._cache._entries.values()
    graph = weakref.ref(entries[0].joint.graph)
    del checkpointed, entries
    gc.collect()
    assert graph() is None
    assert module.weight.shape == (3, 3)  # the module itself is the caller's


@pytest.mark.slow
def test_many_calls_over_many_shapes_keep_memory_flat() -> None:
    checkpointed = remat.checkpoint(lambda x: (x.sin() * x).sum())
    shapes = [(n,) for n in range(1, 21)]
    inputs = [torch.randn(shape, dtype=DTYPE, requires_grad=True) for shape in shapes]
    for x in inputs:  # one trace per shape
        checkpointed(x).backward()
    assert checkpointed.cache_info().traces == len(shapes)
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(400):
            checkpointed(inputs[i % len(inputs)]).backward()
        gc.collect()
        after_warm_up, _ = tracemalloc.get_traced_memory()
        for i in range(1_500):  # a leak of 44 bytes a call would show; the noise is about 15 KiB
            checkpointed(inputs[i % len(inputs)]).backward()
        gc.collect()
        at_end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert checkpointed.cache_info().traces == len(shapes)  # no retrace: all 20 stay cached
    assert at_end - after_warm_up < 64 * 1024, f"grew by {at_end - after_warm_up} bytes over 1,500 calls"


def test_a_bounded_cache_cycling_through_more_shapes_than_it_holds_stays_bounded() -> None:
    checkpointed = remat.checkpoint(lambda x: x.cos().sum(), cache_size=4)
    inputs = [torch.randn(n, dtype=DTYPE, requires_grad=True) for n in range(1, 11)]
    for _ in range(3):
        for x in inputs:
            checkpointed(x).backward()
            assert checkpointed.cache_info().size <= 4
    assert checkpointed.cache_info().traces == 30  # least recently used out, every time
