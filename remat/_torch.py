"""The one door to torch's internals: every private torch name remat uses, and what differs between releases.

remat stands on parts of torch that are not public API: `make_fx` and its
proxy mode, functionalization, fake tensors, functorch's interpreters, Dynamo,
autograd's tracing switches, the schemas of ops, and the text of some of
torch's errors. They change between releases without notice. Every other
module reaches them through the names here, so that a new torch release is
one module to read and fix; `tests/test_torch.py` imports each on the running
torch. Supported releases: `SUPPORTED` (see docs/torch-versions.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import CodeType, FrameType
from typing import Any, Protocol

import torch

# The minor releases remat is tested on (the floor in pyproject.toml, the newest on the registry).
SUPPORTED = ("2.10", "2.11", "2.12", "2.13", "2.14", "2.15")


def minor_release(version: str) -> str:
    """The minor release of a torch version: "2.11" for "2.11.0+cu130"."""
    return ".".join(version.split("+")[0].split(".")[:2])


RELEASE = minor_release(torch.__version__)  # of the running torch; `_quirks.Quirk.applies` takes it


def check_supported(version: str = torch.__version__) -> None:
    """Refuse to import on a torch release outside the tested range, saying which releases are."""
    if minor_release(version) not in SUPPORTED:
        raise ImportError(
            f"remat supports torch {SUPPORTED[0]} to {SUPPORTED[-1]} (each minor release tested), but torch "
            f"{version} is installed. Install a supported release, e.g. `pip install torch=={SUPPORTED[-1]}.*`."
        )


check_supported()  # before the private imports below, which an unsupported release may lack

import torch._functorch.config
import torch._ops
import torch._prims_common
import torch.utils.checkpoint
from torch._C._functorch import TransformType
from torch._functorch.autograd_function import CtxCustomSave, CtxWithSavedTensors
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters, temporarily_clear_interpreter_stack
from torch._functorch.vmap import unwrap_batched
from torch._prims_common import compute_elementwise_output_strides
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    run_fallback_kernel,
    unset_fake_temporarily,
)
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    ShapeEnv,
    free_unbacked_symbols,
    guard_scalar,
)
from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils._sympy.symbol import SymT, symbol_is_type

from . import _quirks

__all__ = [
    "COLLECTIVE_NAMESPACES",
    "LEAF_UPDATED_IN_PLACE",
    "RELEASE",
    "SAC_BYPASSES_HOOKS",
    "SUPPORTED",
    "UNTRACEABLE_COLLECTIVE",
    "BoxedCodeGen",
    "any_autocast_enabled",
    "elementwise_output_strides",
    "empty_in_memory_layout",
    "apply_without_binding",
    "CtxCustomSave",
    "CtxWithSavedTensors",
    "DATA_NOT_ALLOCATED",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "UnsupportedOperatorException",
    "FakeTensor",
    "FakeTensorMode",
    "guard_scalar",
    "grad_dtype_override",
    "FAKE_DTYPE_ERRATA",
    "FakeRankMismatch",
    "ShapeEnv",
    "UncheckedRealValuesFakeMode",
    "carry_real_values",
    "forget_pending_sizes",
    "insert_value_checks",
    "is_custom_op",
    "is_custom_op_autograd",
    "is_custom_function_node",
    "accumulated_leaf",
    "autograd_node_inputs",
    "autograd_node_order",
    "real_values_traced",
    "sdp_priority_order",
    "selective_checkpoint_context",
    "size_bound",
    "STRICT_FAKE_KERNELS",
    "FunctionalTensor",
    "FunctionalTensorMode",
    "GuardOnDataDependentSymNode",
    "HigherOrderOperator",
    "flex_attention_as_one_call",
    "inherit_higher_order_rules",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "TorchFunctionMode",
    "TransformType",
    "batched_level",
    "check_supported",
    "default_generator",
    "dense_without_overlap",
    "disable_current_modes",
    "forward_ad_level",
    "forward_grad_enabled",
    "from_functional",
    "functorch_active",
    "grad_transform_active",
    "is_saved_value_modified",
    "functorch_interpreters",
    "get_proxy_mode",
    "has_data_mutation",
    "import_jvp_decompositions",
    "FunctionApplications",
    "function_applications_noted",
    "drawn_per_example_but_unbatched",
    "batched_at",
    "functorch_level",
    "unbatched_at",
    "unwrap_dead_wrappers",
    "has_no_derivative",
    "decomposition_of",
    "inplace_requires_grad_allowed",
    "innermost",
    "is_user_code",
    "is_functorch_wrapped",
    "make_dual",
    "make_fx",
    "node_behind",
    "runs_per_example_under_vmap",
    "LazyGraphModule",
    "lazy_graph_modules",
    "outside_compilers_tracing",
    "memory_layout",
    "op_schema",
    "overload_name",
    "preserved_dispatch_keys",
    "release_saved_tensors",
    "run_real_kernel_on_zeros",
    "saved_tensors_hooks_tracing",
    "source_and_scope",
    "sync",
    "tangent_of",
    "temporarily_clear_interpreter_stack",
    "random_calls_traced",
    "trace_call",
    "tree_leaves",
    "tree_map_only",
    "under_torch_func",
    "unset_fake_temporarily",
    "unwrap_batched",
    "unwrap_level",
    "version_counter",
    "vmap_levels",
]

aten = torch.ops.aten

_RELEASE = tuple(map(int, RELEASE.split(".")))

# --- ops -------------------------------------------------------------------------------------------

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
HigherOrderOperator = torch._ops.HigherOrderOperator


def op_schema(op: Any) -> Any:
    """The `torch._C.FunctionSchema` of an op overload (None for other callables)."""
    return getattr(op, "_schema", None)


def overload_name(op: Any) -> str:
    return op._overloadname  # type: ignore[no-any-return]


def is_custom_op(op: Any) -> bool:
    """Whether `op` is a `torch.library` custom op (one call, differentiated by its own rule): an op of a
    namespace other than aten's and prims'."""
    return getattr(op, "namespace", None) not in (None, "aten", "prims")


# The namespaces of torch's functional collectives and their waits.
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


# --- make_fx -------------------------------------------------------------------------------------------

# A GraphModule generates and compiles its Python code as it is built; a lazy one, when first called
# (or its code read). remat never calls the joint graph make_fx records, and calls a pure forward only
# for higher-order derivatives and forward mode: building their code took a tenth of a small trace.


def lazy_graph_modules() -> contextlib.AbstractContextManager[None]:
    """Inside this context make_fx builds `LazyGraphModule`s."""
    return _use_lazy_graph_module(True)


# Inside a compile, torch's tracing context names the compiler's fake mode. make_fx there takes that mode
# (since torch 2.11), or checks that the inputs' mode is it and fails (2.10): remat's trace, in its own
# mode, is made outside the context.
def outside_compilers_tracing() -> contextlib.AbstractContextManager[Any]:
    """A context in which make_fx traces in the fake mode of its inputs, even inside a compile."""
    return torch._guards.tracing(None)


# Since torch 2.13 make_fx records a `torch.Generator` argument as a `get_attr` constant of the
# graph (an "opaque reference"); before, it raises NotImplementedError. On those releases the call
# is traced with `generator=None`, and its generator is then put back on the node as such a constant, so that
# every later step sees one graph on every release. Traced with values, the real kernel then draws
# from the device's default generator, which is first set to the user's generator's state, so that it
# draws the user's numbers and advances the user's generator as eager does.
_TRACES_GENERATORS = _RELEASE >= (2, 13)


def trace_call(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run the op `func` under make_fx's proxy mode, recording its `generator=` argument if any."""
    generator = kwargs.get("generator")
    if generator is None or _TRACES_GENERATORS:
        return func(*args, **kwargs)
    with _default_standing_in_for(generator):
        result, random_nodes = random_calls_traced(lambda: func(*args, **{**kwargs, "generator": None}))
    tracer: Any = get_proxy_mode().tracer  # type: ignore[union-attr]
    name = tracer.get_fresh_qualname("_generator")
    setattr(tracer.root, name, generator)
    for node in random_nodes:
        with tracer.graph.inserting_before(node):
            node.kwargs = {**node.kwargs, "generator": tracer.graph.get_attr(name)}
    return result


