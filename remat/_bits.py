"""Kept values stored as bits, exactly: booleans, and masks of Bernoulli draws scaled by a number (dropout's on
the CPU). See NOTE [values kept as bits].
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from ._torch import dense_without_overlap

__all__ = [
    "load_args",
    "pack",
    "packable",
    "packed_like",
    "packed_nbytes",
    "packing_bytes",
    "unpack",
    "unpacking_bytes",
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


def packable(node: fx.Node) -> bool:
    """Whether `node`'s value can be kept as bits exactly, in fewer bytes (NOTE [values kept as bits])."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return False
    # One output of a multi-output call (CUDA's dropout mask) can only be a boolean here.
    scaled = node.target is not operator.getitem and value.is_floating_point() and _scaled_draws(node)
    if not (value.dtype is torch.bool or scaled):
        return False
    if not all(isinstance(n, int) for n in (*value.shape, *value.stride())):
        return False
    return dense_without_overlap(value) and _packed_bytes(value.numel()) < value.numel() * value.element_size()


def _packed_bytes(numel: int) -> int:
    return -(-numel // 8)


def load_args(node: fx.Node) -> tuple[Any, ...]:
    """The static arguments `unpack` takes after the device, for `node`'s value."""
    value = node.meta["val"]
    remake = () if value.dtype is torch.bool or node.target in _BERNOULLI else (node.target, node.args[1])
    return (value.numel(), tuple(value.shape), tuple(value.stride()), value.dtype, *remake)


def packed_nbytes(value: torch.Tensor) -> int:
    """Bytes of the packed form of `value` (a fake tensor of a trace, or a functorch wrapper of one)."""
    return _packed_bytes(value.numel())


def packed_like(value: torch.Tensor) -> torch.Tensor:
    """What the packed form of `value` (a fake tensor) is, for the peak prediction."""
    return value.new_empty((_packed_bytes(value.numel()),), dtype=torch.uint8)


def pack(value: torch.Tensor) -> torch.Tensor:
    """`value`'s elements as bits (nonzero: 1), eight to a byte, in its logical order. Column by column, so
    that what it takes besides the value is at most `packing_bytes`."""
    flat = (value if value.dtype is torch.bool else value != 0).reshape(-1)
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
    """At most the bytes `pack(value)` takes besides `value` and its result, at once: a boolean of it (for a
    float), its copy in logical order (for a layout that is not), and the columns being combined."""
    numel = value.numel()
    return numel * (value.dtype is not torch.bool) + numel * (not value.is_contiguous()) + 4 * _packed_bytes(numel)


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
    `by` again (NOTE [values kept as bits]). What it takes besides its result is at most
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
    """At most the bytes `unpack` takes besides its result (`value`'s size) at once: the bits, a byte each
    (twice, as they are shifted out), and the value before its op or its layout."""
    return 2 * 8 * _packed_bytes(value.numel()) + value.numel() * value.element_size()
