"""Where a kept value lives (remat/_storing/_storage.py): one type that every stage reads, so that a new kind of
storage is one module and one registration (NOTE [kinds of storage])."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import remat
from remat import policies
from remat._storing import _storage
from remat._storing._storage import BITS, DEVICE, HOST, Storage, storage_of


def test_each_decision_names_its_storage() -> None:
    assert storage_of(remat.SAVE) is DEVICE and storage_of(remat.OFFLOAD) is HOST and storage_of(remat.PACK) is BITS
    assert storage_of(remat.RECOMPUTE) is None
    assert [s.name for s in _storage.STORAGES] == ["device", "host", "bits", "float16", "bfloat16", "fp8"]
    assert [s.exact for s in _storage.STORAGES] == [True, True, True, False, False, False]
    assert all(storage_of(s.decision) is s for s in _storage.STORAGES)
    assert DEVICE.device_bytes(100) == 100 and DEVICE.host_bytes(100) == 0
    assert HOST.device_bytes(100) == 0 and HOST.host_bytes(100) == 100 and HOST.ahead > 0
    h100 = remat.costs.DEVICES["h100"]
    assert HOST.move_seconds(h100, 2**30) == h100.copy_seconds(2**30) > 0 and DEVICE.move_seconds(h100, 2**30) == 0


class _Counted:
    """A kind of storage for the test: a copy on the device, every store and load counted."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def store(self, value: torch.Tensor) -> torch.Tensor:
        self.calls["store"] += 1
        return value.clone()

    def start_load(self, stored: torch.Tensor, device: Any) -> torch.Tensor:
        self.calls["start"] += 1
        return stored

    def finish_load(self, started: torch.Tensor) -> torch.Tensor:
        self.calls["finish"] += 1
        return started.clone()

    def load_now(self, stored: torch.Tensor, device: Any) -> torch.Tensor:
        self.calls["now"] += 1
        return stored


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w1) @ w2).sin().sum()


def test_a_new_kind_of_storage_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    # A kind registered for OFFLOAD's calls: the programs store and load through it, the accounting, the
    # peak prediction and the report read its bytes and name from it, and gradients are eager's.
    counted = _Counted()
    kind = Storage(
        "counted copy",
        remat.OFFLOAD,
        store=counted.store,
        start_load=counted.start_load,
        finish_load=counted.finish_load,
        load_now=counted.load_now,
    )
    monkeypatch.setattr(_storage, "STORAGES", (DEVICE, kind))
    monkeypatch.setitem(_storage._BY_DECISION, remat.OFFLOAD, kind)
    generator = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(8, 8, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(3))
    checkpointed = remat.checkpoint(_mlp, policy=policies.offload_dots)
    expected = torch.autograd.grad(_mlp(x, w1, w2), (x, w1, w2))
    got = torch.autograd.grad(checkpointed(x, w1, w2), (x, w1, w2))
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Two matmuls keep their outputs: each stored once and loaded once.
    assert counted.calls == {"store": 2, "start": 2, "finish": 2}
    report = remat.report(_mlp, x, w1, w2, policy=policies.offload_dots)
    on_device = remat.report(_mlp, x, w1, w2, policy=policies.dots_saveable)
    assert [row.storage for row in report.rows if row.saved] == ["counted copy", "counted copy"]
    assert "(counted copy)" in str(report)
    assert report.saved_bytes == on_device.saved_bytes > 0 and report.offloaded_bytes == 0
    assert report.peak.after_forward == on_device.peak.after_forward
    # Differentiated again through the loads, as eager.
    second = [
        torch.autograd.grad(torch.autograd.grad(f(x, w1, w2), x, create_graph=True)[0].sum(), w1)[0]
        for f in (_mlp, checkpointed)
    ]
    torch.testing.assert_close(second[0], second[1], rtol=0, atol=1e-12)


def test_offloaded_values_say_where_they_live() -> None:
    x, w1, w2 = (torch.randn(8, 8, requires_grad=True) for _ in range(3))
    report = remat.report(_mlp, x, w1, w2, policy=policies.save_tagged() | policies.offload_dots)
    assert {row.storage for row in report.rows if row.saved} == {"host"}
    assert all(row.offloaded for row in report.rows if row.saved) and report.offloaded_bytes > 0
    assert {row.storage for row in remat.report(_mlp, x, w1, w2, policy=policies.dots_saveable).rows if row.saved} == {
        "device"
    }
