"""Partition: a joint graph and one decision per call -> the programs that run it.

The forward program runs every forward node once (side effects included) and
returns the user's outputs followed by what backward keeps. The backward
program takes the kept values and the incoming gradients, replays the
discarded calls that the gradient formulas read, each just before its first
use, and returns the gradients. Outputs that are views of inputs or of other
outputs are rebuilt outside the autograd.Function by a small epilogue, so that
autograd tracks them as the views they are (as eager does).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from . import _rng
from ._calls import Decision
from ._trace import JointGraph, is_call, is_free

__all__ = ["Kept", "Programs", "partition"]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Kept:
    """One value the backward program reads, and where the forward finds it.

    `primal` is the index of an input kept by reference (no new memory);
    `output` the position of one of the Function's returned outputs;
    otherwise the value is the `activation`-th extra output of the forward
    program: the value of `node`, or, with `rng_state`, the state of the
    generator right before `node` (a random call) ran.
    """

    node: fx.Node
    primal: int | None = None
    output: int | None = None
    activation: int | None = None
    rng_state: bool = False


@dataclasses.dataclass(frozen=True)
class Programs:
    """Everything needed to run one signature under one set of decisions."""

    forward: fx.GraphModule  # primals -> (*returned outputs, *activations)
    backward: fx.GraphModule  # (*kept, *tangents) -> grads
    epilogue: fx.GraphModule | None  # (*primals, *returned outputs) -> all outputs; None if all are returned
    returned: tuple[int, ...]  # indices of the outputs the Function returns
    kept: tuple[Kept, ...]
    decisions: tuple[Decision, ...]
    saved_calls: tuple[int, ...]  # calls whose outputs are kept
    replayed_calls: tuple[int, ...]
    saved_bytes: int  # activations and generator states
    rng_state_bytes: int
    recompute_flops: int


def partition(joint: JointGraph, decisions: Sequence[Decision]) -> Programs:
    """Split `joint` into programs that keep what `decisions` save and replay the rest."""
    decisions = tuple(decisions)
    decision_of = {node: decisions[i] for i, node in enumerate(joint.call_nodes)}
    primal_index = {node: i for i, node in enumerate(joint.primals)}
    returned = _returned_outputs(joint)
    # Inputs the forward overwrites, and inputs the caller can overwrite through an output that is a
    # view of them: if backward reads one, it keeps a copy of the value it had. See NOTE [kept inputs].
    mutated: set[fx.Node] = {m.args[0] for m in joint.mutations}  # type: ignore[misc]
    mutated |= {_view_base(joint.outputs[i]) for i in range(joint.n_user_outputs) if i not in returned}
    mutated &= set(joint.primals)

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

    call_index = {node: i for i, node in enumerate(joint.call_nodes)}
    replayed_calls = tuple(sorted(call_index[n] for n in replayed if n in call_index))
    random_replays = [joint.call_nodes[i] for i in replayed_calls if joint.trace[i].is_random]

    position = {joint.outputs[i]: p for p, i in reversed(list(enumerate(returned)))}
    kept: list[Kept] = []
    activations: list[fx.Node] = []
    for node in kept_nodes:
        if node.op == "placeholder" and node not in mutated:
            kept.append(Kept(node, primal=primal_index[node]))
        elif node in position:
            kept.append(Kept(node, output=position[node]))
        else:  # an activation, or an input the forward overwrites (kept as a copy)
            kept.append(Kept(node, activation=len(activations)))
            activations.append(node)
    kept.extend(Kept(node, activation=len(activations) + k, rng_state=True) for k, node in enumerate(random_replays))

    produced = [k.node for k in kept if k.primal is None and not k.rng_state]
    rng_state_bytes = sum(_rng.state_nbytes(_device_of(node)) for node in random_replays)
    return Programs(
        forward=_forward_program(joint, returned, activations, random_replays, mutated),
        backward=_backward_program(joint, kept, backward_nodes),
        epilogue=_epilogue(joint, returned)
        if returned[: joint.n_user_outputs] != tuple(range(joint.n_user_outputs))
        else None,
        returned=returned,
        kept=tuple(kept),
        decisions=decisions,
        saved_calls=tuple(sorted({call_index[_producer(n)] for n in produced if _producer(n) in call_index})),
        replayed_calls=replayed_calls,
        saved_bytes=_saved_bytes(produced, joint.primals) + rng_state_bytes,
        rng_state_bytes=rng_state_bytes,
        recompute_flops=sum(joint.trace[i].flops for i in replayed_calls),
    )


# NOTE [kept inputs]
# Backward reads inputs by reference: keeping them costs no memory. That is
# only sound while nobody overwrites them before backward. The forward program
# may (in-place updates of inputs and buffers), and so may the caller, through
# an output that is a view of an input: eager allows `out = f(x); out.mul_(2)`
# when `f` returns `x[0]` and its backward does not read `x`. In both cases a
# copy of the input, taken before anything overwrites it, is kept instead.


def _producer(node: fx.Node) -> fx.Node:
    """The call whose memory `node` names (itself, or the base of a view or getitem)."""
    while not is_call(node) and node.op == "call_function" and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _view_base(node: fx.Node) -> fx.Node:
    """Follow views (not getitems) down to the node whose memory they show."""
    while node.op == "call_function" and is_free(node) and node.target is not operator.getitem:
        node = node.args[0]  # type: ignore[assignment]
    return node


def _returned_outputs(joint: JointGraph) -> tuple[int, ...]:
    """Indices of the outputs the Function returns. The other user outputs are views of
    inputs or of returned outputs, or repeats of them, and are rebuilt by the epilogue;
    the new values of dirty inputs are always returned (as the inputs themselves)."""
    overwritten = _overwritten(joint)

    def base_of(node: fx.Node) -> fx.Node:
        base = _view_base(node)
        return overwritten.get(base, base)

    user_outputs = joint.outputs[: joint.n_user_outputs]
    returned: dict[fx.Node, int] = {}
    for i, output in enumerate(user_outputs):  # first, outputs that own their memory
        if output.op != "placeholder" and base_of(output) is output:
            returned.setdefault(output, i)
    for i, output in enumerate(user_outputs):  # then views of something that is not an output
        base = base_of(output)
        if base.op != "placeholder" and base not in returned:
            returned.setdefault(output, i)
    return (*sorted(returned.values()), *range(joint.n_user_outputs, len(joint.outputs)))


def _overwritten(joint: JointGraph) -> dict[fx.Node, fx.Node]:
    """The final value of each input `fn` updates in place -> that input, which holds it after forward."""
    return {m.args[1]: m.args[0] for m in joint.mutations}  # type: ignore[misc]


def _device_of(node: fx.Node) -> torch.device:
    value = node.meta["val"]
    return (value if isinstance(value, torch.Tensor) else value[0]).device


def _forward_program(
    joint: JointGraph,
    returned: Sequence[int],
    activations: Sequence[fx.Node],
    random_replays: Sequence[fx.Node],
    mutated: set[fx.Node],
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for primal in joint.primals:
        env[primal] = graph.placeholder(primal.name)
    copies = {
        primal: graph.call_function(aten.clone.default, (env[primal],))
        for primal in joint.primals
        if primal in mutated and primal in activations
    }  # the value before the forward overwrites it
    states: dict[fx.Node, fx.Node] = {}
    for node in joint.graph.nodes:
        if node in joint.forward_nodes:
            if node in random_replays:  # See NOTE [replaying random calls].
                generator = _rng.generator_of(node)
                states[node] = graph.call_function(
                    _rng.rng_state, (_device_of(node), env[generator] if generator is not None else None)
                )
            env[node] = graph.node_copy(node, lambda n: env[n])
    dirty = {joint.outputs[joint.n_user_outputs + j]: joint.primals[i] for j, i in enumerate(joint.dirty)}
    graph.output(
        (
            *(env[dirty.get(joint.outputs[i], joint.outputs[i])] for i in returned),
            *(copies.get(a) or env[a] for a in activations),
            *(states[node] for node in random_replays),
        )
    )
    return _module(joint, graph)


def _backward_program(joint: JointGraph, kept: Sequence[Kept], backward_nodes: Sequence[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    states: dict[fx.Node, fx.Node] = {}
    for value in kept:
        if value.rng_state:
            states[value.node] = graph.placeholder(f"rng_state_of_{value.node.name}")
        else:
            env[value.node] = graph.placeholder(f"kept_{value.node.name}")
    for tangent in joint.tangents:
        env[tangent] = graph.placeholder(tangent.name)

    def emit(node: fx.Node) -> fx.Node:
        # Replays are emitted on first use, so each lives only while needed.
        # See NOTE [replay just in time].
        if node not in env:
            for arg in node.all_input_nodes:
                emit(arg)
            if node in states:
                args = fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                env[node] = graph.call_function(
                    _rng.replay_with_rng_state,
                    (states[node], _device_of(node), node.target, *args),  # type: ignore[arg-type]
                    kwargs,
                )
                env[node].meta = dict(node.meta)
            else:
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


def _epilogue(joint: JointGraph, returned: Sequence[int]) -> fx.GraphModule:
    """(*primals, *returned outputs) -> the user's outputs, rebuilding the views among them."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {primal: graph.placeholder(primal.name) for primal in joint.primals}
    for i in returned:
        placeholder = graph.placeholder(f"output_{i}")
        env.setdefault(joint.outputs[i], placeholder)
    for value, primal in _overwritten(joint).items():
        env.setdefault(value, env[primal])  # after forward, the input holds its new value

    def emit(node: fx.Node) -> fx.Node:
        if node not in env:
            emit(node.args[0])  # type: ignore[arg-type]
            env[node] = graph.node_copy(node, lambda n: env[n])
        return env[node]

    graph.output(tuple(emit(output) for output in joint.outputs[: joint.n_user_outputs]))
    return _module(joint, graph)


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
