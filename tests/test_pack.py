"""`remat.PACK`: kept booleans and dropout's masks as bits, exactly (remat/_storing/_bits.py, NOTE [values kept as
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


# Values that backward reads only through one test per element (NOTE [values kept as bits]), by a dropout after
# the activation (which reads the mask, not its input), and the op whose value is packed.
def _relu(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(F.relu(x.sin() * 3), 0.2, training=True).exp()


def _leaky_relu(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(F.leaky_relu(x.sin() * 3, 0.1), 0.2, training=True).exp()


def _relu6(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(F.relu6(x.sin() * 8), 0.2, training=True).exp()


def _threshold(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(F.threshold(x.sin() * 3, 0.5, -1.0), 0.2, training=True).exp()


TESTED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "relu (its output)": (_relu, "aten.relu.default"),
    "leaky_relu (its input)": (_leaky_relu, "aten.mul.Tensor"),
    "threshold (its input)": (_threshold, "aten.mul.Tensor"),
}


def _with_nans_and_infinities(x: torch.Tensor) -> torch.Tensor:
    """`x` with NaN, infinities, zeros of both signs and the tests' bounds (0.5 / 3) where `sin(x) * k` meets
    them: every way a test's comparison can go."""
    x = x.detach().clone()
    x.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 0.0])
    return x


@pytest.mark.parametrize("name", sorted(TESTED))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_a_value_read_through_a_test_is_kept_as_its_bits(name: str, dtype: torch.dtype) -> None:
    fn, packed_op = TESTED[name]
    x = _with_nans_and_infinities(torch.randn(24, 40, dtype=dtype)).requires_grad_()
    assert_checkpoint_equivalent(fn, x, policy=policies.pack_everything, rtol=0, atol=0)
    saved = remat.report(fn, x, policy=policies.save_everything)
    packed = remat.report(fn, x, policy=policies.pack_everything)
    (row,) = [r for r in packed.rows if r.call.name == packed_op and r.saved_bytes]
    (unpacked,) = [r for r in saved.rows if r.call.name == packed_op and r.saved_bytes]
    assert row.storage == "bits" and row.saved_bytes == 24 * 40 // 8
    assert unpacked.saved_bytes == 24 * 40 * x.element_size()


@pytest.mark.parametrize("name", sorted(TESTED))
def test_a_value_read_through_a_test_composes_with_torch_func(name: str) -> None:
    fn, _ = TESTED[name]
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(fn, x, policy=policies.pack_everything, transforms=TRANSFORMS)


def test_the_stand_in_passes_each_test_as_the_value_does() -> None:
    # What the gradient formulas compute from a stand-in equals what they compute from the value, for every
    # kind of number and bound, NaN and infinities included.
    from remat._storing import _bits

    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 0.5, -0.5, 6.0, 1e-30, -1e30]
    value = torch.tensor(special + torch.randn(20).tolist(), dtype=torch.float64)
    grad = torch.arange(1.0, value.numel() + 1, dtype=torch.float64)
    aten = torch.ops.aten
    for formula, bounds, run in [
        (aten.threshold_backward.default, (0,), lambda v: aten.threshold_backward(grad, v, 0)),
        (aten.threshold_backward.default, (0.5,), lambda v: aten.threshold_backward(grad, v, 0.5)),
        (aten.threshold_backward.default, (-float("inf"),), lambda v: aten.threshold_backward(grad, v, -float("inf"))),
        (aten.leaky_relu_backward.default, (), lambda v: aten.leaky_relu_backward(grad, v, 0.01, False)),
    ]:
        packed = _bits.pack(value, formula, bounds)
        node = torch.fx.Graph().placeholder("v")
        node.meta.update(val=value, **{_bits.TESTED: (formula, bounds)})
        stand_in = _bits.unpack(packed, value.device, *_bits.load_args(node))
        assert not torch.equal(stand_in, value)
        assert torch.equal(run(stand_in), run(value)), (formula, bounds)


def test_relu6s_input_is_kept_as_it_is() -> None:
    # `hardtanh_backward` reads its input through a test, but the CPU's kernel passes a NaN's gradient in its
    # scalar loop and drops it in its vectorized loop: one bit per element cannot bring that back.
    x = _with_nans_and_infinities(torch.randn(24, 40)).requires_grad_()
    report = remat.report(_relu6, x, policy=policies.pack_everything)
    (row,) = [r for r in report.rows if r.call.name == "aten.mul.Tensor" and r.saved_bytes]
    assert row.storage == "device" and row.saved_bytes == 24 * 40 * 4
    assert_checkpoint_equivalent(_relu6, x, policy=policies.pack_everything, rtol=0, atol=0)


