"""`remat.policies.compress`: kept values in a narrower format, approximately, only where a policy asks
(remat/_storing/_lossy.py, NOTE [values kept lossy])."""

from __future__ import annotations

from collections.abc import Callable

import models
import pytest
import torch
import torch.nn.functional as F

import remat
from remat import policies
from remat.testing import TRANSFORMS, assert_checkpoint_equivalent

FORMATS = ("float16", "bfloat16", "fp8")
# The largest relative error of one rounding to each format (half a unit in the last place; FP8 scaled per
# row, relative to the row's largest magnitude, which its scale maps to 448: 2^-4 of it at worst).
ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "fp8": 2.0**-4}


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = F.gelu(F.layer_norm(x, (x.shape[-1],)) @ w1)
    return (F.dropout(h, 0.1, training=True) @ w2).tanh()


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return tuple(
        models.randn(*shape, seed=k, requires_grad=False).to(dtype).requires_grad_()
        for k, shape in enumerate([(64, 32), (32, 128), (128, 32)])
    )


def _grads(
    fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    out = fn(*inputs)
    return out, torch.autograd.grad(out.sum(), inputs)


@pytest.mark.parametrize("format", FORMATS)
def test_forward_is_eagers_and_gradients_differ_by_the_rounding(format: str) -> None:
    inputs = _inputs()
    policy = policies.compress(policies.save_everything, format)
    expected_out, expected = _grads(_mlp, inputs)
    out, got = _grads(remat.checkpoint(_mlp, policy=policy), inputs)
    assert torch.equal(out, expected_out)  # forward reads the values themselves
    exact = _grads(remat.checkpoint(_mlp, policy=policies.save_everything), inputs)[1]
    for g, e, x in zip(got, expected, exact, strict=True):
        assert torch.equal(x, e)
        error = (g - e).abs().max() / e.abs().max()
        assert 0 < error < 8 * ROUNDING[format]  # differs, by about the rounding


@pytest.mark.parametrize("format", FORMATS)
def test_the_report_shows_each_compressed_values_format_bytes_and_error(format: str) -> None:
    inputs = _inputs()
    report = remat.report(_mlp, *inputs, policy=policies.compress(policies.save_everything, format))
    saved = remat.report(_mlp, *inputs, policy=policies.save_everything)
    rows = {row.call.index: row for row in report.rows}
    compressed = [row for row in report.rows if row.storage == format]
    # The layer norm's output (the matmul's weight gradient reads it), the GELU's input (its formula reads it)
    # and the dropout's output (the next matmul's weight gradient); not the output of tanh, returned.
    names = {row.call.name for row in compressed}
    assert names == {"aten.native_layer_norm.default", "aten.mm.default", "aten.mul.Tensor"}
    for row in compressed:
        value_bytes = saved.rows[row.call.index].saved_bytes
        assert row.saved_bytes < value_bytes
        assert row.error is not None and row.error > 0
    # The error is what the format makes of the traced batch's value: the GELU's input, rounded.
    (mm,) = [row for row in compressed if row.call.name == "aten.mm.default"]
    h = (F.layer_norm(inputs[0], (32,)) @ inputs[1]).detach()
    assert mm.error <= ROUNDING[format] * h.abs().max().item()
    # The dropout mask, a value of another dtype kind, stays as it is; the report's arguments are untouched.
    assert all(row.storage in ("", "device", format) for row in rows.values())
    assert f"({format}, error " in str(report)


def test_only_float32_values_narrow_to_16_bits_and_fp8_takes_bfloat16() -> None:
    inputs = _inputs(torch.bfloat16)
    for format, expected in (("bfloat16", "device"), ("float16", "device"), ("fp8", "fp8")):
        report = remat.report(_mlp, *inputs, policy=policies.compress(policies.save_everything, format))
        (mm,) = [row for row in report.rows if row.call.name == "aten.mm.default" and row.saved]
        assert mm.storage == expected


def test_a_value_a_replay_reads_is_kept_as_it_is() -> None:
    # The GELU is replayed (for the product of the dropout after it), reading the layer norm's output...
    aten = torch.ops.aten
    policy = policies.compress(policies.save_ops(aten.native_layer_norm.default, aten.div.Scalar), "fp8")
    report = remat.report(_mlp, *_inputs(), policy=policy)
    (norm,) = [row for row in report.rows if row.call.name == "aten.native_layer_norm.default"]
    assert norm.storage == "device" and "replay" in norm.read_by
    assert_checkpoint_equivalent(_mlp, *_inputs(torch.float64), policy=policy, rtol=0, atol=0)


def test_no_planner_chooses_a_lossy_format() -> None:
    trace = remat.trace(_mlp, *_inputs())
    everything = remat.report(_mlp, *_inputs(), policy=policies.save_everything).saved_bytes
    for share in (0.05, 0.3, 0.7):
        decisions = policies.budget(max_bytes=int(share * everything)).solve(trace).decisions
        assert set(decisions) <= {remat.SAVE, remat.PACK, remat.RECOMPUTE}


@pytest.mark.parametrize("format", FORMATS)
def test_compression_composes_with_torch_func(format: str) -> None:
    # (Not a layer norm: torch.func's grad of a jvp through `F.layer_norm` is not its finite differences'.)
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.sin() @ w).tanh()

    x, w = (
        models.randn(*shape, seed=k, requires_grad=False).float().requires_grad_()
        for k, shape in [(1, (6, 16)), (2, (16, 16))]
    )
    tolerance = 16 * ROUNDING[format]
    policy = policies.compress(policies.save_everything, format)
    assert any(row.storage == format for row in remat.report(fn, x, w, policy=policy).rows)
    assert_checkpoint_equivalent(fn, x, w, policy=policy, transforms=TRANSFORMS, rtol=tolerance, atol=tolerance)


