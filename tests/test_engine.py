"""Backward walked without torch's engine (remat/_tracing/_engine.py): what remat traces for tensors of a device this
machine lacks. On the CPU the walk is forced, and its trace must be the engine's."""

from __future__ import annotations

import contextlib
from typing import Any

import models
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import remat
from remat import _torch, policies
from remat._api import _inspect
from remat._memory import _step
from remat._planning import _fit, _fit_probe
from remat._tracing import _engine, _forward_then_backward
from remat.testing import assert_checkpoint_equivalent, functions, inputs

DTYPE = torch.float64


@pytest.fixture
def walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traces walk backward themselves, as where the engine cannot run."""
    monkeypatch.setattr(_forward_then_backward, "engine_can_run", lambda tensors: False)


def _reports(fn: Any, args: Any, policy: Any) -> tuple[Any, ...]:
    """What remat traced and planned: the joint graph, node by node (names left out), and the report."""
    graph = _inspect._joint_of(fn, args, {}, "test")[0].graph
    index = {node: i for i, node in enumerate(graph.nodes)}

    def canonical(value: Any) -> Any:
        return torch.fx.node.map_arg(value, lambda node: index[node])

    nodes = [(node.op, str(node.target), canonical(node.args), canonical(node.kwargs)) for node in graph.nodes]
    return str(nodes), str(remat.report(fn, *args, policy=policy))


@given(st.data())
def test_a_walked_backward_traces_what_the_engine_traces(data: st.DataObject) -> None:
    fn = data.draw(functions(max_ops=6), label="fn")
    args = data.draw(inputs(fn), label="args")
    policy = data.draw(remat.testing.policies(remat.trace(fn, *args)), label="policy")
    expected = _reports(fn, args, policy)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_forward_then_backward, "engine_can_run", lambda tensors: False)
        assert _reports(fn, args, policy) == expected
        # The walked trace's backward program runs (for real, on the CPU) to eager's gradients.
        assert_checkpoint_equivalent(fn, *args, policy=policy, transforms=())


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, factor: float, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, y)
        ctx.factor = factor
        return x * y * factor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, y = ctx.saved_tensors
        return None, grad * y * ctx.factor, grad * x * ctx.factor


@pytest.mark.usefixtures("walked")
@pytest.mark.parametrize("needs", ["both", "first"])
def test_a_walked_backward_runs_custom_functions_and_sums_paths(needs: str) -> None:
    # A custom Function with a non-tensor argument and a tensor that may not require grad; two paths to `x`
    # (their sum); a broadcast (summed back to the input's shape); an input reached by no path.
    def fn(x: torch.Tensor, y: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return (_Scaled.apply(2.0, x.sin(), y) + x.exp() * y[0]).sum()

    x = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
    y = torch.randn(3, 4, dtype=DTYPE, requires_grad=needs == "both")
    unused = torch.randn(2, dtype=DTYPE, requires_grad=True)
    for policy in (policies.save_nothing, policies.save_everything):
        assert_checkpoint_equivalent(fn, x, y, unused, policy=policy, transforms=())


def _stepped(fn: Any, args: Any, walk: bool) -> tuple[list[Any], tuple[int, int, tuple[int, ...]]]:
    """The gradients one step of `fn(*args).sum()` leaves in `.grad`, and the bytes live along it (its peak,
    what is live at the end, and the live bytes after every op), stepped by the engine or walked."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    for leaf in leaves:
        leaf.grad = None
    saved = _engine.SavedTensors() if walk else None
    live: list[int] = []

    def step() -> None:
        torch.manual_seed(0)
        with saved.packing() if saved is not None else contextlib.nullcontext():
            value = sum(out.sum() for out in _outputs(fn(*args)) if out.requires_grad)
        if saved is None:
            value.backward()
        else:
            _engine.walked_backward([value], [torch.ones_like(value)], saved)

    class Watched(_step._Recorder):
        def allocated(self, tensor: torch.Tensor, op: Any) -> None:
            super().allocated(tensor, op)
            live.append(self.total)

    recorder = Watched()
    with _step._Allocations(recorder):
        step()
    return [leaf.grad for leaf in leaves], (recorder.peak, recorder.total, tuple(live))


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, tuple) else (out,)


@given(st.data())
def test_a_walked_step_accumulates_and_frees_as_the_engine(data: st.DataObject) -> None:
    # `.backward()` walked: the same `.grad` (bit for bit: the same kernels in the same order) and the same
    # bytes live after every op, so saved tensors are released as each node runs and gradients dropped once
    # used, as the engine does.
    fn = data.draw(functions(max_ops=6), label="fn")
    args = data.draw(inputs(fn), label="args")
    assume(any(out.requires_grad for out in _outputs(fn(*args))))
    expected_grads, expected_bytes = _stepped(fn, args, walk=False)
    grads, walked_bytes = _stepped(fn, args, walk=True)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert (grad is None) == (expected is None)
        if grad is not None:
            assert grad.stride() == expected.stride()
            torch.testing.assert_close(grad, expected, rtol=0, atol=0, equal_nan=True)
    # (The engine gives a custom Function zeros of its non-differentiable output's shape and dtype, which
    # torch keeps from Python; the walk gives a zero scalar: a few bytes. NOTE [a backward walked without
    # the engine])
    if not any(step.op == "custom_sorted_with_ranks" for step in fn.steps):
        assert walked_bytes == expected_bytes


