"""Partition: a joint graph and one decision per call -> what is kept, what is replayed.

The forward program runs every forward node once (side effects included) and
returns the user's outputs followed by what backward keeps. The backward
program takes the kept values and the incoming gradients, replays the
discarded calls that the gradient formulas read, each just before its first
use, and returns the gradients. Outputs that are views of inputs or of other
outputs are rebuilt outside the autograd.Function, by a small epilogue (or a
prologue, for views of inputs taken before another read), so that autograd tracks
them as the views they are (as eager does). A pure copy of the
forward serves higher-order derivatives and forward mode.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence

import torch
from torch import fx

from .. import _quirks
from .._core import _rng
from .._core._calls import Decision
from .._eager._applications import application_of
from .._eager._capture import history_of
from .._eager._facts import CustomApplication
from .._eager._nodes import stops_gradient
from .._storing._storage import DEVICE, Storage, storage_of
from .._torch import is_custom_op
from .._tracing._joint import JointGraph
from ._accounting import recomputation_reads, saved_calls
from ._programs import PureForward, backward_program, forward_program
from ._rules import rules_of
from ._value_graph import (
    backward_nodes_of,
    calls_inside_functions,
    calls_reading_lu_factors,
    differentiable,
    functions_applied,
    mutated_inputs,
    overwritten,
    returned_outputs,
    varying,
    views_taken_before_a_read,
)
from ._views_of_inputs import views_of_inputs

__all__ = [
    "Kept",
    "KeptActivation",
    "KeptGeneratorState",
    "KeptInput",
    "KeptOutput",
    "Programs",
    "partition",
]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class KeptInput:
    """An input of the Function, kept by reference (no new memory): `primals[index]`."""

    index: int


@dataclasses.dataclass(frozen=True)
class KeptOutput:
    """One of the Function's returned outputs: `outputs[position]`."""

    position: int


@dataclasses.dataclass(frozen=True)
class KeptActivation:
    """The `index`-th extra output of the forward program, kept in `storage` (NOTE [kinds of storage])."""

    index: int
    storage: Storage = DEVICE


@dataclasses.dataclass(frozen=True)
class KeptGeneratorState:
    """The `index`-th extra output of the forward program: the state of the generator right before the
    node (a random call) ran."""

    index: int


@dataclasses.dataclass(frozen=True)
class Kept:
    """One value the backward program reads (`node`'s, or the generator state before it), and where the
    forward finds it."""

    node: fx.Node
    where: KeptInput | KeptOutput | KeptActivation | KeptGeneratorState

    @property
    def rng_state(self) -> bool:
        return isinstance(self.where, KeptGeneratorState)

    @property
    def storage(self) -> Storage:
        """Where it lives until backward (an input, an output or a generator state: on its device)."""
        return self.where.storage if isinstance(self.where, KeptActivation) else DEVICE


@dataclasses.dataclass(frozen=True)
class Programs:
    """Everything needed to run one signature under one set of decisions.

    The Function's forward returns `(*returned outputs, *activations, *generator
    states)`; `kept` says which of its inputs and outputs `ctx.save_for_backward`
    keeps, and every program that runs later takes `*kept` first. What the
    decisions cost (bytes kept, calls replayed) is `_accounting`'s.
    """

    forward: fx.GraphModule  # primals -> (*returned outputs, *activations, *states)
    backward: fx.GraphModule  # (*kept, *tangents) -> grads
    pure: PureForward  # *kept -> (*returned outputs if traced_for_forward_mode, *activations), from the inputs
    # *kept -> (*returned outputs, *activations): the backward that will be differentiated, by autograd where
    # it can (NOTE [a backward that will be differentiated]); None where a custom Function's backward
    # would be lost
    pure_with_outputs: PureForward | None
    traced_for_forward_mode: bool  # traced under forward-mode AD: `pure` returns the outputs too, for jvp
    pure_inputs: tuple[tuple[int, int], ...]  # (position in kept, primal index) of each input pure reads
    # primals -> views of them taken before the Function: NOTE [where views of inputs are rebuilt]
    prologue: fx.GraphModule | None
    epilogue: fx.GraphModule | None  # (*primals, *prologue's, *returned outputs) -> user outputs; None: all returned
    returned: tuple[int, ...]  # indices of the outputs the Function returns
    n_activations: int
    non_differentiable: tuple[bool, ...]  # per Function output: marked non-differentiable
    output_sources: tuple[frozenset[int], ...]  # per Function output: the primals it has a gradient for
    backward_not_differentiable: str | None  # why the backward program cannot be, if it cannot
    kept: tuple[Kept, ...]
    decisions: tuple[Decision, ...]

    @functools.cached_property
    def input_copies(self) -> dict[int, int]:
        """The activations that are copies of inputs (NOTE [kept inputs]): activation index -> primal index."""
        return {
            self.kept[i].where.index: primal  # type: ignore[union-attr]
            for i, primal in self.pure_inputs
            if isinstance(self.kept[i].where, KeptActivation)
        }


