"""Where the traced graph's derivatives stop, which the graph alone does not say: the detaches that are
`fn`'s own (run as detaches), and which outputs of a call autograd differentiates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from .. import _quirks
from .._eager._facts import note_stop_gradient, stop_gradient_of
from .._torch import FakeTensorMode
from ._discovery import all_floats

__all__ = ["find_differentiable_outputs", "mark_replayed_detaches", "may_stop_derivatives"]

aten = torch.ops.aten


def mark_replayed_detaches(
    forward_nodes: frozenset[fx.Node],
    detached: set[fx.Node],
    mutations: Sequence[fx.Node],
    returned: Mapping[fx.Node, Any],
) -> None:
    """Mark as `fn`'s own detaches the aliases functionalization recreated of what `fn` detached,
    and make each of `fn`'s detaches an `aten.detach`. See NOTE [a detach runs as a detach].

    `capture_mode` marks the node `x.detach()` creates (an `aten.detach`, or an `aten.alias` since
    torch 2.15); but functionalization recreates the detached alias of a tensor updated in place
    when it is next read, during another call: of its new value (for an input, the value written
    back into it). Only those aliases of new values are recreations: another alias of what `fn`
    detached, itself not updated, is no detach of `fn`'s (make_fx may record one during `v.detach()`
    that stands for `v` where backward reads a value autograd saved, `exp`'s result, with its
    derivative). An alias `fn` returns (`returned`: output node -> what `fn` returned, as eager made
    it) that is no view and has no history is a detach too, however many updates of the memory it
    shares came between (a detach of an input updated in place before and after)."""
    updated = {m.args[1] for m in mutations if m.args[0] in detached}
    for node in forward_nodes:
        if node.target in _quirks.DETACH_TRACES_AS_ALIAS.table and node.args[0] in updated:
            note_stop_gradient(node, "detach")
        value = returned.get(node)
        if node.target is aten.alias.default and isinstance(value, torch.Tensor) and _is_detached(value):
            note_stop_gradient(node, "detach")
        if node.target is aten.alias.default and stop_gradient_of(node) == "detach":
            node.target = aten.detach.default


# NOTE [a detach runs as a detach]
# Since torch 2.15 make_fx records `x.detach()` as `aten.alias`. Run as traced, an alias is a view
# that autograd differentiates: an output `x.detach()` rebuilt outside the Function (the epilogue
# rebuilds views of inputs and of returned outputs) would require grad, and send gradient back
# into `x`. Eager's detach makes a tensor that shares `x`'s memory and version counter but is no
# view and has no history, which is what `aten.detach` makes: `fn`'s own detaches run as that.


def _is_detached(output: torch.Tensor) -> bool:
    """Whether `output` is what a detach makes: no view, and no history."""
    return not output.requires_grad and not output._is_view()


def may_stop_derivatives(node: fx.Node) -> bool:
    """Whether autograd may leave some float output of the call `node` without a derivative from its
    float inputs: a multi-output call (the mean and rstd of `native_layer_norm`), or one output
    computed from a float tensor (`empty_like`, `zeros_like`: a buffer that dropout then fills)."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return True
    return (
        isinstance(value, torch.Tensor)
        and all_floats(value)
        and any(isinstance(v := arg.meta.get("val"), torch.Tensor) and all_floats(v) for arg in node.all_input_nodes)
    )


def find_differentiable_outputs(node: fx.Node, fake_mode: FakeTensorMode) -> tuple[bool, ...]:
    """Which outputs of a call autograd differentiates (not, say, the mean and rstd of
    `native_layer_norm`, nor the output of `empty_like`), found by calling it on fake tensors
    that require grad: all its float inputs at once or, where the op refuses one (batch norm's
    running statistics), each of them alone."""
    values = [v for n in node.all_input_nodes if isinstance(v := n.meta.get("val"), torch.Tensor) and all_floats(v)]
    found = _outputs_requiring_grad(node, fake_mode, {id(v) for v in values})
    if found is None:
        alone = [_outputs_requiring_grad(node, fake_mode, {id(v)}) for v in values]
        flags = [f for f in alone if f is not None]
        if not flags:  # an op that cannot run again on its own: assume every float output is
            return tuple(isinstance(v, torch.Tensor) and all_floats(v) for v in _as_tuple(node.meta["val"]))
        found = tuple(any(column) for column in zip(*flags, strict=True))
    return found


def _outputs_requiring_grad(node: fx.Node, fake_mode: FakeTensorMode, leaves: set[int]) -> tuple[bool, ...] | None:
    """Which outputs of `node`, run again on its inputs' fake values, require grad when the inputs in
    `leaves` (ids of values) do; None where the op raises."""

    def value(n: fx.Node) -> Any:
        v = n.meta.get("val")
        return v.detach().requires_grad_() if isinstance(v, torch.Tensor) and id(v) in leaves else v

    args = fx.node.map_arg(node.args, value)
    kwargs = fx.node.map_arg(node.kwargs, value)
    try:
        with fake_mode, torch.enable_grad():
            outputs = node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:
        return None
    return tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in _as_tuple(outputs))


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