def test_a_walked_step_adds_to_existing_gradients_and_keeps_the_leaf_layout() -> None:
    w = torch.randn(4, 3, dtype=DTYPE).t().requires_grad_()  # a leaf laid out transposed
    x = torch.randn(5, 3, dtype=DTYPE)

    def fn(w: torch.Tensor) -> torch.Tensor:
        return (x @ w + (x @ w).exp()).sum()

    for walk in (False, True):
        w.grad = None
        for _ in range(2):  # the second step adds to the first's `.grad`
            if walk:
                _engine.walked_backward([fn(w)], [torch.ones((), dtype=DTYPE)])
            else:
                fn(w).backward()
        if not walk:
            expected = w.grad
    assert w.grad.stride() == expected.stride() == w.stride()
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)


def test_a_walked_step_refuses_hooks_it_cannot_run_and_a_second_backward() -> None:
    w = torch.randn(3, requires_grad=True)
    w.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(RuntimeError, match="cannot run the hooks"):
        _engine.walked_backward([(w * 2).sum()], [torch.ones(())])
    v = torch.randn(3, requires_grad=True)
    saved = _engine.SavedTensors()
    with saved.packing():
        value = (v.exp() * v).sum()
    _engine.walked_backward([value], [torch.ones(())], saved)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _engine.walked_backward([value], [torch.ones(())], saved)


@pytest.mark.parametrize("model", ["mlp", "gpt", "resnet"])
def test_fit_plans_a_walked_probe_step_as_the_engine_stepped_it(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe step of a model on meta, planned for the CPU, walked (as for CUDA without a GPU): the same
    # timeline, segment by segment, as the engine's, and so the same plan.
    from test_fit import MLPBlock, gpt_stack, mlp_stack, square_loss

    def planned() -> tuple[Any, ...]:
        timelines: list[Any] = []
        probe = _fit.probe_step
        monkeypatch.setattr(_fit, "probe_step", lambda *a: timelines.append(probe(*a)) or timelines[-1])
        plans: list[Any] = []
        for _ in range(2):  # a first plan reads the range of peaks; the second plans for its middle
            with torch.device("meta"):
                net, block, x = {
                    "mlp": lambda: (mlp_stack(n=3), MLPBlock, torch.empty(32, 16, 32)),
                    "gpt": lambda: (gpt_stack(n=3), models.GPT2Block, torch.empty(8, 16, 32)),
                    "resnet": lambda: (models.resnet18_like(), models.BasicBlock, torch.empty(8, 3, 32, 32)),
                }[model]()
            report = plans[0].report if plans else None
            target = 10**12 if report is None else (report.peak_keeping_everything + report.peak_keeping_nothing) // 2
            plan = remat.fit(net, block, x, peak_bytes=target, loss=square_loss, device="cpu")
            plans.append(plan)
        assert plans[1].predicted_peak < plans[0].predicted_peak  # (the second plan saves less)
        measured = [(t.segments, t.peak, t.gradients, t.end) for t, _ in timelines]
        return measured, [(plan.predicted_peak, [b.label for b in plan.blocks]) for plan in plans]

    expected = planned()
    monkeypatch.setattr(_fit_probe, "engine_runs_on", lambda device: False)
    assert planned() == expected


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch (its fake CUDA tensors)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU: with one, the engine runs")
def test_a_cuda_program_is_traced_and_planned_without_a_gpu() -> None:
    # On a machine without a GPU, fake CUDA tensors run forward; the engine cannot run their backward.
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ((x @ w).relu() @ w).tanh().sum()

    def made(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(64, 32, device=device, requires_grad=True), torch.empty(
            32, 32, device=device, requires_grad=True
        )

    with _torch.FakeTensorMode():
        on_gpu = made("cuda")
    on_cpu = made("cpu")
    trace = remat.trace(fn, *on_gpu)
    assert [call.op for call in trace] == [call.op for call in remat.trace(fn, *on_cpu)]
    assert {call.outputs[0].device.type for call in trace} == {"cuda"}
    report = remat.report(fn, *on_gpu, policy=policies.dots_saveable)
    expected = remat.report(fn, *on_cpu, policy=policies.dots_saveable)
    assert report.replayed_calls == expected.replayed_calls
    assert report.peak.bytes % 512 == 0  # each block as CUDA's allocator counts it
    assert report.peak.bytes >= expected.peak.bytes
    budgeted = remat.report(fn, *on_gpu, policy=policies.budget(max_bytes=report.saved_bytes))
    assert budgeted.saved_bytes <= report.saved_bytes
