"""Partition: a joint graph and one decision per call -> what is kept, what is replayed.

The forward program runs every forward node once (side effects included) and
returns the user's outputs followed by what backward keeps. The backward
program takes the kept values and the incoming gradients, replays the
discarded calls that the gradient formulas read, each just before its first
use, and returns the gradients. Outputs that are views of inputs or of other
outputs are rebuilt outside the autograd.Function by a small epilogue, so that
autograd tracks them as the views they are (as eager does). A pure copy of the
forward serves higher-order derivatives and forward mode.
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
from ._measure import storage_nbytes, tensor_nbytes, tensors_in
from ._programs import backward_program, device_of, epilogue, forward_program, pure_forward
from ._trace import JointGraph, is_call, is_free, stops_gradient

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
class KeptOutputs:
    """What is kept of one saved call's outputs, and what reads it."""

    nbytes: int  # distinct storages, inputs' excluded
    read_by: frozenset[str]  # "backward" (the gradient formulas) and/or "replay" (replayed calls)


@dataclasses.dataclass(frozen=True)
class Programs:
    """Everything needed to run one signature under one set of decisions.

    The Function's forward returns `(*returned outputs, *activations, *generator
    states)`; `kept` says which of its inputs and outputs `ctx.save_for_backward`
    keeps, and every program that runs later takes `*kept` first.
    """

    forward: fx.GraphModule  # primals -> (*returned outputs, *activations, *states)
    backward: fx.GraphModule  # (*kept, *tangents) -> grads
    pure: fx.GraphModule  # *kept -> (*returned outputs if pure_returns_outputs, *activations), from the inputs
    pure_returns_outputs: bool
    pure_inputs: tuple[tuple[int, int], ...]  # (position in kept, primal index) of each input pure reads
    epilogue: fx.GraphModule | None  # (*primals, *returned outputs) -> user outputs; None if all returned
    returned: tuple[int, ...]  # indices of the outputs the Function returns
    n_activations: int
    without_tangent: tuple[bool, ...]  # per Function output: marked non-differentiable
    output_sources: tuple[frozenset[int], ...]  # per Function output: the primals it has a gradient for
    pure_unsupported: str | None  # why the programs cannot be differentiated again, if they cannot
    kept: tuple[Kept, ...]
    decisions: tuple[Decision, ...]
    saved_calls: tuple[int, ...]  # calls whose outputs are kept
    kept_by_call: dict[int, KeptOutputs]  # for each call in saved_calls: what is kept and who reads it
    replayed_calls: tuple[int, ...]
    rng_state_calls: tuple[int, ...]  # random calls whose generator state is kept
    saved_bytes: int  # activations and generator states
    rng_state_bytes: int
    recompute_flops: int


