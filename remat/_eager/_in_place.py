"""Trace in-place ops as eager runs them, from the mode that sees eager's tensors above functionalization.

Tracing rewrites every in-place op as its out-of-place form. `EagerFidelity` sees each op before
functionalization does, and keeps what that rewrite would lose:

* an in-place write through a view is written back through the view's inverse, which is exact for every
  view but `expand`, and undefined where the view's elements share memory (see NOTE [writes through
  views]); a write whose source overlaps what it writes is refused (NOTE [in-place ops that read what
  they write]);
* the numbers an in-place random fill draws depend on the memory layout of the tensor it fills: the
  fill's layout is noted on its node (`_random_fills`, NOTE [random fills draw in eager's layout]).

`eager_fidelity` is the stack of modes `fn` runs under, inside `FunctionalTensorMode`, while traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .. import _quirks
from .._memory._measure import storage_key
from .._torch import (
    HigherOrderOperator,
    OpOverload,
    TorchDispatchMode,
    calls_traced,
    op_schema,
    random_calls_traced,
    trace_call,
    tree_leaves,
)
from ._facts import note_fill, note_written_in_place
from ._fake_kernels import EagerLayoutFakeMode
from ._noting_modes import StackedUnderVmap
from ._random_fills import RANDOM_FILLS, FillInEagerLayout, InsideDropout
from ._strides import is_dense, may_overlap

__all__ = [
    "EagerFidelity",
    "ExpandsAsViews",
    "OverlappingWrite",
    "ReadsWhatItWrites",
    "eager_fidelity",
]

aten = torch.ops.aten


class OverlappingWrite(RuntimeError):
    """An in-place update of a tensor whose elements share memory (raised while tracing)."""

    def __init__(self, op: Any, shape: Sequence[int], strides: Sequence[int]):
        super().__init__(f"{op} writes into a tensor of shape {tuple(shape)} with strides {tuple(strides)}")
        self.op, self.shape, self.strides = op, tuple(shape), tuple(strides)


# NOTE [in-place ops that read what they write]
# An in-place op whose source shares memory with the tensor it writes, in part
# (`t.scatter_(1, idx, t[:, :2])`), reads in eager some elements it has already
# overwritten, in the order its kernel happens to run; elementwise ops and
# `copy_` refuse such overlap in eager, and scatters do not. A traced graph is
# functional: it reads every source element before any write, so its result
# would differ from eager's without a word. remat refuses it at the trace. Only
# a shared element counts: two slices of different columns of one tensor span
# overlapping stretches of its storage but share nothing (circular padding
# copies one into the other), and are traced.
class ReadsWhatItWrites(RuntimeError):
    """An in-place op reads memory it writes, in part (raised while tracing)."""

    def __init__(self, op: Any):
        super().__init__(f"{op} reads memory it writes")
        self.op = op


def _reads_what_it_writes(written: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a tensor argument other than `written` overlaps its memory without being it."""
    if not all(isinstance(n, int) for n in (*written.shape, *written.stride())):
        return False
    storage, span = _memory_span(written)
    for value in tree_leaves((args, kwargs)):
        if value is written or not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        if not all(isinstance(n, int) for n in (*value.shape, *value.stride(), value.storage_offset())):
            continue
        other_storage, other_span = _memory_span(value)
        same_view = (value.storage_offset(), value.shape, value.stride()) == (
            written.storage_offset(),
            written.shape,
            written.stride(),
        )
        spans_overlap = other_storage == storage and other_span[0] < span[1] and span[0] < other_span[1]
        if spans_overlap and not same_view and _share_an_element(written, value):
            return True
    return False


_LARGEST_ELEMENT_SET = 1 << 16  # elements of each side, beyond which overlapping spans count as shared


