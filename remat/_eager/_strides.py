"""Read what a tensor's shape and strides say about its memory: whether its elements fill it with no
gaps (`is_dense`), and whether two of them may share it (`may_overlap`).

Sizes and strides are read as plain integers (where one is symbolic, `is_dense` says dense and
`may_overlap` says no), with no tensor op, so that the tracing modes can ask while a trace's modes are
active.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "is_dense",
    "may_overlap",
]


def _known(shape: Sequence[Any], strides: Sequence[Any]) -> list[tuple[int, int]] | None:
    """(stride, size) of each dimension with more than one element, by stride; None if symbolic."""
    if not all(isinstance(v, int) for v in (*shape, *strides)):
        return None
    if 0 in shape:
        return []
    return sorted((stride, size) for size, stride in zip(shape, strides, strict=True) if size > 1)


def may_overlap(shape: Sequence[Any], strides: Sequence[Any]) -> bool:
    """Whether two elements of a tensor may share memory. Where every stride steps past the whole
    extent of the smaller-strided dimensions, none do; where one is zero, some do; in between
    (`as_strided((3, 2), (2, 3))` interleaves distinct elements), the offsets are counted, up to
    `_OFFSETS_COUNTED` elements (past that, the write is taken to overlap)."""
    dims = _known(shape, strides)
    extent = 0
    for stride, size in dims or ():
        if stride == 0:
            return True
        if stride <= extent:
            return _offsets_repeat(dims or [])
        extent += stride * (size - 1)
    return False


_OFFSETS_COUNTED = 1 << 20


def _offsets_repeat(dims: Sequence[tuple[int, int]]) -> bool:
    """Whether two indices of a tensor with these (stride, size) dimensions reach one offset."""
    count = 1
    for _, size in dims:
        count *= size
    if count > _OFFSETS_COUNTED:
        return True
    offsets = {0}  # plain integers: no tensor op while a trace's modes are active
    for stride, size in dims:
        offsets = {offset + stride * i for offset in offsets for i in range(size)}
    return len(offsets) < count


def is_dense(shape: Sequence[Any], strides: Sequence[Any]) -> bool:
    """Whether a tensor's elements fill its memory with no gaps (contiguous in some order)."""
    dims = _known(shape, strides)
    if dims is None:
        return True
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True