def partition(joint: JointGraph, decisions: Sequence[Decision], *, forward_mode: bool = False) -> Programs:
    """Split `joint` into programs that keep what `decisions` save and replay the rest.

    With `forward_mode`, the pure forward also recomputes the returned outputs
    (for their tangents), so the random calls they depend on keep their state too.
    """
    decisions = tuple(decisions)
    primal_index = {node: i for i, node in enumerate(joint.primals)}
    returned = _returned_outputs(joint)
    overwritten = _overwritten(joint)
    mutated = mutated_inputs(joint, returned)

    backward_nodes = backward_nodes_of(joint)
    kept_values, replayed, read_as_they_were = _kept_and_replayed(joint, decisions, backward_nodes)

    # What the pure forward recomputes, and the inputs and random calls it reads: the
    # kept values that depend on a differentiable input. Kept values that do not are
    # constants to any derivative, and stand for themselves.
    returned_nodes = [joint.outputs[i] for i in returned]
    activations = [n for n in kept_values if n.op != "placeholder" and n not in returned_nodes]
    activations += [p for p in kept_values if p in mutated and p in read_as_they_were]  # kept as copies
    varying = _varying(joint, forward_mode)
    constants = {n for n in kept_values if n.op != "placeholder" and n not in varying}
    targets = [*returned_nodes, *activations] if forward_mode else activations
    recomputed, recomputed_from = _ancestors(
        [t for t in targets if t not in constants], joint.forward_nodes, stop=constants
    )
    for primal in joint.primals:
        if primal in recomputed:
            kept_values.setdefault(primal, None)
    activations += [p for p in joint.primals if p in recomputed_from and p in mutated and p not in activations]
    call_index = {node: i for i, node in enumerate(joint.call_nodes)}
    # A random call keeps its generator state if backward replays it or the pure forward
    # recomputes it. See NOTE [replaying random calls].
    random_states = [
        n
        for n in joint.call_nodes
        if joint.trace[call_index[n]].is_random and (n in replayed or n in recomputed) and n not in constants
    ]

    position = {node: p for p, node in reversed(list(enumerate(returned_nodes)))}
    kept: list[Kept] = []
    copied = {a for a in activations if a.op == "placeholder"}
    for node in kept_values:
        if node.op == "placeholder" and node not in copied:  # by reference: see NOTE [kept inputs]
            kept.append(Kept(node, primal=primal_index[node]))
        elif node in position:
            kept.append(Kept(node, output=position[node]))
    kept += [Kept(node, activation=k) for k, node in enumerate(activations)]
    kept += [Kept(node, activation=len(activations) + k, rng_state=True) for k, node in enumerate(random_states)]
    kept_pairs = [(k.node, k.rng_state) for k in kept]
    holder = {k.node: i for i, k in enumerate(kept) if k.node.op == "placeholder" and not k.rng_state}

    replayed_calls = tuple(sorted(call_index[n] for n in replayed if n in call_index))
    produced = [n for n in activations if n.op != "placeholder"] + [n for n in kept_values if n in position]
    copies_bytes = sum(tensor_nbytes(p.meta["val"]) for p in activations if p.op == "placeholder")
    rng_state_bytes = sum(_rng.state_nbytes(device_of(node)) for node in random_states)
    return Programs(
        forward=forward_program(
            joint,
            _dirty_as_inputs(joint, returned_nodes),
            activations,
            {p for p in activations if p.op == "placeholder"},
            random_states,
        ),
        backward=backward_program(joint, kept_pairs, backward_nodes),
        pure=pure_forward(
            joint,
            forward_mode,
            kept_pairs,
            {**{p: p for p in holder}, **{c: c for c in constants}},
            [*returned_nodes, *activations] if forward_mode else activations,  # copies of inputs included
        ),
        pure_returns_outputs=forward_mode,
        pure_inputs=tuple((i, primal_index[node]) for node, i in holder.items()),
        epilogue=epilogue(joint, returned, overwritten)
        if returned[: joint.n_user_outputs] != tuple(range(joint.n_user_outputs))
        else None,
        returned=returned,
        n_activations=len(activations),
        pure_unsupported=next(
            (
                f"{joint.trace[call_index[n]]}: {_NOT_TWICE_DIFFERENTIABLE[n.target]}"
                for n in joint.call_nodes
                if (n in recomputed or n in replayed) and n.target in _NOT_TWICE_DIFFERENTIABLE
            ),
            None,
        ),
        without_tangent=_without_tangent(joint, returned, activations, constants, len(random_states), forward_mode),
        output_sources=(
            *_output_sources(joint, returned),
            *([frozenset(range(len(joint.primals)))] * len(activations)),  # kept values: never marked here
            *([frozenset()] * len(random_states)),
        ),
        kept=tuple(kept),
        decisions=decisions,
        saved_calls=tuple(sorted({call_index[_producer(n)] for n in produced if _producer(n) in call_index})),
        kept_by_call=_kept_by_call(joint, produced, replayed, call_index),
        replayed_calls=replayed_calls,
        rng_state_calls=tuple(call_index[n] for n in random_states),
        saved_bytes=_saved_bytes(produced, joint.primals) + copies_bytes + rng_state_bytes,
        rng_state_bytes=rng_state_bytes,
        recompute_flops=sum(joint.trace[i].flops for i in replayed_calls),
    )


def _kept_by_call(
    joint: JointGraph, produced: Sequence[fx.Node], replayed: set[fx.Node], call_index: dict[fx.Node, int]
) -> dict[int, KeptOutputs]:
    """For each saved call, the bytes of its kept outputs and whether backward's gradient
    formulas, replayed calls, or (through the pure forward) neither read them."""
    by_call: dict[int, list[fx.Node]] = {}
    for node in produced:
        if _producer(node) in call_index:
            by_call.setdefault(call_index[_producer(node)], []).append(node)
    grads = set(joint.grads)

    def readers(node: fx.Node) -> set[str]:
        found = {"backward"} if node in grads else set()
        for user in node.users:
            if user not in joint.forward_nodes:
                found.add("backward")
            elif user in replayed:
                found |= readers(user) if is_free(user) else {"replay"}  # a view replayed for its readers
        return found

    return {
        index: KeptOutputs(_saved_bytes(nodes, joint.primals), frozenset().union(*map(readers, nodes)))
        for index, nodes in by_call.items()
    }


