"""OFFLOAD: kept values wait for backward in host memory, with the gradients of SAVE.

On the CPU a tensor is its own host copy; `remat.testing.offloading_on_cpu()` makes the
copies real, so that lifetimes, hooks and the programs' bookkeeping are tested on every
machine. The CUDA tests (side stream, pinned memory, peak) run where a GPU exists.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import replace as dataclass_replace
from typing import Any

import models
import pytest
import torch
from conftest import DEVICES, examples
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

import remat
import remat.testing
from remat import OFFLOAD, RECOMPUTE, SAVE, _torch, policies
from remat.testing import assert_checkpoint_equivalent, functions, inputs, offloading_on_cpu

aten = torch.ops.aten
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return ((x @ w1).tanh() @ w2).sin().sum()


def _mlp_args(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 8), (8, 16), (16, 4)]
    return tuple(torch.randn(*s, generator=generator, dtype=dtype).to(device).requires_grad_() for s in shapes)


def _grads(fn: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(fn(*args), args)


# --- decisions and policies --------------------------------------------------------------------------------


def test_offload_is_a_decision_that_keeps() -> None:
    assert remat.OFFLOAD is remat.Decision.OFFLOAD
    assert [d.keeps for d in (SAVE, OFFLOAD, RECOMPUTE)] == [True, True, False]
    assert repr(OFFLOAD) == "remat.OFFLOAD"


@pytest.mark.parametrize(
    ("a", "b", "either", "both"),
    [
        (SAVE, OFFLOAD, SAVE, OFFLOAD),
        (OFFLOAD, RECOMPUTE, OFFLOAD, RECOMPUTE),
        (OFFLOAD, OFFLOAD, OFFLOAD, OFFLOAD),
        (SAVE, RECOMPUTE, SAVE, RECOMPUTE),
    ],
)
def test_combinators_rank_save_over_offload_over_recompute(
    a: remat.Decision, b: remat.Decision, either: remat.Decision, both: remat.Decision
) -> None:
    trace = remat.trace(lambda x: x.sin(), torch.ones(2))
    p, q = policies.save_any_of(lambda call: a), policies.save_any_of(lambda call: b)
    for combined, expected in ((p | q, either), (q | p, either), (p & q, both), (q & p, both)):
        assert combined.plan(trace) == (expected,)
        assert combined(trace[0]) is expected


def test_inverting_keeps_offload() -> None:
    trace = remat.trace(lambda x: x.sin().cos(), torch.ones(2))
    policy = ~policies.save_any_of(lambda call: OFFLOAD if call.index == 0 else SAVE)
    assert policy.plan(trace) == (OFFLOAD, RECOMPUTE)
    assert [policy(call) for call in trace] == [OFFLOAD, RECOMPUTE]


def test_offload_turns_what_a_policy_keeps_into_offload() -> None:
    trace = remat.trace(lambda a, b: (a @ b).relu().sum(), torch.ones(2, 3), torch.ones(3, 4))
    assert policies.offload(policies.save_everything).plan(trace) == (OFFLOAD,) * 3
    assert policies.offload(None).plan(trace) == (RECOMPUTE,) * 3
    assert policies.offload(lambda call: call.index == 1).plan(trace) == (RECOMPUTE, OFFLOAD, RECOMPUTE)
    assert repr(policies.offload(policies.dots_saveable)) == "offload(dots_saveable)"
    assert policies.offload_dots.plan(trace) == (OFFLOAD, RECOMPUTE, RECOMPUTE)


def test_offload_dots_with_no_batch_dims_leaves_batched_products() -> None:
    trace = remat.trace(
        lambda q, w: (q @ q.mT).sum() + (q.flatten(0, 1) @ w).sum(), torch.ones(2, 3, 4), torch.ones(4, 4)
    )
    decided = {
        call.name: d for call, d in zip(trace, policies.offload_dots_with_no_batch_dims.plan(trace), strict=True)
    }
    assert decided["aten.bmm.default"] is RECOMPUTE
    assert decided["aten.mm.default"] is OFFLOAD


def _tagged(x: torch.Tensor) -> torch.Tensor:
    q = remat.tag(x.sin(), "q")
    kv = remat.tag(remat.tag(q.cos(), "kv"), "q2")
    both = remat.tag(remat.tag(kv.exp(), "q"), "kv")
    return both.tanh()


def test_offload_tagged_and_save_and_offload_tagged() -> None:
    trace = remat.trace(_tagged, torch.ones(3))
    assert policies.offload_tagged("kv").plan(trace) == (RECOMPUTE, OFFLOAD, OFFLOAD, RECOMPUTE)
    policy = policies.save_and_offload_tagged(save=["q"], offload=("kv",))
    assert policy.plan(trace) == (SAVE, OFFLOAD, SAVE, RECOMPUTE)  # tagged with both: saved
    assert policies.save_and_offload_tagged(offload=["q2"]).plan(trace) == (RECOMPUTE, OFFLOAD, RECOMPUTE, RECOMPUTE)


@pytest.mark.parametrize("argument", ["save", "offload"])
def test_save_and_offload_tagged_refuses_a_bare_string(argument: str) -> None:
    with pytest.raises(TypeError, match=rf"`{argument}` takes a list of tag names.*{argument}=\['kv'\]"):
        policies.save_and_offload_tagged(**{argument: "kv"})
    with pytest.raises(TypeError, match="non-empty strings"):
        policies.save_and_offload_tagged(**{argument: [""]})


@pytest.mark.parametrize("value", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
def test_from_sac_maps_the_offload_values(value: str) -> None:
    if not hasattr(CheckpointPolicy, value):
        pytest.skip(f"torch {_torch.RELEASE}: `CheckpointPolicy.{value}` is new in torch 2.11")

    def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return getattr(CheckpointPolicy, value) if op is aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    trace = remat.trace(lambda a, b: (a @ b).relu(), torch.ones(2, 3), torch.ones(3, 4))
    assert policies.from_sac(sac_policy).plan(trace) == (OFFLOAD, RECOMPUTE)


def test_a_policy_answering_something_else_names_offload() -> None:
    f = remat.checkpoint(lambda x: x.sin(), policy=lambda call: "offload")
    with pytest.raises(TypeError, match=r"remat\.SAVE, remat\.PACK, remat\.OFFLOAD, remat\.RECOMPUTE"):
        f(torch.ones(2, requires_grad=True))


# --- gradients -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("copies", [False, True], ids=["elided", "copied"])
@pytest.mark.parametrize(
    "policy",
    [
        policies.offload_dots,
        policies.offload(policies.save_everything),
        policies.save_ops(aten.tanh) | policies.offload_dots,
    ],
    ids=repr,
)
def test_gradients_are_those_of_save(policy: Any, copies: bool) -> None:
    args = _mlp_args()
    saving = policies.save_any_of(lambda call: policy(call).keeps)  # the same calls, kept on the device
    expected = _grads(remat.checkpoint(_mlp, policy=saving), args)
    with offloading_on_cpu() if copies else contextlib.nullcontext():
        got = _grads(remat.checkpoint(_mlp, policy=policy), args)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert_checkpoint_equivalent(_mlp, *args, policy=policy)


@pytest.mark.parametrize("transforms", [("grad",), ("vmap",), ("jvp",), ("vjp",)], ids=lambda t: t[0])
def test_under_torch_func(transforms: tuple[str, ...]) -> None:
    with offloading_on_cpu():
        assert_checkpoint_equivalent(_mlp, *_mlp_args(), policy=policies.offload_dots, transforms=transforms)


def test_second_derivatives_flow_through_offloaded_values() -> None:
    x, w1, w2 = _mlp_args()
    f = remat.checkpoint(_mlp, policy=policies.offload(policies.save_everything))

    def hvp(fn: Any) -> torch.Tensor:
        (g,) = torch.autograd.grad(fn(x, w1, w2), w1, create_graph=True)
        return torch.autograd.grad((g * g).sum(), (x, w1, w2))

    with offloading_on_cpu():
        got = hvp(f)
    for a, b in zip(hvp(_mlp), got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with offloading_on_cpu():
        hessian = torch.func.hessian(lambda w: f(x, w, w2))(w1)
    torch.testing.assert_close(hessian, torch.func.hessian(lambda w: _mlp(x, w, w2))(w1), rtol=1e-10, atol=1e-12)


def test_nested_checkpoints_offload_their_own_calls() -> None:
    inner = remat.checkpoint(lambda h: (h @ h.mT).tanh(), policy=policies.offload_dots)

    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x.sin()).cos().sum()

    x = models.randn(4, 3)
    report = remat.report(remat.checkpoint(outer, policy=policies.save_everything), x)
    by_op = {row.call.name: row for row in report.rows}
    assert by_op["aten.mm.default"].decision is OFFLOAD
    assert by_op["aten.sin.default"].decision is SAVE
    with offloading_on_cpu():
        assert_checkpoint_equivalent(outer, x, checkpointed=remat.checkpoint(outer, policy=policies.save_everything))


def test_compiled_programs_offload() -> None:
    args = _mlp_args()
    f = remat.checkpoint(_mlp, policy=policies.offload_dots, compile="aot_eager")
    with offloading_on_cpu():
        got = _grads(f, args)
    for a, b in zip(_grads(_mlp, args), got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_inside_torch_compile_offload_keeps_on_the_device() -> None:
    # See NOTE [offload inside torch.compile]: the compiled region saves what remat would offload.
    block = models.GPT2Block(d=16, heads=2)
    reference = models.GPT2Block(d=16, heads=2)
    remat.checkpoint_modules(block, models.GPT2Block, policy=policies.offload_dots)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    x = models.gpt2_input(d=16)
    compiled(x).sum().backward()
    reference(x.detach().requires_grad_()).sum().backward()
    for (name, a), b in zip(block.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


# NOTE [random functions, offloaded]
# The property: random functions from the catalog, under random three-way policies (every split
# of SAVE, OFFLOAD and RECOMPUTE is reachable), with the copies made for real, checkpoint to the
# outputs and gradients of the function itself, under torch.func transforms too.
# functorch has no batching rule for the `copy` an in-place update of a view functionalizes into
# (a slow fallback, not a wrong result), and a draw followed by a log-sigmoid under forward mode
# over vmap warns of a resized `out=` tensor (torch's): see test_testing.py.
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@examples(ci=20, soak=3_000)
@given(st.data())
def test_random_functions_and_three_way_policies(data: st.DataObject) -> None:
    fn = data.draw(functions(max_ops=5), label="fn")
    args = data.draw(inputs(fn), label="args")
    trace = remat.trace(fn, *args)
    policy = data.draw(remat.testing.policies(trace, save_calls=False, offload=True), label="policy")
    allowed = [(), *((t,) for t in remat.testing.transforms_for(fn))]
    transforms = data.draw(st.sampled_from(allowed), label="transforms")
    with offloading_on_cpu():
        assert_checkpoint_equivalent(fn, *args, policy=policy, transforms=transforms)


# --- what is kept, where, and for how long -----------------------------------------------------------------


class _Outputs(TorchDispatchMode):
    """Weak references to the storages of the outputs of one op dispatched while active (a saved
    tensor's storage lives as long as it is kept; its Python object may not)."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op, self.outputs = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is self.op:
            self.outputs.append(weakref.ref(out.untyped_storage()))
        return out


@pytest.mark.parametrize(("policy", "alive"), [(policies.dots_saveable, 2), (policies.offload_dots, 0)], ids=repr)
def test_the_device_copy_is_freed_after_forward(policy: Any, alive: int) -> None:
    args = _mlp_args()
    f = remat.checkpoint(_mlp, policy=policy)
    f(*args)  # traced: the next call only runs the programs
    with offloading_on_cpu():
        with _Outputs(aten.mm.default) as seen:
            loss = f(*args)
        gc.collect()
        assert len(seen.outputs) == 2
        assert sum(ref() is not None for ref in seen.outputs) == alive
        loss.backward()


def test_saved_tensors_hooks_see_the_host_copies() -> None:
    args = _mlp_args()
    f = remat.checkpoint(_mlp, policy=policies.offload_dots)
    report = remat.report(f, *args)
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return tensor

    with offloading_on_cpu(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with _Outputs(aten.mm.default) as seen:
            loss = f(*args)
        inputs = {a.untyped_storage().data_ptr() for a in args}
        activations = [t for t in packed if t.untyped_storage().data_ptr() not in inputs]
        assert sum(t.untyped_storage().nbytes() for t in activations) == report.offloaded_bytes == (5 * 16 + 5 * 4) * 8
        assert report.saved_bytes == 0
        # What the hooks see are the copies, not the products the forward made.
        made = {ref().data_ptr() for ref in seen.outputs if ref() is not None}
        assert not made & {t.untyped_storage().data_ptr() for t in activations}
        loss.backward()


def test_report_splits_device_and_host_bytes() -> None:
    args = _mlp_args()
    saving = remat.report(_mlp, *args, policy=policies.dots_saveable)
    offloading = remat.report(_mlp, *args, policy=policies.offload_dots)
    mixed = remat.report(
        _mlp, *args, policy=policies.save_ops(aten.mm.default) & policies.save_calls(0) | policies.offload_dots
    )
    assert offloading.saved_bytes == 0
    assert offloading.offloaded_bytes == saving.saved_bytes == (5 * 16 + 5 * 4) * 8
    assert (mixed.saved_bytes, mixed.offloaded_bytes) == (5 * 16 * 8, 5 * 4 * 8)
    assert [row.offloaded for row in mixed.rows] == [False, False, True, False, False]
    assert saving.offloaded_bytes == 0 and saving.copy_seconds() == 0
    assert offloading.copy_seconds("h100") == pytest.approx(offloading.offloaded_bytes / 50e9)
    assert offloading.copy_seconds("cpu") == 0  # a CPU tensor is its own host copy
    assert offloading.peak.after_forward == saving.peak.after_forward - offloading.offloaded_bytes
    text = str(mixed)
    assert "160 B (host)" in text
    assert "in host memory: 160 B from 1 calls" in text
    as_dict = mixed.to_dict()
    assert as_dict["offloaded_bytes"] == 160
    assert [row["offloaded"] for row in as_dict["rows"]] == [False, False, True, False, False]


def test_outputs_of_the_function_stay_on_the_device() -> None:
    # The caller holds an output anyway: offloading it would only copy it.
    x = models.randn(3, 3)
    report = remat.report(lambda x: x @ x, x, policy=policies.offload(policies.save_everything))
    assert report.offloaded_bytes == 0 and not any(row.offloaded for row in report.rows)


def test_an_offloaded_call_backward_never_reads_is_reported_unused() -> None:
    report = remat.report(lambda x: x.sum() * 2, models.randn(3), policy=policies.offload(policies.save_everything))
    assert report.saves_nothing == (0, 1)


# --- the pinned pool ------------------------------------------------------------------------------------------


def test_limit_pinned_memory_returns_the_previous_cap() -> None:
    previous = remat.limit_pinned_memory(1024)
    try:
        assert remat.limit_pinned_memory(2048) == 1024
    finally:
        remat.limit_pinned_memory(previous)


@pytest.mark.parametrize("cap", [-1, 1.5, True, "1GiB"])
def test_limit_pinned_memory_refuses_what_is_not_a_byte_count(cap: Any) -> None:
    with pytest.raises(ValueError, match="expected a number of bytes >= 0 or None"):
        remat.limit_pinned_memory(cap)


def test_the_pinned_cap_counts_bytes_until_the_host_copy_is_freed() -> None:
    from remat._storing import _offload

    previous = remat.limit_pinned_memory(100)
    in_use = _offload.pinned_bytes_in_use()
    try:
        assert _offload._take_pinned(60 - in_use)
        with pytest.warns(UserWarning, match="pass the cap of 100 set by remat.limit_pinned_memory"):
            assert not _offload._take_pinned(60)
        assert not _offload._take_pinned(60)  # warned once
        # The bytes come back when the host copy's storage is freed, however long saved tensors hold it.
        host = torch.empty(15)
        weakref.finalize(host.untyped_storage(), _offload._give_back_pinned, 60 - in_use)
        view = host[1:]
        del host
        gc.collect()
        assert not _offload._take_pinned(60)
        del view
        gc.collect()
        assert _offload.pinned_bytes_in_use() == in_use
        assert _offload._take_pinned(60)
        _offload._give_back_pinned(60)
    finally:
        remat.limit_pinned_memory(previous)


# --- CUDA: the side stream, pinned memory and the device peak -------------------------------------------------


@needs_cuda
def test_cuda_gradients_equal_save_bit_for_bit() -> None:
    args = _mlp_args("cuda", torch.float32)
    expected = _grads(remat.checkpoint(_mlp, policy=policies.dots_saveable), args)
    got = _grads(remat.checkpoint(_mlp, policy=policies.offload_dots), args)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


@needs_cuda
def test_cuda_saved_values_are_pinned_host_tensors() -> None:
    args = _mlp_args("cuda", torch.float32)
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return tensor

    f = remat.checkpoint(_mlp, policy=policies.offload_dots)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = f(*args)
    host = [t for t in packed if t.device.type == "cpu"]
    assert len(host) == 2 and all(t.is_pinned() for t in host)
    assert remat._storing._offload.pinned_bytes_in_use() >= sum(t.untyped_storage().nbytes() for t in host)
    loss.backward()


@needs_cuda
def test_cuda_memory_after_forward_drops_by_the_offloaded_bytes() -> None:
    block = models.GPT2Block(d=256, heads=4).to("cuda", torch.float32)
    x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)

    def live_after_forward(policy: Any) -> int:
        f = remat.checkpoint(block, policy=policy)
        f(x).sum().backward()  # traced, allocator warm
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = f(x)
        torch.cuda.synchronize()
        live = torch.cuda.memory_allocated() - before
        out.sum().backward()
        return live

    saving, offloading = live_after_forward(policies.dots_saveable), live_after_forward(policies.offload_dots)
    report = remat.report(block, x, policy=policies.offload_dots)
    assert saving - offloading == report.offloaded_bytes


@needs_cuda
def test_cuda_past_the_pinned_cap_values_go_to_pageable_memory() -> None:
    args = _mlp_args("cuda", torch.float32)
    previous = remat.limit_pinned_memory(0)
    try:
        f = remat.checkpoint(_mlp, policy=policies.offload_dots)
        with pytest.warns(UserWarning, match="pageable memory"):
            got = _grads(f, args)
    finally:
        remat.limit_pinned_memory(previous)
    for a, b in zip(_grads(remat.checkpoint(_mlp, policy=policies.dots_saveable), args), got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_gpt2_block_under_offload_policies(device: str) -> None:
    block = models.GPT2Block(d=32, heads=4).to(device)
    x = models.gpt2_input(d=32).to(device).detach().requires_grad_()
    for policy in (policies.offload_dots, policies.offload_dots_with_no_batch_dims | policies.dots_saveable):
        with offloading_on_cpu():
            assert_checkpoint_equivalent(block, x, policy=policy, device=device)


# --- the planner: keep, offload or replay ------------------------------------------------------------------


def _long_block() -> tuple[torch.nn.Module, torch.Tensor]:
    """A GPT-2 block on a long sequence: attention's compute grows with T^2, its values with T, so
    an H100's compute hides the copies of some of them (traced only, never run here)."""
    return models.GPT2Block(d=512, heads=8).float(), torch.randn(1, 8192, 512, requires_grad=True)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5])