def test_combined_policies_rank_exact_decisions_above_lossy_ones() -> None:
    trace = remat.trace(lambda x: x.sin().exp(), torch.ones(8, 8))
    fp8 = policies.compress(policies.save_everything, "fp8")
    bf16 = policies.compress(policies.save_everything, "bfloat16")
    assert set((fp8 | bf16).plan(trace)) == {remat.Decision.BFLOAT16}
    assert set((fp8 & bf16).plan(trace)) == {remat.Decision.FP8}
    assert set((fp8 | policies.offload(policies.save_everything)).plan(trace)) == {remat.OFFLOAD}
    assert set((~fp8).plan(trace)) == {remat.Decision.FP8}
    assert repr(fp8) == "compress(save_everything, 'fp8')"


def test_a_bad_format_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`format` must be one of 'float16', 'bfloat16', 'fp8', but got 'int8'"):
        policies.compress(policies.save_everything, "int8")


def test_the_report_puts_back_the_generators_and_buffers_it_changes() -> None:
    block = models.GPT2Block()
    norm = torch.nn.BatchNorm1d(32)
    model = torch.nn.Sequential(block, torch.nn.Dropout(0.2), torch.nn.Flatten(0, 1), norm).float()
    x = models.gpt2_input(batch=2, seq=8).detach().float().requires_grad_()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    report = remat.report(model, x, policy=policies.compress(policies.save_everything, "bfloat16"))
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert any(row.error for row in report.rows)


@pytest.mark.parametrize("format", FORMATS)
def test_fp8_and_16_bit_kept_values_on_fake_cuda_tensors(format: str) -> None:
    if not torch.backends.cuda.is_built() or torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch on a machine without a GPU (fake CUDA tensors)")
    from remat import _torch

    with _torch.FakeTensorMode(), torch.device("cuda"):
        x = torch.empty(64, 1024, requires_grad=True)
        w = torch.empty(1024, 1024, requires_grad=True)
    fn = lambda x, w: F.gelu(x @ w).sum()  # noqa: E731
    report = remat.report(fn, x, w, policy=policies.compress(policies.save_everything, format))
    (mm,) = [row for row in report.rows if row.call.name == "aten.mm.default"]
    per_element = 1 if format == "fp8" else 2
    assert mm.storage == format and mm.error is None  # no real values to measure on
    stored = 64 * 1024 * per_element + (64 * 4 if format == "fp8" else 0)  # the elements, and FP8's scales
    assert mm.saved_bytes == -(-stored // 512) * 512  # as the caching allocator rounds it


def test_training_with_fp8_mlp_inputs_follows_the_exact_loss() -> None:
    # benchmarks/lossy_training.py: a small GPT-style model on text the benchmark writes; docs/storage.md
    # states the difference its 300 steps measure.
    from benchmarks.lossy_training import summary, train

    exact, fp8 = train(None, steps=120), train("fp8", steps=120)
    assert exact[-1] < 0.5 * exact[0] and fp8[-1] < 0.5 * fp8[0]  # both learn
    assert fp8 != exact  # the MLP inputs were compressed: the runs differ
    assert abs(summary(fp8, exact)["difference"]) < 0.02


def test_inside_a_compiled_model_a_compressed_call_is_kept_as_it_is() -> None:
    # The compiled region has no storage but the device: remat answers MUST_SAVE, and gradients are eager's.
    inputs = _inputs()
    expected = _grads(_mlp, inputs)[1]
    torch._dynamo.reset()
    compiled = torch.compile(
        remat.checkpoint(_mlp, policy=policies.compress(policies.save_everything, "fp8")), backend="aot_eager"
    )
    got = _grads(compiled, inputs)[1]
    torch._dynamo.reset()
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_under_forward_mode_values_are_kept_as_they_are() -> None:
    # Forward-mode AD differentiates what its programs read of kept values: traced for it, nothing is narrowed.
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.sin() @ w).tanh()

    x, w = (models.randn(*shape, seed=k, requires_grad=False).float() for k, shape in [(1, (6, 16)), (2, (16, 16))])
    tangents = (torch.ones_like(x), torch.ones_like(w))
    checkpointed = remat.checkpoint(fn, policy=policies.compress(policies.save_everything, "fp8"))
    expected = torch.func.jvp(fn, (x, w), tangents)
    got = torch.func.jvp(checkpointed, (x, w), tangents)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    (grad,) = torch.autograd.grad(checkpointed(x, w.requires_grad_()).sum(), w)  # first order: narrowed
    assert not torch.equal(grad, torch.autograd.grad(fn(x, w).sum(), w)[0])