# Ops whose functional form torch differentiates wrongly a second time.
_NOT_TWICE_DIFFERENTIABLE = {
    torch.ops.aten.rrelu_with_noise_functional.default: (
        "torch 2.13's derivative of the functional `rrelu_with_noise` reads its uninitialized `noise` input; "
        "save this call with the policy, or take second derivatives outside remat.checkpoint"
    ),
}


def _without_tangent(
    joint: JointGraph,
    returned: Sequence[int],
    activations: Sequence[fx.Node],
    constants: set[fx.Node],
    n_states: int,
    forward_mode: bool,
) -> tuple[bool, ...]:
    """For each output of the Function, whether it is marked non-differentiable.

    As in eager, an output that depends on no input requiring grad does not require grad
    (under forward mode, where inputs need not require grad, only non-float ones are
    marked); nor do kept values that autograd does not differentiate or that have no
    derivative at all (`constants`: a view of one rebuilt outside the Function must not
    require grad), nor generator states.
    """
    differentiable = set(joint.differentiable_outputs)
    return (
        *(not _is_float(joint.outputs[i]) or (i not in differentiable and not forward_mode) for i in returned),
        *(not _is_float(a) or not _differentiable(a) or a in constants for a in activations),
        *([True] * n_states),
    )


def _is_float(node: fx.Node) -> bool:
    value = node.meta["val"]
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _differentiable(node: fx.Node) -> bool:
    """Whether autograd differentiates the value of `node` (false for, say, the mean and
    rstd outputs of `native_layer_norm`: double backward must not ask for their derivative)."""
    if node.target is operator.getitem:
        producer, index = node.args
        flags = producer.meta.get("remat_differentiable_outputs")  # type: ignore[union-attr]
        return flags is None or bool(flags[index])  # type: ignore[index]
    return True


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


def _kept_and_replayed(
    joint: JointGraph, decisions: Sequence[Decision], backward_nodes: Sequence[fx.Node]
) -> tuple[dict[fx.Node, None], set[fx.Node], set[fx.Node]]:
    """The forward values backward reads without replaying (inputs, outputs of SAVE calls), in
    order of first need; the nodes it replays: the RECOMPUTE calls (and views) it needs; and the
    inputs read for the value they had before `fn` ran (the others may be read as they are now)."""
    decision_of = dict(zip(joint.call_nodes, decisions, strict=True))

    def is_kept(node: fx.Node) -> bool:
        if node.op in ("placeholder", "get_attr"):
            return True
        if node in decision_of:
            return decision_of[node] is Decision.SAVE
        if node.target is operator.getitem:  # one output of a multi-output call
            return is_kept(node.args[0])  # type: ignore[arg-type]
        return False  # a view: replaying it is free, keep its base instead

    needed = needed_by_backward(joint, backward_nodes)
    kept: dict[fx.Node, None] = {}
    replayed: set[fx.Node] = set()
    as_they_were: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = [(node, False) for node in reversed(needed)]
    while stack:
        node, any_value = stack.pop()
        if node.op == "placeholder" and not any_value:
            as_they_were.add(node)
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            replayed.add(node)  # constants are read from the program module
        elif is_kept(node):
            kept[node] = None
        else:
            replayed.add(node)
            ignored = reads_any_value(node)
            stack.extend((n, n in ignored) for n in reversed(node.all_input_nodes))
    return kept, replayed, as_they_were


def reads_any_value(node: fx.Node) -> set[fx.Node]:
    """Inputs of `node` whose value does not matter to what a replay of it uses: the running
    statistics of a training-mode batch norm (the replay only needs the normalized output and
    the batch statistics; the new running statistics it computes are dropped)."""
    if node.target is aten._native_batch_norm_legit_functional.default and node.args[5] is True:
        return {a for a in node.args[3:5] if isinstance(a, fx.Node)}
    return set()