def test_a_value_read_in_full_elsewhere_is_kept_as_it_is() -> None:
    # The next layer's weight gradient reads the ReLU's output itself: nothing to pack.
    def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.relu(x.sin()) @ w

    x, w = torch.randn(32, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    report = remat.report(mlp, x, w, policy=policies.pack_everything)
    (row,) = [r for r in report.rows if r.call.name == "aten.relu.default"]
    assert row.saved_bytes == 32 * 16 * 4 and row.storage == "device"


def test_a_value_a_replay_reads_is_kept_as_it_is() -> None:
    # Replaying the dropout's product (for the exp after it) reads the ReLU's output itself, not the stand-in;
    # where the exp is kept, nothing replays it, and the ReLU's output is packed.
    aten = torch.ops.aten
    x = torch.randn(24, 40, dtype=torch.float64, requires_grad=True)
    for also, storage in ((), "device"), ((aten.exp.default,), "bits"):
        policy = policies.pack(policies.save_ops(aten.relu.default, aten.div.Scalar, *also))
        (row,) = [r for r in remat.report(_relu, x, policy=policy).rows if r.call.name == "aten.relu.default"]
        assert row.storage == storage and row.read_by == ({"backward", "replay"} if not also else {"backward"})
        assert row.saved_bytes == (24 * 40 * 8 if not also else 24 * 40 // 8)
        assert_checkpoint_equivalent(_relu, x, policy=policy, transforms=TRANSFORMS)


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


class _GatedBlock(torch.nn.Module):
    """A gate computed by a matmul: backward reads the comparison (a boolean), which only the matmul remakes."""

    def __init__(self, d: int = 32, hidden: int = 128):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(d, hidden), torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x)
        return x + self.down(torch.where(gate > 0, self.up(x), 0.1 * gate))


def _hard_gate(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return torch.where(x @ gate > 0, x @ up, 0.0) @ down


def test_the_byte_budget_packs_where_the_bytes_buy_fewer_replays() -> None:
    # Packing costs its passes over the value (one FLOP per element per pass under the FLOPs model): where a
    # replay is cheap (a dropout mask, from its generator state) the planner replays; where the bytes it frees
    # buy a matmul's replay (the gate's comparison, which only the matmul remakes), it packs.
    args = [
        torch.randn(256, 32),
        torch.randn(32, 128),
        *(torch.randn(*s, requires_grad=True) for s in [(32, 128), (128, 32)]),
    ]
    trace = remat.trace(_hard_gate, *args)
    everything = remat.report(_hard_gate, *args, policy=policies.save_everything).saved_bytes
    budget = int(0.1 * everything)
    packed = policies.budget(max_bytes=budget).solve(trace)
    unpacked = policies.budget(max_bytes=budget, pack=False).solve(trace)
    assert remat.PACK in packed.decisions and remat.PACK not in unpacked.decisions
    assert packed.cost < unpacked.cost
    report = remat.report(_hard_gate, *args, policy=policies.budget(max_bytes=budget))
    assert report.saved_bytes == packed.saved_bytes <= budget
    # With room, and for the dropout MLP's masks, nothing is worth its passes.
    assert remat.PACK not in policies.budget(fraction=0.5).solve(trace).decisions
    dropout = remat.trace(_DropoutMLP(), torch.randn(256, 32))
    assert remat.PACK not in policies.budget(fraction=0.3).solve(dropout).decisions


class _ReluMLP(torch.nn.Module):
    def __init__(self, d: int = 32, hidden: int = 128):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.dropout(F.relu(self.up(x)), 0.2, training=True))


@pytest.mark.parametrize("block", [_ReluMLP, _GatedBlock], ids=["relu", "gated"])
def test_the_budgets_packed_plans_keep_what_it_counts(block: type[torch.nn.Module]) -> None:
    # Its rows for values that come back as stand-ins (no replay may read them) are the partition's rule: at
    # every budget, the plan's bytes are what the programs keep, and its gradients are eager's.
    x = torch.randn(256, 32)
    trace = remat.trace(block(), x)
    everything = remat.report(block(), x, policy=policies.save_everything).saved_bytes
    for share in (0.05, 0.1, 0.2, 0.4, 0.7):
        policy = policies.budget(max_bytes=int(share * everything))
        assert remat.report(block(), x, policy=policy).saved_bytes == policy.solve(trace).saved_bytes
    model = block().double()
    x64 = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    policy = policies.budget(max_bytes=remat.report(model, x64, policy=policies.save_everything).saved_bytes // 10)
    assert_checkpoint_equivalent(model, x64, policy=policy, rtol=0, atol=0)


def test_fit_packs_where_it_replays_less_and_holds_its_target() -> None:
    share = 0.05
    from test_fit import eager_and_lowest, measured_peak, square_loss

    block = _GatedBlock
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[block() for _ in range(3)])
    x = torch.randn(256, 32)
    eager, lowest = eager_and_lowest(model, block, x)
    target = int(lowest + share * (eager - lowest))
    unpacked = remat.fit(model, block, x, peak_bytes=target, loss=square_loss, pack=False)
    remat.uncheckpoint_modules(model)
    plan = remat.fit(model, block, x, peak_bytes=target, loss=square_loss)
    measured = measured_peak(model, x)
    assert measured <= target and plan.predicted_peak <= target
    assert abs(plan.predicted_peak - measured) <= 0.05 * measured
    assert any(remat.PACK in b.decisions for b in plan.blocks)
    assert plan.replay_cost < unpacked.replay_cost
    assert not any(remat.PACK in b.decisions for b in unpacked.blocks)


class _Cube(torch.autograd.Function):
    """A custom Function between the packed values: its forward keeps its input itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


def _with_a_custom_function(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(_Cube.apply(F.relu(x.sin())), 0.3, training=True).exp()


def _gradients(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, autocast: bool = False
) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    return [out.detach(), grad]


@pytest.mark.parametrize(
    "how", ["autocast", "compiled programs", "custom Function"], ids=["autocast", "compile", "function"]
)
def test_packing_composes(how: str) -> None:
    fn = _with_a_custom_function if how == "custom Function" else _relu
    x = torch.randn(16, 32)
    checkpointed = remat.checkpoint(
        fn, policy=policies.pack_everything, compile="aot_eager" if how == "compiled programs" else False
    )
    expected = _gradients(fn, x, autocast=how == "autocast")
    got = _gradients(checkpointed, x, autocast=how == "autocast")
    torch._dynamo.reset()
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    report = remat.report(fn, x.requires_grad_(), policy=policies.pack_everything)
    assert any(row.storage == "bits" for row in report.rows)
