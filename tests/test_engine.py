"""Backward walked without torch's engine (remat/_engine.py): what remat traces for tensors of a device this
machine lacks. On the CPU the walk is forced, and its trace must be the engine's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import remat
from remat import _api, _joint, _torch, policies
from remat.testing import assert_checkpoint_equivalent, functions, inputs

DTYPE = torch.float64


@pytest.fixture
def walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traces walk backward themselves, as where the engine cannot run."""
    monkeypatch.setattr(_joint, "engine_can_run", lambda tensors: False)


def _reports(fn: Any, args: Any, policy: Any) -> tuple[Any, ...]:
    """What remat traced and planned: the joint graph, node by node (names left out), and the report."""
    graph = _api._joint_of(fn, args, {}, "test")[0].graph
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
        patch.setattr(_joint, "engine_can_run", lambda tensors: False)
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
