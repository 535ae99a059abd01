"""Make the fake kernels of a trace give the outputs eager's kernels give.

Fake tensors predict each op's output from its meta kernel or decomposition. `EagerLayoutFakeMode`, the
fake tensor mode of a trace, corrects that where it differs from eager: the CPU kernels that choose their
output layout themselves (NOTE [kernels that choose their output layout]), the dtypes of
`FAKE_DTYPE_ERRATA`, the layout of a random fill traced in eager's (NOTE [random fills draw in eager's
layout]), outputs the fake cache would give at the wrong storage offset (NOTE [fake results from the
cache lose their storage offset]), and the in-place ops whose meta kernels fail under forward AD (NOTE
[in-place ops whose meta kernels fail under forward AD]), which the functional mode also runs out of
place. It notes the user's generators it draws from, and a fake kernel that refuses its inputs raises
`FakeKernelRefused`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _quirks
from .._core._rng import DrawnGenerators
from .._torch import (
    FAKE_DTYPE_ERRATA,
    STRICT_FAKE_KERNELS,
    HigherOrderOperator,
    UncheckedRealValuesFakeMode,
    elementwise_output_strides,
    forward_ad_level,
    run_real_kernel_on_zeros,
)

__all__ = [
    "EagerLayoutFakeMode",
    "FakeKernelRefused",
    "check_in_place_result",
    "out_of_place_under_forward_ad",
]

aten = torch.ops.aten


# NOTE [kernels that choose their output layout]
# Fake tensors predict output strides from each op's meta kernel or
# decomposition, which mostly follows the input's layout. Some CPU kernels
# choose another: batch norm's return a tensor contiguous in the input's
# suggested memory format, log-sigmoid's and several backward kernels' a
# contiguous one whatever their inputs, and some elementwise ops whose
# decomposition reorders their operands (`floor_divide`, `copysign`, `xlogy`)
# take the layout TensorIterator gives, led by the first operand. Eager's
# `bn(x.transpose(1, 2)).view(-1)` works, while the fake predicts transposed
# strides and refuses the view. The tracing fake mode corrects those outputs,
# so that the trace (views, random fills, the kernels attention chooses, output
# metadata) sees the layouts eager sees. The table is PyTorch's OpInfo database
# swept on torch 2.13 and 2.15 for real CPU strides that differ from the fake
# ones (docs/debugging.md).
# The table is `_quirks.CPU_KERNELS_CHOOSE_LAYOUTS`.
_CPU_LAYOUT = _quirks.CPU_KERNELS_CHOOSE_LAYOUTS.table


# NOTE [fake results from the cache lose their storage offset]
# FakeTensorMode caches the metadata of an op's outputs, and on a hit makes a
# new output with `empty_strided`: an output that is no view but sits at an
# offset in its storage, as `aten.copy`'s does when its destination does (a
# slice assignment, functionalized), comes back at offset 0, with a smaller
# storage than eager's. The first trace in a process then counted other bytes
# than the next one. These ops are dispatched past the cache.
_CACHE_LOSES_OFFSETS = frozenset({aten.copy.default})


class EagerLayoutFakeMode(UncheckedRealValuesFakeMode):
    """A fake tensor mode whose outputs have the strides (and dtypes, `FAKE_DTYPE_ERRATA`) eager's kernels give them,
    and that notes the user's generators it draws from (`drawn_generators`), to be put back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drawn_generators = DrawnGenerators()
        self.fill_strides: tuple[int, ...] | None = None  # eager's layout for the random fill traced next
        # eager's layout for the functional form of the in-place op traced next: NOTE [in-place ops keep
        # their tensor's layout]
        self.in_place_layout: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (shape, strides)

    def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):  # See NOTE [higher-order ops under remat's modes].
            return super().dispatch(func, types, args, kwargs)
        try:
            if func in STRICT_FAKE_KERNELS and not _on_cuda(args):
                return run_real_kernel_on_zeros(self, func, args, kwargs)
            out_of_place = out_of_place_under_forward_ad(func)
            if out_of_place is not None:  # See NOTE [in-place ops whose meta kernels fail under forward AD].
                check_in_place_result(func, args[0], self.dispatch(out_of_place, types, args, kwargs))
                return args[0]
            self.drawn_generators.note(kwargs.get("generator"))  # tracing with real values draws for real
            if func in _CACHE_LOSES_OFFSETS and self.cache_enabled:
                result: Any = self._uncached(func, types, args, kwargs)
            else:
                result = super().dispatch(func, types, args, kwargs)
        except RuntimeError as error:
            if type(error) is RuntimeError:  # not one of the subclasses that say why tracing cannot go on
                raise FakeKernelRefused(func, error) from error
            raise
        if self.fill_strides is not None and torch.Tag.nondeterministic_seeded in func.tags:
            strides, self.fill_strides = self.fill_strides, None  # NOTE [random fills draw in eager's layout]
            if isinstance(result, torch.Tensor) and tuple(result.stride()) != strides:
                return self._restrided(types, result, strides)
        if self.in_place_layout is not None and isinstance(result, torch.Tensor):
            (shape, strides), self.in_place_layout = self.in_place_layout, None
            if tuple(result.shape) == shape and tuple(result.stride()) != strides:
                return self._restrided(types, result, strides)
        erratum = FAKE_DTYPE_ERRATA.get(func)
        if erratum is not None:
            index, eager_dtype = erratum
            dtype = eager_dtype(*args, **kwargs)
            if result[index].dtype != dtype:
                fixed = super().dispatch(aten._to_copy.default, types, (result[index],), {"dtype": dtype})
                result = (*result[:index], fixed, *result[index + 1 :])
        layout = _CPU_LAYOUT.get(func)
        if layout is None:
            return result
        outputs = list(result) if isinstance(result, tuple) else [result]
        for i in layout.outputs:
            output = outputs[i]
            if not isinstance(output, torch.Tensor) or output.device.type != "cpu" or output.dim() == 0:
                continue
            eager = _eager_strides(layout, output, args)
            if eager is not None and tuple(output.stride()) != eager:
                outputs[i] = self._restrided(types, output, eager)
        return tuple(outputs) if isinstance(result, tuple) else outputs[0]

    def _uncached(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """`func` dispatched past the fake tensor cache: NOTE [fake results from the cache lose their storage offset]."""
        self.cache_enabled = False
        try:
            return super().dispatch(func, types, args, kwargs)
        finally:
            self.cache_enabled = True

    def _restrided(self, types: Any, fake: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
        """`fake` with `strides` (and, traced with values, the same values)."""
        fixed = super().dispatch(
            aten.empty_strided.default,
            types,
            (fake.shape, tuple(strides)),
            {"dtype": fake.dtype, "device": fake.device},
        )
        return super().dispatch(aten.copy_.default, types, (fixed, fake), {})  # type: ignore[no-any-return]


class FakeKernelRefused(RuntimeError):
    """An op's fake kernel (its rule for output shapes and dtypes) refused its inputs while tracing:
    the inputs are wrong for the op, or the rule is stricter than the real kernel."""

    def __init__(self, op: Any, error: RuntimeError):
        super().__init__(f"{op}: {error}")
        self.op, self.reason = op, str(error)


def _on_cuda(args: Sequence[Any]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args)


def _eager_strides(layout: _quirks.CpuLayout, output: torch.Tensor, args: Sequence[Any]) -> tuple[int, ...] | None:
    """The strides the CPU kernel gives `output`, by `layout`; None where the fake's can stand (and
    where sizes depend on values, which meta tensors cannot take: the fake's stand there too)."""
    tensors = [output, *(a for a in args if isinstance(a, torch.Tensor))]
    if any(not isinstance(n, int) for t in tensors for n in (*t.shape, *t.stride())):
        return None
    if layout.position == _quirks.ELEMENTWISE:
        chosen = args if layout.operands is None else [args[i] for i in layout.operands]
        operands = [a for a in chosen if isinstance(a, torch.Tensor) and a.dim() > 0]  # 0-d ones lead nothing
        if not operands or torch.broadcast_shapes(*(o.shape for o in operands)) != output.shape:
            return None
        return elementwise_output_strides(operands)
    memory_format = (
        torch.contiguous_format
        if layout.position == _quirks.CONTIGUOUS
        else _suggested_memory_format(args[layout.position])
    )
    return tuple(torch.empty(output.shape, device="meta", memory_format=memory_format).stride())


def _suggested_memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """The layout CPU kernels give the output for `tensor`: channels-last if it is, else contiguous."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if tensor.dim() == 5 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


# NOTE [in-place ops whose meta kernels fail under forward AD]
# The meta kernel of `lerp_` with a tensor weight calls `lerp` by its overload
# packet, and resolving the overload prints the weight as it tries it against
# `lerp.Scalar`; while a forward-mode AD level is active, printing a tensor
# inside a kernel raises torch's internal assert about `_fw_primal`
# (`_quirks.IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD`). `quantile` calls
# `lerp_`, so it could not be traced under `jvp` or `forward_ad`. While a level
# is active, remat's fake and functional modes run such an op as its out-of-place
# overload (the same kernel), after the check the in-place op adds (the result's
# shape is the updated tensor's); the functional mode then gives the updated
# tensor that result as its new value, as functionalization does for an in-place
# op.


def out_of_place_under_forward_ad(func: Any) -> Any:
    """The out-of-place overload to run instead of `func` (in place), if its meta kernel would fail here."""
    table = _quirks.IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD.table
    if func not in table or forward_ad_level() < 0:
        return None
    return table[func]


def check_in_place_result(func: Any, target: torch.Tensor, result: torch.Tensor) -> None:
    """The check `func` (in place into `target`) makes of its `result` beyond the out-of-place op's (which
    already asks for one dtype), as eager's message says it."""
    if result.shape != target.shape:
        raise RuntimeError(
            f"{func}: output with shape {list(target.shape)} doesn't match the broadcast shape {list(result.shape)}"
        )
