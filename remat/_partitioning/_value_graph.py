"""The value graph: a joint graph's values and who reads them, the one graph the rules run on.

A value is an input of the function or one output of a forward call; views are not values (reading a
view reads the values it shows). `value_graph_of` reads, off a joint graph: which values each replay
of a call reads, which values the gradient formulas read (in order of first need), which values have
a derivative, which the Function returns, which inputs are overwritten (kept as copies), what keeping
each value costs, and the node that holds it. The rules (`_rules`) run on it, so the planners, the
accounting and the partition all count what the partitioner keeps. The helpers that read those facts
off the graph (returned outputs, views, overwritten inputs, derivatives) are here too, for the
programs' builders.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx

from .. import _quirks
from .._core import _rng
from .._core._calls import Call, Dataflow, Trace, Value
from .._eager._capture import history_of
from .._eager._facts import application_of, differentiable_outputs, fill_of
from .._eager._nodes import is_free, stops_gradient
from .._memory._measure import storage_key, storage_nbytes, tensor_nbytes, tensors_in
from .._storing import _bits
from .._torch import is_custom_op
from .._tracing._joint import JointGraph
from ._program_graphs import device_of, first_draws

__all__ = [
    "ValueGraph",
    "backward_nodes_of",
    "calls_inside_functions",
    "calls_reading_lu_factors",
    "functions_applied",
    "differentiable",
    "mutated_inputs",
    "needed_by_backward",
    "overwritten",
    "reads_any_value",
    "returned_outputs",
    "value_graph_of",
    "with_value_graph",
    "views_taken_before_a_read",
    "varying",
    "varying_again",
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
    gradient_formula_reads = _views_with_gradient_formulas(joint, base_of)
    for i, output in user_outputs:  # first, outputs that own their memory
        if output.op != "placeholder" and (base_of(output) is output or i in gradient_formula_reads):
            returned.setdefault(output, i)
    for i, output in user_outputs:  # then views of something that is not an output
        base = base_of(output)
        if base.op != "placeholder" and base not in returned:
            returned.setdefault(output, i)
    return (*sorted(returned.values()), *range(joint.n_user_outputs, len(joint.outputs)))


def _views_with_gradient_formulas(joint: JointGraph, base_of: Callable[[fx.Node], fx.Node]) -> set[int]:
    """The user outputs that are views autograd does not see as views, yet whose gradients backward
    computes: a custom autograd Function that returns a view of its input (its forward runs under
    `no_grad`, its own backward gives the gradient). Rebuilt after the Function as views, they would
    have no derivative at all; the Function returns them, so that their gradients reach its backward."""
    found = set()
    final_values = overwritten(joint)
    for k, i in enumerate(joint.differentiable_outputs):
        if i >= joint.n_user_outputs or not joint.tangents[k].users:
            continue
        if joint.outputs[i] in final_values:  # an input `fn` updated, returned: the input itself
            continue
        node, base = joint.outputs[i], base_of(joint.outputs[i])
        while node is not base and node.op == "call_function" and is_free(node):
            if stops_gradient(node):
                found.add(i)
                break
            node = node.args[0]  # type: ignore[assignment]
    return found


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


def varying(
    joint: JointGraph, forward_mode: bool, *, through_draws: bool = False, through_applications: bool = False
) -> set[fx.Node]:
    """Forward nodes whose value has a derivative with respect to some differentiable input.

    Differentiable inputs are those requiring grad (any floating input under forward
    mode). Derivatives stop at detaches and no_grad regions of `fn` (forward mode sees
    through the latter; the new value of a tensor updated in place under no_grad keeps the
    old one's history), and at random draws, whose outputs have none; `through_draws`
    follows autograd instead, which gives a draw from a differentiable mean or
    probability a derivative of zero (only a draw of a new tensor, `rand_like`, has none).
    With `through_applications`, the outputs of custom autograd Functions have one too (their
    forward runs under `no_grad`, and eager differentiates them by their backward).
    """
    if forward_mode:
        found = {p for p in joint.primals if p.meta["val"].is_floating_point() or p.meta["val"].is_complex()}
    else:
        found = {joint.primals[i] for i in joint.grad_of}
    if through_applications:
        found |= {node for node in joint.forward_nodes if application_of(node) is not None}
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
        has_derivative = node.op == "call_function" and not plain_draw and differentiable(node) and _has_float(node)
        if has_derivative and any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def varying_again(joint: JointGraph) -> set[fx.Node]:
    """The forward nodes autograd gives a derivative where it differentiates a recomputation of the
    forward again, as eager runs it: through custom Functions and random fills (but fills themselves,
    read as kept and connected: NOTE [a fill's derivative])."""
    found = varying(joint, forward_mode=False, through_draws=True, through_applications=True)
    return {node for node in found if fill_of(node) is None}


def calls_inside_functions(joint: JointGraph) -> list[tuple[Call, fx.Node]]:
    """The calls made inside custom autograd Functions (and custom ops) whose values are read. (A random
    call of a Function whose outputs nothing reads is left in the trace, read by nothing.)"""
    return [
        (c, node) for c, node in zip(joint.trace, joint.call_nodes, strict=True) if c.scope is not None and node.users
    ]


def functions_applied(joint: JointGraph) -> list[tuple[str, Call | None]]:
    """The custom autograd Functions `fn` applies whose outputs are read, each as its name and the first
    call made inside it (None for a Function whose forward only takes a view: it calls no op of its own).
    The backward program holds their backwards as plain ops, which a second derivative must not
    differentiate: the pure forward applies them again (NOTE [custom Functions applied again])."""
    found: dict[str, Call | None] = {}
    for call, node in calls_inside_functions(joint):
        if not is_custom_op(node.target):
            found.setdefault(str(call.scope), call)
    for node in joint.graph.nodes:
        if (application := application_of(node)) is not None:
            found.setdefault(application[0].function.__name__, None)
    return list(found.items())


def calls_reading_lu_factors(
    joint: JointGraph, has_derivative: set[fx.Node] | None = None
) -> list[tuple[Call, fx.Node]]:
    """The calls with a derivative whose gradient formula reads the LU factors their forward computed
    (`_quirks.GRADIENTS_READ_LU_FACTORS`): autograd does not differentiate those, so a second derivative
    through them is exact only from the pure forward."""
    found = [(c, node) for c, node in zip(joint.trace, joint.call_nodes, strict=True) if node.target in _READS_LU]
    if not found:  # (most traces: no walk of the graph for derivatives)
        return []
    if has_derivative is None:
        has_derivative = varying(joint, forward_mode=False)
    return [
        (c, node)
        for c, node in found
        if any(out in has_derivative for out in (node, *(u for u in node.users if u.target is operator.getitem)))
    ]


_READS_LU = _quirks.GRADIENTS_READ_LU_FACTORS.table


def _has_float(node: fx.Node) -> bool:
    """Whether `node` has a floating or complex value, or several values: an integer or boolean tensor
    (`isnan`, a count) has no derivative, nor has what autograd computes from it alone."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return True
    return value.is_floating_point() or value.is_complex()


def differentiable(node: fx.Node) -> bool:
    """Whether autograd differentiates the value of `node` (false for, say, the mean and
    rstd outputs of `native_layer_norm`: double backward must not ask for their derivative;
    nor for the output of `empty_like`, which a random fill may then read)."""
    if node.target is operator.getitem:
        producer, index = node.args
        flags = differentiable_outputs(producer)  # type: ignore[arg-type]
        return flags is None or bool(flags[index])  # type: ignore[index]
    flags = differentiable_outputs(node)
    return flags is None or isinstance(node.meta.get("val"), (tuple, list)) or bool(flags[0])


# --- the value graph -------------------------------------------------------------------------------------


class Reapplied(NamedTuple):
    """A custom Function application that a recomputation applies again (NOTE [custom Functions applied
    again]): where one of the calls `outputs` (that compute its outputs) is recomputed, it reads `reads`
    (its tensor arguments) and the generator states of the random calls `draws` (`_program_graphs.first_draws`)."""

    outputs: tuple[int, ...]
    reads: tuple[Value, ...]
    draws: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class ValueGraph:
    """A joint graph's values and who reads them. Inputs are the values `(-1 - i, 0)`; the outputs of
    call `c` are `(c, 0)`, `(c, 1)`, ...

    Attributes:
        reads: per call, the values a replay of it (or a recomputation) reads, in order.
        read_as_they_are: per call, the inputs it reads whose value does not matter to it
            (`reads_any_value`): an overwritten one needs no copy.
        backward_reads: the values the gradient formulas read, in order of first need.
        varying: the values with a derivative with respect to an input that requires grad.
        varying_forward_mode: the same under forward-mode AD (every floating input has a tangent).
        returned: the values the Function returns (outputs and the new values of dirty inputs).
        shown_by_returned: the values the returned outputs show (a returned view shows its base).
        overwritten: the inputs a program or the caller may overwrite before backward
            (NOTE [kept inputs]): read for their value, they are kept as copies.
        nbytes: what keeping a value costs: the bytes of its new storage (none for a value in an
            input's memory), a copy for an overwritten input, nothing for another input.
        rng_state_nbytes: per call, the bytes of its generator state (0 if it draws nothing).
        recomputes_returned: whether a backward that will be differentiated recomputes the returned
            outputs, to apply the custom autograd Functions they are computed from again (NOTE [custom
            Functions applied again]): what that reads is kept, generator states and copies of
            overwritten inputs included.
        varying_again: the values autograd differentiates where it differentiates that recomputation:
            `varying`, and what has a derivative through custom Functions and random fills (a fill
            itself is read as kept: NOTE [a fill's derivative]).
        reapplied: the custom Function applications that recomputation applies again.
        nodes: the node holding each value (a `getitem` for one output of a multi-output call).
    """

    reads: tuple[tuple[Value, ...], ...]
    read_as_they_are: tuple[frozenset[Value], ...]
    backward_reads: tuple[Value, ...]
    varying: frozenset[Value]
    varying_forward_mode: frozenset[Value]
    returned: frozenset[Value]
    shown_by_returned: tuple[Value, ...]
    overwritten: frozenset[Value]
    nbytes: Mapping[Value, int]
    rng_state_nbytes: tuple[int, ...]
    recomputes_returned: bool
    varying_again: frozenset[Value]
    reapplied: tuple[Reapplied, ...]
    nodes: Mapping[Value, fx.Node]

    def dataflow(self) -> Dataflow:
        """The public view of it (`remat.Dataflow`): the values that cost memory to keep, and who reads
        them for their value (inputs read as they are cost nothing)."""

        def costs(value: Value) -> bool:
            return value[0] >= 0 or value in self.overwritten

        reads = tuple(
            frozenset(v for v in values if costs(v) and v not in as_they_are)
            for values, as_they_are in zip(self.reads, self.read_as_they_are, strict=True)
        )
        return Dataflow(
            reads=reads,
            backward_reads=frozenset(filter(costs, self.backward_reads)),
            nbytes={v: b for v, b in self.nbytes.items() if costs(v)},
            rng_state_nbytes=self.rng_state_nbytes,
            varying=frozenset(filter(costs, self.varying)),
            returned=self.returned,
        )


def with_value_graph(joint: JointGraph) -> JointGraph:
    """`joint` with its value graph, and its trace carrying the graph and `joint` itself (whose programs
    under any decisions give their peak: `remat._partitioning._peak.peak_of`)."""
    with_values = dataclasses.replace(joint, values=value_graph_of(joint))
    return dataclasses.replace(with_values, trace=Trace(joint.trace, with_values.values, with_values))


def value_graph_of(joint: JointGraph) -> ValueGraph:
    """Read the value graph off `joint` (once per trace)."""
    call_index = {node: i for i, node in enumerate(joint.call_nodes)}
    nodes: dict[Value, fx.Node] = {(-1 - i, 0): p for i, p in enumerate(joint.primals)}
    for c, node in enumerate(joint.call_nodes):
        outputs = node.meta.get("val")
        for i in range(len(outputs) if isinstance(outputs, (tuple, list)) else 1):
            nodes[(c, i)] = node  # the whole tuple, until a getitem names the output
    named: set[Value] = set()
    for node in joint.graph.nodes:
        if node.target is operator.getitem and node.args[0] in call_index:
            value = (call_index[node.args[0]], node.args[1])  # type: ignore[index]
            if value not in named:
                named.add(value)
                nodes[value] = node  # type: ignore[index]
    input_index = {p: -1 - i for i, p in enumerate(joint.primals)}
    shown: dict[fx.Node, tuple[Value, ...]] = {}

    def values_shown(node: fx.Node) -> tuple[Value, ...]:
        """The values reading `node` reads: itself if it is one, else those it shows (through views)."""
        if node in shown:
            return shown[node]
        found: tuple[Value, ...]
        if node.op == "placeholder":
            found = ((input_index[node], 0),)
        elif node.op == "get_attr":
            found = ()  # a constant of the program module
        elif node in call_index:
            outputs = node.meta.get("val")
            count = len(outputs) if isinstance(outputs, (tuple, list)) else 1
            found = tuple((call_index[node], i) for i in range(count))
        elif node.target is operator.getitem and node.args[0] in call_index:
            found = ((call_index[node.args[0]], node.args[1]),)  # type: ignore[arg-type, index, assignment]
        else:  # a view, or a copy back into an input: reading it reads what it reads
            found = _distinct(v for n in node.all_input_nodes for v in values_shown(n))
        shown[node] = found
        return found

    backward_nodes = backward_nodes_of(joint)
    _record_tests(joint, nodes)
    reads, as_they_are = [], []
    for node in joint.call_nodes:
        any_value = reads_any_value(node)
        reads.append(_distinct(v for n in node.all_input_nodes for v in values_shown(n)))
        by_value = {v for n in node.all_input_nodes if n not in any_value for v in values_shown(n)}
        as_they_are.append(frozenset(v for n in any_value for v in values_shown(n) if v[0] < 0 and v not in by_value))
    returned = returned_outputs(joint)
    returned_nodes = [joint.outputs[i] for i in returned]
    returned_set = set(returned_nodes)
    overwritten_inputs = frozenset((input_index[p], 0) for p in mutated_inputs(joint, returned))
    with_derivative = varying(joint, forward_mode=False)
    with_tangent = varying(joint, forward_mode=True)
    with_derivative_again = varying_again(joint)
    # A second derivative through these is exact only from the pure forward: what it reads is kept.
    recomputes = bool(functions_applied(joint)) or bool(calls_reading_lu_factors(joint, with_derivative))
    inputs = {storage_key(t) for p in joint.primals for t in tensors_in(p.meta["val"])}
    return ValueGraph(
        reads=tuple(reads),
        read_as_they_are=tuple(as_they_are),
        backward_reads=_distinct(v for n in needed_by_backward(joint, backward_nodes) for v in values_shown(n)),
        varying=frozenset(v for v, node in nodes.items() if node in with_derivative),
        varying_forward_mode=frozenset(v for v, node in nodes.items() if node in with_tangent),
        returned=frozenset(v for v, node in nodes.items() if node in returned_set and v[0] >= 0),
        shown_by_returned=_distinct(v for node in returned_nodes for v in values_shown(node)),
        overwritten=overwritten_inputs,
        nbytes={v: _nbytes(v, node, overwritten_inputs, inputs) for v, node in nodes.items()},
        rng_state_nbytes=tuple(
            _rng.state_nbytes(device_of(node)) if call.is_random else 0
            for call, node in zip(joint.trace, joint.call_nodes, strict=True)
        ),
        recomputes_returned=recomputes,
        varying_again=frozenset(v for v, node in nodes.items() if node in with_derivative_again),
        reapplied=_reapplied(joint, call_index, values_shown) if recomputes else (),
        nodes=nodes,
    )


def _record_tests(joint: JointGraph, nodes: Mapping[Value, fx.Node]) -> None:
    """Record on the node of each call's value that the gradient formulas read only through one test per
    element which test that is (`_bits.TESTED`: NOTE [values kept as bits])."""
    for value, node in nodes.items():
        if value[0] >= 0:
            test = _bits.read_through_a_test(node, joint.forward_nodes, is_free)
            if test is None:
                node.meta.pop(_bits.TESTED, None)
            else:
                node.meta[_bits.TESTED] = test


def _reapplied(
    joint: JointGraph, call_index: Mapping[fx.Node, int], values_shown: Callable[[fx.Node], tuple[Value, ...]]
) -> tuple[Reapplied, ...]:
    applications = {found[0]: None for node in joint.graph.nodes if (found := application_of(node)) is not None}
    live = set(joint.graph.nodes)
    reapplied = []
    for application in applications:
        region = {call_index[node] for node in application.region if node in call_index}
        outputs = (v[0] for node in application.outputs if node in live for v in values_shown(node))
        reapplied.append(
            Reapplied(
                outputs=tuple(dict.fromkeys(c for c in outputs if c in region)),  # (none for a view of an input)
                reads=_distinct(v for node in application.argument_nodes() if node in live for v in values_shown(node)),
                draws=tuple(call_index[node] for node in first_draws(application, joint, live)),
            )
        )
    return tuple(reapplied)


def _nbytes(value: Value, node: fx.Node, overwritten_inputs: frozenset[Value], inputs: set[Any]) -> int:
    """What keeping `value` costs: see `ValueGraph.nbytes`."""
    held: Any = node.meta.get("val")
    if value[0] < 0:
        return tensor_nbytes(held) if value in overwritten_inputs else 0
    if isinstance(held, (tuple, list)) and node.target is not operator.getitem:
        held = held[value[1]]
    storages = {storage_key(t): storage_nbytes(t) for t in tensors_in(held) if storage_key(t) not in inputs}
    return sum(storages.values())


def _distinct(values: Any) -> tuple[Value, ...]:
    return tuple(dict.fromkeys(values))
