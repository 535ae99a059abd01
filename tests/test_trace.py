"""`remat.trace`: the forward calls a policy decides about, and what each `Call` says.

Every function traced here is defined in this file, so that `Call.source`
can be checked against the line that issued the op (found by its `# @name`
marker comment).
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from torch import nn

import remat
import remat.testing
from remat import _quirks, _torch

aten = torch.ops.aten
DTYPE = torch.float64
CPU = torch.device("cpu")


def _line_of(marker: str) -> int:
    """The line number of this file's line that ends with `# @marker`."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    (number,) = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# @{marker}")]
    return number


def _assert_source(call: remat.Call, marker: str) -> None:
    assert call.source is not None, f"{call} has no source"
    path, line = call.source.rsplit(":", 1)
    assert os.path.samefile(path, __file__), call.source
    assert int(line) == _line_of(marker), call.source


def _randn(*shape: int, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPE, requires_grad=requires_grad)


def _meta(*shape: int, dtype: torch.dtype = DTYPE) -> remat.TensorMeta:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return remat.TensorMeta(tuple(shape), dtype, CPU, nbytes)


def two_matmuls(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    h = a @ b  # @first_mm
    h = h.relu()  # @relu
    h = h @ c  # @second_mm
    return h.sum()  # @sum


def test_trace_returns_a_trace_of_calls():
    trace = remat.trace(two_matmuls, _randn(2, 3), _randn(3, 4), _randn(4, 5))
    assert isinstance(trace, remat.Trace)
    assert len(trace) == 4
    assert all(isinstance(call, remat.Call) for call in trace)
    assert [call.name for call in trace] == [
        "aten.mm.default",
        "aten.relu.default",
        "aten.mm.default",
        "aten.sum.default",
    ]
    assert trace[-1] is list(trace)[3]
    assert repr(trace) == "remat.Trace(4 calls)"


def test_call_index_op_and_occurrence():
    trace = remat.trace(two_matmuls, _randn(2, 3), _randn(3, 4), _randn(4, 5))
    assert [call.index for call in trace] == [0, 1, 2, 3]
    assert [call.op for call in trace] == [aten.mm.default, aten.relu.default, aten.mm.default, aten.sum.default]
    assert all(isinstance(call.op, torch._ops.OpOverload) for call in trace)
    assert [call.occurrence for call in trace] == [0, 0, 1, 0]


def test_occurrence_counts_the_same_overload_only():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sum() + x.sum(0).sum() + x.sum()

    trace = remat.trace(fn, _randn(2, 3))
    sums = [(call.name, call.occurrence) for call in trace if call.op.overloadpacket is aten.sum]
    assert sums == [
        ("aten.sum.default", 0),
        ("aten.sum.dim_IntList", 0),
        ("aten.sum.default", 1),
        ("aten.sum.default", 2),
    ]


def test_call_inputs_and_outputs_describe_tensors_and_values():
    trace = remat.trace(two_matmuls, _randn(2, 3), _randn(3, 4), _randn(4, 5))
    first_mm, relu, second_mm, total = trace
    assert first_mm.inputs == (_meta(2, 3), _meta(3, 4))
    assert first_mm.outputs == (_meta(2, 4),)
    assert relu.inputs == (_meta(2, 4),)
    assert second_mm.inputs == (_meta(2, 4), _meta(4, 5))
    assert second_mm.outputs == (_meta(2, 5),)
    assert total.outputs == (_meta(),)

    def with_values(x: torch.Tensor) -> torch.Tensor:
        return aten.add.Scalar(x, 2.5).sum(1, keepdim=True)

    add, reduce = remat.trace(with_values, _randn(2, 3))
    assert add.op is aten.add.Scalar
    assert add.inputs == (_meta(2, 3), 2.5)
    assert reduce.op is aten.sum.dim_IntList
    assert reduce.inputs == (_meta(2, 3), [1], True)
    assert reduce.outputs == (_meta(2, 1),)


def test_tensor_meta_fields():
    (call,) = remat.trace(lambda x: x.to(torch.float32), _randn(4, 5))
    (meta,) = call.outputs
    assert meta.shape == (4, 5)
    assert meta.dtype is torch.float32
    assert meta.device == CPU
    assert meta.nbytes == 4 * 5 * 4
    assert call.inputs[0].nbytes == 4 * 5 * 8
    assert str(meta) == "float32[4,5]"


def test_flops_and_nbytes():
    m, k, n, p = 2, 3, 4, 5
    trace = remat.trace(two_matmuls, _randn(m, k), _randn(k, n), _randn(n, p))
    first_mm, relu, second_mm, total = trace
    assert first_mm.flops == 2 * m * n * k
    assert second_mm.flops == 2 * m * p * n
    assert first_mm.nbytes == m * n * 8
    assert relu.nbytes == m * n * 8
    assert second_mm.nbytes == m * p * 8
    assert total.nbytes == 8
    assert all(call.flops > 0 for call in trace)


def test_plain_fields_have_their_defaults():
    trace = remat.trace(two_matmuls, _randn(2, 3), _randn(3, 4), _randn(4, 5))
    for call in trace:
        assert call.tags == frozenset()
        assert isinstance(call.tags, frozenset)
        assert call.scope is None
        assert call.module is None
        assert call.is_random is False


def test_source_is_the_user_line():
    trace = remat.trace(two_matmuls, _randn(2, 3), _randn(3, 4), _randn(4, 5))
    for call, marker in zip(trace, ["first_mm", "relu", "second_mm", "sum"], strict=True):
        _assert_source(call, marker)


def test_source_of_a_lambda_and_a_nested_function():
    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x).cos()  # @outer_cos

    def inner(x: torch.Tensor) -> torch.Tensor:
        return x.sin()  # @inner_sin

    sin, cos = remat.trace(outer, _randn(3))
    _assert_source(sin, "inner_sin")
    _assert_source(cos, "outer_cos")


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).sum()  # @stack_forward