def _ancestors(
    targets: Sequence[fx.Node], within: frozenset[fx.Node], stop: set[fx.Node]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """`targets` and the nodes of `within` (and primals) they are computed from, not looking past
    `stop`; and the primals among them whose value matters (see `reads_any_value`)."""
    found: set[fx.Node] = set()
    value_read: set[fx.Node] = set()
    stack = [(target, False) for target in targets]
    while stack:
        node, any_value = stack.pop()
        if node.op == "placeholder" and not any_value:
            value_read.add(node)
        if node not in found and node not in stop:
            found.add(node)
            ignored = reads_any_value(node)
            stack.extend((n, n in ignored) for n in node.all_input_nodes if n in within or n.op == "placeholder")
    return found, value_read


def _varying(joint: JointGraph, forward_mode: bool) -> set[fx.Node]:
    """Forward nodes whose value has a derivative with respect to some differentiable input.

    Differentiable inputs are those requiring grad (any floating input under forward
    mode). Derivatives stop at detaches and no_grad regions of `fn` (forward mode sees
    through the latter), and at random draws, whose outputs have none.
    """
    if forward_mode:
        varying = {p for p in joint.primals if p.meta["val"].is_floating_point() or p.meta["val"].is_complex()}
    else:
        varying = {joint.primals[i] for i in joint.grad_of}
    for node in joint.graph.nodes:
        if node not in joint.forward_nodes or stops_gradient(node, forward_mode=forward_mode):
            continue
        if node.target is operator.getitem and (node.args[0] not in varying or not _differentiable(node)):
            continue
        differentiable = node.op == "call_function" and not _rng.has_zero_derivative(node)
        if differentiable and any(arg in varying for arg in node.all_input_nodes):
            varying.add(node)
    return varying


def _output_sources(joint: JointGraph, returned: Sequence[int]) -> tuple[frozenset[int], ...]:
    """For each returned output, the primals it has a derivative from, as eager's autograd sees
    it: those reaching it through differentiable calls (derivatives stop at detaches, no_grad
    regions and random factories; a random draw such as `bernoulli` has a zero derivative, which
    autograd still records), and those whose gradient backward computes from its tangent (which
    sees through custom Functions, whose forwards run under no_grad)."""
    forward: dict[fx.Node, frozenset[int]] = {p: frozenset({i}) for i, p in enumerate(joint.primals)}
    for node in joint.graph.nodes:
        if node not in joint.forward_nodes:
            continue
        if node.meta.get("remat_stops_gradient") == "no_grad_update" and isinstance(node.args[0], fx.Node):
            forward[node] = forward.get(node.args[0], frozenset())  # the updated tensor keeps its history
            continue
        if stops_gradient(node):
            continue
        if node.target is operator.getitem and not _differentiable(node):
            continue
        if node.op == "call_function" and not _rng.is_random_factory(node):
            forward[node] = frozenset().union(*(forward.get(arg, frozenset()) for arg in node.all_input_nodes))

    from_tangent: dict[fx.Node, frozenset[int]] = {t: frozenset({k}) for k, t in enumerate(joint.tangents)}
    for node in joint.graph.nodes:
        if node.op == "call_function" and node not in joint.forward_nodes:
            from_tangent[node] = frozenset().union(*(from_tangent.get(a, frozenset()) for a in node.all_input_nodes))
    backward: dict[int, set[int]] = {i: set() for i in joint.differentiable_outputs}
    for grad, primal in zip(joint.grads, joint.grad_of, strict=True):
        for k in from_tangent.get(grad, frozenset()):
            backward[joint.differentiable_outputs[k]].add(primal)
    return tuple(forward.get(joint.outputs[i], frozenset()) | backward.get(i, set()) for i in returned)


def _dirty_as_inputs(joint: JointGraph, returned_nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """The nodes the forward returns: a dirty input's new value is returned as the input itself."""
    dirty = {joint.outputs[joint.n_user_outputs + j]: joint.primals[i] for j, i in enumerate(joint.dirty)}
    return [dirty.get(node, node) for node in returned_nodes]


def mutated_inputs(joint: JointGraph, returned: Sequence[int]) -> set[fx.Node]:
    """Inputs the forward overwrites, and inputs the caller can overwrite through an output that is a
    view of them: whatever reads one later reads a copy of the value it had. See NOTE [kept inputs]."""
    mutated = set(_overwritten(joint).values())
    mutated |= {_view_base(joint.outputs[i]) for i in range(joint.n_user_outputs) if i not in returned}
    return mutated & set(joint.primals)


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
    """Follow views down to the node whose memory they show: through the views of a multi-output
    view op (`unbind`, `split`, `chunk`), not through the outputs of other multi-output calls."""
    while node.op == "call_function" and is_free(node):
        if node.target is operator.getitem and not getattr(node.args[0].target, "is_view", False):  # type: ignore[union-attr]
            break
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


def _saved_bytes(activations: Sequence[fx.Node], primals: Sequence[fx.Node]) -> int:
    """Bytes of the distinct storages of `activations` that are not inputs' storages."""
    inputs = {_storage(p.meta["val"]) for p in primals}
    storages: dict[Any, int] = {}
    for node in activations:
        for value in tensors_in(node.meta.get("val")):
            if _storage(value) not in inputs:
                storages[_storage(value)] = storage_nbytes(value)
    return sum(storages.values())


def _storage(tensor: torch.Tensor) -> Any:
    return StorageWeakRef(tensor.untyped_storage())
