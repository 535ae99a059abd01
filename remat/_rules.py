"""The partitioner's rules, read off a joint graph.

What backward reads, which outputs the `autograd.Function` returns (the others are views rebuilt
outside it), which inputs are overwritten, which values have a derivative, what keeping values costs.
`_partition` builds its programs by these rules and `_dataflow` describes the graph to planners by
them, so that what a planner counts is what the partitioner keeps.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from . import _quirks, _rng
from ._capture import history_of
from ._facts import differentiable_outputs
from ._joint import JointGraph, is_free, stops_gradient
from ._measure import storage_key, storage_nbytes, tensors_in

__all__ = [
    "backward_nodes_of",
    "differentiable",
    "kept_bytes",
    "mutated_inputs",
    "needed_by_backward",
    "overwritten",
    "reads_any_value",
    "returned_outputs",
    "views_taken_before_a_read",
    "varying",
    "view_base",
]

aten = torch.ops.aten


def backward_nodes_of(joint: JointGraph) -> list[fx.Node]:
    """The nodes of the backward part of `joint`, in graph order."""
    return [n for n in joint.graph.nodes if n.op in ("call_function", "get_attr") and n not in joint.forward_nodes]


def needed_by_backward(joint: JointGraph, backward_nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """The forward values (and inputs) backward's own nodes read, in order of first need."""
    primals = set(joint.primals)
    needed: list[fx.Node] = []
    for user in backward_nodes:
        needed.extend(n for n in user.all_input_nodes if n in joint.forward_nodes or n in primals)
    needed.extend(g for g in joint.grads if g in joint.forward_nodes or g in primals)
    return needed


def reads_any_value(node: fx.Node) -> set[fx.Node]:
    """Inputs of `node` whose value does not matter to what a replay of it uses: the running
    statistics of a training-mode batch norm (the replay only needs the normalized output and
    the batch statistics; the new running statistics it computes are dropped)."""
    unread = _quirks.BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS.table["replay"].get(node.target)
    if unread is None or node.args[unread[0]] is not True:
        return set()
    return {a for i, a in enumerate(node.args) if i in unread[1] and isinstance(a, fx.Node)}


def returned_outputs(joint: JointGraph) -> tuple[int, ...]:
    """Indices of the outputs the Function returns. The other user outputs are views of
    inputs or of returned outputs, or repeats of them, and are rebuilt by the epilogue;
    the new values of dirty inputs are always returned (as the inputs themselves), and
    so are the bases of the outputs whose elements may share memory, never returned
    themselves (NOTE [outputs whose elements may share memory])."""
    final_values = overwritten(joint)

    def base_of(node: fx.Node) -> fx.Node:
        # The final value of an input updated through a view of it is itself a view (of the scatter
        # that functionalization wrote the update with): it is the input, whatever it views.
        return view_base(node, stop_at=final_values)

    user_outputs = [(i, o) for i, o in enumerate(joint.outputs[: joint.n_user_outputs]) if i not in joint.rebuilt]
    returned: dict[fx.Node, int] = {}
    for i, output in user_outputs:  # first, outputs that own their memory
        if output.op != "placeholder" and base_of(output) is output:
            returned.setdefault(output, i)
    for i, output in user_outputs:  # then views of something that is not an output
        base = base_of(output)
        if base.op != "placeholder" and base not in returned:
            returned.setdefault(output, i)
    return (*sorted(returned.values()), *range(joint.n_user_outputs, len(joint.outputs)))


def view_base(node: fx.Node, stop_at: Mapping[fx.Node, fx.Node] | None = None) -> fx.Node:
    """Follow views down to the node whose memory they show: through the views of a multi-output
    view op (`unbind`, `split`, `chunk`), not through the outputs of other multi-output calls.
    A node in `stop_at` shows the memory of the node it maps to."""
    stop_at = stop_at or {}
    while node not in stop_at and node.op == "call_function" and is_free(node):
        if node.target is operator.getitem and not getattr(node.args[0].target, "is_view", False):  # type: ignore[union-attr]
            break
        node = node.args[0]  # type: ignore[assignment]
    return stop_at.get(node, node)


