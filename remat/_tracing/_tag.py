"""`remat.tag`: names for the calls that produce values, for policies to refer to."""

from __future__ import annotations

from typing import Any, TypeVar

import optree
import torch
from torch import fx

from .._core._pytree import NAMESPACE
from .._eager._facts import add_tag
from .._eager._nodes import is_free
from .._torch import get_proxy_mode
from ._nesting import is_tracing

__all__ = ["tag"]

T = TypeVar("T")

aten = torch.ops.aten


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


def name_producer(tensor: torch.Tensor, name: str) -> None:
    """Give `name` to the call of the graph being traced that produced `tensor` (see `remat.tag`).

    The traced graph names `tensor` only through what it is computed from, so an
    alias of it is traced, its argument read off, and the alias removed again.
    """
    proxy_mode = get_proxy_mode()
    if proxy_mode is None:  # the discovery pass records no graph
        return
    graph = proxy_mode.tracer.graph
    last = next(iter(reversed(graph.nodes)))
    torch.ops.aten.alias.default(tensor)
    new_nodes = []
    for node in reversed(graph.nodes):
        if node is last:
            break
        new_nodes.append(node)
    for node in new_nodes:  # newest first: nothing reads them
        if node.target is aten.alias.default and isinstance(node.args[0], fx.Node):
            producer = node.args[0]
            while is_free(producer) and producer.op == "call_function" and isinstance(producer.args[0], fx.Node):
                producer = producer.args[0]
            add_tag(producer, name)
        graph.erase_node(node)