def test_budget_offloads_where_the_link_is_hidden_and_keeps_the_device_budget(fraction: float) -> None:
    pytest.importorskip("highspy")
    block, x = _long_block()
    trace = remat.trace(block, x)
    budget = int(fraction * remat.report(block, x, policy=policies.save_everything).saved_bytes)
    keeping = policies.budget(max_bytes=budget, cost="roofline:h100", exact=True).solve(trace)
    offloading = policies.budget(max_bytes=budget, cost="roofline:h100", exact=True, offload=True).solve(trace)
    assert OFFLOAD in offloading.decisions and OFFLOAD not in keeping.decisions
    assert offloading.cost < keeping.cost  # a choice more: never dearer, and here cheaper
    report = remat.report(block, x, policy=policies.budget(max_bytes=budget, cost="roofline:h100", offload=True))
    assert report.saved_bytes <= budget
    assert (report.saved_bytes, report.offloaded_bytes) == (offloading.saved_bytes, offloading.offloaded_bytes)


def test_budget_prefers_the_device_when_the_budget_allows() -> None:
    pytest.importorskip("highspy")
    block, x = _long_block()
    plan = policies.budget(fraction=1.0, cost="roofline:h100", offload=True).solve(remat.trace(block, x))
    assert OFFLOAD not in plan.decisions and plan.offloaded_bytes == 0