def test_module_path_of_a_module_passed_as_fn():
    model = _Stack().to(DTYPE)
    trace = remat.trace(model, _randn(5, 3))
    assert [(call.name, call.module) for call in trace] == [
        ("aten.addmm.default", "layers.0"),
        ("aten.tanh.default", "layers.1"),
        ("aten.addmm.default", "layers.2"),
        ("aten.sum.default", ""),  # the root module itself
    ]
    assert trace[0].flops == 2 * 5 * 4 * 3
    _assert_source(trace[-1], "stack_forward")


def test_module_path_of_a_sequential_passed_as_fn():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU()).to(DTYPE)
    trace = remat.trace(model, _randn(5, 3))
    assert [(call.name, call.module) for call in trace] == [("aten.addmm.default", "0"), ("aten.relu.default", "1")]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()  # @block_relu


def test_module_path_of_a_closed_over_module():
    block = _Block().to(DTYPE)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return block(x).sum()  # @closure_sum

    linear, relu, total = remat.trace(fn, _randn(2, 3))
    assert (linear.name, linear.module) == ("aten.addmm.default", "block.fc")
    assert (relu.name, relu.module) == ("aten.relu.default", "block")
    assert (total.name, total.module) == ("aten.sum.default", None)
    _assert_source(relu, "block_relu")
    _assert_source(total, "closure_sum")


def test_dropout_in_training_is_random():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5, training=True).sin()

    trace = remat.trace(fn, _randn(2, 3))
    random = [call.name for call in trace if call.is_random]
    assert random == ["aten.bernoulli.p"]
    assert [call.name for call in trace if not call.is_random] != []
    assert "aten.sin.default" in [call.name for call in trace if not call.is_random]
    assert "(random)" in str(trace)


def test_dropout_in_eval_is_not_random():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5, training=False).sin()

    trace = remat.trace(fn, _randn(2, 3))
    assert [call.name for call in trace] == ["aten.sin.default"]
    assert not any(call.is_random for call in trace)


def test_bernoulli_is_random():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.bernoulli(torch.sigmoid(x)) * x

    trace = remat.trace(fn, _randn(2, 3))
    assert [(call.name, call.is_random) for call in trace] == [
        ("aten.sigmoid.default", False),
        ("aten.bernoulli.default", True),
        ("aten.mul.Tensor", False),
    ]


def test_views_and_slices_are_not_calls():
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.t()
        flat = x.view(6)
        big = x.unsqueeze(0).expand(4, 2, 3)
        sliced = x[1:, ::2]
        swapped = x.transpose(0, 1)
        first, second = x.unbind(0)
        return t.sum() + flat.sum() + big.sum() + sliced.sum() + swapped.sum() + first.sum() + second.sum()

    trace = remat.trace(fn, _randn(2, 3))
    names = [call.name for call in trace]
    assert set(names) == {"aten.sum.default", "aten.add.Tensor"}
    assert names.count("aten.sum.default") == 7
    assert names.count("aten.add.Tensor") == 6


