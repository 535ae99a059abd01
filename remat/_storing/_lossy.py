"""Kept values stored in a narrower floating format, approximately, where the user asks: bfloat16 or float16 for
float32 values, and FP8 (e4m3) with a scale per row for float32 and bfloat16 values. See NOTE [values kept
lossy].
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

from .._memory._cuda_allocator import allocated_nbytes
from .._torch import dense_without_overlap, is_functorch_wrapped

__all__ = ["FP8_MAX", "Narrowing", "FLOAT16", "BFLOAT16", "FP8", "recording_errors"]

# NOTE [values kept lossy]
# A kept value may wait for backward in fewer bits per element than it has,
# where a policy asks (`policies.compress`), or a planner is allowed to
# (`compress=`); they never choose it on their own. The gradient formulas that read it then read it rounded: forward
# is untouched (it reads the value itself), and so is every replay and every
# recomputation to differentiate again (a value one of them reads is kept as it
# is, as a stand-in is: NOTE [values kept as bits]), so the one rounding is the
# only error, in the gradients of the formulas that read the value. Formats:
#
# - bfloat16 (a float32 value's range, 8 bits of precision) and float16 (11
#   bits, but values beyond 65504 in magnitude become infinities);
# - FP8 e4m3 (4 bits of precision, up to 448) for float32 and bfloat16 values,
#   scaled per row (the value's last dimension): each row's largest finite
#   magnitude maps to 448, and its scale is kept in float32 beside it, in one
#   byte tensor (scales first, for their alignment). Per row, not per tensor:
#   one large row (an outlier token) then costs the other rows no precision
#   (docs/storage.md has the measurement). A row's infinities come back as its
#   largest finite magnitude, NaN as NaN.
#
# Forward-mode AD differentiates what its programs read of kept values, and a
# narrowed value carries no derivative: where a function is traced for forward
# mode, its values are kept as they are (`_partition`).
#
# FP8's stored form views bytes as other dtypes, which vmap cannot do before
# torch 2.12: there, under torch.func's transforms, a value FP8 would hold is
# kept as it is (the load finds it so), beyond what the peak prediction counts.
#
# Only dense values are narrowed, and only where it takes fewer bytes (a row of
# fewer than 8 elements costs FP8 more in scales than it saves). A narrowed
# value is loaded in its own layout. `recording_errors` records the largest
# error each store introduced, for `remat.report`.

FP8_MAX = 448.0  # e4m3's largest finite magnitude


@functools.cache
def transforms_view_dtypes() -> bool:
    """Whether this torch's vmap views a tensor as another dtype (FP8's stored form needs it; 2.12 on)."""
    try:
        torch.vmap(lambda t: t.view(torch.uint8))(torch.zeros(1, 4))
    except RuntimeError:
        return False
    return True


_FP8 = torch.float8_e4m3fn

_recording = threading.local()


@contextlib.contextmanager
def recording_errors() -> Iterator[dict[str, float]]:
    """Inside, each store records the largest absolute error its value comes back with, by the name of the
    node it keeps (the largest over several runs)."""
    errors: dict[str, float] = {}
    previous = getattr(_recording, "errors", None)
    _recording.errors = errors
    try:
        yield errors
    finally:
        _recording.errors = previous


def _record(name: str, value: torch.Tensor, back: torch.Tensor) -> None:
    errors = getattr(_recording, "errors", None)
    if errors is not None:
        error = (back.double() - value.double()).abs().nan_to_num(nan=0.0).amax().item() if value.numel() else 0.0
        errors[name] = max(errors.get(name, 0.0), error)


@dataclasses.dataclass(frozen=True)
class Narrowing:
    """One narrower format for kept values: its functions, for a `_storage.Storage`."""

    name: str
    narrows: tuple[torch.dtype, ...]  # the dtypes of the values it stores
    itemsize: int  # bytes per element in it
    scaled: bool  # FP8's scale per row

    def holds(self, node: fx.Node) -> bool:
        """Whether `node`'s value can be stored so, in fewer bytes."""
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dtype not in self.narrows or value.dim() == 0:
            return False
        if not all(isinstance(n, int) for n in (*value.shape, *value.stride())) or not dense_without_overlap(value):
            return False
        return self.form_nbytes(value) < value.numel() * value.element_size()

    def form_nbytes(self, value: torch.Tensor) -> int:
        return value.numel() * self.itemsize + (4 * _rows(value) if self.scaled else 0)

    def form(self, value: torch.Tensor) -> torch.Tensor:
        """What the stored form of `value` (a fake tensor) is, for the peak prediction."""
        if self.scaled:
            return value.new_empty((self.form_nbytes(value),), dtype=torch.uint8)
        return value.new_empty_strided(tuple(value.shape), tuple(value.stride()), dtype=_DTYPES[self.name])

    def store_args(self, node: fx.Node) -> tuple[Any, ...]:
        return (node.name,)

    def load_args(self, node: fx.Node) -> tuple[Any, ...]:
        value = node.meta["val"]
        return (tuple(value.shape), tuple(value.stride()), value.dtype)

    def store(self, value: torch.Tensor, name: str) -> torch.Tensor:
        """`value` in this format (FP8: scales, then the scaled elements in logical order, as bytes)."""
        if not self.scaled:
            stored = value.to(_DTYPES[self.name])
        elif is_functorch_wrapped(value) and not transforms_view_dtypes():
            return value  # kept as it is: NOTE [values kept lossy]
        else:
            rows = value.reshape(_rows(value), -1)
            finite = rows.abs().nan_to_num(nan=0.0, posinf=0.0)
            largest = finite.amax(dim=1, keepdim=True).float()
            del finite
            scales = torch.where(largest > 0, FP8_MAX / largest, torch.ones_like(largest))
            scaled = (rows.float() * scales).clamp(-FP8_MAX, FP8_MAX).to(_FP8)
            # Made out of place (no buffer filled in), so that it runs under vmap as it does outside.
            stored = torch.cat([scales.view(torch.uint8).reshape(-1), scaled.view(torch.uint8).reshape(-1)])
        if getattr(_recording, "errors", None) is not None:
            _record(
                name, value, self.load(stored, value.device, tuple(value.shape), tuple(value.stride()), value.dtype)
            )
        return stored

    def store_bytes(self, value: torch.Tensor) -> int:
        """At most the bytes `store` takes besides `value` and its result, at once, as the device allocates
        them (FP8: the magnitudes; the scaled float32 rows, with a float32 copy of a bfloat16 value, then their
        FP8 elements; the scales)."""
        if not self.scaled:
            return 0
        on, numel = value.device, value.numel()
        floats = allocated_nbytes(4 * numel, on)
        copy = floats if value.dtype is not torch.float32 else 0
        magnitudes = allocated_nbytes(numel * value.element_size(), on)
        elements = allocated_nbytes(numel, on)
        return max(2 * magnitudes, copy + floats, floats + elements, 2 * elements) + 4 * allocated_nbytes(
            4 * _rows(value), on
        )

    def load(
        self,
        stored: torch.Tensor,
        device: torch.device,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The value `store` stored, in its dtype and layout (rounded)."""
        if not self.scaled:
            value = stored.to(dtype)
        elif stored.dtype is not torch.uint8:  # kept as it is (under vmap, before torch 2.12)
            return stored
        else:
            rows = _rows_of(shape)
            scales = stored[: rows * 4].view(torch.float32).view(rows, 1)
            value = (stored[rows * 4 :].view(_FP8).view(rows, -1).float() / scales).to(dtype).view(shape)
        if value.stride() == stride:
            return value
        return torch.empty_strided(shape, stride, dtype=dtype, device=value.device).copy_(value)

    def load_bytes(self, value: torch.Tensor) -> int:
        """At most the bytes `load` takes besides its result (`value`'s size), at once."""
        on, numel = value.device, value.numel()
        before_layout = allocated_nbytes(numel * value.element_size(), on)
        if not self.scaled:
            return before_layout
        floats = allocated_nbytes(4 * numel, on)
        return 2 * floats + before_layout


def _rows(value: torch.Tensor) -> int:
    return _rows_of(tuple(value.shape))


def _rows_of(shape: tuple[int, ...]) -> int:
    """Rows of the last dimension (1 for a 0-d value)."""
    count = 1
    for n in shape[:-1]:
        count *= n
    return count


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

BFLOAT16 = Narrowing("bfloat16", (torch.float32,), 2, scaled=False)
FLOAT16 = Narrowing("float16", (torch.float32,), 2, scaled=False)
FP8 = Narrowing("fp8", (torch.float32, torch.bfloat16), 1, scaled=True)