def _share_an_element(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one storage whose spans overlap share an element (slices of different columns of
    one tensor do not: circular padding copies one into the other). Large views are taken to share one."""
    if a.numel() > _LARGEST_ELEMENT_SET or b.numel() > _LARGEST_ELEMENT_SET:
        return True
    return not _element_offsets(a).isdisjoint(_element_offsets(b))


def _element_offsets(tensor: torch.Tensor) -> set[int]:
    """The offsets in its storage of the elements `tensor` views."""
    offsets = {int(tensor.storage_offset())}
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        offsets = {o + i * int(stride) for o in offsets for i in range(int(size))}
    return offsets


def _memory_span(tensor: torch.Tensor) -> tuple[Any, tuple[Any, Any]]:
    """The storage `tensor` views, and the range of element offsets it spans there."""
    start = tensor.storage_offset()
    end = start + 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True) if n > 0)
    return storage_key(tensor), (start, end)


# NOTE [writes through views]
# Functionalization writes an in-place update of a view back into its base
# through the view's inverse. For `expand` the inverse is `base + sum(new -
# base)` over the expanded dimensions: one rounding off eager when nothing is
# expanded (`x.expand(*x.shape)`, a plain alias), and plainly wrong when
# something is (eager's `fill_` on a broadcast view writes each element once;
# the sum writes it as many times as it is repeated). So an `expand` to the
# same shape is traced as the alias it is (one that only adds leading dimensions
# of size one as the view it is), and an in-place op into a tensor
# whose elements may share memory (a broadcast, an overlapping `unfold`) is
# refused: which of the writes wins is not something a functional graph says.
# Backward formulas write through the same views (an in-place fill's zero
# derivative through the `expand` it filled): the backward is traced with such
# an `expand` as its view too (`ExpandsAsViews`), or a NaN or infinity the
# gradient holds leaks through `base + (new - base)` where eager writes zeros.
# Functionalization itself refuses a write through any `unfold` whose window is
# longer than its step, even where there is only one window and nothing
# overlaps; such an `unfold` is traced as the slice and reordering it is. It
# also refuses a write through an `as_strided` of a view (as_strided reads the
# storage, not the view): that is traced as the same `as_strided` of the base.
# And it writes back through an `unfold` whose windows leave gaps as the sum of
# the windows, which sets the gaps to zero: such an unfold is traced as a
# slice of whole steps, or, where its last window is shorter than a step, as
# the `as_strided` it is (which `vmap` cannot batch and forward mode does not
# yet differentiate exactly through remat: a known limitation).
class EagerFidelity(TorchDispatchMode):
    """Sits above FunctionalTensorMode while the joint graph is traced, seeing eager's tensors."""

    def __init__(self, dropouts: InsideDropout, under_functorch: bool, fake_mode: EagerLayoutFakeMode):
        super().__init__()
        self.dropouts = dropouts
        self.under_functorch = under_functorch
        self.fake_mode = fake_mode
        self.dropout_layout_matters = False  # a dropout filled a non-contiguous mask

    supports_higher_order_operators = True  # See NOTE [higher-order ops under remat's modes].

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if func is aten.expand.default and not expands(args[0], args[1]):
            return _as_a_view(args[0], args[1])
        unmapped = _UNMAPPED_IN_PLACE.get(func)
        if unmapped is not None:  # NOTE [in-place ops functionalization cannot map]
            return unmapped(*args, **kwargs)
        written = _written_tensors(func, args, kwargs)
        for tensor in written:
            if may_overlap(tensor.shape, tensor.stride()):
                raise OverlappingWrite(func, tensor.shape, tensor.stride())
            if _reads_what_it_writes(tensor, args, kwargs):  # NOTE [in-place ops that read what they write]
                raise ReadsWhatItWrites(func)
        if written and func.overloadpacket not in RANDOM_FILLS and _keeps_its_layout(func, args, written[0]):
            return self._in_place_in_eager_layout(func, args, kwargs, written[0])
        if not written or func.overloadpacket not in RANDOM_FILLS:
            return trace_call(func, args, kwargs)
        target = written[0]
        if self.dropouts.depth and not target.is_contiguous():  # NOTE [dropout under torch.func]
            self.dropout_layout_matters = True
            if self.under_functorch:
                return trace_call(func, args, kwargs)
        strides = tuple(target.stride())
        if all(isinstance(n, int) for n in (*target.shape, *strides)):
            fill = FillInEagerLayout(func.name(), strides, is_dense(target.shape, strides), not self.dropouts.depth)
        else:  # a program's code cannot hold a symbol: the strides are taken from the tensor as it runs
            fill = FillInEagerLayout(func.name(), None, False, not self.dropouts.depth)
        if fill.dense:  # the fill's value has eager's layout, for every op that reads it
            self.fake_mode.fill_strides = fill.strides
        try:
            result, random_nodes = random_calls_traced(lambda: trace_call(func, args, kwargs))
        finally:
            self.fake_mode.fill_strides = None
        if random_nodes:
            note_fill(random_nodes[0], fill)
        return result

    def _in_place_in_eager_layout(self, func: Any, args: Any, kwargs: dict[str, Any], target: torch.Tensor) -> Any:
        """Trace the in-place op `func` writing into `target`, its functional form laid out as `target`:
        NOTE [in-place ops keep their tensor's layout]."""
        shape, strides = tuple(target.shape), tuple(target.stride())
        self.fake_mode.in_place_layout = (shape, strides)
        try:
            result, added = calls_traced(lambda: trace_call(func, args, kwargs))
        finally:
            self.fake_mode.in_place_layout = None
        form = next((node for node in added if _is_functional_form(node, shape)), None)
        if form is not None:
            note_written_in_place(form)
        return result


# NOTE [in-place ops functionalization cannot map]
# Functionalization runs an in-place op as its functional form, found by name
# and arguments; for a few it finds none (`polygamma_(self, n)`, whose functional
# op is `polygamma(n, self)`) and raises a raw error about alias annotations.
# Such an op is traced as its definition: the functional op, copied into the
# tensor it writes (`_quirks.IN_PLACE_OPS_FUNCTIONALIZATION_CANNOT_MAP`). Autograd,
# above this mode, has recorded the in-place op's own derivative already.
_UNMAPPED_IN_PLACE = _quirks.IN_PLACE_OPS_FUNCTIONALIZATION_CANNOT_MAP.table


# NOTE [in-place ops keep their tensor's layout]
# An in-place op leaves the tensor it writes in its layout; tracing rewrites it
# as its functional form, whose kernel may lay out a new tensor otherwise
# (`masked_fill`, `scatter`, `index_add`, `index_copy`, `masked_scatter`,
# `scatter_reduce` return contiguous tensors whatever their input's layout).
# The value then differs from eager's in its strides, and so does everything
# laid out after it: a `randn_like` of it draws in another order. So the
# functional form of each in-place op (found by its schema, not by a list) is
# traced with the layout of the tensor it writes (the fake mode gives its
# result those strides), its node is noted, and the programs run it in the
# layout of its input, which is that tensor's (`_eager_copies`).
def _keeps_its_layout(func: Any, args: Sequence[Any], target: torch.Tensor) -> bool:
    """Whether `func` is an in-place op writing into its first argument, `target`, a dense tensor of
    known strides, without changing its metadata (not `resize_`, `t_`, `set_`)."""
    if not args or args[0] is not target or torch.Tag.inplace_view in func.tags:
        return False
    if func.overloadpacket in _CHANGE_METADATA or not func.name().split("::")[-1].split(".")[0].endswith("_"):
        return False
    shape, strides = target.shape, target.stride()
    return all(isinstance(n, int) for n in (*shape, *strides)) and is_dense(shape, strides)


def _is_functional_form(node: Any, shape: tuple[int, ...]) -> bool:
    """Whether `node`, traced for an in-place op into a tensor of `shape`, is the value functionalization
    gives that tensor: not a view it replays first, and computed from a tensor of that shape (the one
    written); an output of a multi-output functional form (`rrelu_with_noise_functional`'s) counts."""
    value = node.meta.get("val")
    if node.op != "call_function" or not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        return False
    producer = node.args[0] if node.target is operator.getitem else node
    target = getattr(producer, "target", None)
    if not isinstance(target, OpOverload) or any(r.alias_info for r in op_schema(target).returns):
        return False
    first = producer.args[0] if producer.args else None
    written = getattr(first, "meta", {}).get("val")
    return isinstance(written, torch.Tensor) and tuple(written.shape) == shape


_CHANGE_METADATA = frozenset(
    {aten.resize_, aten.resize_as_, aten.set_, aten.copy_}
)  # (copy_ runs as `copied`, in its layout)


@contextlib.contextmanager
def eager_fidelity(under_functorch: bool, fake_mode: EagerLayoutFakeMode) -> Iterator[EagerFidelity]:
    """The modes to run `fn` under, inside `FunctionalTensorMode`, while tracing the joint graph
    (for a function that runs under a torch.func transform, with `under_functorch`)."""
    with (
        _ViewsWrittenThroughExactly(),
        InsideDropout() as dropouts,
        StackedUnderVmap(),
        EagerFidelity(dropouts, under_functorch, fake_mode) as fidelity,
    ):
        yield fidelity


def _written_tensors(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments an op writes into (`self` of an in-place op, `out=`)."""
    written = []
    for position, argument in enumerate(op_schema(func).arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


class ExpandsAsViews(TorchDispatchMode):
    """Traces an `expand` that repeats no element as the view it is (NOTE [writes through views]): while a
    backward is traced, whose formulas write through such views (an in-place fill's, through the `expand`
    it filled), as `EagerFidelity` does while `fn` is."""

    supports_higher_order_operators = True  # See NOTE [higher-order ops under remat's modes].

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is aten.expand.default and not expands(args[0], args[1]):
            return _as_a_view(args[0], args[1])
        return func(*args, **(kwargs or {}))


def expands(tensor: torch.Tensor, sizes: Sequence[Any]) -> bool:
    """Whether `tensor.expand(sizes)` repeats elements (a broadcast), rather than only naming them again or
    putting dimensions of one in front."""
    return not (_expands_nothing(tensor, sizes) or _only_adds_dims_of_one(tensor, sizes))


def _as_a_view(tensor: torch.Tensor, sizes: Sequence[Any]) -> torch.Tensor:
    """`tensor.expand(sizes)`, which repeats nothing, as an alias or a view."""
    if _expands_nothing(tensor, sizes):
        return aten.alias.default(tensor)  # type: ignore[no-any-return]
    return aten.view.default(tensor, [1] * (len(sizes) - tensor.dim()) + list(tensor.shape))  # type: ignore[no-any-return]


def _expands_nothing(tensor: torch.Tensor, sizes: Sequence[Any]) -> bool:
    if len(sizes) != tensor.dim():
        return False
    return all(isinstance(s, int) and s in (-1, n) for s, n in zip(sizes, tensor.shape, strict=True))


def _only_adds_dims_of_one(tensor: torch.Tensor, sizes: Sequence[Any]) -> bool:
    """Whether `tensor.expand(sizes)` only puts dimensions of size one in front: a view, not a broadcast."""
    added = len(sizes) - tensor.dim()
    return (
        added > 0
        and all(isinstance(s, int) and s == 1 for s in sizes[:added])
        and _expands_nothing(tensor, sizes[added:])
    )


class _ViewsWrittenThroughExactly(TorchFunctionMode):
    """Traces the views functionalization cannot write back through exactly as views it can
    (NOTE [writes through views]), above autograd, so that its view replays take them too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.unfold:
            unfold = _Unfold(*args, **kwargs)
            if unfold.has_one_window():
                return unfold.as_slice()
            if unfold.has_gaps():
                return unfold.with_gaps()
        if func in _AS_STRIDED and isinstance(args[0], torch.Tensor):
            return _as_strided(*args, **kwargs)
        return func(*args, **kwargs)


_AS_STRIDED = (torch.Tensor.as_strided, torch.as_strided)


def _as_strided(
    tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> torch.Tensor:
    """`tensor.as_strided(...)`, of the tensor it views if it is a view: functionalization writes through
    an `as_strided` of a tensor, but refuses one at the end of a chain of views."""
    offset = tensor.storage_offset() if storage_offset is None else storage_offset
    base = tensor if tensor._base is None else tensor._base
    return torch.Tensor.as_strided(base, size, stride, offset)


@dataclasses.dataclass(frozen=True)
class _Unfold:
    """A call `tensor.unfold(dimension, size, step)`."""

    tensor: torch.Tensor
    dimension: int
    size: int
    step: int

    @property
    def length(self) -> Any:
        """The size of the unfolded dimension (a symbol where it depends on data)."""
        return self.tensor.shape[self.dimension] if self.tensor.dim() else 1

    @property
    def windows(self) -> Any:
        return (self.length - self.size) // self.step + 1

    def has_one_window(self) -> bool:
        """Whether it has one window, longer than its step: functionalization refuses writes through
        such an `unfold`, though none of its elements overlap."""
        return isinstance(self.length, int) and self.windows == 1 and self.size > self.step

    def has_gaps(self) -> bool:
        """Whether its windows share nothing but leave elements out (`unfold(0, 1, 2)`, or a last element
        no window reaches): functionalization writes back through it as the sum of the windows, which
        sets those elements to zero."""
        if not isinstance(self.length, int) or self.size > self.step:
            return False
        return self.size < self.step or self.windows * self.step != self.length

    def with_gaps(self) -> torch.Tensor:
        """It as views functionalization writes through exactly: where its windows fit in whole steps,
        the steps as a dimension of their own and the first `size` elements of each; otherwise (a last
        window shorter than a step) the `as_strided` it is. Both have its shape and strides."""
        dim = self.dimension % self.tensor.dim()
        if self.windows * self.step <= self.length:
            steps = self.tensor.narrow(dim, 0, self.windows * self.step).unflatten(dim, (self.windows, self.step))
            return steps.narrow(dim + 1, 0, self.size).movedim(dim + 1, -1)
        shape, strides = list(self.tensor.shape), list(self.tensor.stride())
        shape[dim] = self.windows
        strides[dim] *= self.step
        return _as_strided(self.tensor, (*shape, self.size), (*strides, self.tensor.stride(dim)))

    def as_slice(self) -> torch.Tensor:
        """Its one window as a slice, its elements moved last, a dimension of 1 in their place: the
        unfold's shape and strides, through views that functionalization writes through exactly."""
        if self.tensor.dim() == 0:
            return self.tensor.unsqueeze(0)
        dim = self.dimension % self.tensor.dim()
        return self.tensor.narrow(dim, 0, self.size).movedim(dim, -1).unsqueeze(dim)
