"""Fake tensors: what their kernels get wrong and how a fake mode corrects it, real values traced beside
fake ones, sizes that depend on data (their bounds, and the checks a trace makes of the values Python
read), and torch's rules for strides that say which layout an output has.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch._functorch.config
import torch._prims_common
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
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    ShapeEnv,
    free_unbacked_symbols,
    guard_scalar,
)
from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts
from torch.utils import _pytree as pytree
from torch.utils._sympy.symbol import SymT, symbol_is_type

from .. import _quirks
from ._frames import is_user_code
from ._func import is_functorch_wrapped
from ._ops import inherit_higher_order_rules
from ._releases import RELEASE_NUMBERS

__all__ = [
    "FAKE_DTYPE_ERRATA",
    "fake_kernel_errors_unlogged",
    "STRICT_FAKE_KERNELS",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeRankMismatch",
    "FakeTensor",
    "FakeTensorMode",
    "GuardOnDataDependentSymNode",
    "ShapeEnv",
    "UncheckedRealValuesFakeMode",
    "UnsupportedOperatorException",
    "carry_real_values",
    "put_back_real_values",
    "dense_without_overlap",
    "elementwise_output_strides",
    "forget_pending_sizes",
    "guard_scalar",
    "insert_value_checks",
    "real_values_traced",
    "run_real_kernel_on_zeros",
    "size_bound",
    "unset_fake_temporarily",
]


aten = torch.ops.aten


# --- fake tensors ---------------------------------------------------------------------------------------

# Outputs whose dtype a fake (meta) kernel gets wrong on some releases: op -> (output position, the
# dtype eager gives it, from the op's arguments). A fake mode corrects them, so that the bytes a trace
# accounts for are the bytes eager keeps.
FAKE_DTYPE_ERRATA: dict[Any, tuple[int, Any]] = {}
if RELEASE_NUMBERS < (2, 13):
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
    if RELEASE_NUMBERS < (2, 11):
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


def put_back_real_values(fakes: Sequence[Any], originals: Sequence[torch.Tensor]) -> None:
    """Give each fake's real data its original's values again. A fake made from a tensor whose storage the
    fake mode has already seen shares the real copy made then (its memo of storages), which an earlier run
    of `fn` on the same fake mode (remat's discovery pass) may have updated in place: a buffer `fn`
    increments would be read incremented twice."""
    with unset_fake_temporarily(), torch.no_grad():
        for fake, original in zip(fakes, originals, strict=True):
            real = getattr(fake, "real_tensor", None)
            if real is not None and real.shape == original.shape and not is_functorch_wrapped(original):
                real.copy_(original.detach())


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


# --- strides ----------------------------------------------------------------------------------------------


# (`_or_false` since 2.11, where it answers False for a symbolic size that leaves it open; before, without)
_NON_OVERLAPPING_AND_DENSE: Any = next(
    getattr(torch._prims_common, name)
    for name in ("is_non_overlapping_and_dense_or_false", "is_non_overlapping_and_dense")
    if hasattr(torch._prims_common, name)
)


def dense_without_overlap(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill its memory once each, in some order of its dimensions."""
    return bool(_NON_OVERLAPPING_AND_DENSE(tensor))