@dataclasses.dataclass(frozen=True)
class _Split:
    """Which nodes of a joint graph the programs keep, and which calls they replay and recompute, as the
    rules resolve the decisions (`_rules`)."""

    returned: tuple[int, ...]  # indices of the outputs the Function returns
    returned_nodes: list[fx.Node]
    backward_nodes: list[fx.Node]
    kept_values: dict[fx.Node, None]  # what the programs keep or read as it is, in order of first need
    replayed: frozenset[int]  # the calls backward replays
    activations: list[fx.Node]  # kept values the forward returns besides the outputs (copies of inputs included)
    kept: set[fx.Node]  # the values of saved calls kept
    constants: set[fx.Node]  # kept values without a derivative: the pure forward reads them as they are
    recomputed: frozenset[int]  # the calls the pure forward recomputes
    random_states: list[fx.Node]  # random calls whose generator state is kept


def partition(joint: JointGraph, decisions: Sequence[Decision], *, forward_mode: bool = False) -> Programs:
    """Split `joint` into programs that keep what `decisions` save and replay the rest.

    With `forward_mode`, the pure forward also recomputes the returned outputs
    (for their tangents), so the random calls they depend on keep their state too.
    """
    decisions = tuple(decisions)
    split = _split(joint, decisions, forward_mode)
    primal_index = {node: i for i, node in enumerate(joint.primals)}
    position = {node: p for p, node in reversed(list(enumerate(split.returned_nodes)))}
    activations, random_states = split.activations, split.random_states
    kept: list[Kept] = []
    copied = {a for a in activations if a.op == "placeholder"}
    for node in split.kept_values:
        if node.op == "placeholder" and node not in copied:  # by reference: see NOTE [kept inputs]
            kept.append(Kept(node, KeptInput(primal_index[node])))
        elif node in position:
            kept.append(Kept(node, KeptOutput(position[node])))
    stored = _stored_elsewhere(joint, decisions, activations, _read_again(joint, split), forward_mode)
    kept += [Kept(node, KeptActivation(k, stored.get(node, DEVICE))) for k, node in enumerate(activations)]
    n = len(activations)
    kept += [Kept(node, KeptGeneratorState(n + k)) for k, node in enumerate(random_states)]
    by_autograd = _differentiated_again_by_autograd(joint)
    if by_autograd:  # See NOTE [a backward that will be differentiated].
        kept += [Kept(p, KeptInput(primal_index[p])) for p in _inputs_to_differentiate_again(joint, split, kept)]
    kept_pairs = [(k.node, k.rng_state) for k in kept]
    holder = {k.node: i for i, k in enumerate(kept) if k.node.op == "placeholder" and not k.rng_state}
    returned = split.returned
    prologue, epilogue = None, None
    if returned[: joint.n_user_outputs] != tuple(range(joint.n_user_outputs)):
        prologue, epilogue = views_of_inputs(
            joint, returned, overwritten(joint), views_taken_before_a_read(joint, returned)
        )
    pure_with_outputs = (
        None
        if not by_autograd
        else PureForward(
            joint,
            False,
            tuple(kept_pairs),
            tuple(stored.items()),
            {**{p: p for p in holder}, **{c: c for c in _constants_to_autograd(joint, split.kept)}},
            tuple([*split.returned_nodes, *activations]),
            reapply=True,
        )
    )
    return Programs(
        forward=forward_program(
            joint, _dirty_as_inputs(joint, split.returned_nodes), activations, copied, random_states, stored
        ),
        backward=backward_program(joint, kept_pairs, split.backward_nodes, stored),
        pure=PureForward(
            joint,
            forward_mode,
            tuple(kept_pairs),
            tuple(stored.items()),
            {**{p: p for p in holder}, **{c: c for c in split.constants}},
            tuple([*split.returned_nodes, *activations] if forward_mode else activations),  # input copies too
        ),
        pure_with_outputs=pure_with_outputs,
        traced_for_forward_mode=forward_mode,
        pure_inputs=tuple((i, primal_index[node]) for node, i in holder.items()),
        prologue=prologue,
        epilogue=epilogue,
        returned=returned,
        n_activations=len(activations),
        backward_not_differentiable=_backward_not_differentiable(joint, pure_with_outputs),
        non_differentiable=_non_differentiable(
            joint,
            returned,
            activations,
            split.constants | _stored_without_derivative(stored),
            len(random_states),
            varying(joint, forward_mode=True, through_draws=True) if forward_mode else None,
        ),
        output_sources=(
            *_output_sources(joint, returned),
            # kept values: never marked here; a copy of an input has a derivative from that input alone
            *(frozenset({primal_index[a]} if a in copied else range(len(joint.primals))) for a in activations),
            *([frozenset()] * len(random_states)),
        ),
        kept=tuple(kept),
        decisions=decisions,
    )


def _differentiated_again_by_autograd(joint: JointGraph) -> bool:
    """Whether a backward that will be differentiated is autograd's over the pure forward: where the
    backward was traced for `.backward()` (`create_graph=True` may differentiate it), or calls an op whose
    formula autograd differentiates wrongly, or applies a custom autograd Function; and the pure forward
    can apply every such Function again. See NOTE [a backward that will be differentiated] and NOTE
    [custom Functions applied again]."""
    scoped = [node for _, node in calls_inside_functions(joint)]
    applied = {found[0] for node in joint.graph.nodes if (found := application_of(node)) is not None}
    if scoped or applied:  # (a Function whose forward only takes a view calls no op of its own)
        live = set(joint.graph.nodes)
        usable = [a for a in applied if _applies_again(a, live)]
        covered = frozenset().union(*(a.region for a in usable))
        return len(usable) == len(applied) and all(node in covered or is_custom_op(node.target) for node in scoped)
    # A backward traced in grad mode holds eager's grad-mode formulas (NOTE [a backward traced as it will
    # run]); all but those that autograd differentiates wrongly.
    return not joint.backward_in_grad_mode or any(node.target in _SWITCH_IN_GRAD_MODE for node in joint.call_nodes)


_SWITCH_IN_GRAD_MODE = _quirks.GRADIENTS_SWITCH_IN_GRAD_MODE.table


def _constants_to_autograd(joint: JointGraph, kept: set[fx.Node]) -> set[fx.Node]:
    """The kept values that autograd, as eager runs it, gives no derivative (`varying_again`: not the
    outputs of custom Functions and what has a derivative through them, traced under `no_grad` but with
    the Function's backward in eager; nor what is computed from a random fill of a value with a
    derivative), and kept fills, read as kept and connected to what they filled (NOTE [a fill's
    derivative]). See NOTE [custom Functions applied again]."""
    graph = joint.values
    return kept - {graph.nodes[v] for v in graph.varying_again}


def _applies_again(application: CustomApplication, live: set[fx.Node]) -> bool:
    """Whether the pure forward can apply `application` again: its inputs are still in the graph (an
    output nothing reads may be gone)."""
    return all(node in live for node in application.argument_nodes())