def default_generator(device: torch.device) -> torch.Generator:
    """The generator a random call on `device` draws from when given none."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        if not torch.cuda.is_available():  # fake CUDA tensors, on a machine without a GPU
            return _CUDA_GENERATOR_STAND_INS.setdefault(device.index or 0, _CudaGeneratorStandIn())  # type: ignore[return-value]
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise NotImplementedError(
        f"remat.checkpoint: replaying a random call on a {device.type!r} device is not supported; save it with a "
        "policy (e.g. `policy | (lambda call: call.is_random)`)."
    )


class _CudaGeneratorStandIn:
    """A CUDA generator's state where torch has no CUDA generator (a CUDA build on a machine without a GPU):
    random calls on fake CUDA tensors draw nothing, but remat keeps and restores their generator's state as
    on a GPU, a 16-byte Philox state (seed and offset). The state is made as the generator makes it, outside
    the dispatcher, so that a probe step does not count it as device memory."""

    def __init__(self) -> None:
        self._state = torch.frombuffer(bytearray(16), dtype=torch.uint8)

    def get_state(self) -> torch.Tensor:
        return self._state

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state


_CUDA_GENERATOR_STAND_INS: dict[int, _CudaGeneratorStandIn] = {}


@contextlib.contextmanager
def _default_standing_in_for(generator: torch.Generator) -> Iterator[None]:
    """While active, the default generator of `generator`'s device draws `generator`'s numbers; after,
    `generator` is where those draws left it, and the default generator is as before."""
    default = default_generator(generator.device)
    own = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(default.get_state())
        default.set_state(own)


def random_calls_traced(run: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """`run()`'s result, and the nodes of random calls it added to the graph make_fx is tracing."""
    graph = get_proxy_mode().tracer.graph  # type: ignore[union-attr]
    last = next(iter(reversed(graph.nodes)))
    result = run()
    added = []
    for node in reversed(graph.nodes):
        if node is last:
            break
        added.append(node)
    random = [n for n in reversed(added) if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    return result, random


# The boxed calling convention: a program takes one list of its inputs and empties it once it has
# read them, so that each input can be freed at its last use inside the program.
BoxedCodeGen = torch.fx.graph._BoxedCodeGen


# --- fake tensors ---------------------------------------------------------------------------------------

# Outputs whose dtype a fake (meta) kernel gets wrong on some releases: op -> (output position, the
# dtype eager gives it, from the op's arguments). A fake mode corrects them, so that the bytes a trace
# accounts for are the bytes eager keeps.
FAKE_DTYPE_ERRATA: dict[Any, tuple[int, Any]] = {}
if _RELEASE < (2, 13):
    # The CPU attention kernel keeps its logsumexp in the computation dtype (float64 for float64
    # inputs); its meta kernel said float32 until 2.13.
    FAKE_DTYPE_ERRATA[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default] = (
        1,
        lambda query, *args, **kwargs: torch.float64 if query.dtype == torch.float64 else torch.float32,
    )

# Ops whose fake kernel refuses inputs that their real kernel accepts off CUDA: `_grouped_mm`'s fake
# kernel checks what the CUDA kernel needs (bfloat16 only), while the CPU kernel also takes float32
# and float16, which mixture-of-experts layers on CPU use. A fake mode finds their outputs with
# `run_real_kernel_on_zeros` instead.
STRICT_FAKE_KERNELS = frozenset({torch.ops.aten._grouped_mm.default})


def elementwise_output_strides(operands: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The strides TensorIterator gives the output of an elementwise op of `operands` (broadcast
    together), led by the first: what eager's CPU kernels give it."""
    metas = [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta") for o in operands]
    shape = torch.broadcast_shapes(*(m.shape for m in metas))
    return tuple(compute_elementwise_output_strides(*(m.expand(shape) for m in metas)))


# --- data-dependent sizes -------------------------------------------------------------------------
# A fake mode with a `ShapeEnv` gives an op whose output size depends on values (`nonzero`, a boolean
# mask) a size that is a fresh symbol (an "unbacked" SymInt), with the range torch knows for it.


def forget_pending_sizes(fake_mode: FakeTensorMode) -> None:
    """Forget the sizes a run of `fn` outside make_fx created, and what it learned of them: make_fx
    checks that each new symbol comes out of the op being traced, and would find these."""
    if fake_mode.shape_env is not None:
        fake_mode.shape_env.pending_fresh_unbacked_symbols.clear()
        fake_mode.shape_env.deferred_runtime_asserts.clear()
        _real_values(fake_mode.shape_env).clear()


def _real_values(shape_env: ShapeEnv) -> dict[Any, Any]:
    """The real value of each data-dependent size (and bool read) a trace with real values made."""
    if _RELEASE < (2, 11):
        return shape_env.unbacked_var_to_val  # type: ignore[attr-defined,no-any-return]
    return shape_env.real_tensor_prop_unbacked_vals


@contextlib.contextmanager
def real_values_traced() -> Iterator[None]:
    """Fake modes made inside carry a real tensor beside each fake one and run every op on both, so
    that a data-dependent value Python reads (`bool(t)`, the length of `nonzero`'s output) takes its
    real value, noted as a runtime assertion of the `ShapeEnv` (torch's "propagate real tensors", made
    for torch.export's draft mode). Fake inputs get copies of the real data: nothing real is updated.
    Torch logs each such value as a warning; here they are expected, and are not logged."""
    with (
        logged_only_from("torch.fx.experimental.symbolic_shapes", logging.ERROR),
        torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True),
    ):
        yield


def fake_kernel_errors_unlogged() -> contextlib.AbstractContextManager[None]:
    """A fake kernel refusing its inputs is logged by torch with its traceback before it is raised; inside,
    it is only raised (remat raises it with the line of `fn` that called the op)."""
    return logged_only_from("torch._subclasses.fake_tensor", logging.CRITICAL)


@contextlib.contextmanager
def logged_only_from(logger_name: str, level: int) -> Iterator[None]:
    """Records of torch's logger `logger_name` below `level` are dropped inside."""
    logger = logging.getLogger(logger_name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


# NOTE [squeezing a size that depends on data]
# `squeeze` drops a dimension only where its size is 1, and a fake kernel asked
# about a data-dependent size (a symbol) assumes it is not 1. Traced with real
# values beside the fake ones, the two then disagree on the rank: iterating over
# `t.nonzero()` (torch's `unbind` squeezes each slice) when exactly one element
# is nonzero gives fake rows of shape (u0, 1) and real rows of shape (1,), and a
# later op fails deep inside torch; traced without values, the trace is wrong
# for every call where the size is 1. So a squeeze of such a dimension reads the
# size, as Python reading a value does (remat traces again with the values, and
# checks on every call whether the size is 1), and where it is 1 the fake is made
# by `select`, the view squeeze is then. (`squeeze_`'s own kernel reads the size
# too, but fails where torch logs an error: it is read before.) Any other op whose
# fake and real outputs differ in rank is refused.
_SQUEEZES = frozenset({aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims})
_SQUEEZES_IN_PLACE = frozenset({aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims})


class FakeRankMismatch(RuntimeError):
    """Traced with real values, an op's fake and real kernels gave outputs of different ranks."""

    def __init__(self, op: Any, fake_ranks: Sequence[int], real_ranks: Sequence[int]):
        super().__init__(f"{op}: fake ranks {list(fake_ranks)}, real ranks {list(real_ranks)}")
        self.op, self.fake_ranks, self.real_ranks = op, tuple(fake_ranks), tuple(real_ranks)


class UncheckedRealValuesFakeMode(FakeTensorMode):
    """A fake mode that, running real kernels beside the fake ones (`real_values_traced`), does not
    cross-check their outputs: torch's check compares sizes and storage offsets with `==`, which
    would tie every data-dependent size (the tokens each expert gets) to its value in this run.
    It checks ranks only, and squeezes as the real kernel does (NOTE [squeezing a size that depends
    on data])."""

    def __enter__(self) -> Any:
        inherit_higher_order_rules(type(self))
        return super().__enter__()

    def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _SQUEEZES and not kwargs:
            return self._squeeze(func, types, *args)
        if func in _SQUEEZES_IN_PLACE and not kwargs:
            _data_dependent_ones(*args)  # read here rather than inside torch's kernel, which logs an error
        if (
            self.propagate_real_tensors and func in _FAKE_KERNEL_IGNORES_MASK
        ):  # NOTE [backward kernels that skip outputs]
            args = _masked_as_the_fake_kernel(func, args)
        return super().dispatch(func, types, args, kwargs)

    def _squeeze(self, func: Any, types: Any, tensor: Any, dims: Any = None) -> Any:
        wanted, ones = _data_dependent_ones(tensor, dims)
        if not ones:
            return super().dispatch(func, types, (tensor,) if dims is None else (tensor, dims), {})
        out = tensor
        for d in reversed(ones):
            out = super().dispatch(aten.select.int, types, (out, d, 0), {})
        rest = [d - sum(one < d for one in ones) for d in wanted if d not in ones]
        return super().dispatch(aten.squeeze.dims, types, (out, rest), {}) if rest else out

    def _maybe_infer_fake_kernel_from_pytree_out(  # type: ignore[no-untyped-def]
        self, func, fake_in, real_in, fake_out, real_out
    ):
        fake_ranks = [t.dim() for t in pytree.tree_leaves(fake_out) if isinstance(t, torch.Tensor)]
        real_ranks = [t.dim() for t in pytree.tree_leaves(real_out) if isinstance(t, torch.Tensor)]
        if fake_ranks != real_ranks:
            raise FakeRankMismatch(func, fake_ranks, real_ranks)
        return fake_out


# NOTE [backward kernels that skip outputs]
# A backward kernel with an `output_mask` leaves the outputs it is not asked for undefined (None),
# and its fake kernel should too. Batch norm's gives the input's gradient anyway: in `BatchNorm1d`
# on an input that needs no grad, traced with real values, torch pairs the fake output with the
# missing real one and fails. For such an op the fake mode asks the real kernel for those outputs
# as well (the traced call keeps its own mask): an extra gradient, computed while tracing only.
# op -> (the position of `output_mask`, the outputs its fake kernel gives whatever the mask says)
_FAKE_KERNEL_IGNORES_MASK = _quirks.FAKE_BATCH_NORM_BACKWARD_IGNORES_MASK.table


def _masked_as_the_fake_kernel(func: Any, args: Sequence[Any]) -> Sequence[Any]:
    """`args` with `output_mask` asking for every output the fake kernel of `func` gives."""
    position, filled = _FAKE_KERNEL_IGNORES_MASK[func]
    if len(args) <= position:
        return args
    mask = list(args[position])
    if all(mask[i] for i in filled):
        return args
    for i in filled:
        mask[i] = True
    return (*args[:position], mask, *args[position + 1 :])


def _data_dependent_ones(tensor: Any, dims: Any = None) -> tuple[list[int], list[int]]:
    """The dimensions a squeeze of `tensor` over `dims` asks about, and those of them whose size depends
    on data and is 1. `bool(size == 1)` reads the size: traced without values it raises
    GuardOnDataDependentSymNode, and with values it takes the real one, which the trace then checks."""
    rank = tensor.dim()
    asked = range(rank) if dims is None else [dims] if isinstance(dims, int) else dims
    wanted = sorted({d % rank for d in asked}) if rank else []
    ones = [d for d in wanted if _depends_on_data(tensor.shape[d]) and bool(tensor.shape[d] == 1)]
    return wanted, ones


def _depends_on_data(size: Any) -> bool:
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size))


def carry_real_values(fakes: Sequence[Any], originals: Sequence[Any]) -> None:
    """Give make_fx's fake inputs the real data of the fakes they were made from (make_fx makes its
    own, with fresh real tensors of no particular value)."""
    for fake, original in zip(fakes, originals, strict=True):
        real = getattr(original, "real_tensor", None)
        if real is not None:
            fake.real_tensor = real


def insert_value_checks(graph_module: Any, shape_env: ShapeEnv) -> tuple[set[str], dict[str, str | None]]:
    """Put the runtime assertions `shape_env` noted into the graph, each right after the node that
    binds its symbols (as `aten._assert_scalar` calls). Return the names of the int symbols they are
    about, and of the float ones with the user's line that made each: torch's pass leaves out
    assertions about floats (or, before 2.13, fails on them: with floats it is not run), and about
    symbols no node of the graph binds."""
    bool_reads = _unasserted_bool_reads(shape_env)
    ints: set[str] = {str(s) for read in bool_reads for s in read.free_symbols}
    floats: dict[str, str | None] = {}
    for asserts in shape_env.deferred_runtime_asserts.values():
        for assertion in asserts:
            for symbol in assertion.expr.free_symbols:
                if symbol_is_type(symbol, SymT.UNBACKED_FLOAT):
                    floats[str(symbol)] = _user_line(shape_env.var_to_stack.get(symbol))
                else:
                    ints.add(str(symbol))
    if not floats:
        insert_deferred_runtime_asserts(graph_module, shape_env, "remat")
        _check_bool_reads(graph_module.graph, bool_reads)
    return ints, floats


def _unasserted_bool_reads(shape_env: ShapeEnv) -> dict[Any, bool]:
    """The bools Python read (`if t:`) that no runtime assertion of `shape_env` is about, with the value
    each read: before 2.12 torch takes a true read for statically known and asserts nothing (the trace
    would hold for any value, unchecked). A bool read is a `SymBool`, `Eq(u, 1)` over an int symbol, whose
    real value torch keeps under that expression."""
    asserted = {
        s for asserts in shape_env.deferred_runtime_asserts.values() for a in asserts for s in a.expr.free_symbols
    }
    return {
        read: bool(value)
        for read, value in _real_values(shape_env).items()
        if read.is_Relational and read.free_symbols and not read.free_symbols & asserted
    }


def _check_bool_reads(graph: Any, reads: dict[Any, bool]) -> None:
    """A check after each node that makes one of `reads`, that it reads the value it read when traced."""
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if isinstance(value, torch.SymBool) and value.node.expr in reads:
            expected = reads[value.node.expr]
            with graph.inserting_after(node):
                same = graph.call_function(operator.eq, (node, expected))
            with graph.inserting_after(same):
                graph.call_function(
                    aten._assert_scalar.default,
                    (same, f"Runtime assertion failed for expression {value.node.expr} == {expected} on node '{node}'"),
                )


def _user_line(stack: Any) -> str | None:
    frames = [] if stack is None else [f for f in stack.summary() if is_user_code(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


UNBOUNDED_SIZE = 8192  # torch.compile's inductor assumes this size for a data-dependent one


def size_bound(size: Any) -> int:
    """An int size as it is; a data-dependent one as the largest value it can take (`nonzero` of a
    tensor of n elements: n), or where nothing bounds it (a size made with `.item()`), as the size
    torch.compile's cost model assumes for such sizes."""
    if isinstance(size, int):
        return size
    node = size.node
    bound = node.shape_env.bound_sympy(node.expr).upper
    if not bound.is_Integer:  # `int_oo`, torch's infinity
        return UNBOUNDED_SIZE
    return int(bound)


def run_real_kernel_on_zeros(fake_mode: FakeTensorMode, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Fake outputs of `func(*args, **kwargs)` found by running its real kernel on zeros of the fake
    inputs' metadata (what a fake mode does for an op that has no fake kernel at all)."""
    flat_args, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    refusal = RuntimeError(f"{func} cannot run on zeros in place of its fake inputs")
    return run_fallback_kernel(fake_mode, func, flat_args, spec, refusal)


# --- functionalization -----------------------------------------------------------------------------------


def sync(functional: torch.Tensor) -> None:
    """Apply the updates pending on a FunctionalTensor (of its views' bases)."""
    torch._sync(functional)


def has_data_mutation(functional: Any) -> bool:
    """Whether the data of a FunctionalTensor was updated in place since it was wrapped."""
    return bool(torch._functionalize_has_data_mutation(functional.elem))  # type: ignore[attr-defined]


@functools.cache
def runs_per_example_under_vmap(name: str) -> bool:
    """Whether vmap runs the aten op `name` example by example (its boxed fallback): a composite op with
    neither a batching rule nor a decomposition or randomness rule registered for vmap. See NOTE [ops vmap
    runs example by example] in `remat/_noting_modes.py`."""
    qualified = f"aten::{name}"
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        return has_kernel(qualified, "CompositeImplicitAutograd") and not any(
            has_kernel(qualified, key)
            for key in ("FuncTorchBatched", "FuncTorchBatchedDecomposition", "FuncTorchVmapMode")
        )
    except RuntimeError:  # no such op
        return False


def node_behind(functional: Any) -> Any:
    """The graph node make_fx recorded for the current value of a FunctionalTensor (before its pending
    updates are applied: no sync), or None where it recorded none."""
    mode = get_proxy_mode()
    if mode is None or not isinstance(functional, FunctionalTensor):
        return None
    proxy = get_proxy_slot(torch._from_functional_tensor(functional.elem), mode.tracer, None)
    return None if proxy is None else proxy.proxy.node


def from_functional(functional: Any) -> torch.Tensor:
    """The traced tensor behind a FunctionalTensor (its updates applied first: `sync`)."""
    return torch._from_functional_tensor(functional.elem)


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's version counter, bumped by every in-place update."""
    return tensor._version


# NOTE [gradients in another dtype than the tensor's]
# A leaf may ask autograd for its gradient in a dtype of its own (`tensor.grad_dtype = torch.float32`
# on a bfloat16 parameter, or None: any dtype): the engine then casts the gradient it gets to that
# dtype, not to the tensor's, or leaves it as computed. FSDP2's mixed precision sets it on every
# unsharded parameter on torch 2.15 (the reduce dtype), so that a float32 gradient computed from a
# bfloat16 parameter reaches the reduction unrounded. remat's backward is traced, and the cast the
# engine makes at the end is traced with it: the traced inputs take the real ones' `grad_dtype`, and it
# is part of the signature.


def grad_dtype_override(tensor: torch.Tensor) -> tuple[bool, torch.dtype | None]:
    """(whether `tensor` has a `grad_dtype` of its own, which). See NOTE [gradients in another dtype
    than the tensor's]."""
    if not tensor.is_leaf:  # only a leaf has one
        return False, None
    try:
        grad_dtype = tensor.grad_dtype
        # 2.15 says whether it was set; before, an unset `grad_dtype` is the tensor's dtype.
        overridden = getattr(tensor, "_has_grad_dtype_override", grad_dtype != tensor.dtype)
    except (AttributeError, RuntimeError):  # a release without it, or a tensor that cannot say
        return False, None
    return (True, grad_dtype) if overridden else (False, None)


# --- torch.func (functorch) -----------------------------------------------------------------------------


def any_autocast_enabled() -> bool:
    """Whether autocast is on for any device: one call where asking each device is two per device."""
    return bool(torch._C._is_any_autocast_enabled())


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, ...) is running."""
    return bool(torch._C._are_functorch_transforms_active())


def is_saved_value_modified(error: RuntimeError) -> bool:
    """Whether autograd raised `error` because a value a gradient formula saved was updated in place since."""
    return "modified by an inplace operation" in str(error)


def grad_transform_active() -> bool:
    """Whether a torch.func reverse-mode transform (`grad`, `vjp`, `jacrev`, `hessian`) is running: its
    backward runs in grad mode (`create_graph=True`)."""
    return functorch_active() and any(i.key() == TransformType.Grad for i in functorch_interpreters())


def functorch_interpreters() -> list[Any]:
    return list(retrieve_all_functorch_interpreters())


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(tensor))


def unwrap_level(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor one torch.func level below a wrapped one."""
    return torch._C._functorch.get_unwrapped(tensor)


def innermost(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor under every torch.func wrapper."""
    while is_functorch_wrapped(tensor):
        tensor = unwrap_level(tensor)
    return tensor


def under_torch_func(tensor: torch.Tensor) -> bool:
    """Whether a program meets `tensor` wrapped by a torch.func transform. Never inside a graph Dynamo
    compiles (`compile=`), which cannot trace the question, and in which no tensor is wrapped."""
    return not torch.compiler.is_compiling() and is_functorch_wrapped(tensor)


def memory_layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Where each `vmap` level keeps its batch dimension, and the shape and strides of the tensor under
    every torch.func wrapper: what decides its layout in memory."""
    batch_dims = []
    while under_torch_func(tensor):
        if torch._C._functorch.is_batchedtensor(tensor):
            batch_dims.append(torch._C._functorch.maybe_get_bdim(tensor))
        tensor = unwrap_level(tensor)
    return tuple(batch_dims), tuple(tensor.shape), tensor.stride()


def empty_in_memory_layout(tensor: torch.Tensor) -> torch.Tensor | None:
    """An uninitialized tensor with the strides of `tensor`, batched as it is under each `vmap` (every
    batch dimension where `tensor` keeps it in memory) and at the gradient levels it is at, so that an
    in-place op may write into it there; None for a tensor under other torch.func wrappers."""
    functorch = torch._C._functorch
    if not is_functorch_wrapped(tensor):
        with torch._C._DisableFuncTorch():  # a plain tensor: under a gradient level, a factory's is wrapped
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    empty = empty_in_memory_layout(unwrap_level(tensor))
    if empty is None:
        return None
    level = functorch.maybe_get_level(tensor)
    if functorch.is_batchedtensor(tensor):
        return functorch._add_batch_dim(empty, functorch.maybe_get_bdim(tensor), level)
    if functorch.is_gradtrackingtensor(tensor):
        return functorch._wrap_for_grad(empty, level)
    return None


def batched_level(ctx: Any) -> int:
    """The vmap level of the ctx `setup_context` gets under vmap (a `CtxCustomSave`)."""
    return ctx._pt_current_level  # type: ignore[no-any-return]


def preserved_dispatch_keys() -> Any:
    """A guard that puts this thread's included and excluded dispatch keys back as they were when it was
    made, when it exits."""
    return torch._C._PreserveDispatchKeyGuard()


@contextlib.contextmanager
def inplace_requires_grad_allowed() -> Iterator[None]:
    """Let `requires_grad_()` be called under torch.func transforms, which forbid it by default."""
    allowed = torch._C._functorch.get_inplace_requires_grad_allowed()
    torch._C._functorch.set_inplace_requires_grad_allowed(True)
    try:
        yield
    finally:
        torch._C._functorch.set_inplace_requires_grad_allowed(allowed)


@contextlib.contextmanager
def forward_grad_enabled() -> Iterator[None]:
    """Compute forward-mode tangents (at the current `forward_ad` level) where autograd turned that off:
    inside a custom Function's jvp rule."""
    enabled = torch._C._is_fwd_grad_enabled()
    torch._C._set_fwd_grad_enabled(True)
    try:
        yield
    finally:
        torch._C._set_fwd_grad_enabled(enabled)


# NOTE [forward-mode tangents under vmap]
# torch.autograd.forward_ad keeps tangents on the tensors under vmap's batch
# wrappers (vmap's rules run the ops on those), and `make_dual`/`unpack_dual`
# have no batching rule. Under vmap they are applied to the tensors under every
# batch wrapper, and the result is batched again as its primal is.
def tangent_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The forward-mode tangent of `tensor` at the current `forward_ad` level, under vmap too."""
    wrapper = _batch_wrapper(tensor)
    if wrapper is None:
        return torch.autograd.forward_ad.unpack_dual(tensor).tangent
    tangent = tangent_of(unwrap_level(tensor))
    return None if tangent is None else torch._C._functorch._add_batch_dim(tangent, wrapper[1], wrapper[0])


def make_dual(primal: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    """`primal` with `tangent` at the current `forward_ad` level, under vmap too."""
    if _batch_wrapper(primal) is None and _batch_wrapper(tangent) is None:
        return torch.autograd.forward_ad.make_dual(primal, tangent)
    # Both batched alike (the same op on the same kinds of batching), so their wrappers match.
    primal, tangent = primal + torch.zeros_like(tangent), tangent + torch.zeros_like(primal)
    wrappers = []
    while (wrapper := _batch_wrapper(primal)) is not None:
        if _batch_wrapper(tangent) != wrapper:
            raise AssertionError(f"remat: a primal and its tangent batched differently under vmap: {wrapper}")
        wrappers.append(wrapper)
        primal, tangent = unwrap_level(primal), unwrap_level(tangent)
    dual = torch.autograd.forward_ad.make_dual(primal, tangent)
    for level, bdim in reversed(wrappers):
        dual = torch._C._functorch._add_batch_dim(dual, bdim, level)
    return dual


def unwrap_dead_wrappers(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors`, each unwrapped from the torch.func wrappers of levels that have ended (as
    `Function.apply` unwraps its arguments)."""
    return list(torch._functorch.utils.unwrap_dead_wrappers(tuple(tensors)))


def drawn_per_example_but_unbatched(tensor: torch.Tensor) -> bool:
    """Whether the innermost `vmap` running draws different random numbers for each example
    (`randomness="different"`) while `tensor` is not batched by it: there an in-place random fill of
    `tensor` raises, where an out-of-place draw gives the whole batch its numbers. Never inside a graph
    Dynamo compiles (`compile=`), which runs under no transform."""
    if torch.compiler.is_compiling():
        return False
    for interpreter in reversed(functorch_interpreters()):
        if interpreter.key() == TransformType.Vmap:
            return interpreter.randomness() == "different" and interpreter.level() not in vmap_levels(tensor)
    return False


def unbatched_at(tensor: torch.Tensor, level: int) -> tuple[torch.Tensor, int | None]:
    """`tensor` without its batching at the vmap `level`, and the dimension that batched it (None where
    `level` does not batch it)."""
    if torch._C._functorch.is_batchedtensor(tensor) and torch._C._functorch.maybe_get_level(tensor) == level:
        return torch._C._functorch._unwrap_batched(tensor, level)  # type: ignore[no-any-return]
    return tensor, None


def functorch_level(tensor: torch.Tensor) -> int:
    """The torch.func level of the outermost wrapper of `tensor` (a wrapped one)."""
    return int(torch._C._functorch.maybe_get_level(tensor))


def batched_at(tensor: torch.Tensor, dim: int, level: int) -> torch.Tensor:
    """`tensor` batched at the vmap `level` along `dim` (the converse of `unbatched_at`)."""
    return torch._C._functorch._add_batch_dim(tensor, dim, level)  # type: ignore[no-any-return]


def vmap_levels(tensor: torch.Tensor) -> frozenset[int]:
    """The levels of the `vmap`s `tensor` is batched by, through every torch.func wrapper around it."""
    levels = set()
    while is_functorch_wrapped(tensor):
        if torch._C._functorch.is_batchedtensor(tensor):
            levels.add(torch._C._functorch.maybe_get_level(tensor))
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return frozenset(levels)


def _batch_wrapper(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The (level, batch dimension) of the vmap wrapper around `tensor`, or None if it has none."""
    if not torch._C._functorch.is_batchedtensor(tensor):
        return None
    return torch._C._functorch.maybe_get_level(tensor), torch._C._functorch.maybe_get_bdim(tensor)


def import_jvp_decompositions() -> None:
    """Import the decompositions forward-mode AD loads on first use, ahead of time: they call
    `torch.jit.script`, which torch itself deprecates (a DeprecationWarning before 2.15, a
    FutureWarning since), an error where warnings are errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        import torch._decomp.decompositions_for_jvp  # noqa: F401


# --- autograd ----------------------------------------------------------------------------------------------


class FunctionApplications(Protocol):
    """What `function_applications_noted` tells about the custom autograd Functions applied."""

    def started(self) -> None: ...

    def finished(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any) -> None: ...


class _Noting(threading.local):
    listener: FunctionApplications | None = None
    depth = 0


_noting = _Noting()
_noting_lock = threading.Lock()
_noting_threads = 0
_ORIGINAL_APPLY = inspect.getattr_static(torch.autograd.Function, "apply")
_APPLY_IS_OWN = "apply" in vars(torch.autograd.Function)


def _apply_noting(cls: type, *args: Any, **kwargs: Any) -> Any:
    apply = _ORIGINAL_APPLY.__get__(None, cls)
    return _noted(cls, lambda: apply(*args, **kwargs), args, kwargs, lambda outputs: outputs)


def _noted(
    cls: type, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any], noted: Callable[[Any], Any]
) -> Any:
    """`run()`, an application of `cls` on `args` and `kwargs`, told to this thread's listener (with the
    outputs `noted` picks of what it returns) unless another thread's or inside another application."""
    listener = _noting.listener
    if listener is None or _noting.depth:
        return run()
    listener.started()
    _noting.depth += 1
    try:
        outputs = run()
    finally:
        _noting.depth -= 1
    listener.finished(cls, args, kwargs, noted(outputs))
    return outputs


@contextlib.contextmanager
def function_applications_noted(listener: FunctionApplications) -> Iterator[None]:
    """Tell `listener` of each custom autograd Function applied on this thread while this runs (not
    those applied inside another's `forward`): `Function.apply` is wrapped meanwhile, for every thread,
    and passes other threads' calls straight on; and so is the `forward` of every Function class defined
    so far, for an `apply` taken before this started (`my_op = MyFunction.apply`), which the first does
    not see. A class that defines its own `apply` is seen through its `forward` only."""
    global _noting_threads
    with _noting_lock:
        if _noting_threads == 0:
            torch.autograd.Function.apply = classmethod(_apply_noting)  # type: ignore[assignment, method-assign]
            _wrap_forwards()
        _noting_threads += 1
    outer, _noting.listener = _noting.listener, listener
    try:
        yield
    finally:
        _noting.listener = outer
        with _noting_lock:
            _noting_threads -= 1
            if _noting_threads == 0:
                _unwrap_forwards()
                if _APPLY_IS_OWN:
                    torch.autograd.Function.apply = _ORIGINAL_APPLY  # type: ignore[method-assign]
                else:
                    del torch.autograd.Function.apply


_wrapped_forwards: dict[type, Any] = {}  # class -> its own `forward` attribute before wrapping (or _ABSENT)
_ABSENT = object()


def _wrap_forwards() -> None:
    """Wrap the `forward` of every custom Function class so far, each as the class sees it."""
    classes: dict[type, None] = {}
    pending: list[type] = [torch.autograd.Function]
    while pending:
        subclasses: list[type] = pending.pop().__subclasses__()
        for subclass in subclasses:
            if subclass not in classes:
                classes[subclass] = None
                pending.append(subclass)
    own_setup = inspect.getattr_static(torch.autograd.Function, "setup_context")
    wrappers = {}
    for cls in classes:
        forward = _class_attribute(cls, "forward")
        if isinstance(forward, staticmethod):
            forward = forward.__func__
        if not inspect.isfunction(forward):  # (a classmethod, a C function: left as it is)
            continue
        with_ctx = _class_attribute(cls, "setup_context") is own_setup  # old style: forward(ctx, ...)
        made = _forward_wrappers.get(cls)
        if made is None or made[0] is not forward or made[1] != with_ctx:
            made = _forward_wrappers[cls] = (forward, with_ctx, staticmethod(_forward_noting(cls, forward, with_ctx)))
        wrappers[cls] = made[2]
    for cls, wrapper in wrappers.items():
        _wrapped_forwards[cls] = vars(cls).get("forward", _ABSENT)
        type.__setattr__(cls, "forward", wrapper)


def _class_attribute(cls: type, name: str) -> Any:
    """`cls`'s attribute `name` as its class dictionaries hold it (`inspect.getattr_static` for a class whose
    metaclass defines no such attribute, as Function's does not; five times faster, and this runs for every
    Function class on each trace)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


# class -> (the forward it wrapped, whether old style, the wrapper): made once per class and forward
_forward_wrappers: weakref.WeakKeyDictionary[type, tuple[Any, bool, staticmethod[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def _unwrap_forwards() -> None:
    for cls, own in _wrapped_forwards.items():
        if own is _ABSENT:
            type.__delattr__(cls, "forward")
        else:
            type.__setattr__(cls, "forward", own)
    _wrapped_forwards.clear()


def _forward_noting(cls: type, forward: Callable[..., Any], with_ctx: bool) -> Callable[..., Any]:
    """`forward`, noting its application where `Function.apply` did not (an `apply` taken before noting
    started): its arguments as `apply` got them, and its outputs, unless one is an argument itself (whose
    output `apply` makes a new view, which this does not see)."""

    @functools.wraps(forward)
    def noting(*args: Any, **kwargs: Any) -> Any:
        given = args[1:] if with_ctx else args

        def noted(outputs: Any) -> Any:  # (only for an application noted: not on every call)
            inputs = {id(a) for a in pytree.tree_leaves((given, kwargs)) if isinstance(a, torch.Tensor)}
            returned = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
            return () if any(id(t) in inputs for t in returned) else outputs

        return _noted(cls, lambda: forward(*args, **kwargs), given, kwargs, noted)

    return noting


def has_no_derivative(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether autograd has no derivative formula for `op` at all (it records torch's `NotImplemented`
    node, which raises where it is differentiated), found by calling it on `args` and `kwargs`: fake
    tensors of a trace, whose float ones are made to require grad. False where the call raises."""
    fakes = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FakeTensor)]
    if not fakes:
        return False

    def leaf(value: Any) -> Any:
        if isinstance(value, FakeTensor) and (value.is_floating_point() or value.is_complex()):
            return value.detach().requires_grad_()
        return value

    # Outside a torch.func transform's interpreters (the fake tensors are no transform's) and the
    # caller's dispatch modes (a user's op counter must not see the probe).
    with disable_current_modes(), temporarily_clear_interpreter_stack(), inplace_requires_grad_allowed():
        args, kwargs = pytree.tree_map(leaf, (args, kwargs))
        try:
            with fakes[0].fake_mode, torch.enable_grad():
                outputs = op(*args, **kwargs)
        except Exception:
            return False
    return any(
        isinstance(o, torch.Tensor) and type(o.grad_fn).__name__ == "NotImplemented"
        for o in pytree.tree_leaves(outputs)
    )


def decomposition_of(op: OpOverload) -> Callable[..., Any] | None:
    """torch's decomposition of `op` into other ops (its Python reference formula), if it has one."""
    from torch._decomp import decomposition_table

    return decomposition_table.get(op)


@contextlib.contextmanager
def saved_tensors_hooks_tracing() -> Iterator[None]:
    """Keep users' `saved_tensors_hooks` from running (autograd's switch for tracing)."""
    previous = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_set_tracing(previous)


def apply_without_binding(function: type[torch.autograd.Function]) -> Any:
    """The C++ `apply` of a custom Function, without the Python argument binding that
    `Function.apply` did until torch 2.13 (a third of the overhead of a small call; since 2.14
    `Function.apply` is this C++ apply already)."""
    return super(torch.autograd.Function, function).apply  # type: ignore[misc]


def release_saved_tensors(ctx: Any) -> None:
    """Drop autograd's references to what a custom Function saved, unless the graph is retained
    (`retain_graph=True`, `create_graph=True`): the references its backward unpacked are then the only ones.
    (What AOTAutograd's runtime does; a ctx of torch.func's own has no such method.)"""
    clear = getattr(ctx, "maybe_clear_saved_tensors", None)
    if clear is not None:
        clear()


def forward_ad_level() -> int:
    """The level of `torch.autograd.forward_ad` in use, or -1 (torch.func.jvp also enters one)."""
    return torch.autograd.forward_ad._current_level


# --- torch.utils.checkpoint ----------------------------------------------------------------------------------

# Keyword arguments of `torch.utils.checkpoint.checkpoint` that keep a selective-checkpoint region's
# saved tensors out of `saved_tensors_hooks`, as every release did until 2.14. Torch 2.15 warns
# (FutureWarning) unless told, and a later release will route them through the hooks.
SAC_BYPASSES_HOOKS: dict[str, Any] = (
    {"respect_saved_tensors_hooks": False}
    if "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    else {}
)


def autograd_node_order(node: Any) -> int:
    """The sequence number of an autograd graph node: the engine runs the ready node created last first."""
    return node._sequence_nr()  # type: ignore[no-any-return]


def autograd_node_inputs(node: Any) -> Sequence[Any]:
    """The shape, dtype and device of each gradient an autograd graph node takes."""
    return node._input_metadata  # type: ignore[no-any-return]


def accumulated_leaf(node: Any) -> torch.Tensor | None:
    """The leaf tensor whose `.grad` an autograd graph node accumulates into (its `AccumulateGrad`), if it is one."""
    return node.variable if type(node).__name__ == "AccumulateGrad" else None  # type: ignore[no-any-return]


# (`_or_false` since 2.11, where it answers False for a symbolic size that leaves it open; before, without)
_NON_OVERLAPPING_AND_DENSE: Any = next(
    getattr(torch._prims_common, name)
    for name in ("is_non_overlapping_and_dense_or_false", "is_non_overlapping_and_dense")
    if hasattr(torch._prims_common, name)
)


def dense_without_overlap(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill its memory once each, in some order of its dimensions."""
    return bool(_NON_OVERLAPPING_AND_DENSE(tensor))


def is_custom_function_node(node: Any) -> bool:
    """Whether an autograd graph node is a custom Function's (its `backward` runs through `node.apply`)."""
    return hasattr(node, "_forward_cls")


def is_custom_op_autograd(function: type) -> bool:
    """Whether `function` is the autograd Function torch made for a custom op's `register_autograd`."""
    return function.__module__ == "torch._library.autograd"


_SDP_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}  # torch's `SDPBackend` values


def sdp_priority_order() -> list[str]:
    """The order in which SDPA tries its backends on CUDA (`torch._C._set_sdp_priority_order` changes it)."""
    return [_SDP_BACKENDS.get(int(b), "unknown") for b in torch._C._get_sdp_priority_order()]


def selective_checkpoint_context(op_output: Any) -> torch.utils.checkpoint.SelectiveCheckpointContext:
    """The context a SAC policy function receives in forward, with the output of the call it decides on.

    Before 2.12 the context has no `op_output` (its constructor takes only `is_recompute`): it is set after
    construction, so that a policy function written for a newer release reads it on every release."""
    context = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)
    context.op_output = op_output
    return context


# --- torch's error messages ------------------------------------------------------------------------------------

LEAF_UPDATED_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"
UNTRACEABLE_COLLECTIVE = ("Could not find a token for effect", "c10d")
# What a kernel that reads a fake tensor's values (`tensor_split` with tensor indices) raises.
DATA_NOT_ALLOCATED = "data is not allocated yet"


# --- frames: where a call came from --------------------------------------------------------------------------

_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep, "<frozen")


