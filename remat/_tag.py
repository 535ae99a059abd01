"""`remat.tag`: names for the calls that produce values, for policies to refer to."""

from __future__ import annotations

from typing import Any, TypeVar

import optree
import torch

from ._joint import is_tracing, name_producer
from ._pytree import NAMESPACE

__all__ = ["tag"]

T = TypeVar("T")


def tag(x: T, name: str) -> T:
    """Name the calls that produce the tensors of `x`, and return `x` unchanged.

    Inside a function that `remat.checkpoint` traces, every tensor leaf of `x`
    gives `name` to the call that produced it (`Call.tags`), so a policy can
    save it by name: `remat.policies.save_tagged(name)`, as JAX's
    `checkpoint_name` and `save_only_these_names`. A view's name goes to the
    call that produced its base; an input of the function is produced by no
    call, so naming it names nothing. Outside a trace (plain eager code, or
    under `torch.func` transforms outside any checkpoint) it does nothing, and
    it never costs anything when the checkpointed function runs: names exist
    only in the trace.

    Args:
        x: a tensor, or a pytree of tensors (other leaves are left alone).
        name: a non-empty string.

    Returns:
        `x` itself.

    >>> import torch, remat
    >>> def mlp(x, w1, w2):
    ...     h = remat.tag(x @ w1, "hidden")
    ...     return h.relu() @ w2
    >>> x, w1, w2 = torch.randn(2, 3), torch.randn(3, 4, requires_grad=True), torch.randn(4, 1)
    >>> [(call.name, sorted(call.tags)) for call in remat.trace(mlp, x, w1, w2)]
    [('aten.mm.default', ['hidden']), ('aten.relu.default', []), ('aten.mm.default', [])]
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"remat.tag: expected a non-empty string as the name, but got {name!r}.")
    if is_tracing():
        leaves: list[Any] = optree.tree_leaves(x, none_is_leaf=False, namespace=NAMESPACE)  # type: ignore[arg-type]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                name_producer(leaf, name)
    return x