def _inputs_to_differentiate_again(joint: JointGraph, split: _Split, kept: Sequence[Kept]) -> list[fx.Node]:
    """The inputs that recomputing the outputs reads, not kept already: kept by reference (they cost
    nothing), where a backward that will be differentiated must be autograd's over the pure forward.
    Inputs the forward or the caller may overwrite are left out: a copy would cost memory."""
    have = {k.node for k in kept}
    overwritable = mutated_inputs(joint, split.returned)
    reached: dict[fx.Node, None] = {}
    stack, seen = [*split.returned_nodes], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if node in joint.primals and node not in have and node not in overwritable:
                reached[node] = None
            continue
        stack.extend(node.all_input_nodes)
    return list(reached)


def _read_again(joint: JointGraph, split: _Split) -> set[fx.Node]:
    """The nodes of the values that replays, and recomputations to differentiate again, read."""
    graph = joint.values
    values = {v for c in split.replayed for v in graph.reads[c]} | recomputation_reads(graph, split.recomputed)
    return {graph.nodes[v] for v in values}


def _stored_elsewhere(
    joint: JointGraph,
    decisions: Sequence[Decision],
    activations: Sequence[fx.Node],
    read_again: set[fx.Node],
    forward_mode: bool,
) -> dict[fx.Node, Storage]:
    """The activations kept elsewhere than on their device as they are, in order, with their storage: the
    values of calls whose decision keeps them so, that the forward does not return anyway (the caller
    holds those on the device). Traced for forward mode, only exactly (NOTE [values kept lossy]). See
    NOTE [kinds of storage]."""
    storages = {node: storage_of(d) for node, d in zip(joint.call_nodes, decisions, strict=True)}
    stored = {}
    for a in activations:
        storage = storages.get(a.args[0] if a.target is operator.getitem else a)  # type: ignore[arg-type]
        if storage is None or storage is DEVICE or (forward_mode and not storage.exact):
            continue
        if storage.can_hold(a, a in read_again):
            stored[a] = storage
    return stored


def _split(joint: JointGraph, decisions: Sequence[Decision], forward_mode: bool) -> _Split:
    """The nodes of what the rules resolve for `decisions`."""
    graph = joint.values
    resolved = rules_of(graph, forward_mode).resolve(saved_calls(decisions))
    returned = returned_outputs(joint)
    returned_nodes = [joint.outputs[i] for i in returned]
    outputs = set(returned_nodes)
    node_of = graph.nodes
    varying_values = graph.varying_forward_mode if forward_mode else graph.varying
    kept = [node_of[v] for v in resolved.needed if v in resolved.kept]
    return _Split(
        returned=returned,
        returned_nodes=returned_nodes,
        backward_nodes=backward_nodes_of(joint),
        kept_values=dict.fromkeys(node_of[v] for v in resolved.needed),
        replayed=resolved.replayed,
        activations=list(
            dict.fromkeys(
                [
                    *(node for node in kept if node not in outputs),
                    *(node_of[v] for v in resolved.needed if v in resolved.copied),
                ]
            )
        ),
        kept={node_of[v] for v in resolved.kept},
        constants={node_of[v] for v in resolved.kept if v not in varying_values},
        recomputed=resolved.recomputed,
        random_states=[joint.call_nodes[c] for c in resolved.states],
    )


def _backward_not_differentiable(joint: JointGraph, pure_with_outputs: PureForward | None) -> str | None:
    """Why differentiating the backward program would not be exact, if it would not: a call with a
    derivative whose traced gradient formula reads what autograd does not differentiate, or a custom
    autograd Function whose backward it holds as plain ops, where the backward that will be differentiated
    cannot be autograd's over the pure forward: that cannot apply the Function again (there is no
    `pure_with_outputs`), or cannot recompute the outputs. (A trace in grad mode knows which of the
    backward's ops ran without grad, but the derivatives of kept values computed from the Function's
    outputs would still go through its forward's ops, computed under `no_grad`: none.)"""
    applied = functions_applied(joint)
    if applied:
        name, inside = applied[0]
        where = f"{inside}: it runs inside" if inside is not None else "it applies"
        if pure_with_outputs is None:
            return f"{where} {_NOT_APPLIED_AGAIN.format(name)}"
        if not pure_with_outputs.reads_only_what_is_kept:
            return f"{where} {_NOT_RECOMPUTED.format(name)}"
    reading = calls_reading_lu_factors(joint)
    if reading:
        call, node = reading[0]
        return f"{call}: {_FORMULA_READS_FACTORS[node.target]}"
    return None