def is_user_code(filename: str) -> bool:
    """Whether a frame of this file is the user's: not torch's, nor remat's, nor Python's own."""
    return not filename.startswith(_LIBRARY_DIRS)


# NOTE [custom Function scopes without apply's frame]
# Until torch 2.13 `Function.apply` was Python, and its frame named the class
# being applied; since 2.14 it is C++, with no frame. Either way, the
# Function's `forward` runs as a Python frame of the user's own code: a frame
# whose code is the `forward` of a Function subclass is inside that Function.
# Old-style forwards name their class through `ctx` (an instance of the
# class's backward node, which knows its Function); a forward with a separate
# `setup_context` has no ctx, and is found by its code among the subclasses.
def source_and_scope(skip: int) -> tuple[str | None, str | None]:
    """The innermost `file:line` of user code on the stack, and the custom `autograd.Function`s
    being applied (outermost first, joined by "/"). Starts `skip` frames above the caller."""
    source = None
    functions: list[str] = []
    frame: FrameType | None = sys._getframe(skip + 1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward":
            name = _function_of(frame)
            if name is not None:
                functions.append(name)
        if source is None and is_user_code(code.co_filename):
            source = f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return source, "/".join(reversed(functions)) or None


def _function_of(frame: FrameType) -> str | None:
    """The custom Function whose `forward` `frame` runs, if it is one."""
    forward_cls = getattr(type(frame.f_locals.get("ctx")), "_forward_cls", None)  # the ctx of an old-style forward
    if forward_cls is not None:
        return forward_cls.__name__  # type: ignore[no-any-return]
    if frame.f_code not in _FORWARDS:  # a forward not seen yet: of a Function defined since, or of a module
        _FORWARDS.update(_function_forwards())
        _FORWARDS.setdefault(frame.f_code, None)
    return _FORWARDS[frame.f_code]


_FORWARDS: dict[CodeType, str | None] = {}  # code of a `forward` -> the Function it belongs to, or None


def _function_forwards() -> dict[CodeType, str]:
    """The code of every `forward` a subclass of `torch.autograd.Function` defines -> its class name."""
    found: dict[CodeType, str] = {}
    pending = [torch.autograd.Function]
    while pending:
        cls = pending.pop()
        for subclass in cls.__subclasses__():
            pending.append(subclass)
            code = _code_of(subclass.__dict__.get("forward"))
            if code is not None:
                found.setdefault(code, subclass.__name__)
    return found


def _code_of(method: Any) -> CodeType | None:
    function = getattr(method, "__func__", method)  # a staticmethod
    function = getattr(function, "__wrapped__", function)  # while noted: see `function_applications_noted`
    return getattr(function, "__code__", None)


# NOTE [higher-order ops under remat's modes]
# A higher-order op (FlexAttention's `flex_attention` and its backward) finds
# its rule for a dispatch mode by the mode's exact class, so torch's rules for
# `FakeTensorMode` and `FunctionalTensorMode` do not reach remat's subclasses of
# them: each subclass takes its bases' rules as it is entered (the ops made
# since it was last entered included). remat's other dispatch modes look at aten
# calls only and let higher-order ops pass through.


def inherit_higher_order_rules(mode_class: type) -> None:
    """Give `mode_class` the rules every higher-order op has for its nearest base class that has one."""
    for op in list(torch._ops._higher_order_ops.values()):
        if mode_class in op.python_key_table:
            continue
        rule = next((op.python_key_table[c] for c in mode_class.__mro__[1:] if c in op.python_key_table), None)
        if rule is not None:
            op.py_impl(mode_class)(rule)


@contextlib.contextmanager
def flex_attention_as_one_call() -> Iterator[None]:
    """While tracing: `flex_attention` calls its higher-order op directly, which traces as one call, as
    under torch.compile; eagerly it compiles the op with Dynamo, which cannot run inside a trace. See
    NOTE [flex attention inside a trace]."""
    module = sys.modules.get("torch.nn.attention.flex_attention")
    flag = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"
    if module is None or not hasattr(module, flag):
        yield
        return
    before = getattr(module, flag)
    setattr(module, flag, True)
    try:
        yield
    finally:
        setattr(module, flag, before)


# NOTE [flex attention inside a trace]
# Called eagerly, `flex_attention` wraps its higher-order op in `torch.compile`
# (Dynamo, with the eager backend), which fails on the fake and functional
# tensors of remat's trace. Its module flag `_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`
# makes it call the op directly instead, which make_fx records as one call with
# its `score_mod` and `mask_mod` as subgraphs, and whose autograd rule traces
# the backward op: so the flag is set while remat traces (traces take turns).
# A thread running flex attention eagerly meanwhile runs the op uncompiled,
# with the same results. The programs run the traced op, without Dynamo.