def views_taken_before_a_read(joint: JointGraph, returned: Sequence[int]) -> tuple[int, ...]:
    """The user outputs rebuilt as views of an input that `fn` took before it read that input again
    with a derivative: they are rebuilt before the Function. See NOTE [where views of inputs are rebuilt]."""
    final_values = overwritten(joint)
    candidates = []
    for i in range(joint.n_user_outputs):
        output = joint.outputs[i]
        base = view_base(output, stop_at=final_values)
        if i in returned or output is base or base.op != "placeholder" or base in final_values.values():
            continue
        first = output
        while first.args[0] is not base:
            first = first.args[0]  # type: ignore[assignment]
        candidates.append((i, base, first))
    if not candidates:
        return ()
    position = {node: k for k, node in enumerate(joint.graph.nodes)}
    has_derivative = varying(joint, forward_mode=False)

    def read_after(base: fx.Node, view: fx.Node) -> bool:
        return any(
            position[user] > position[view]
            and user in has_derivative
            and any(t.is_floating_point() or t.is_complex() for t in tensors_in(user.meta.get("val")))
            for user in base.users
        )

    return tuple(i for i, base, first in candidates if read_after(base, first))


# NOTE [where views of inputs are rebuilt]
# Under `torch.func.grad`, and for an input that is not a leaf, an input's
# gradient is the sum of its contributions in the order they arrive, laid out
# as the first one is; autograd runs the node recorded last first. An output
# rebuilt as a view of an input after the Function sends its contribution
# before the Function's; eager's view, taken before `fn` read the input again,
# sent it after. Such views are taken before the Function instead, in eager's
# order; a view `fn` took after its last read of the input stays after it.
# (Inputs `fn` updates in place keep their views after the update.)


def overwritten(joint: JointGraph) -> dict[fx.Node, fx.Node]:
    """The final value of each input `fn` updates in place -> that input, which holds it after forward."""
    return {m.args[1]: m.args[0] for m in joint.mutations}  # type: ignore[misc]


def mutated_inputs(joint: JointGraph, returned: Sequence[int]) -> set[fx.Node]:
    """Inputs the forward overwrites, and inputs the caller can overwrite through an output that is a
    view of them: whatever reads one later reads a copy of the value it had. See NOTE [kept inputs]."""
    mutated = set(overwritten(joint).values())
    mutated |= {view_base(joint.outputs[i]) for i in range(joint.n_user_outputs) if i not in returned}
    return mutated & set(joint.primals)


# NOTE [kept inputs]
# Backward reads inputs by reference: keeping them costs no memory. That is
# only sound while nobody overwrites them before backward. The forward program
# may (in-place updates of inputs and buffers), and so may the caller, through
# an output that is a view of an input: eager allows `out = f(x); out.mul_(2)`
# when `f` returns `x[0]` and its backward does not read `x`. In both cases a
# copy of the input, taken before anything overwrites it, is kept instead.


def varying(joint: JointGraph, forward_mode: bool, *, through_draws: bool = False) -> set[fx.Node]:
    """Forward nodes whose value has a derivative with respect to some differentiable input.

    Differentiable inputs are those requiring grad (any floating input under forward
    mode). Derivatives stop at detaches and no_grad regions of `fn` (forward mode sees
    through the latter; the new value of a tensor updated in place under no_grad keeps the
    old one's history), and at random draws, whose outputs have none; `through_draws`
    follows autograd instead, which gives a draw from a differentiable mean or
    probability a derivative of zero (only a draw of a new tensor, `rand_like`, has none).
    """
    if forward_mode:
        found = {p for p in joint.primals if p.meta["val"].is_floating_point() or p.meta["val"].is_complex()}
    else:
        found = {joint.primals[i] for i in joint.grad_of}
    for node in joint.graph.nodes:
        if node not in joint.forward_nodes:
            continue
        history = history_of(node, forward_mode=forward_mode)
        if history is not None:  # see NOTE [updates under no_grad keep their tensors' histories]
            if history in found:
                found.add(node)
            continue
        if stops_gradient(node, forward_mode=forward_mode):
            continue
        if node.target is operator.getitem and (node.args[0] not in found or not differentiable(node)):
            continue
        plain_draw = _rng.is_random_factory(node) if through_draws else _rng.has_zero_derivative(node)
        has_derivative = node.op == "call_function" and not plain_draw
        if has_derivative and any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def differentiable(node: fx.Node) -> bool:
    """Whether autograd differentiates the value of `node` (false for, say, the mean and
    rstd outputs of `native_layer_norm`: double backward must not ask for their derivative)."""
    if node.target is operator.getitem:
        producer, index = node.args
        flags = differentiable_outputs(producer)  # type: ignore[arg-type]
        return flags is None or bool(flags[index])  # type: ignore[index]
    return True


def kept_bytes(activations: Sequence[fx.Node], primals: Sequence[fx.Node]) -> int:
    """Bytes of the distinct storages of `activations` that are not inputs' storages."""
    inputs = {storage_key(p.meta["val"]) for p in primals}
    storages: dict[Any, int] = {}
    for node in activations:
        for value in tensors_in(node.meta.get("val")):
            if storage_key(value) not in inputs:
                storages[storage_key(value)] = storage_nbytes(value)
    return sum(storages.values())