def test_multi_output_ops_are_one_call():
    weight, bias = _randn(3, requires_grad=False), _randn(3, requires_grad=False)

    def layer_norm(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (3,), weight, bias)

    (call,) = remat.trace(layer_norm, _randn(2, 3))
    assert call.op is aten.native_layer_norm.default
    assert call.outputs == (_meta(2, 3), _meta(2, 1), _meta(2, 1))
    assert call.nbytes == 48 + 16 + 16

    def max_with_indices(x: torch.Tensor) -> torch.Tensor:
        values, indices = torch.max(x, dim=1)
        return values * indices

    maximum, product = remat.trace(max_with_indices, _randn(2, 3))
    assert maximum.op is aten.max.dim
    assert maximum.outputs == (_meta(2), _meta(2, dtype=torch.int64))
    assert maximum.nbytes == 32
    assert product.op is aten.mul.Tensor


def test_str_is_a_table_of_calls():
    trace = remat.trace(two_matmuls, _randn(2, 3), _randn(3, 4), _randn(4, 5))
    text = str(trace)
    lines = text.splitlines()
    assert len(lines) == 2 + len(trace)  # header, rule, one row per call
    assert lines[0].split()[:2] == ["#", "op"]
    for row, call in zip(lines[2:], trace, strict=True):
        assert row.split()[0] == str(call.index)
        assert call.name in row
        assert str(call.outputs[0]) in row
    assert "aten.mm.default" in text
    assert "aten.relu.default" in text
    assert f"{_line_of('second_mm')}" in lines[2 + 2]


def test_trace_of_a_checkpointed_function():
    checkpointed = remat.checkpoint(two_matmuls)
    args = (_randn(2, 3), _randn(3, 4), _randn(4, 5))
    assert [call.name for call in remat.trace(checkpointed, *args)] == [
        call.name for call in remat.trace(two_matmuls, *args)
    ]


def test_trace_passes_keyword_arguments():
    def fn(x: torch.Tensor, *, scale: torch.Tensor, power: int) -> torch.Tensor:
        return (x * scale) ** power

    trace = remat.trace(fn, _randn(3), scale=_randn(3), power=3)
    assert [call.name for call in trace] == ["aten.mul.Tensor", "aten.pow.Tensor_Scalar"]
    assert trace[1].inputs == (_meta(3), 3)


# Tracing runs on fake tensors: it must leave no mark on the real world.


def test_tracing_does_not_change_inputs_or_set_grads():
    x = _randn(2, 3)
    w = _randn(3, 3)
    buffer = torch.zeros(3, dtype=DTYPE)
    x_before, w_before = x.detach().clone(), w.detach().clone()

    def fn(x: torch.Tensor, w: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        buffer.add_(1.0)
        return (x @ w).sum() + buffer.sum()

    trace = remat.trace(fn, x, w, buffer)
    remat.report(fn, x, w, buffer, policy=remat.policies.save_everything)
    names = [call.name for call in trace]
    assert "aten.copy_.default" not in names  # the write back into `buffer` is not a call
    assert names[:2] == ["aten.add.Tensor", "aten.mm.default"]
    assert torch.equal(x, x_before)
    assert torch.equal(w, w_before)
    assert torch.equal(buffer, torch.zeros(3, dtype=DTYPE))
    assert x.grad is None and w.grad is None


def test_tracing_does_not_change_module_state():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(DTYPE).train()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    x = _randn(4, 3)
    x_before = x.detach().clone()

    trace = remat.trace(model, x)
    remat.report(model, x, policy=remat.policies.save_everything)

    assert "aten._native_batch_norm_legit_functional.default" in [call.name for call in trace]
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert torch.equal(x, x_before)
    assert all(parameter.grad is None for parameter in model.parameters())
    assert x.grad is None


def test_tracing_leaves_the_rng_alone():
    x = _randn(8)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    remat.trace(lambda x: torch.nn.functional.dropout(x, 0.5, training=True) * torch.rand_like(x), x)
    assert torch.equal(torch.get_rng_state(), state)


def test_tracing_does_not_call_saved_tensors_hooks():
    packed: list[str] = []
    unpacked: list[str] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(type(tensor).__name__)
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        unpacked.append(type(tensor).__name__)
        return tensor

    x = _randn(3)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        remat.trace(lambda x: x.sin().exp(), x)
        remat.report(lambda x: x.sin().exp(), x, policy=remat.policies.save_everything)
    assert packed == []
    assert unpacked == []


def test_keyword_arguments_are_kept_apart_with_their_names() -> None:
    (gelu,) = remat.trace(lambda x: torch.nn.functional.gelu(x, approximate="tanh"), _randn(2, 3))
    assert gelu.inputs == (_meta(2, 3),)
    assert gelu.kwargs == (("approximate", "tanh"),)


def test_a_checkpointed_function_runs_under_a_fake_mode_of_the_callers() -> None:
    # Planning a model too big for the machine runs it on a fake mode of its own: the checkpoint traces
    # with its own fake mode beside it, and its outputs and gradients are the caller's fakes.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        layer = torch.nn.Linear(8, 8)
        x = torch.empty(4, 8, requires_grad=True)
        out = remat.checkpoint(lambda x: torch.nn.functional.gelu(layer(x)).sum())(x)
        out.backward()
    assert isinstance(out, FakeTensor) and out.fake_mode is mode
    assert isinstance(x.grad, FakeTensor) and x.grad.fake_mode is mode and x.grad.shape == (4, 8)
    assert isinstance(layer.weight.grad, FakeTensor) and layer.weight.grad.shape == (8, 8)


# --- a failed trace leaves the thread as it found it ----------------------------------------------

_LEFT_BEHIND: list[object] = []  # what the stale context below changes the thread's dispatch keys with


def _python_key_excluded() -> bool:
    return torch._C._dispatch_tls_local_exclude_set().has(torch._C.DispatchKey.Python)


def _fails_leaving_a_context_that_excludes_the_python_key(x: torch.Tensor) -> torch.Tensor:
    """As torch's own error paths can: a context suspended in the failing frame that, once the frame is
    freed, excludes the Python dispatch key and never includes it again."""

    def stale() -> object:
        try:
            yield
        finally:
            guard = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python))
            guard.__enter__()  # never exited
            _LEFT_BEHIND.append(guard)

    context = stale()
    next(context)  # type: ignore[call-overload]
    raise ValueError("the trace fails here")


