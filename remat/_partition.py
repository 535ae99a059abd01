"""Partition: a joint graph and one decision per call -> forward and backward programs.

The forward program runs every forward node once (side effects included) and
returns the user's outputs followed by the activations backward keeps. The
backward program takes the kept values and the incoming gradients, replays the
discarded calls that the gradient formulas read, each just before its first
use, and returns the gradients.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ._calls import Decision
from ._trace import JointGraph, is_call

__all__ = ["Kept", "Programs", "partition"]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Kept:
    """One value the backward program reads, and where the forward finds it.

    `primal` is the index of an input kept by reference (no new memory),
    `output` the index of one of the user's outputs; otherwise the value is the
    `activation`-th extra output of the forward program.
    """

    node: fx.Node
    primal: int | None = None
    output: int | None = None
    activation: int | None = None


@dataclasses.dataclass(frozen=True)
class Programs:
    """Everything needed to run one signature under one set of decisions."""

    forward: fx.GraphModule  # primals -> (*outputs, *activations)
    backward: fx.GraphModule  # (*kept, *tangents) -> grads
    kept: tuple[Kept, ...]
    n_activations: int
    decisions: tuple[Decision, ...]  # as applied (random calls are saved)
    saved_calls: tuple[int, ...]  # calls whose outputs are kept
    replayed_calls: tuple[int, ...]
    saved_bytes: int
    recompute_flops: int


def partition(joint: JointGraph, decisions: Sequence[Decision]) -> Programs:
    """Split `joint` into forward and backward programs that keep what `decisions` save."""
    applied = tuple(
        Decision.SAVE if call.is_random else decision for call, decision in zip(joint.trace, decisions, strict=False)
    )  # random calls cannot be replayed identically yet: keep their outputs
    decision_of = {node: applied[i] for i, node in enumerate(joint.call_nodes)}
    primal_index = {node: i for i, node in enumerate(joint.primals)}
    mutated: set[fx.Node] = {m.args[0] for m in joint.mutations}  # type: ignore[misc]

    backward_nodes = [
        n for n in joint.graph.nodes if n.op in ("call_function", "get_attr") and n not in joint.forward_nodes
    ]
    needed_by_backward: list[fx.Node] = []
    for user in [*backward_nodes, *joint.grads]:
        inputs = user.all_input_nodes if user in backward_nodes else [user]
        needed_by_backward.extend(
            n for n in inputs if n in joint.forward_nodes or (n.op == "placeholder" and n in primal_index)
        )

    def is_kept(node: fx.Node) -> bool:
        """Whether backward can read `node` without replaying anything."""
        if node.op in ("placeholder", "get_attr"):
            return True
        if node in decision_of:
            return decision_of[node] is Decision.SAVE
        if node.target is operator.getitem:  # one output of a multi-output call
            return is_kept(node.args[0])  # type: ignore[arg-type]
        return False  # a view: replaying it is free, keep its base instead

    kept_nodes: dict[fx.Node, None] = {}
    replayed: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = list(reversed(needed_by_backward))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            replayed.add(node)  # constants are read from the program module
        elif is_kept(node):
            kept_nodes[node] = None
        else:
            replayed.add(node)
            stack.extend(reversed(node.all_input_nodes))

    kept: list[Kept] = []
    activations: list[fx.Node] = []
    output_index = {node: i for i, node in reversed(list(enumerate(joint.outputs)))}
    for node in kept_nodes:
        if node.op == "placeholder" and node not in mutated:
            kept.append(Kept(node, primal=primal_index[node]))
        elif node in output_index and node.op != "placeholder":
            kept.append(Kept(node, output=output_index[node]))
        else:  # an activation, or an input the forward overwrites (kept as a copy)
            kept.append(Kept(node, activation=len(activations)))
            activations.append(node)

    call_index = {node: i for i, node in enumerate(joint.call_nodes)}
    replayed_calls = tuple(sorted(call_index[n] for n in replayed if n in call_index))
    produced = [k.node for k in kept if k.primal is None]
    saved_calls = tuple(sorted({call_index[_producer(n)] for n in produced if _producer(n) in call_index}))
    return Programs(
        forward=_forward_program(joint, activations, mutated),
        backward=_backward_program(joint, kept, backward_nodes),
        kept=tuple(kept),
        n_activations=len(activations),
        decisions=applied,
        saved_calls=saved_calls,
        replayed_calls=replayed_calls,
        saved_bytes=_saved_bytes(produced, joint.primals),
        recompute_flops=sum(joint.trace[i].flops for i in replayed_calls),
    )


def _producer(node: fx.Node) -> fx.Node:
    """The call whose memory `node` names (itself, or the base of a view or getitem)."""
    while not is_call(node) and node.op == "call_function" and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _forward_program(joint: JointGraph, activations: Sequence[fx.Node], mutated: set[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for primal in joint.primals:
        env[primal] = graph.placeholder(primal.name)
    copies = {
        primal: graph.call_function(aten.clone.default, (env[primal],))
        for primal in joint.primals
        if primal in mutated and primal in activations
    }  # the value before the forward overwrites it
    for node in joint.graph.nodes:
        if node in joint.forward_nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
    # An input returned as is must leave the Function as a view of itself:
    # autograd.Function refuses to save an input it also returns unchanged.
    outputs = [
        graph.call_function(aten.alias.default, (env[o],)) if o in joint.primals else env[o] for o in joint.outputs
    ]
    returned = outputs + [copies.get(a) or env[a] for a in activations]
    graph.output(tuple(returned))
    return _module(joint, graph)


def _backward_program(joint: JointGraph, kept: Sequence[Kept], backward_nodes: Sequence[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in kept:
        env[value.node] = graph.placeholder(f"kept_{value.node.name}")
    for tangent in joint.tangents:
        env[tangent] = graph.placeholder(tangent.name)

    def emit(node: fx.Node) -> fx.Node:
        # Replays are emitted on first use, so each lives only while needed.
        # See NOTE [replay just in time].
        if node not in env:
            for arg in node.all_input_nodes:
                emit(arg)
            env[node] = graph.node_copy(node, lambda n: env[n])
        return env[node]

    for node in backward_nodes:
        emit(node)
    graph.output(tuple(emit(g) for g in joint.grads))
    return _module(joint, graph)


# NOTE [replay just in time]
# Replaying every discarded call at the start of backward would hold all of
# them at once and raise the backward peak above eager's. Emitting each replay
# right before the first backward node that reads it, with FX's code
# generation freeing each value after its last use, keeps the replayed values
# alive only while the gradient formulas that read them run.


def _module(joint: JointGraph, graph: fx.Graph) -> fx.GraphModule:
    constants = {n.target: joint.constants[n.target] for n in graph.nodes if n.op == "get_attr"}
    graph.lint()
    return fx.GraphModule(constants, graph)


def _saved_bytes(activations: Sequence[fx.Node], primals: Sequence[fx.Node]) -> int:
    """Bytes of the distinct storages of `activations` that are not inputs' storages."""
    inputs = {_storage(p.meta["val"]) for p in primals}
    storages: dict[Any, int] = {}
    for node in activations:
        for value in _tensors(node.meta.get("val")):
            if node.op == "placeholder":  # an input the forward overwrites, kept as a copy
                storages[("copy", node)] = value.numel() * value.element_size()
            elif _storage(value) not in inputs:
                storages[_storage(value)] = value.untyped_storage().nbytes()
    return sum(storages.values())


def _storage(tensor: torch.Tensor) -> Any:
    return StorageWeakRef(tensor.untyped_storage())


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []
