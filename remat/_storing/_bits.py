"""Kept values stored as bits, exactly: booleans, masks of Bernoulli draws scaled by a number (dropout's on the
CPU), and values backward reads only through one test per element (a ReLU's output). See NOTE [values kept as
bits].
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import torch
from torch import fx

from .._memory._cuda_allocator import allocated_nbytes
from .._torch import dense_without_overlap

__all__ = [
    "TESTED",
    "load_args",
    "pack",
    "packable",
    "packed_like",
    "packed_nbytes",
    "packing_bytes",
    "read_through_a_test",
    "store_args",
    "unpack",
    "unpacking_bytes",
    "whole",
]

aten = torch.ops.aten

# NOTE [values kept as bits]
# Some values backward reads hold one bit of information per element, in a
# byte or more: a boolean (a comparison, a `where` condition, the mask CUDA's
# dropout keeps), and a mask of Bernoulli draws scaled by a number (the mask
# `F.dropout` keeps on the CPU: `bernoulli` then a division by 1 - p, every
# element 0 or 1 / (1 - p)). Kept as bits (`PACK`), such a value takes an
# eighth of a byte per element on its device, and comes back bit for bit:
# a boolean as the bits themselves, a scaled mask by running its own op (the
# division or product by that number) again on the unpacked draws, an
# elementwise kernel that rounds each element alone, so that it gives the
# same number as in forward. The bits are written in the value's logical
# order and read back into its layout; a value that is not dense (a broadcast
# mask), or whose bits would not take fewer bytes than its memory, is kept as
# it is.
#
# A value that every gradient formula reading it reads only through one test
# per element (`_TESTS`: a ReLU's output, which `threshold_backward` reads as
# `result <= 0`) is kept as the bits of that test, and comes back as a stand-in
# the formula tests alike: the bit times the number the test passes for (a set
# bit: that number; a clear bit: NaN, as IEEE's 0 * inf, which fails every
# comparison), so gradients are bit for bit those of eager with NaN and
# infinities too. The stand-in is not the value: where a replay, or a
# recomputation to differentiate again, reads the value itself, it is kept as
# it is (`whole`). Which formulas read a value is a fact of the joint graph,
# recorded on the value's node (`TESTED`) when its value graph is read.

TESTED = "remat_tested"  # node meta: (formula, bounds) of the one test backward's formulas read a value through


class _Test(NamedTuple):
    """How a gradient formula reads one of its arguments through a test per element (NOTE [values kept as
    bits]): the formula's decomposition, as torch writes it, names the test."""

    position: int  # of the value among the formula's arguments
    bounds: slice  # the formula's arguments the test compares with (numbers)
    holds: Callable[..., torch.Tensor]  # (value, *bounds) -> where the test holds
    passes: float  # a number the test holds for, whatever the bounds (none are NaN)


_TESTS = {
    # where(self <= threshold, 0, grad): ReLU (self is its output), `F.threshold` (its input)
    aten.threshold_backward.default: _Test(1, slice(2, 3), lambda v, t: v <= t, -math.inf),
    # Not `hardtanh_backward` (`F.hardtanh`, `F.relu6`): the CPU's kernel passes a NaN's gradient in its scalar
    # loop and drops it in its vectorized one, by where the element falls; only a NaN itself reads alike.
    # where(self > 0, grad, grad * slope): `F.leaky_relu` (self is its input, or its output in place)
    aten.leaky_relu_backward.default: _Test(1, slice(0, 0), lambda v: v > 0, math.inf),
}


def read_through_a_test(node: fx.Node, forward: Collection[fx.Node], shows: Callable[[fx.Node], bool]) -> Any:
    """The (formula, bounds) of the one test through which the gradient formulas read `node`'s value, the
    nodes not in `forward` that read it or its views (`shows(n)`: whether n shows its first argument's
    memory); None if they read more of it, or none reads it."""
    found = set()
    showing, seen = [node], {node}
    while showing:
        shown = showing.pop()
        for reader in shown.users:  # (a formula reading two views of the value fails for one of them)
            if shows(reader) and reader.args[0] is shown and shown not in reader.args[1:]:
                if reader not in seen:
                    seen.add(reader)
                    showing.append(reader)
                continue
            if reader in forward:  # forward reads the value itself, stored or not
                continue
            test = _TESTS.get(reader.target)  # type: ignore[call-overload]
            if test is None or reader.kwargs or len(reader.args) <= test.position:
                return None
            others = [a for i, a in enumerate(reader.args) if i != test.position]
            bounds = reader.args[test.bounds]
            numbers = all(isinstance(b, int | float) and not isinstance(b, bool) and b == b for b in bounds)
            if reader.args[test.position] is not shown or shown in others or not numbers:
                return None
            found.add((reader.target, tuple(bounds)))
    return found.pop() if len(found) == 1 else None


_BERNOULLI = frozenset({aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor})
_SCALINGS = frozenset({aten.div.Scalar, aten.mul.Scalar})


def _scaled_draws(node: fx.Node) -> bool:
    """Whether `node` is Bernoulli draws, or draws divided or multiplied by a positive number."""
    if node.target in _BERNOULLI:
        return True
    if node.target not in _SCALINGS or len(node.args) != 2:
        return False
    draws, by = node.args
    positive = isinstance(by, int | float) and not isinstance(by, bool) and by > 0
    return positive and isinstance(draws, fx.Node) and draws.target in _BERNOULLI and not node.kwargs


def _tested(node: fx.Node, value: torch.Tensor) -> bool:
    """Whether `node`'s value is kept as the bits of the test backward reads it through."""
    return value.is_floating_point() and TESTED in node.meta and not _scaled(node, value)


def _scaled(node: fx.Node, value: torch.Tensor) -> bool:
    # One output of a multi-output call (CUDA's dropout mask) can only be a boolean here.
    return node.target is not operator.getitem and value.is_floating_point() and _scaled_draws(node)


def packable(node: fx.Node) -> bool:
    """Whether `node`'s value can be kept as bits exactly, in fewer bytes (NOTE [values kept as bits])."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return False
    if not (value.dtype is torch.bool or _scaled(node, value) or _tested(node, value)):
        return False
    if not all(isinstance(n, int) for n in (*value.shape, *value.stride())):
        return False
    return dense_without_overlap(value) and _packed_bytes(value.numel()) < value.numel() * value.element_size()


def _packed_bytes(numel: int) -> int:
    return -(-numel // 8)


def whole(node: fx.Node) -> bool:
    """Whether what `unpack` gives back for `node`'s packable value is the value itself (else a stand-in that
    only backward's formulas read alike)."""
    return not _tested(node, node.meta["val"])


def store_args(node: fx.Node) -> tuple[Any, ...]:
    """The static arguments `pack` takes after the value, for `node`'s value: the test, where it has one."""
    return node.meta[TESTED] if _tested(node, node.meta["val"]) else ()


def load_args(node: fx.Node) -> tuple[Any, ...]:
    """The static arguments `unpack` takes after the device, for `node`'s value."""
    value = node.meta["val"]
    if _tested(node, value):  # a set bit times the number the test passes for, a clear one NaN (0 * inf)
        remake: tuple[Any, ...] = (aten.mul.Scalar, _TESTS[node.meta[TESTED][0]].passes)
    elif value.dtype is torch.bool or node.target in _BERNOULLI:
        remake = ()
    else:
        remake = (node.target, node.args[1])
    return (value.numel(), tuple(value.shape), tuple(value.stride()), value.dtype, *remake)


def packed_nbytes(value: torch.Tensor) -> int:
    """Bytes of the packed form of `value` (a fake tensor of a trace, or a functorch wrapper of one)."""
    return _packed_bytes(value.numel())


def packed_like(value: torch.Tensor) -> torch.Tensor:
    """What the packed form of `value` (a fake tensor) is, for the peak prediction."""
    return value.new_empty((_packed_bytes(value.numel()),), dtype=torch.uint8)


def pack(value: torch.Tensor, formula: Any = None, bounds: tuple[Any, ...] = ()) -> torch.Tensor:
    """`value`'s elements as bits (nonzero, or where the test `formula` reads it through holds: 1), eight to a
    byte, in its logical order. Column by column, so that what it takes besides the value is at most
    `packing_bytes`."""
    if formula is not None:
        bits = _TESTS[formula].holds(value, *bounds)
    else:
        bits = value if value.dtype is torch.bool else value != 0
    flat = bits.reshape(-1)
    numel = flat.numel()
    whole = numel - numel % 8
    rows = flat[:whole].view(-1, 8)
    packed = rows[:, 0].to(torch.uint8)
    for k in range(1, 8):
        packed = packed | (rows[:, k].to(torch.uint8) << k)
    if whole < numel:
        tail = flat[whole:].to(torch.uint8) << torch.arange(numel - whole, dtype=torch.uint8, device=value.device)
        packed = torch.cat([packed, tail.sum(0, keepdim=True, dtype=torch.uint8)])
    return packed


def packing_bytes(value: torch.Tensor) -> int:
    """At most the bytes `pack(value)` takes besides `value` and its result, at once, as `value`'s device
    allocates them: a boolean of it (for a float), its copy in logical order (for a layout that is not), the
    columns being combined, and the shifts of a last partial byte."""
    numel, on = value.numel(), value.device
    tested = allocated_nbytes(numel, on) * (value.dtype is not torch.bool)
    in_order = allocated_nbytes(numel, on) * (not value.is_contiguous())
    return tested + in_order + 4 * allocated_nbytes(_packed_bytes(numel), on) + allocated_nbytes(8, on)


def unpack(
    packed: torch.Tensor,
    device: torch.device,
    numel: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    op: Any = None,
    by: Any = None,
) -> torch.Tensor:
    """The value `pack` packed, in its layout: a boolean, Bernoulli draws, or draws run through `op` with
    `by` again (a tested value's stand-in: NOTE [values kept as bits]). What it takes besides its result is at most
    `unpacking_bytes`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:numel].view(shape)
    value = bits.bool() if dtype is torch.bool else bits.to(dtype)
    del bits
    if op is not None:
        value = op(value, by)
    if value.stride() == stride:
        return value
    return packed.new_empty_strided(shape, stride, dtype=dtype).copy_(value)


def unpacking_bytes(value: torch.Tensor) -> int:
    """At most the bytes `unpack` takes besides its result (`value`'s size) at once, as `value`'s device
    allocates them: the eight shifts, and the bits, a byte each, twice (shifted, then masked), or the value
    before its op or its layout, while the result is made."""
    on = value.device
    bits = allocated_nbytes(8 * _packed_bytes(value.numel()), on)
    return allocated_nbytes(8, on) + max(2 * bits, allocated_nbytes(value.numel() * value.element_size(), on))