def test_a_failed_trace_leaves_the_threads_dispatch_keys_as_it_found_them() -> None:
    # See NOTE [a failed trace leaves the thread's dispatch keys as it found them].
    try:
        with pytest.raises(ValueError, match="the trace fails here"):
            remat.checkpoint(_fails_leaving_a_context_that_excludes_the_python_key)(torch.ones(3, requires_grad=True))
        assert _LEFT_BEHIND  # the context ran, inside the failed trace
        assert not _python_key_excluded()
        remat.testing.assert_checkpoint_equivalent(lambda x: x.sin().exp(), torch.randn(3, dtype=DTYPE))
    finally:
        _LEFT_BEHIND.clear()


def test_after_quantile_fails_to_trace_under_forward_mode_the_next_trace_works() -> None:
    # `torch.quantile` traced for forward mode fails in torch's meta kernel of `lerp_`, whose error path
    # left the Python dispatch key excluded: every later trace failed ("you set no_dispatch()").
    x, q = torch.randn(3, 4, dtype=DTYPE), torch.tensor([0.2, 0.7], dtype=DTYPE)
    checkpointed = remat.checkpoint(lambda x: torch.quantile(x, q, dim=1))
    if _quirks.QUANTILE_COMPARES_TENSORS.applies(_torch.RELEASE):
        # There quantile compares two tensors (`aten.equal`), a value read in Python: refused, saying so
        # (docs/torch-versions.md).
        with pytest.raises(remat.TraceError, match=r"torch\.equal"):
            checkpointed(x.requires_grad_())
        assert not _python_key_excluded()
        return
    try:
        torch.func.jvp(checkpointed, (x,), (torch.ones_like(x),))
    except remat.TraceError as error:
        assert "lerp_" in str(error)
    assert not _python_key_excluded()
    remat.testing.assert_checkpoint_equivalent(lambda x: torch.quantile(x, q, dim=1), x.requires_grad_())


@pytest.mark.parametrize("where", ["input", "closed_over", "intermediate"])
def test_a_function_that_reads_a_data_pointer_is_a_trace_error(where: str) -> None:
    # Hugging Face's grouped_mm experts check their operands' alignment this way on torch 2.10 (test_moe).
    w = torch.randn(4, dtype=DTYPE)

    def fn(x: torch.Tensor) -> torch.Tensor:
        read = {"input": x, "closed_over": w, "intermediate": x * 2}[where]
        return x.sin() if read.data_ptr() % 16 == 0 else x.cos()

    with pytest.raises(remat.TraceError, match=r"memory address at .*test_trace\.py.*data_ptr"):
        remat.checkpoint(fn)(torch.randn(4, dtype=DTYPE, requires_grad=True))
    assert not _python_key_excluded()