def test_a_free_link_offloads_everything_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("highspy")
    from remat.costs import DEVICES, Device

    monkeypatch.setitem(
        DEVICES, "free-link", dataclass_replace(DEVICES["h100"], name="free-link", host_bandwidth=float("inf"))
    )
    args = _mlp_args()
    policy = policies.budget(max_bytes=0, cost="roofline:free-link", offload=True, exact=True)
    report = remat.report(_mlp, *args, policy=policy)
    saving = remat.report(_mlp, *args, policy=policies.save_everything)
    assert report.saved_bytes == 0 and report.replayed_calls == ()
    assert report.offloaded_bytes == saving.saved_bytes
    with offloading_on_cpu():
        assert_checkpoint_equivalent(_mlp, *args, policy=policy)
    assert isinstance(DEVICES["free-link"], Device)


def test_budget_offload_needs_seconds() -> None:
    with pytest.raises(ValueError, match="offload=True weighs copies against replays in seconds"):
        policies.budget(fraction=0.5, offload=True)
    assert repr(policies.budget(fraction=0.5, cost="roofline:h200", offload=True)) == (
        "budget(fraction=0.5, cost='roofline:h200', offload=True)"
    )


def test_exposed_copy_time_is_what_compute_after_the_producer_does_not_hide() -> None:
    from remat._deciding._budget import HostLink

    link = HostLink(seconds_per_byte=1.0, compute=(5.0, 1.0, 1.0))
    assert link.exposed_seconds([0, 0, 0]) == 0
    assert link.exposed_seconds([2, 0, 0]) == 0  # 2 s of copy behind 2 s of forward compute after it
    assert link.exposed_seconds([3, 0, 0]) == 1 + 0  # forward shows 1 s; backward has twice the compute
    assert link.exposed_seconds([0, 0, 1]) == 1 + 1  # the last call's value: nothing after it to hide it
    assert link.exposed_seconds([2, 1, 0]) == 1 + 0  # 3 s queued after call 0, 2 s of compute


def test_a_stack_of_identical_blocks_shares_one_trace_and_offloads() -> None:
    reference = torch.nn.Sequential(*[models.GPT2Block(d=16, heads=2, seed=i) for i in range(3)])
    model = torch.nn.Sequential(*[models.GPT2Block(d=16, heads=2, seed=i) for i in range(3)])
    remat.checkpoint_modules(model, models.GPT2Block, policy=policies.offload_dots)
    x = models.gpt2_input(d=16)
    with offloading_on_cpu():
        models.compare(reference, model, x)
    assert [block.forward.cache_info().shared for block in model] == [0, 1, 1]


def test_copying_on_the_cpu_holds_only_in_the_thread_that_asked_for_it() -> None:
    # The testing switch is a context variable: no process-wide state another thread could see.
    import threading

    from remat._storing import _offload

    tensor = torch.ones(3)
    seen: dict[str, bool] = {}

    def elsewhere() -> None:
        seen["copied"] = _offload.to_host(tensor) is not tensor

    with offloading_on_cpu():
        assert _offload.to_host(tensor) is not tensor
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert seen == {"copied": False}
    assert _offload.to_host(tensor) is tensor