@pytest.mark.parametrize("how", ["compiled programs", "autocast"], ids=["compile", "autocast"])
def test_compression_composes(how: str) -> None:
    # Compiled, the programs store and load through the same functions, run eagerly between them: the
    # gradients are those of the uncompiled checkpoint. Under autocast, bfloat16 values are kept in FP8.
    inputs = _inputs()
    policy = policies.compress(policies.save_everything, "fp8")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast")
    with autocast:
        expected = _grads(remat.checkpoint(_mlp, policy=policy) if how != "autocast" else _mlp, inputs)[1]
        compiled = remat.checkpoint(_mlp, policy=policy, compile="aot_eager" if how != "autocast" else False)
        got = _grads(compiled, inputs)[1]
        report = remat.report(_mlp, *inputs, policy=policy)
    torch._dynamo.reset()
    if how == "autocast":
        assert any(row.storage == "fp8" and row.call.outputs[0].dtype is torch.bfloat16 for row in report.rows)
        for g, e in zip(got, expected, strict=True):
            assert (g - e).abs().max() <= 8 * ROUNDING["fp8"] * e.abs().max()
    else:
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


class _MLPBlock(torch.nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.ln, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.dropout(F.gelu(self.up(self.ln(x))), 0.1, training=True))


def test_the_budget_compresses_only_when_allowed_where_it_buys_fewer_replays() -> None:
    format = "fp8"
    x = torch.randn(256, 32)
    trace = remat.trace(_MLPBlock(), x)
    budget = int(0.3 * remat.report(_MLPBlock(), x, policy=policies.save_everything).saved_bytes)
    allowed = policies.budget(max_bytes=budget, compress=format)
    plan, exact = allowed.solve(trace), policies.budget(max_bytes=budget).solve(trace)
    assert remat.Decision[format.upper()] in plan.decisions and plan.cost < exact.cost
    assert remat.Decision[format.upper()] not in exact.decisions
    assert remat.report(_MLPBlock(), x, policy=allowed).saved_bytes == plan.saved_bytes <= budget
    assert repr(allowed) == f"budget(max_bytes={budget}, compress={format!r})"
    with pytest.raises(ValueError, match="`compress` must be None or one of 'float16', 'bfloat16', 'fp8'"):
        policies.budget(fraction=0.5, compress="int4")


def test_fit_compresses_only_when_allowed_and_holds_its_target() -> None:
    from test_fit import eager_and_lowest, measured_peak, square_loss

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_MLPBlock() for _ in range(3)])
    x = torch.randn(256, 32)
    eager, lowest = eager_and_lowest(model, _MLPBlock, x)
    target = int(lowest + 0.1 * (eager - lowest))
    exact = remat.fit(model, _MLPBlock, x, peak_bytes=target, loss=square_loss)
    assert not any(remat.Decision.FP8 in block.decisions for block in exact.blocks)
    remat.uncheckpoint_modules(model)
    plan = remat.fit(model, _MLPBlock, x, peak_bytes=target, loss=square_loss, compress="fp8")
    measured = measured_peak(model, x)
    assert measured <= target and abs(plan.predicted_peak - measured) <= 0.05 * measured
    assert any(remat.Decision.FP8 in block.decisions for block in plan.blocks)
    assert plan.replay_cost < exact.replay_cost
    remat.uncheckpoint_modules(model)
    with pytest.raises(ValueError, match=r"remat.fit: `compress` must be None or one of"):
        remat.fit(model, _MLPBlock, x, peak_bytes=target, compress="int4")