_FORMULA_READS_FACTORS = _quirks.GRADIENTS_READ_LU_FACTORS.table
_NOT_RECOMPUTED = (
    "the custom autograd Function {}, whose backward a second derivative would differentiate "
    "as plain ops, where eager runs the Function's own: the kept values do not suffice to recompute the "
    "function's outputs and apply the Function again (the rules keep what that reads: please report this). "
    "Take second derivatives outside remat.checkpoint meanwhile"
)
_NOT_APPLIED_AGAIN = (
    "the custom autograd Function {}, which remat cannot apply again (its tensor arguments "
    "are not values the trace can place): its first derivatives are exact, but a second derivative through "
    "its outputs would not be. Take second derivatives outside remat.checkpoint"
)


def _stored_without_derivative(stored: dict[fx.Node, Storage]) -> set[fx.Node]:
    """The kept values whose stored form carries no derivative (bits; a stand-in or a narrowed value, which
    only the gradient formulas read: NOTE [values kept as bits], NOTE [values kept lossy]), which the Function
    returns: no tangent or gradient reaches them."""
    found = set()
    for node, storage in stored.items():
        form = storage.stored_form(node.meta.get("val"))
        if not storage.can_hold(node, read_again=True) or (
            isinstance(form, torch.Tensor) and not form.is_floating_point()
        ):
            found.add(node)
    return found


def _non_differentiable(
    joint: JointGraph,
    returned: Sequence[int],
    activations: Sequence[fx.Node],
    constants: set[fx.Node],
    n_states: int,
    dual: set[fx.Node] | None,
) -> tuple[bool, ...]:
    """For each output of the Function, whether it is marked non-differentiable.

    As in eager, an output that depends on no input requiring grad does not require grad;
    under forward mode (`dual`: the nodes autograd would give a tangent, inputs with
    tangents not needing to require grad), one of `fn`'s outputs autograd would give no
    tangent (a detach) gets none. Nor do kept values that autograd does not differentiate
    or that have no derivative at all (`constants`: a view of one rebuilt outside the
    Function must not require grad; copies of inputs without a gradient: a backward in grad
    mode may pass them where autograd refuses a tensor that requires grad, running
    statistics), nor generator states.
    """
    requiring_grad = set(joint.differentiable_outputs)

    def without_derivative(i: int) -> bool:
        if dual is None:
            return True
        is_new_value = joint.n_user_outputs <= i < joint.n_user_outputs + len(joint.dirty)
        return not is_new_value and joint.outputs[i] not in dual

    with_gradient = {joint.primals[i] for i in joint.grad_of}

    def copy_without_derivative(a: fx.Node) -> bool:  # of an input that requires grad at no level
        return a.op == "placeholder" and a not in with_gradient  # (its tangent is the input's: `pure_inputs`)

    return (
        *(not _is_float(joint.outputs[i]) or (i not in requiring_grad and without_derivative(i)) for i in returned),
        *(
            not _is_float(a) or not differentiable(a) or a in constants or copy_without_derivative(a)
            for a in activations
        ),
        *([True] * n_states),
    )


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
        history = history_of(node)
        if history is not None:  # See NOTE [updates under no_grad keep their tensors' histories].
            forward[node] = forward.get(history, frozenset())
            continue
        if stops_gradient(node):
            continue
        if node.target is operator.getitem and not differentiable(node):
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


def _is_float(node: fx.Node) -> bool:
    value = node.meta["val"]
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
