"""Copy a node of the joint graph into a program so that it runs as eager ran it.

The functional graph holds forms of ops whose layouts, batching rules or
derivatives differ from eager's in-place ops and writes through views (and
batch norms whose replays must update nothing); `eager_copy` has a program call
the functions here in their place. The others are what programs call instead
of an op: `copied` for `aten.copy`, `with_history_of` after an update autograd
did not see, `run_under_no_grad` for a view `fn` took under no_grad.
"""

from __future__ import annotations

import contextvars
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from .. import _quirks
from .._eager._capture import SCATTERS
from .._eager._eager_kernels import RRELU, run_rrelu_as_eager
from .._eager._facts import fill_of, stacked_under_vmap, written_in_place
from .._eager._random_fills import fill_in_eager_layout
from .._eager._strides import is_dense
from .._torch import memory_layout, vmap_levels

__all__ = ["RUN_AS", "STACKS_UNDER_VMAP", "copied", "eager_copy", "run_under_no_grad", "with_history_of"]

aten = torch.ops.aten


def eager_copy(graph: fx.Graph, node: fx.Node, env: Mapping[fx.Node, fx.Node]) -> fx.Node:
    """A copy of `node` in `graph` that runs as eager ran it. See NOTE [random fills draw in eager's layout]."""
    ignored = _RUNNING_STATS_IGNORED.get(node.target)
    if ignored is not None and node.args[ignored[0]] is True:
        # A replayed training-mode batch norm does not read its running statistics (it drops the ones it
        # computes): they go in detached, for the functional op refuses ones that require grad at some
        # level, as an input `fn` hands it (instance norm's, under `grad` of `grad`) may.
        stats = {a for i, a in enumerate(node.args) if i in ignored[1] and isinstance(a, fx.Node)}
        env = {**env, **{a: graph.call_function(aten.detach.default, (env[a],)) for a in stats}}
    copy = graph.node_copy(node, lambda n: env[n])
    fill = fill_of(node)
    if fill is not None:  # a NamedTuple prints as an argument, not as a target
        copy.target, copy.args = fill_in_eager_layout, (fill, *copy.args)
    elif node.target in _SCATTERS:
        copy.target, copy.args = _scattered_in_base_layout, (node.target, *copy.args)
    elif node.target is aten.as_strided_scatter.default:
        copy.target = _as_strided_scattered
    elif node.target is aten.index_fill.int_Tensor:
        copy.target = _index_filled
    elif node.target in RRELU:
        copy.target = run_rrelu_as_eager
    elif node.target in _UPDATING_BATCH_NORM:
        copy.target, copy.args = _batch_norm_updating_copies, (node.target, *copy.args)  # type: ignore[arg-type]
    if stacked_under_vmap(node) and copy.target is operator.getitem:
        # (A program's code names a builtin target by name but prints an argument by its repr.)
        copy.target = _item_stacked_under_vmap
    elif stacked_under_vmap(node):
        copy.target, copy.args = _as_stacked_under_vmap, (copy.target, *copy.args)  # type: ignore[arg-type]
    producer = node.args[0] if node.target is operator.getitem else node  # (an output of a multi-output op)
    written = producer.args[0] if isinstance(producer, fx.Node) and producer.args else None
    if written_in_place(node) and isinstance(written, fx.Node):
        # NOTE [in-place ops keep their tensor's layout] (`remat/_eager/_in_place.py`)
        copy = graph.call_function(_in_layout_of, (env[written], copy))
        copy.meta = dict(node.meta)
    return copy


# Whether the innermost torch.func level where the checkpointed function was called is a vmap: only
# there does vmap meet a composite op before an inner level (`grad`, `jvp`) has split it into its ops.
STACKS_UNDER_VMAP: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_stacks_under_vmap", default=False)


