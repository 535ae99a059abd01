"""What one op call measures: its FLOPs and the bytes of its tensors (data-dependent sizes at their bound)."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

from .._torch import size_bound
from ._cuda_allocator import allocated_nbytes

__all__ = ["estimate_flops", "output_nbytes", "storage_key", "storage_nbytes", "tensor_nbytes", "tensors_in"]


aten = torch.ops.aten

# Kernels torch's FLOP counter has no formula for, counted like one it has: the CPU attention
# kernels take (query, key, value, ...) as the CUDA ones do.
_SAME_FORMULA: dict[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_attention_math: aten._scaled_dot_product_flash_attention,
}


def _grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: Any, **kwargs: Any) -> int:
    """A grouped product multiplies each row of a group by its group's matrix: 2 * output * inner size,
    except that two 2-D operands split the inner size among the groups."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    return 2 * out_val.numel() * mat_a.shape[-1]


_FORMULAS: dict[Any, Any] = {aten._grouped_mm: _grouped_mm_flops}


def estimate_flops(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Estimate the forward FLOPs of `op(*args, **kwargs) -> out` (the count `Call.flops` holds, and the
    default cost remat's planners minimize; public as `remat.costs.estimate_flops`).

    Matmul-like ops use torch's own FLOP formulas (`torch.utils.flop_counter`);
    any other op is counted as one FLOP per output element, which is the right
    order of magnitude for pointwise ops and reductions.

    Args:
        op: an aten op overload (`torch.ops.aten.mm.default`).
        args: its positional arguments (tensors, fake tensors or meta tensors).
        kwargs: its keyword arguments.
        out: its output.

    >>> import torch
    >>> from remat.costs import estimate_flops
    >>> a, b = torch.ones(4, 8), torch.ones(8, 16)
    >>> estimate_flops(torch.ops.aten.mm.default, (a, b), {}, a @ b)  # 2 * 4 * 8 * 16
    1024
    >>> estimate_flops(torch.ops.aten.relu.default, (a,), {}, a.relu())  # one per output element
    32
    """
    packet = getattr(op, "overloadpacket", None)
    count_flops = _FORMULAS.get(packet) or flop_registry.get(_SAME_FORMULA.get(packet, packet))
    if count_flops is not None:
        try:
            return size_bound(count_flops(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not accept these arguments
            pass
    return sum(size_bound(t.numel()) for t in tensors_in(out))


# NOTE [data-dependent sizes count at their bound]
# The size of `nonzero`'s output (or of a boolean-mask index, `masked_select`, ...) is a symbol
# while tracing. What remat accounts (bytes kept, FLOPs, the peak) is what a memory plan must
# allow for: the largest value the size can take (n for `nonzero` of n elements), or, where
# nothing bounds it, the size torch.compile's cost model assumes (`UNBOUNDED_SIZE`).
def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s elements. See NOTE [data-dependent sizes count at their bound]."""
    return size_bound(tensor.numel() * tensor.element_size())


def storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the memory `tensor` views, as its device's allocator counts them (NOTE [what the CUDA
    allocator counts]). See NOTE [data-dependent sizes count at their bound]."""
    return allocated_nbytes(size_bound(tensor.untyped_storage().nbytes()), tensor.device)


def storage_key(tensor: torch.Tensor) -> Any:
    """A hashable name for the memory `tensor` views (which does not keep it alive)."""
    return StorageWeakRef(tensor.untyped_storage())


def output_nbytes(out: Any) -> int:
    """Bytes of the tensors in `out`."""
    return sum(tensor_nbytes(t) for t in tensors_in(out))


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a value that may be a tensor, a tuple/list of them, or neither."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []
