"""`remat.PACK`: kept booleans and dropout's masks as bits, exactly (remat/_bits.py, NOTE [values kept as
bits])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import remat
from remat import _torch, policies
from remat.testing import TRANSFORMS, assert_checkpoint_equivalent


def _where_of_a_comparison(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.sin() > 0, x.cos(), x * 3).exp()


def _dropout(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x.sin(), 0.3, training=True).exp()


def _dropout_of_a_transpose(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x.sin().t(), 0.4, training=True).t().exp()


def _masked_fill_with_infinities(x: torch.Tensor) -> torch.Tensor:
    y = x.sin() / (x - x.detach())  # NaN and infinities where x - x is 0: every element
    return torch.where(y.isnan(), x.cos(), x).exp()


def _bernoulli_times(x: torch.Tensor) -> torch.Tensor:
    return (x * torch.bernoulli(torch.full_like(x, 0.7))).exp()


PROGRAMS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "where": (_where_of_a_comparison, "aten.gt.Scalar"),
    "dropout": (_dropout, "aten.div.Scalar"),
    "dropout of a transpose": (_dropout_of_a_transpose, "aten.div.Scalar"),
    "nan mask": (_masked_fill_with_infinities, "aten.isnan.default"),
    "bernoulli": (_bernoulli_times, "aten.bernoulli.default"),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_packed_values_come_back_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    fn, packed_op = PROGRAMS[name]
    x = torch.randn(24, 40, dtype=dtype)
    assert_checkpoint_equivalent(fn, x.requires_grad_(), policy=policies.pack_everything, rtol=0, atol=0)
    saved = remat.report(fn, x, policy=policies.save_everything)
    packed = remat.report(fn, x, policy=policies.pack_everything)
    (row,) = [row for row in packed.rows if row.call.name == packed_op]
    assert row.storage == "bits" and row.saved_bytes == 24 * 40 // 8
    (unpacked,) = [r for r in saved.rows if r.call.name == packed_op]
    assert packed.saved_bytes == saved.saved_bytes - unpacked.saved_bytes + row.saved_bytes
    assert packed.peak.after_forward < saved.peak.after_forward


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_packing_composes_with_torch_func(name: str) -> None:
    fn, _ = PROGRAMS[name]
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)  # 35 elements: the last byte half used
    assert_checkpoint_equivalent(fn, x, policy=policies.pack_everything, transforms=TRANSFORMS)


def test_what_packing_would_not_shrink_is_kept_as_it_is() -> None:
    # One boolean takes a byte, and so would its bit.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x.sum() > 0, x.sin(), x.cos()).sum()

    x = torch.randn(64, 64, requires_grad=True)
    report = remat.report(fn, x, policy=policies.pack_everything)
    (row,) = [r for r in report.rows if r.call.name == "aten.gt.Scalar"]
    assert row.saved and row.storage == "device" and row.saved_bytes == 1
    assert_checkpoint_equivalent(fn, x, policy=policies.pack_everything, rtol=0, atol=0)


def test_pack_falls_between_save_and_offload_when_policies_combine() -> None:
    trace = remat.trace(_where_of_a_comparison, torch.randn(4, 4))
    packed, saved = policies.pack_everything, policies.save_everything
    assert set((packed | policies.offload(saved)).plan(trace)) == {remat.PACK}
    assert set((packed & policies.offload(saved)).plan(trace)) == {remat.OFFLOAD}
    assert set((packed | saved).plan(trace)) == {remat.SAVE}
    assert set((~packed).plan(trace)) == {remat.PACK}


needs_fake_cuda = pytest.mark.skipif(
    not torch.backends.cuda.is_built() or torch.cuda.is_available(),
    reason="needs a CUDA build of torch on a machine without a GPU (fake CUDA tensors)",
)


@needs_fake_cuda
def test_cuda_dropout_keeps_its_mask_as_bits() -> None:
    # On CUDA, dropout is `native_dropout`, which keeps a boolean mask: 1 byte per element, or 1 bit.
    with _torch.FakeTensorMode(), torch.device("cuda"):
        x = torch.empty(64, 1024, requires_grad=True)
    report = remat.report(_dropout, x, policy=policies.pack_everything)
    saved = remat.report(_dropout, x, policy=policies.save_everything)
    (row,) = [r for r in report.rows if r.call.name == "aten.native_dropout.default"]
    (unpacked,) = [r for r in saved.rows if r.call.name == "aten.native_dropout.default"]
    assert row.storage == "bits" and row.saved_bytes == 64 * 1024 // 8  # (a multiple of 512: no rounding)
    assert unpacked.saved_bytes - row.saved_bytes == 64 * 1024 - 64 * 1024 // 8


def _bool_program(x: torch.Tensor) -> Any:
    return (x > 0).logical_and(x < 1)


def test_a_boolean_output_is_returned_as_it_is() -> None:
    # The caller holds what the function returns: nothing of it is packed.
    x = torch.randn(16, 16, requires_grad=True)
    report = remat.report(lambda x: (_bool_program(x), x.sin().sum()), x, policy=policies.pack_everything)
    assert all(row.storage != "bits" for row in report.rows if row.call.name == "aten.logical_and.default")


def test_inside_a_compiled_model_pack_gives_eagers_gradients() -> None:
    # The compiled region has no storage but the device: remat answers MUST_SAVE for a PACK call there.
    x = torch.randn(16, 32, requires_grad=True)
    torch.manual_seed(0)
    expected = torch.autograd.grad(_dropout(x).sum(), x)[0]
    torch._dynamo.reset()
    compiled = torch.compile(remat.checkpoint(_dropout, policy=policies.pack_everything), backend="aot_eager")
    torch.manual_seed(0)
    got = torch.autograd.grad(compiled(x).sum(), x)[0]
    torch._dynamo.reset()
    assert torch.equal(expected, got)


class _DropoutMLP(torch.nn.Module):
    def __init__(self, d: int = 32, hidden: int = 128):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.down(F.dropout(torch.tanh(self.up(x)), 0.2, training=True)), 0.1, training=True)


def test_the_byte_budget_packs_where_the_bytes_buy_fewer_replays() -> None:
    x = torch.randn(256, 32)
    trace = remat.trace(_DropoutMLP(), x)
    everything = remat.report(_DropoutMLP(), x, policy=policies.save_everything).saved_bytes
    for share in (0.2, 0.3, 0.5):
        budget = int(share * everything)
        packed = policies.budget(max_bytes=budget).solve(trace)
        unpacked = policies.budget(max_bytes=budget, pack=False).solve(trace)
        assert remat.PACK in packed.decisions and remat.PACK not in unpacked.decisions
        assert packed.cost < unpacked.cost
        assert remat.report(_DropoutMLP(), x, policy=policies.budget(max_bytes=budget)).saved_bytes <= budget
    # With nothing to gain, it keeps values as they are (packing is a tie the planner breaks against).
    assert remat.PACK not in policies.budget(fraction=1.0).solve(trace).decisions


def test_fit_does_not_pack_yet() -> None:
    # Where the byte budget would pack (above), fit plans without: its step's peak under PACK is not yet
    # checked against the probe's measurement.
    from test_fit import eager_and_lowest, square_loss

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_DropoutMLP() for _ in range(2)])
    x = torch.randn(256, 32)
    eager, lowest = eager_and_lowest(model, _DropoutMLP, x)
    target = int(lowest + 0.3 * (eager - lowest))
    plan = remat.fit(model, _DropoutMLP, x, peak_bytes=target, loss=square_loss)
    assert not any(remat.PACK in block.decisions for block in plan.blocks)
    assert any(remat.RECOMPUTE in block.decisions for block in plan.blocks)
