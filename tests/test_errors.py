"""The wording of remat's errors: each names the API, says what was expected and what was got, and how to fix it."""

from __future__ import annotations

import logging
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
import transformers

import remat
import remat.testing
from remat import policies

aten = torch.ops.aten
DTYPE = torch.float64


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPE, requires_grad=True)


def _where(marker: str) -> str:
    """`test_errors.py:<line>` of this file's line that ends with `# @marker`, as a regex."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    (number,) = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# @{marker}")]
    return re.escape(f"{os.path.basename(__file__)}:{number}")


def matmul_sin_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a @ b).sin().sum()  # three calls: mm, sin, sum


def _matmul_args() -> tuple[torch.Tensor, torch.Tensor]:
    return _randn(2, 3), _randn(3, 4)


# --- what is wrapped ------------------------------------------------------------------------------


@pytest.mark.parametrize("not_a_function", [3, "abc", [lambda x: x]], ids=["int", "str", "list"])
def test_checkpoint_of_a_non_callable(not_a_function):
    with pytest.raises(TypeError, match=r"remat\.checkpoint: expected a function or nn\.Module") as info:
        remat.checkpoint(not_a_function)
    assert repr(not_a_function) in str(info.value)
    assert type(not_a_function).__qualname__ in str(info.value)


def test_decorator_factory_with_a_non_callable():
    with pytest.raises(TypeError, match=r"remat\.checkpoint: expected a function or nn\.Module.*got 42 of type int"):
        remat.checkpoint(policy=policies.save_everything)(42)


def test_trace_of_a_non_callable():
    with pytest.raises(TypeError, match=r"remat\.trace: expected a function or nn\.Module.*got 'sin' of type str"):
        remat.trace("sin", _randn(3))


# --- policies -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["save", None, 1, remat.Decision.SAVE.value], ids=["str", "none", "int", "enum-value"]
)
def test_policy_returning_a_non_decision(value):
    def policy(call: remat.Call) -> object:
        return value

    f = remat.checkpoint(matmul_sin_sum, policy=policy)
    with pytest.raises(TypeError) as info:
        f(*_matmul_args())
    message = str(info.value)
    assert message.startswith("remat.checkpoint: the policy")
    assert f"returned {value!r} (of type {type(value).__qualname__})" in message
    assert "aten.mm.default" in message  # the call it was asked about (the first)
    assert "#0" in message
    assert "remat.SAVE, remat.PACK, remat.OFFLOAD, remat.RECOMPUTE, True (save) or False (recompute)" in message


def test_policy_returning_a_non_decision_names_the_call_it_failed_on():
    def policy(call: remat.Call) -> object:
        return "save" if call.op is aten.sin.default else remat.RECOMPUTE

    with pytest.raises(TypeError, match=r"returned 'save' \(of type str\) for call #1 aten\.sin\.default"):
        remat.report(matmul_sin_sum, *_matmul_args(), policy=policy)


@pytest.mark.parametrize("policy", [3, "save_nothing", 2.5], ids=["int", "str", "float"])
def test_policy_of_a_wrong_type(policy):
    f = remat.checkpoint(matmul_sin_sum, policy=policy)
    with pytest.raises(TypeError, match=r"remat\.checkpoint: `policy` must be None, a callable") as info:
        f(*_matmul_args())
    assert f"got {policy!r} of type {type(policy).__qualname__}" in str(info.value)
    assert "plan(trace)" in str(info.value)


def test_planner_returning_the_wrong_number_of_decisions():
    class ShortPlanner:
        def plan(self, trace: remat.Trace) -> list[remat.Decision]:
            return [remat.SAVE] * (len(trace) - 1)

        def __repr__(self) -> str:
            return "ShortPlanner()"

    with pytest.raises(ValueError, match=r"the planner ShortPlanner\(\) returned 2 decisions for a trace of 3 calls"):
        remat.checkpoint(matmul_sin_sum, policy=ShortPlanner())(*_matmul_args())
    with pytest.raises(ValueError, match=r"exactly one decision per call"):
        remat.report(matmul_sin_sum, *_matmul_args(), policy=ShortPlanner())


def test_planner_returning_a_non_decision():
    class Planner:
        def plan(self, trace: remat.Trace) -> list[object]:
            return ["keep"] * len(trace)

    with pytest.raises(TypeError, match=r"returned 'keep' \(of type str\) for call #0 aten\.mm\.default"):
        remat.report(matmul_sin_sum, *_matmul_args(), policy=Planner())


@pytest.mark.parametrize("index", [3, 7, -4], ids=["one-past-end", "far", "negative"])
def test_save_calls_index_out_of_range(index):
    f = remat.checkpoint(matmul_sin_sum, policy=policies.save_calls(0, index))
    expected = rf"remat\.policies\.save_calls: index {index} is out of range for a trace of 3 calls"
    with pytest.raises(IndexError, match=expected):
        f(*_matmul_args())
    with pytest.raises(IndexError, match=expected):
        remat.report(matmul_sin_sum, *_matmul_args(), policy=policies.save_calls(index))
    with pytest.raises(IndexError, match=re.escape("remat.trace(fn, *args)")):
        remat.report(matmul_sin_sum, *_matmul_args(), policy=policies.save_calls(index))


@pytest.mark.parametrize("index", [1.5, "0", True], ids=["float", "str", "bool"])
def test_save_calls_with_a_non_integer(index):
    with pytest.raises(TypeError, match=r"remat\.policies\.save_calls: expected integer call indices, but got"):
        policies.save_calls(index)


@pytest.mark.parametrize(
    ("function", "suggestion"),
    [
        (torch.mm, "torch.ops.aten.mm"),
        (torch.sin, "torch.ops.aten.sin"),
        (torch.nn.functional.relu, "torch.ops.aten.relu"),
    ],
    ids=["mm", "sin", "functional-relu"],
)
def test_save_ops_with_a_python_function(function, suggestion):
    with pytest.raises(TypeError, match=r"remat\.policies\.save_ops: expected operators from `torch\.ops`") as info:
        policies.save_ops(aten.add.Tensor, function)
    assert f"`{suggestion}`" in str(info.value)
    assert type(function).__qualname__ in str(info.value)


def test_save_ops_with_a_string():
    with pytest.raises(TypeError, match=r"expected operators from `torch\.ops`.*but got 'aten\.mm' of type str"):
        policies.save_ops("aten.mm")


def test_cache_size_must_be_positive():
    with pytest.raises(ValueError, match=r"remat\.checkpoint: `cache_size` must be a positive integer, but got 0"):
        remat.checkpoint(matmul_sin_sum, cache_size=0)


# --- arguments and outputs ------------------------------------------------------------------------


def test_argument_leaf_that_is_an_object():
    f = remat.checkpoint(lambda inputs: inputs["x"].sin())
    with pytest.raises(TypeError, match=r"remat\.checkpoint: the argument at args\[0\]\['extra'\] is a object") as info:
        f({"x": _randn(3), "extra": object()})
    assert "neither a tensor nor a static value" in str(info.value)
    assert "register" in str(info.value)


def test_argument_leaf_that_is_a_numpy_array():
    np = pytest.importorskip("numpy")  # not a dependency of remat's tests
    f = remat.checkpoint(lambda x, inputs: x * inputs["scale"][1])
    with pytest.raises(TypeError, match=r"the argument at args\[1\]\['scale'\]\[1\] is a ndarray"):
        f(_randn(3), {"scale": [1.0, np.ones(3)]})


def test_keyword_argument_leaf_that_is_not_static():
    f = remat.checkpoint(lambda x, *, options: x.sin())
    with pytest.raises(TypeError, match=r"the argument at kwargs\['options'\]\[0\] is a object"):
        f(_randn(3), options=(object(), 2))


def test_trace_names_itself_for_a_bad_argument():
    with pytest.raises(TypeError, match=r"remat\.trace: the argument at args\[1\] is a object"):
        remat.trace(lambda x, y: x.sin(), _randn(3), object())


def test_transformers_cache_passed_to_a_checkpointed_layer_names_use_cache_false():
    model = models.hf_model("llama")
    layer = remat.checkpoint(model.model.layers[0])
    hidden = torch.randn(2, 8, 32, dtype=DTYPE, requires_grad=True)
    positions = model.model.rotary_emb(hidden, position_ids=torch.arange(8)[None])
    cache = transformers.DynamicCache(config=model.config)
    message = (
        r"remat\.checkpoint: the argument at kwargs\['cache'\] is a DynamicCache, a transformers key/value cache, "
        r"which remat cannot trace through"
    )
    with pytest.raises(TypeError, match=message) as info:
        layer(hidden, position_embeddings=positions, cache=cache, use_cache=True)
    assert "call the model with `use_cache=False`" in str(info.value)
    assert "remat.checkpoint_modules(model, transformers.GradientCheckpointingLayer" in str(info.value)


def test_checkpoint_modules_refuses_a_cache_that_already_holds_tokens():
    model = remat.checkpoint_modules(models.hf_model("llama"), transformers.GradientCheckpointingLayer)
    input_ids = models.hf_input_ids(seq=8)
    with torch.no_grad():  # no gradients: the layers run as written and fill the cache with a 5-token prefix
        cache = model(input_ids[:, :5], use_cache=True).cache
    with pytest.raises(
        ValueError,
        match=r"remat\.checkpoint_modules: LlamaDecoderLayer at 'model\.layers\.0' was called, while gradients are "
        r"recorded, with a key/value cache \(DynamicCache at kwargs\['cache'\]\) that already holds 5 token\(s\) "
        r"for this layer\.",
    ) as info:
        model(input_ids[:, 5:], cache=cache, labels=input_ids[:, 5:])
    assert "call the model with `use_cache=False` and no cache (`cache=None`)" in str(info.value)
    assert "run under `torch.no_grad()`" in str(info.value)


def test_checkpoint_modules_refuses_transformers_own_gradient_checkpointing():
    model = models.hf_model("llama")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    message = (
        r"remat\.checkpoint_modules: LlamaDecoderLayer at 'model\.layers\.0' has transformers' own gradient "
        r"checkpointing on \(`gradient_checkpointing=True` on LlamaDecoderLayer\), which would checkpoint it a "
        r"second time.*Turn it off on the model first with `model\.gradient_checkpointing_disable\(\)`"
    )
    with pytest.raises(ValueError, match=message):
        remat.checkpoint_modules(model, transformers.GradientCheckpointingLayer)


def test_checkpoint_modules_refuses_transformers_checkpointing_turned_on_afterwards():
    model = remat.checkpoint_modules(models.hf_model("llama"), transformers.GradientCheckpointingLayer)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    input_ids = models.hf_input_ids()
    with pytest.raises(ValueError, match=r"has transformers' own gradient checkpointing on"):
        model(input_ids, labels=input_ids, use_cache=False)


@pytest.mark.parametrize(
    ("returned", "where"),
    [(3, r"output"), ("done", r"output"), ((None, "done"), r"output\[1\]"), ({"loss": 1.5}, r"output\['loss'\]")],
    ids=["int", "str", "tuple-with-str", "dict-with-float"],
)
def test_output_that_is_not_a_tensor(returned, where):
    def fn(x: torch.Tensor) -> object:
        x.sin()
        return returned

    kind = type(optree_leaf(returned)).__qualname__
    expected = rf"remat\.checkpoint: the function returned an? {kind} at {where}, but a checkpointed function must return a tensor"
    with pytest.raises(TypeError, match=expected):
        remat.checkpoint(fn)(_randn(3))
    with pytest.raises(TypeError, match=expected):
        remat.trace(fn, _randn(3))


def optree_leaf(value: object) -> object:
    """The one non-None leaf of the small outputs above."""
    if isinstance(value, tuple):
        return value[1]
    if isinstance(value, dict):
        return next(iter(value.values()))
    return value


def test_output_tensor_next_to_a_string():
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, str]:
        return x.sin(), "label"

    with pytest.raises(TypeError, match=r"returned an? str at output\[1\]"):
        remat.checkpoint(fn)(_randn(3))


# --- values read in Python ---------------------------------------------------------------------------


def python_float_of_a_tensor(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.detach().max())  # @float


def branches_on_a_float(x: torch.Tensor) -> torch.Tensor:
    if x.detach().sum().item() > 0.5:  # @branch
        return x.sin()
    return x.cos()


@pytest.mark.parametrize(("fn", "marker"), [(python_float_of_a_tensor, "float"), (branches_on_a_float, "branch")])
def test_a_float_read_in_python_is_a_trace_error(fn, marker):
    for run in (lambda: remat.checkpoint(fn)(_randn(3)), lambda: remat.trace(fn, _randn(3))):
        with pytest.raises(remat.TraceError, match=r"reads a float value of a tensor in Python at ") as info:
            run()
        message = str(info.value)
        assert re.search(_where(marker), message), message
        assert f"`{fn.__qualname__}`" in message
        assert "torch.where" in message
    assert issubclass(remat.TraceError, RuntimeError)


def test_a_value_read_under_a_torch_func_transform_is_a_trace_error():
    class Gate(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            while x.norm() > 1:  # @while
                x = x / 2
            return x

    checkpointed = remat.checkpoint(Gate())
    with pytest.raises(
        remat.TraceError,
        match=r"reads the value of a tensor in Python at .*" + _where("while") + r".*under a torch.func transform",
    ):
        torch.func.vmap(checkpointed)(_randn(2, 3))


def test_compile_of_a_trace_specialized_on_values_is_refused():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin() if x.sum() > 0 else x.cos()

    with pytest.raises(remat.TraceError, match=r"compile=.*reads the value of a tensor in Python.*without `compile=`"):
        remat.checkpoint(fn, compile=True)(_randn(3))


def test_split_indices_given_as_a_tensor_are_a_trace_error():
    def fn(x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.tensor_split(x, indices)  # @split

    with pytest.raises(remat.TraceError, match=r"reads the values of a tensor argument to decide") as info:
        remat.checkpoint(fn)(_randn(6), torch.tensor([1, 4]))
    assert re.search(_where("split"), str(info.value))
    assert "Pass those values as a Python list" in str(info.value)


def test_seeding_the_global_generator_inside_is_a_trace_error():
    def fn(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(42)  # @seed
        return torch.nn.functional.dropout(x, 0.5)

    with pytest.raises(remat.TraceError, match=r"sets the state of the global random number generator") as info:
        remat.checkpoint(fn)(_randn(4))
    message = str(info.value)
    assert re.search(_where("seed"), message)
    assert "(`torch.manual_seed`)" in message
    assert "Seed before calling the checkpointed function" in message
    assert "a `torch.Generator` of your own (`generator=g`)" in message


def test_a_write_through_as_strided_under_vmap_or_forward_ad_is_refused_with_what_to_do():
    # torch's vmap has no batching rule for `as_strided_scatter`: a raw RuntimeError from inside torch.
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.sin()
        t.view(-1).as_strided((1, 1), (2, 2)).mul_(2.0)
        return t

    checkpointed = remat.checkpoint(fn)
    x = _randn(1, 2)
    torch.testing.assert_close(checkpointed(x), fn(x))  # outside vmap it runs
    with pytest.raises(
        NotImplementedError, match=r"under torch.func.vmap, the function makes a write through `as_strided`"
    ):
        torch.func.vmap(checkpointed)(_randn(3, 1, 2))
    # torch.func.jvp differentiates it exactly; remat's derivative under torch.autograd.forward_ad would not be.
    tangent = torch.randn_like(x)
    torch.testing.assert_close(
        torch.func.jvp(checkpointed, (x.detach(),), (tangent,)), torch.func.jvp(fn, (x.detach(),), (tangent,))
    )
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x.detach(), tangent)
        with pytest.raises(
            NotImplementedError,
            match=r"under torch.autograd.forward_ad, the function makes a write through `as_strided`.*"
            r"use torch.func.jvp \(or jacfwd\), where this works",
        ):
            checkpointed(dual)


def test_a_generator_made_inside_the_function_is_a_trace_error():
    # The trace kept the generator it was traced with, and drew other numbers than eager from the
    # second call on. NOTE [generators made inside the function]
    def fn(x: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return x * torch.rand(x.shape, generator=generator, dtype=x.dtype)

    with pytest.raises(remat.TraceError, match=r"draws from a `torch.Generator` that it creates itself") as info:
        remat.checkpoint(fn)(_randn(4))
    assert "Create (and seed) the generator outside the function" in str(info.value)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_argument_is_refused():
    sparse = torch.eye(3, dtype=DTYPE).to_sparse_csr()
    with pytest.raises(
        TypeError, match=r"the argument at args\[0\] is a tensor of layout torch\.sparse_csr, but remat"
    ):
        remat.checkpoint(lambda a, b: torch.sparse.mm(a, b))(sparse, _randn(3, 2))


def test_a_sparse_output_is_refused():
    with pytest.raises(TypeError, match=r"the function's output at output is a tensor of layout torch\.sparse_coo"):
        remat.checkpoint(lambda x: x.to_sparse())(_randn(3, 3))


def test_in_place_update_of_a_leaf_input_that_requires_grad_fails_as_in_eager():
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sin()

    message = r"a leaf Variable that requires grad (is being|has been) used in an in-place operation"
    with pytest.raises(RuntimeError, match=message):
        fn(_randn(3))
    with pytest.raises(RuntimeError, match=message):
        remat.checkpoint(fn)(_randn(3))


def test_in_place_update_of_a_parameter_is_a_trace_error():
    linear = torch.nn.Linear(3, 3).double()

    def fn(x: torch.Tensor) -> torch.Tensor:
        linear.weight.mul_(2)  # @in_place
        return linear(x)

    with pytest.raises(remat.TraceError, match=r"updates in place .* a leaf tensor that requires grad") as info:
        remat.checkpoint(fn)(_randn(2, 3))
    assert re.search(_where("in_place"), str(info.value))
    assert "clone" in str(info.value)


_INDEX = torch.tensor([[1, 0], [2, 1]])


@pytest.mark.parametrize(
    "update",
    [
        lambda t: t.scatter_(1, _INDEX, t[:, :2]),  # @reads_what_it_writes
        lambda t: t[:, 1:].add_(t[:, :2]),
        lambda t: t.index_add_(1, torch.tensor([0, 1]), t[:, 1:]),
    ],
    ids=["scatter_", "add_ of a shifted view", "index_add_"],
)
def test_an_in_place_update_from_a_source_sharing_its_memory_is_refused(update: Callable[..., Any]) -> None:
    # Eager reads elements it has already overwritten, in its kernel's order; the traced graph read every
    # source element first, and gave other numbers without a word. NOTE [in-place ops that read what they write]
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x * 1
        update(t)
        return t

    with pytest.raises(remat.TraceError, match=r"shares part of its memory .* Pass a copy as the source") as info:
        remat.checkpoint(fn)(_randn(2, 3))
    if "aten.scatter_" in str(info.value):
        assert re.search(_where("reads_what_it_writes"), str(info.value))

    def from_a_copy(x: torch.Tensor) -> torch.Tensor:  # the way out the message gives
        t = x * 1
        t.scatter_(1, _INDEX, t[:, :2].clone())
        t.add_(t)  # the same memory, as the same tensor: one element at a time
        return t

    remat.testing.assert_checkpoint_equivalent(from_a_copy, _randn(2, 3))


# --- names, module paths, costs ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [3, "", None, ("a",)], ids=["int", "empty", "none", "tuple"])
def test_tag_with_a_name_that_is_not_a_non_empty_string(name):
    with pytest.raises(TypeError, match=r"remat\.tag: expected a non-empty string as the name, but got"):
        remat.tag(_randn(3), name)


@pytest.mark.parametrize("make", [policies.save_tagged, policies.save_tagged_except], ids=["tagged", "all_but"])
def test_tag_policies_with_a_name_that_is_not_a_string(make):
    with pytest.raises(TypeError, match=r"expected the names given with `remat\.tag\(x, name\)` as non-empty strings"):
        make("attn", 3)


def test_save_modules_with_a_module_instead_of_its_path():
    with pytest.raises(TypeError, match=r"save_modules: expected qualified module names or glob patterns as strings"):
        policies.save_modules(torch.nn.Linear(2, 2))


def test_unknown_device_for_costs():
    with pytest.raises(ValueError, match=r"unknown device 'a100'; the named ones are \['cpu', 'h100', 'h200'\]"):
        policies.save_by_cost(1e-12, cost="roofline:a100")


@pytest.mark.parametrize("threshold", [0, -1.0, float("nan")], ids=["zero", "negative", "nan"])
def test_save_by_cost_with_a_threshold_that_is_not_positive(threshold):
    with pytest.raises(ValueError, match=r"expected a positive, finite threshold in seconds per byte"):
        policies.save_by_cost(threshold)


def test_from_sac_with_a_policy_function_returning_a_string():
    f = remat.checkpoint(matmul_sin_sum, policy=policies.from_sac(lambda ctx, op, *args, **kwargs: "save"))
    with pytest.raises(TypeError, match=r"returned 'save' \(of type str\) for call #0 aten\.mm\.default.*must return"):
        f(*_matmul_args())


def test_a_rebound_variable_that_is_no_longer_a_tensor():
    w = _randn(3)
    f = remat.checkpoint(lambda x: x * w)
    f(_randn(3))
    w = None  # read by the lambda
    with pytest.raises(RuntimeError, match=r"the variable `w` .* is NoneType now\. Call `\.cache_clear\(\)`"):
        f(_randn(3))


def test_an_op_that_refuses_its_inputs_while_tracing_is_named_with_its_line():
    def mismatched(a, b):
        return a @ b  # @mismatched

    with pytest.raises(
        remat.TraceError,
        match=r"could not trace `.*mismatched`: `aten.mm.default` at .*"
        + _where("mismatched")
        + r".* refused its inputs while tracing: a and b must have same reduction dim.*If eager runs this line "
        r"without error.*call the op outside the checkpointed function",
    ):
        remat.checkpoint(mismatched)(_randn(2, 3), _randn(4, 5))


def test_an_op_refusing_its_inputs_is_still_the_runtime_error_eager_raises():
    with pytest.raises(RuntimeError, match=r"same reduction dim") as info:
        remat.checkpoint(lambda x: x @ x)(_randn(2, 3))  # a shape mismatch, as eager would report it
    assert isinstance(info.value, remat.TraceError)


def test_an_op_refusing_its_inputs_is_raised_not_logged():
    # torch logs the fake kernel's error with its traceback before raising it; eager only raises.
    records: list[logging.LogRecord] = []
    collect = logging.Handler()
    collect.emit = records.append  # type: ignore[method-assign]
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addHandler(collect)
    try:
        with pytest.raises(remat.TraceError, match=r"same reduction dim"):
            remat.checkpoint(lambda x: x @ x)(_randn(2, 3))
    finally:
        fake_log.removeHandler(collect)
    assert not records
    assert fake_log.level == logging.NOTSET  # put back


def test_an_op_returning_a_python_value_of_tensors_is_a_trace_error():
    def fn(x: torch.Tensor) -> torch.Tensor:
        same = torch.equal(x, x.detach())  # @equal
        return x.sin() if same else x.cos()

    with pytest.raises(
        remat.TraceError, match=r"calls an op at .*" + _where("equal") + r".*such as `torch.equal`.*\(a == b\).all\(\)"
    ):
        remat.checkpoint(fn)(_randn(3))