def _as_stacked_under_vmap(op: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`op(*args, **kwargs)`, the value of an op vmap runs example by example: contiguous where vmap's stack
    of the examples' values is (NOTE [ops vmap runs example by example] in `remat/_eager/_noting_modes.py`)."""
    return _stacked(op(*args, **kwargs))


def _item_stacked_under_vmap(values: Sequence[Any], index: int) -> Any:
    """`values[index]`, one value of an op vmap runs example by example (`embedding_bag`'s): as
    `_as_stacked_under_vmap`."""
    return _stacked(values[index])


def _stacked(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and STACKS_UNDER_VMAP.get() and vmap_levels(value):
        return value.contiguous()
    return value


# NOTE [batch norm under vmap]
# Batch norm with running statistics in training updates them in place; the
# trace holds its functional form, which returns new statistics. Under vmap,
# torch has a batching rule for the in-place op (it folds the batch into the
# channels, and the output keeps that layout) and none for the functional one,
# whose fallback runs example by example and stacks a contiguous result. There
# the functional op runs as its definition: the in-place op on copies of the
# statistics, eager's batching rule, layout and errors included.
_UPDATING_BATCH_NORM = _quirks.BATCH_NORM_FUNCTIONAL_UNBATCHED.table


def _batch_norm_updating_copies(
    op: Any,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """The functional batch norm `op`, under vmap as the in-place op on copies of the running statistics:
    see NOTE [batch norm under vmap]."""
    if not vmap_levels(input):
        return op(input, weight, bias, running_mean, running_var, training, momentum, eps)  # type: ignore[no-any-return]
    mean, var = running_mean.clone(), running_var.clone()
    out, saved_mean, saved_invstd = _UPDATING_BATCH_NORM[op](input, weight, bias, mean, var, training, momentum, eps)
    return out, saved_mean, saved_invstd, mean, var


# The functions `eager_copy` runs ops as, taking the op they stand for first (its decomposition replaces either).
RUN_AS = frozenset({_batch_norm_updating_copies})


# NOTE [an index fill of a batched value]
# Under vmap, torch's batching rule for `index_fill` with a tensor value fills
# every example with the last example's value where the tensor filled is not
# batched and the value is (`zeros(25).index_fill(0, idx, v)` for a batched
# `v`): in torch alone, though eager rarely meets it. remat's programs do:
# `trace`'s gradient formula is such a fill of zeros, by the incoming gradient,
# which is batched under `vmap`. There the fill runs as a `where` over a mask of
# the filled positions, which selects the same elements and is batched right.
def _index_filled(base: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`aten.index_fill(base, dim, index, value)`; as a `where` where `value` is batched under vmap and
    `base` is not: see NOTE [an index fill of a batched value]."""
    if not vmap_levels(value) - vmap_levels(base):
        return aten.index_fill.int_Tensor(base, dim, index, value)
    mask = torch.zeros_like(base, dtype=torch.bool).index_fill(dim, index, True)
    return torch.where(mask, value.to(base.dtype), base)


# NOTE [a write through as_strided runs as one]
# torch's forward-mode derivative of `as_strided_scatter` (what a write through
# `as_strided` functionalizes into) is wrong to a reverse-mode level outside it:
# `grad` of a `jvp` of such a write differs from eager's, in torch alone. The
# op is run as its own definition, a write into a clone through `as_strided`,
# which eager's write is, and whose derivatives are right at every order.
def _as_strided_scattered(
    base: torch.Tensor, source: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None
) -> torch.Tensor:
    """`aten.as_strided_scatter(base, source, size, stride, storage_offset)`, as a write into a clone of
    `base` (the op's definition): see NOTE [a write through as_strided runs as one]."""
    out = base.clone()
    out.as_strided(size, stride, storage_offset).copy_(source)
    return out


# The functional forms of writes through views. Eager's write keeps the layout of the tensor written
# into, and so do these, except under `vmap`, whose batching rules for them return contiguous tensors.
_SCATTERS = SCATTERS - {aten.as_strided_scatter.default}  # (run as a write through `as_strided`: above)


def _scattered_in_base_layout(op: Any, base: torch.Tensor, /, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`op(base, *args, **kwargs)`, in the layout of `base`, as eager's write through a view leaves it."""
    if base.is_complex() and torch.is_grad_enabled():  # See NOTE [complex writes through views].
        return _written_through_view(op, base, *args, **kwargs)
    scatter = _select_scattered if op is aten.select_scatter.default else op
    if op in _NEGATIVE_BOUNDS_UNDER_VMAP:
        args, kwargs = _bounds_from_the_start(base, *args, **kwargs), {}
    return _in_layout_of(base, scatter(base, *args, **kwargs))


def _in_layout_of(base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` in the layout of `base` (dense), as eager's write into `base` leaves it."""
    # Under vmap, the layout is that of the batched tensors, the batch dimension's place in memory too.
    layout = memory_layout(base)
    _, shape, stride = layout
    if memory_layout(out) == layout or not is_dense(shape, stride) or out.shape != base.shape:
        return out
    return torch.empty_like(base).copy_(out)


_RUNNING_STATS_IGNORED = _quirks.BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS.table["replay"]


# NOTE [slice scatters count from the start]
# Under vmap, torch's batching rule for `slice_scatter` raises on a negative
# bound ("upper bound and lower bound inconsistent with step sign"), which a
# write through `t[:, 1:-1]` functionalizes into. The bounds are counted from
# the start of the dimension instead, the same elements
# (`_quirks.SLICE_SCATTER_NEGATIVE_BOUNDS_UNDER_VMAP`).
_NEGATIVE_BOUNDS_UNDER_VMAP = _quirks.SLICE_SCATTER_NEGATIVE_BOUNDS_UNDER_VMAP.table


def _bounds_from_the_start(
    base: torch.Tensor,
    source: torch.Tensor,
    dim: int = 0,
    start: int | None = None,
    end: int | None = None,
    step: int = 1,
) -> tuple[Any, ...]:
    """The arguments after `base` of a `slice_scatter`, with negative bounds counted from the start:
    see NOTE [slice scatters count from the start]."""
    size = base.shape[dim]
    if start is not None and start < 0:
        start = max(start + size, 0)
    if end is not None and end < 0:
        end = max(end + size, 0)
    return source, dim, start, end, step


# NOTE [a select scatter runs as a slice scatter]
# Under vmap, torch's forward-mode derivative of `select_scatter` (what a write
# through `t[:, 0]` functionalizes into) is wrong to a reverse-mode level
# outside it: `grad` of a `jvp` of a `vmap` of a function that writes through a
# selected row differs from the same of eager's in-place write, in torch alone.
# A `slice_scatter` of the source with the selected dimension put back writes
# the same elements, and is differentiated right at every order.
# NOTE [complex writes through views]
# Autograd has no formula for the scatters of complex tensors (`slice_scatter`
# "does not support automatic differentiation for outputs with complex dtype"),
# which a backward traced in grad mode holds where a gradient formula writes
# into a slice of a complex buffer (the FFTs' of a real input: `fft.ihfft2`'s
# under `torch.func.grad`). Where they will be recorded, they run as eager's
# write: a `copy_` into the view of a clone of the base, which autograd records.
_VIEWS = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
}


def _written_through_view(op: Any, base: torch.Tensor, source: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """`op(base, source, *args, **kwargs)`, a scatter, as a write into the view of a clone of `base`: see
    NOTE [complex writes through views]."""
    out = base.clone()
    _VIEWS[op](out, *args, **kwargs).copy_(source)
    return out


def _select_scattered(base: torch.Tensor, source: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    """`aten.select_scatter(base, source, dim, index)`, as a `slice_scatter`: see NOTE [a select scatter
    runs as a slice scatter]."""
    dim = dim % base.dim()
    index = index % base.shape[dim]
    return aten.slice_scatter.default(base, source.unsqueeze(dim), dim, index, index + 1)


def copied(destination: torch.Tensor, source: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """`aten.copy(destination, source)` (what a slice assignment functionalizes into, in `fn` and in
    the gradient formulas of one) as ops that autograd and forward-mode AD differentiate, which they
    do not `aten.copy`: `source`, cast and broadcast, copied into a new tensor laid out as
    `aten.copy`'s result was when traced (`stride`). The new tensor is made from `source`, so that
    under a torch.func transform it lives at `source`'s level: the result depends on `source` alone."""
    source = source.to(dtype=destination.dtype, device=destination.device).expand(destination.shape)
    return source.new_empty_strided(destination.shape, stride).copy_(source)


class _WithHistoryOf(torch.autograd.Function):
    """`value` with `tensor`'s history: what autograd sees of a tensor updated in place where it does not
    see (its new `value`, its old history). See NOTE [updates under no_grad keep their tensors' histories]."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        return value.clone()  # a new tensor: a Function's output may not be one of its inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad

    @staticmethod
    def jvp(ctx: Any, value_tangent: torch.Tensor | None, tensor_tangent: torch.Tensor | None) -> torch.Tensor | None:
        # Only a pure forward for forward mode has it (where the update was through a detached alias:
        # forward mode sees one under no_grad), and the tensor keeps its tangent too.
        return tensor_tangent


def with_history_of(value: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    return _WithHistoryOf.apply(value, tensor)  # type: ignore[no-any-return]


def run_under_no_grad(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`op` run as `fn` ran it, under `torch.no_grad()` (in a view rebuilt outside the Function)."""
    with torch.no_grad():
        return op(*args, **kwargs)
