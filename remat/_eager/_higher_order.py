"""Higher-order ops inside a trace: the tensors their function arguments close over, passed explicitly.

See NOTE [tensors that a higher-order op's functions close over].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from .._core import _objects
from .._torch import HigherOrderOperator

__all__ = ["with_closures_lifted"]

_NAMESPACE = "remat"

# NOTE [tensors that a higher-order op's functions close over]
# FlexAttention's op takes functions (`score_mod`, and the block mask's
# `mask_mod`) and the tensors they read besides their index arguments as extra
# arguments (`score_mod_other_buffers`, `mask_mod_other_buffers`), which it
# passes on to them. Called eagerly, `flex_attention` passes none: the
# functions read their tensors from their closures (document masking's
# `document_ids`), which torch.compile lifts into those arguments. In remat's
# trace, such a tensor is one of the trace's own (an input opened from a
# `BlockMask` argument, see NOTE [objects handed to a checkpointed function],
# or a closed-over tensor), and the op's autograd rule traces the functions'
# derivatives where no functionalization or fake mode is active, so a tensor
# read from a closure there would be used outside the modes that own it (torch
# raises) or baked in as a constant. So remat lifts them as torch.compile does:
# each function is opened, its tensors are appended to its extra arguments, and
# it is called through a wrapper that closes it again over the tensors it is
# handed.


def _lifted(function: Any, n_args: int) -> tuple[Any, list[torch.Tensor]]:
    """`function` (called with `n_args` arguments, then its extra tensors) made to take the tensors it
    closes over after those, and the tensors; `function` itself and none if it closes over none."""
    opened = _objects.open_leaf(function, _NAMESPACE)
    if not _objects.is_opened(opened):
        return function, []
    leaves, spec = optree.tree_flatten(opened, none_is_leaf=False, namespace=_NAMESPACE)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not positions:
        return function, []

    def with_its_tensors(*args: Any) -> Any:
        given, extra = args[: len(args) - len(positions)], args[len(args) - len(positions) :]
        closed = list(leaves)
        for position, tensor in zip(positions, extra, strict=True):
            closed[position] = tensor
        return _objects.closed(optree.tree_unflatten(spec, closed), _NAMESPACE)(*given)

    return with_its_tensors, [leaves[i] for i in positions]


def _flex_attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = ("score_mod_other_buffers", "mask_mod_other_buffers")
    query, key, value, score_mod, block_mask, scale, kernel_options, *rest = args
    buffers = {**dict(zip(names, rest, strict=False)), **kwargs}
    score_buffers, mask_buffers = (tuple(buffers.get(name, ())) for name in names)
    score_mod, score_tensors = _lifted(score_mod, 5 + len(score_buffers))
    mask_mod, mask_tensors = _lifted(block_mask[-1], 4 + len(mask_buffers))
    block_mask = (*block_mask[:-1], mask_mod)
    lifted = (query, key, value, score_mod, block_mask, scale, kernel_options)
    return lifted, {names[0]: (*score_buffers, *score_tensors), names[1]: (*mask_buffers, *mask_tensors)}


_Arguments = tuple[tuple[Any, ...], dict[str, Any]]
_RULES: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], _Arguments]] = {"flex_attention": _flex_attention}


def with_closures_lifted(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Arguments:
    """The arguments of a call of the higher-order op `func` with the tensors its function arguments close
    over passed explicitly (the arguments as they are for any other op)."""
    if not isinstance(func, HigherOrderOperator):
        return args, kwargs
    rule = _RULES.get(func.name())
    return (args, kwargs) if rule is None else rule(args, kwargs)
