"""remat inside `torch.compile`: checkpointed functions and modules in a compiled model."""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import models
import optree
import pytest
import torch
from conftest import bytes_seen_by_saved_tensors_hooks
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

import remat
from remat import policies
from remat._torch import FAKE_DTYPE_ERRATA
from remat.testing import assert_checkpoint_equivalent

pytestmark = [
    # Warnings torch's compiler stack raises about itself.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]

# Inductor's first compile in a process on a cold machine costs some 13 s (its C++ prelude, its compile
# workers), whatever it compiles after: its tests run on one xdist worker, which pays it once.
INDUCTOR = pytest.mark.xdist_group("inductor")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


POLICIES = {
    "save_nothing": None,
    "dots_saveable": policies.dots_saveable,
    "save_everything": policies.save_everything,
    "per_call": policies.save_calls(0, 3, 9),
    "budget": policies.budget(fraction=0.5, exact=True),
}


def _mixed(block: models.GPT2Block) -> Callable[[torch.Tensor], torch.Tensor]:
    """A model around a checkpointed block, with work on both sides of it."""

    def model(x: torch.Tensor) -> torch.Tensor:
        return (block(x.tanh()) * 2).sin()

    return model


class SavedGraphs:
    """A capturing backend (AOTAutograd with the min-cut partitioner): the forward graphs it compiled."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(
            fw_compiler=self._forward,
            bw_compiler=lambda gm, _: make_boxed_func(gm),
            partition_fn=min_cut_rematerialization_partition,
        )

    def _forward(self, gm: torch.fx.GraphModule, _: Any) -> torch.fx.GraphModule:
        self.forward.append(gm)
        return make_boxed_func(gm)

    def saved_activation_bytes(self, n_outputs: int) -> int:
        """Bytes of the distinct tensors the forward graph hands to backward that are not
        graph inputs (parameters and the model's input), nor generator states."""
        (graph,) = self.forward
        output = next(n for n in graph.graph.nodes if n.op == "output")
        bases: dict[torch.fx.Node, int] = {}
        for node in output.args[0][n_outputs:]:
            base = _base(node)
            if base.op == "placeholder" or base.target is torch.ops.higher_order.run_and_save_rng_state:
                continue  # the compiler keeps a generator state to replay attention: see docs/compile.md
            bases[base] = _eager_nbytes(base)
        return sum(bases.values())


def _eager_nbytes(node: torch.fx.Node) -> int:
    """Bytes of the tensor `node` holds when it runs: its fake value's, in the dtype eager gives it
    where torch's fake kernel names another (`FAKE_DTYPE_ERRATA`, which remat's accounting follows)."""
    value = node.meta["val"]
    if node.target is operator.getitem and node.args[0].target in FAKE_DTYPE_ERRATA:
        call, index = node.args
        position, eager_dtype = FAKE_DTYPE_ERRATA[call.target]
        if index == position:
            arguments = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in call.args]
            return value.numel() * eager_dtype(*arguments).itemsize
    return value.untyped_storage().nbytes()


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node` views (an output of a multi-output call is its own)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False):
        node = node.args[0]  # type: ignore[assignment]
    if node.target is operator.getitem and node.args[0].target is torch.ops.higher_order.run_and_save_rng_state:
        return node.args[0]  # type: ignore[return-value]
    return node


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_checkpointed_block_in_a_compiled_model_has_eager_gradients(policy: Any) -> None:
    block = models.GPT2Block()
    checkpointed = remat.checkpoint(block, policy=policy)
    compiled = torch.compile(_mixed(checkpointed), backend="aot_eager", fullgraph=True)
    assert_checkpoint_equivalent(_mixed(block), models.gpt2_input(), checkpointed=compiled, params=block.parameters())
    assert checkpointed.cache_info().traces == 1  # remat's own trace gave the decisions


def some(*names: str) -> Any:
    """A parametrization over the named `POLICIES` (where all five would repeat the same paths)."""
    return pytest.mark.parametrize("policy", [POLICIES[name] for name in names], ids=names)


@pytest.mark.slow
@some("dots_saveable", "per_call", "budget")
def test_the_compiled_program_saves_what_remat_keeps(policy: Any) -> None:
    block = models.GPT2Block()
    checkpointed = remat.checkpoint(block, policy=policy)
    captured = SavedGraphs()
    x = models.gpt2_input()
    torch.compile(lambda x: checkpointed(x) * 2, backend=captured.backend, fullgraph=True)(x)
    assert captured.saved_activation_bytes(n_outputs=1) == remat.report(checkpointed, x).saved_bytes


def test_the_compiled_program_recomputes_what_remat_replays() -> None:
    block = models.GPT2Block()
    checkpointed = remat.checkpoint(block, policy=policies.dots_saveable)
    captured = SavedGraphs()
    x = models.gpt2_input()
    torch.compile(lambda x: checkpointed(x) * 2, backend=captured.backend, fullgraph=True)(x).sum().backward()
    (graph,) = captured.forward
    output = next(n for n in graph.graph.nodes if n.op == "output")
    saved_ops = {_base(n).target for n in output.args[0][1:]}
    assert torch.ops.aten.gelu.default not in saved_ops  # replayed, as remat replays it
    assert torch.ops.aten.addmm.default in saved_ops


@pytest.mark.slow
@INDUCTOR
def test_inductor_compiles_a_model_with_a_checkpointed_block() -> None:
    block = models.GPT2Block().float()
    checkpointed = remat.checkpoint(block, policy=policies.dots_saveable)
    x = models.gpt2_input().float().detach().requires_grad_()
    compiled = torch.compile(_mixed(checkpointed), fullgraph=True)
    out = compiled(x)
    grads = torch.autograd.grad(out.sum(), [x, *block.parameters()])
    expected = torch.autograd.grad(_mixed(block)(x).sum(), [x, *block.parameters()])
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=[pytest.mark.slow, INDUCTOR])])
def test_a_recomputed_dropout_draws_the_mask_forward_drew(backend: str) -> None:
    dropped = remat.checkpoint(lambda x: torch.nn.functional.dropout(x * 2, p=0.5).exp())
    x = torch.randn(1000, requires_grad=True)
    y = torch.compile(dropped, backend=backend, fullgraph=True)(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    kept = y != 1  # exp(0) where the mask dropped
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(grad, torch.where(kept, 4 * y, torch.zeros_like(y)))


def test_checkpoint_modules_train_under_torch_compile() -> None:
    def stack() -> torch.nn.Sequential:
        return torch.nn.Sequential(models.GPT2Block(seed=0), models.GPT2Block(seed=1))

    eager, model = stack(), stack()
    remat.checkpoint_modules(model, models.GPT2Block, policy=policies.dots_saveable)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):
        x = models.gpt2_input(seed=step)
        for m in (compiled, eager):
            m(x).square().mean().backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    infos = [block.forward.cache_info() for block in model]  # type: ignore[operator, union-attr]
    assert [(info.traces, info.shared) for info in infos] == [(1, 0), (0, 1)]  # the second block takes the first's


def test_nested_checkpoints_compile_with_each_policy() -> None:
    w = models.randn(8, 8)
    inner = remat.checkpoint(lambda x: (x @ w).sin() @ w, policy=policies.save_everything)
    outer = remat.checkpoint(lambda x: inner(x.cos()).exp() @ w, policy=policies.dots_saveable)
    x = models.randn(3, 8, seed=2)
    captured = SavedGraphs()
    compiled = torch.compile(outer, backend=captured.backend, fullgraph=True)
    assert_checkpoint_equivalent(lambda x: ((x.cos() @ w).sin() @ w).exp() @ w, x, checkpointed=compiled, params=[w])
    torch._dynamo.reset()
    captured = SavedGraphs()
    torch.compile(outer, backend=captured.backend, fullgraph=True)(x)
    assert captured.saved_activation_bytes(n_outputs=1) == remat.report(outer, x).saved_bytes


def test_dynamic_shapes_are_specialized_per_signature() -> None:
    w = models.randn(8, 8)
    checkpointed = remat.checkpoint(lambda x: (x @ w).sin() @ w, policy=policies.dots_saveable)
    compiled = torch.compile(lambda x: checkpointed(x).sum(), backend="aot_eager", dynamic=True)
    for rows in (3, 5, 7):
        x = models.randn(rows, 8, seed=rows)
        assert_checkpoint_equivalent(lambda x: ((x @ w).sin() @ w).sum(), x, checkpointed=compiled, params=[w])
    assert checkpointed.cache_info().traces == 3


@pytest.mark.slow  # compiles three batch sizes
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic=True"])
def test_a_compiled_module_called_with_new_batch_sizes_compiles_in_full(dynamic: bool | None) -> None:
    # Regression: once Dynamo made a size symbolic (automatically, at the second batch size, or with
    # `dynamic=True`), the region's signature was no constant ("Not a Python constant" under
    # `fullgraph=True`), nor was the checkpoint's key under `dynamic=True`; and the region then read
    # the block's float as a tensor (`_local_scalar_dense`), a call remat's trace has no counterpart of.
    block, eager = models.GPT2Block(d=16, heads=2), models.GPT2Block(d=16, heads=2)
    remat.checkpoint_modules(block, models.GPT2Block, policy=policies.dots_saveable)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for batch in (2, 3, 4):
        x = models.gpt2_input(batch=batch, d=16, seed=batch)
        for m in (compiled, eager):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        for got, want in zip(block.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)
    assert block.forward.cache_info().traces == 3  # type: ignore[operator, union-attr]  # one per shape


def test_a_graph_break_inside_the_function_keeps_the_gradients() -> None:
    w = models.randn(8, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = (x @ w).sin()
        torch._dynamo.graph_break()
        return (y @ w).cos()

    checkpointed = remat.checkpoint(fn, policy=policies.dots_saveable)
    compiled = torch.compile(lambda x: checkpointed(x.exp()), backend="aot_eager")
    assert_checkpoint_equivalent(lambda x: fn(x.exp()), models.randn(3, 8, seed=2), checkpointed=compiled, params=[w])


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


optree.register_pytree_node(
    Pair,
    lambda p: ((p.a, p.b), None, None),
    lambda _, children: Pair(*children),
    namespace=remat._core._pytree.NAMESPACE,
)


def test_arguments_dynamo_cannot_describe_run_remat_outside_the_graph() -> None:
    w = models.randn(8, 8)

    def fn(pair: Pair) -> torch.Tensor:
        return ((pair.a @ w).sin() * pair.b).sum()

    checkpointed = remat.checkpoint(fn, policy=policies.dots_saveable)

    def model(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return checkpointed(Pair(a.cos(), b))

    args = [models.randn(3, 8, seed=2), models.randn(3, 8, seed=3)]
    assert_checkpoint_equivalent(
        lambda a, b: fn(Pair(a.cos(), b)), *args, checkpointed=torch.compile(model, backend="aot_eager"), params=[w]
    )
    assert checkpointed.cache_info().traces == 1  # ran by remat itself, between two graphs
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, backend="aot_eager", fullgraph=True)(*args)


def _other_calls_under_dynamo(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that runs other calls while Dynamo traces it than while remat traces it."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():  # not while remat traces it
            return (x @ w).cos()
        return (x @ w).sin()

    return fn


class _OtherCallsUnderDynamo(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(models.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _other_calls_under_dynamo(self.w)(x)


@pytest.mark.parametrize("compile", [False, True], ids=["plain", "compile=True"])
def test_a_region_that_compiles_to_other_calls_is_an_error(compile: bool) -> None:
    # `compile=True` on the checkpoint is no way out: the model's compilation takes over.
    fn = _other_calls_under_dynamo(models.randn(8, 8))
    checkpointed = remat.checkpoint(fn, policy=policies.dots_saveable, compile=compile)
    with pytest.raises(Exception, match=r"aten\.cos\.default.*aten\.sin\.default") as info:
        torch.compile(checkpointed, backend="aot_eager", fullgraph=True)(models.randn(3, 8, seed=2))
    message = " ".join(str(info.value).split())
    assert "is_dynamo_compiling" in message  # the likely cause; then the ways out, each tried below
    assert "wrap the checkpointed function in `torch.compiler.disable`" in message
    assert "leave the model uncompiled and compile only remat's programs with `compile=True`" in message
    assert "Inside a compiled model `compile=True` changes nothing" in message


# The ways out that the error names (see NOTE [regions that differ from the trace]), each tried.


def test_a_region_that_differs_runs_through_torch_compiler_disable() -> None:
    w = models.randn(8, 8)
    fn = _other_calls_under_dynamo(w)
    checkpointed = remat.checkpoint(fn, policy=policies.dots_saveable)

    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.compiler.disable(checkpointed)(x.exp()) * 2

    x = models.randn(3, 8, seed=2)
    assert_checkpoint_equivalent(
        lambda x: fn(x.exp()) * 2, x, checkpointed=torch.compile(model, backend="aot_eager"), params=[w]
    )
    assert checkpointed.cache_info().traces == 1  # run by remat itself, between two compiled graphs
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):  # a graph break: not with fullgraph=True
        torch.compile(model, backend="aot_eager", fullgraph=True)(x)


def test_a_region_that_differs_runs_in_an_uncompiled_model_with_compiled_programs() -> None:
    w = models.randn(8, 8)
    fn = _other_calls_under_dynamo(w)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = remat.checkpoint(fn, policy=policies.dots_saveable, compile=counter)
    assert_checkpoint_equivalent(fn, models.randn(3, 8, seed=2), checkpointed=compiled, params=[w])
    assert counter.frame_count == 2  # remat's forward and backward programs, never the function

    model = torch.nn.Sequential(_OtherCallsUnderDynamo(), _OtherCallsUnderDynamo())
    reference = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    remat.checkpoint_modules(model, _OtherCallsUnderDynamo, policy=policies.dots_saveable, compile=counter)
    # Two copies of the parameters: each run fills its own, compared below.
    assert_checkpoint_equivalent(reference, models.randn(3, 8, seed=2), checkpointed=model, params=())
    torch.testing.assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])
    assert counter.frame_count == 2  # one forward and one backward program, which the second block shares


# --- remat's own programs compiled: remat.checkpoint(..., compile=...) ---------------------------------


@pytest.mark.slow
@some("save_nothing", "save_everything", "per_call")
def test_compiled_programs_give_eager_gradients_and_keep_what_the_policy_saves(policy: Any) -> None:
    block = models.GPT2Block()
    counter = CompileCounterWithBackend("aot_eager")
    checkpointed = remat.checkpoint(block, policy=policy, compile=counter)
    x = models.gpt2_input()
    assert_checkpoint_equivalent(block, x, checkpointed=checkpointed)
    assert counter.frame_count == 2  # the forward and the backward program, each compiled once
    kept = bytes_seen_by_saved_tensors_hooks(checkpointed, x, [x, *block.parameters()])
    assert kept == remat.report(checkpointed, x).saved_bytes
    assert kept == bytes_seen_by_saved_tensors_hooks(
        remat.checkpoint(block, policy=policy), x, [x, *block.parameters()]
    )


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=str)
def test_compiled_programs_write_through_views_and_fill_in_eagers_layout(policy: Any) -> None:
    # The programs' scatter and random-fill calls ask whether a tensor is batched under vmap, which
    # Dynamo cannot trace: inside a compiled program they must not ask (a warning, an error here).
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.sin()
        t[:, 0] = 1.0
        u = x.cos()
        u[1:].bernoulli_(0.5)
        return t * x + u

    x = models.randn(3, 4, seed=3)
    counter = CompileCounterWithBackend("aot_eager")
    assert_checkpoint_equivalent(fn, x, checkpointed=remat.checkpoint(fn, policy=policy, compile=counter))
    assert counter.frame_count >= 2  # the programs ran compiled


@pytest.mark.slow
@INDUCTOR
def test_inductor_compiles_remat_programs() -> None:
    block = models.GPT2Block().float()
    checkpointed = remat.checkpoint(block, policy=policies.dots_saveable, compile=True)
    x = models.gpt2_input().float().detach().requires_grad_()
    grads = torch.autograd.grad(checkpointed(x).sum(), [x, *block.parameters()])
    expected = torch.autograd.grad(block(x).sum(), [x, *block.parameters()])
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_compiled_programs_replay_the_numbers_random_calls_drew() -> None:
    w = models.randn(8, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout((x @ w).sin(), p=0.5) @ w

    x = models.randn(16, 8, seed=2)
    compiled = remat.checkpoint(fn, compile=CompileCounterWithBackend("aot_eager"))
    assert_checkpoint_equivalent(fn, x, checkpointed=compiled, params=[w], seed=0)  # the same seed before each


def test_under_torch_func_and_double_backward_the_programs_run_uncompiled() -> None:
    w = models.randn(8, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return ((x @ w).tanh() @ w).sin().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = remat.checkpoint(fn, policy=policies.dots_saveable, compile=counter)
    x = models.randn(3, 8, seed=2)
    torch.testing.assert_close(torch.func.grad(compiled)(x), torch.func.grad(fn)(x))
    compiled.cache_clear()
    torch._dynamo.reset()
    counter.frame_count = 0
    (grad,) = torch.autograd.grad(compiled(x), x, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), x)
    (grad_expected,) = torch.autograd.grad(fn(x), x, create_graph=True)
    torch.testing.assert_close(second, torch.autograd.grad(grad_expected.sum(), x)[0])
    assert counter.frame_count == 1  # the forward; backward ran uncompiled to be differentiated


def test_checkpoint_modules_compiles_each_selected_module() -> None:
    model = torch.nn.Sequential(models.GPT2Block(seed=0), models.GPT2Block(seed=1))
    reference = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    remat.checkpoint_modules(model, models.GPT2Block, policy=policies.dots_saveable, compile=counter)
    x = models.gpt2_input()
    # Two copies of the parameters: each run fills its own, compared below.
    assert_checkpoint_equivalent(reference, x, checkpointed=model, params=())
    torch.testing.assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])
    assert counter.frame_count == 2  # one forward and one backward program, which the second block shares


@pytest.mark.parametrize(
    ("compile", "error", "message"),
    [
        (3, TypeError, r"compile=3 is not understood.*backend"),
        ({"backend": "aot_eager", "fullgrahp": True}, ValueError, r"'fullgrahp'.*keys among"),
    ],
)
def test_a_bad_compile_argument_says_what_is_accepted(compile: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        remat.checkpoint(torch.sin, compile=compile)


def test_the_repr_shows_compilation() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    assert repr(remat.checkpoint(f, compile="aot_eager")) == (
        "remat.checkpoint(test_the_repr_shows_compilation.<locals>.f, policy=None, compile='aot_eager')"
    )
    assert repr(remat.checkpoint(f)) == "remat.checkpoint(test_the_repr_shows_compilation.<locals>.f, policy=None)"


def test_fullgraph_compilation_of_replayed_random_calls_is_an_error() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x.sin(), p=0.5).exp()

    x = models.randn(8, seed=2)
    with pytest.raises(ValueError, match=r"fullgraph.*random calls.*Leave fullgraph unset.*save_any_of\(policy, "):
        remat.checkpoint(fn, compile={"backend": "aot_eager", "fullgraph": True})(x)
    # The two ways out the error names, each tried (with the default policy, None).
    saved_dropout = policies.save_any_of(None, lambda call: call.is_random)
    for policy, options in [
        (None, {"backend": "aot_eager"}),
        (saved_dropout, {"backend": "aot_eager", "fullgraph": True}),
    ]:
        y = remat.checkpoint(fn, policy=policy, compile=options)(x)
        (grad,) = torch.autograd.grad(y.sum(), x)
        kept = y != 1
        torch.testing.assert_close(grad, torch.where(kept, 2 * y * x.cos(), torch.zeros_like(y)))


class _ResidualBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


@pytest.mark.slow
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.dots_saveable])
def test_batch_norm_blocks_train_inside_a_compiled_model(policy: Any) -> None:
    # The compiled region runs training-mode batch norm as an allocation and the in-place op; remat's
    # trace has the functional op: the two must line up (issue 18, part 3).
    torch.manual_seed(0)
    eager = torch.nn.Sequential(_ResidualBN(), _ResidualBN()).double()
    model = copy.deepcopy(eager)
    remat.checkpoint_modules(model, _ResidualBN, policy=policy)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):
        x = models.randn(2, 4, 6, 6, seed=step)
        x_eager = x.detach().clone().requires_grad_()
        out, out_eager = compiled(x), eager(x_eager)
        out.sum().backward()
        out_eager.sum().backward()
        torch.testing.assert_close(out, out_eager)
        torch.testing.assert_close(x.grad, x_eager.grad)
    for (name, ours), theirs in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
    for (name, ours), theirs in zip(model.named_buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(ours, theirs, msg=name)  # running statistics, batches tracked


def _reads_values(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for row in (x > 0).any(dim=1).nonzero():  # reads which rows: NOTE [values Python reads]
        row = row[0]
        out = out.index_add(0, row[None], x[row][None].sin())
    return out


def test_a_function_that_reads_values_inside_a_compiled_model_names_the_way_out() -> None:
    checkpointed = remat.checkpoint(_reads_values)
    x = models.randn(4, 3, seed=3)
    with pytest.raises(remat.TraceError, match=r"reads the value of a tensor in Python.*`torch.compiler.disable`"):
        torch.compile(lambda x: checkpointed(x * 2).sum(), backend="aot_eager")(x)
    torch._dynamo.reset()
    disabled = torch.compiler.disable(checkpointed)
    compiled = torch.compile(lambda x: disabled(x * 2).sum(), backend="aot_eager")
    assert_checkpoint_equivalent(lambda x: _reads_values(x * 2).sum(), x, checkpointed=compiled)
