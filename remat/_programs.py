"""The FX programs one partition runs: forward, backward, the views around them and the differentiable forward.

Each is built from nodes of the joint graph and knows nothing of how it is
called; `_partition` decides what goes in them, `_execute` runs them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from . import _quirks, _rng
from ._applications import Reapplication, application_of
from ._capture import SCATTERS, history_of
from ._eager_kernels import RRELU, run_rrelu_as_eager, runnable
from ._errors import TraceError
from ._facts import CustomApplication, computed_without_grad, fill_of, stacked_under_vmap, stop_gradient_of
from ._joint import JointGraph, draws_random_numbers, is_free, stops_gradient
from ._random_fills import fill_in_eager_layout, with_a_fills_derivative
from ._storage import Storage
from ._strides import is_dense
from ._torch import (
    BoxedCodeGen,
    LazyGraphModule,
    OpOverload,
    decomposition_of,
    has_no_derivative,
    memory_layout,
    vmap_levels,
)

__all__ = [
    "HELD_STATE",
    "TRANSIENT",
    "PureForward",
    "backward_program",
    "device_of",
    "forward_program",
    "views_of_inputs",
]

# The meta key of the bytes a node takes on the device besides its inputs and its result, at once (`_peak`).
TRANSIENT = "remat_transient_bytes"
HELD_STATE = "remat_held_state_bytes"  # a replay's generator state as found, besides TRANSIENT

aten = torch.ops.aten


def device_of(node: fx.Node) -> torch.device:
    value = node.meta["val"]
    return (value if isinstance(value, torch.Tensor) else value[0]).device


def first_draws(application: CustomApplication, joint: JointGraph, live: Collection[fx.Node]) -> tuple[fx.Node, ...]:
    """The random calls of `application`'s forward that applying it again starts from their kept
    generator states: the first on each generator (the forward then draws the rest from it, as it did)."""
    first: dict[tuple[torch.device, int], fx.Node] = {}
    for node in application.region:
        if node in live and draws_random_numbers(node):
            generator = node.kwargs.get("generator")  # each read of a generator is a node of its own
            if isinstance(generator, fx.Node):
                generator = joint.constants[generator.target]  # type: ignore[index]
            first.setdefault((device_of(node), id(generator)), node)
    return tuple(first.values())


def forward_program(
    joint: JointGraph,
    returned: Sequence[fx.Node],
    activations: Sequence[fx.Node],
    copied: set[fx.Node],
    random_states: Sequence[fx.Node],
    stored: Mapping[fx.Node, Storage],
) -> fx.GraphModule:
    """primals -> (*returned, *activations, *generator states): every forward node, once.

    `copied` inputs are kept as a copy taken before anything overwrites them;
    a generator state is read right before each call in `random_states`; the
    `stored` activations are returned in their storage's form, stored as soon as
    each is made (see NOTE [kinds of storage]).
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {primal: graph.placeholder(primal.name) for primal in joint.primals}
    copies = {primal: graph.call_function(aten.clone.default, (env[primal],)) for primal in copied}
    states: dict[fx.Node, fx.Node] = {}
    for node in joint.graph.nodes:
        if node in joint.forward_nodes:
            if node in random_states:  # See NOTE [replaying random calls].
                args = fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                drawn = graph.call_function(
                    _rng.run_keeping_state,
                    (device_of(node), runnable(node), *args),  # type: ignore[arg-type]
                    kwargs,
                )
                states[node] = graph.call_function(operator.getitem, (drawn, 0))
                env[node] = graph.call_function(operator.getitem, (drawn, 1))
                env[node].meta = dict(node.meta)
            else:
                env[node] = _copy(graph, node, env)
    forms = {}
    for node, storage in stored.items():
        with graph.inserting_after(env[node]):
            forms[node] = graph.call_function(
                storage.store,  # type: ignore[arg-type]
                (env[node], *storage.store_static_args(node)),
            )
        form = storage.stored_form(node.meta.get("val"))
        if form is not None:  # what it takes on the device (see `_peak`)
            forms[node].meta["val"] = form
        if storage.store_bytes is not None and isinstance(node.meta.get("val"), torch.Tensor):
            forms[node].meta[TRANSIENT] = storage.store_bytes(node.meta["val"])
    graph.output(
        (
            *(env[node] for node in returned),
            *(copies.get(a) or forms.get(a) or env[a] for a in activations),
            *(states[node] for node in random_states),
        )
    )
    return _module(joint, graph)


def backward_program(
    joint: JointGraph,
    kept: Sequence[tuple[fx.Node, bool]],
    backward_nodes: Sequence[fx.Node],
    stored: Mapping[fx.Node, Storage],
) -> fx.GraphModule:
    """[*kept, *tangents] -> grads, replaying what is not kept just before its first use.

    Boxed: it takes one list and empties it, so that each kept tensor is freed
    at its last use. `kept` pairs a node with whether the kept tensor is the
    generator state of that (random) node rather than its value. See NOTE
    [replay just in time]. The `stored` kept values arrive in their storage's form
    and are loaded before their first use (see NOTE [kinds of storage]).
    """
    graph = fx.Graph()
    env, states = _kept_placeholders(graph, kept)
    forms = {node: (env.pop(node), storage) for node, storage in stored.items()}
    for tangent in joint.tangents:
        env[tangent] = graph.placeholder(tangent.name)
    for node, placeholder in env.items():  # for `differentiable_again` to call ops on
        placeholder.meta.setdefault("val", node.meta.get("val"))
    emit = _emitter(graph, env, states, forward_mode=False, forms=forms)
    for node in backward_nodes:
        emit(node)
    graph.output(tuple(emit(g) for g in joint.grads))
    for storage in {storage for _, storage in forms.values() if storage.ahead}:
        _load_ahead(graph, storage)
    graph.set_codegen(BoxedCodeGen())
    return _module(joint, graph)


# NOTE [a backward that will be differentiated]
# Eager runs gradient formulas with grad mode on where their results will be
# differentiated (`create_graph=True`, `grad` of `grad`, `hessian`), and some
# formulas switch form there. Under torch.func's reverse-mode transforms remat
# knows this when it traces, and traces the backward in grad mode too (NOTE [a
# backward traced as it will run]). Elsewhere (`create_graph=True` of plain
# autograd) it traces backward with grad mode off, for first-order speed, and
# its backward program holds the first form, which differs from eager's where
# it runs with grad mode on: it calls fused backward ops autograd has no
# derivative for (SiLU's, mish's, logit's, group norm's), ops autograd
# differentiates wrongly (`_quirks.GRADIENTS_SWITCH_IN_GRAD_MODE`: cumprod's
# divides by its input, NaN at a zero; linalg.solve's, det's and slogdet's read
# LU factors), and lays gradients out or rounds them otherwise (group norm's
# fused kernel makes its gradient contiguous; the grad-mode formula keeps the
# incoming layout). So where the gradients may be differentiated (grad mode is
# on and something they come from requires grad at some level), the backward is
# autograd's over the pure forward (`Programs.pure_with_outputs`, recomputing
# the outputs too): every formula runs as eager runs it in grad mode. (A backward
# traced in grad mode holds eager's formulas and runs as traced, but where it
# calls one autograd differentiates wrongly, or applies a custom Function.) That needs
# the inputs the outputs are computed from (kept by reference: they cost
# nothing), every random call replayable from a kept state, and every custom
# autograd Function applied again (NOTE [custom Functions applied again]).
# Elsewhere remat runs a copy of the backward program in which each call of an
# op autograd cannot differentiate (found by calling it on the trace's fake
# tensors, not from a list) is torch's decomposition of it: the same gradient
# to within round-off, and an exact derivative of it; the LU formulas refuse to
# be differentiated (NOTE [second derivatives of gradients that read LU factors]).


# NOTE [tangents that will be differentiated]
# Forward mode takes its tangents from the pure program by the forward-mode
# formulas of its ops, as eager computes them, so that a transform outside
# differentiates them as it does eager's. Some of those formulas read
# statistics their op returns without a derivative (layer norm's and batch
# norm's mean and inverse deviation: `_quirks.TANGENT_FORMULAS_READ_STATISTICS`),
# and a reverse-mode derivative of such a tangent misses the terms through them:
# eager's `grad` of `jvp` of a layer norm is off from float64 finite differences,
# and under `vmap` eager and a per-example loop differ from each other as well.
# Where the tangents will be differentiated (grad mode on, and something they
# come from requires grad at some level), remat runs the pure program with those
# ops as torch's decompositions, whose formulas differentiate exactly: the
# tangents equal eager's to within round-off, and their derivatives are the
# finite differences' rather than eager's.


def decomposed(program: fx.GraphModule, ops: frozenset[Any]) -> fx.GraphModule:
    """`program` with each call of one of `ops` replaced by torch's decomposition of it."""
    graph = _copy_of(program)
    replaced = _decompose(graph, lambda node, op: op in ops)
    return LazyGraphModule(program, graph) if replaced else program


def differentiable_again(program: fx.GraphModule) -> fx.GraphModule:
    """`program` with each call of an op autograd cannot differentiate replaced by a decomposition of
    it that autograd can, and the values its trace computed with grad mode off detached (`program` itself
    if it has neither). See NOTE [a backward that will be differentiated] and NOTE [regions of a backward
    without grad]."""
    graph = _copy_of(program)
    without_grad = [
        node
        for node in graph.nodes
        if node.op == "call_function" and computed_without_grad(node) and isinstance(node.meta.get("val"), torch.Tensor)
    ]
    for node in without_grad:
        _detach_uses(graph, node)
    replaced = _decompose(graph, _has_no_derivative)
    return LazyGraphModule(program, graph) if replaced or without_grad else program


def _copy_of(program: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    graph.set_codegen(program.graph._codegen)
    return graph


def _decompose(graph: fx.Graph, wanted: Callable[[fx.Node, OpOverload], bool]) -> bool:
    """Replace each call of an op (or of a function `_copy` runs one as) that `wanted` picks and torch has
    a decomposition of by that decomposition; whether any was."""
    replaced = False
    for node in graph.nodes:
        run_as = node.op == "call_function" and node.target in _RUN_AS
        op = node.args[0] if run_as else node.target
        if node.op != "call_function" or not isinstance(op, OpOverload):
            continue
        decomposition = decomposition_of(op)
        if decomposition is not None and wanted(node, op):
            node.target, node.args = decomposition, node.args[1:] if run_as else node.args
            replaced = True
    return replaced


def _has_no_derivative(node: fx.Node, op: OpOverload) -> bool:
    """Whether autograd has no derivative for `op`, which `node` calls."""
    arguments = node.args[1:] if node.target in _RUN_AS else node.args
    args, kwargs = fx.node.map_arg((arguments, node.kwargs), lambda n: n.meta.get("val"))
    return has_no_derivative(op, args, kwargs)


def _detach_uses(graph: fx.Graph, node: fx.Node) -> None:
    """Make every user of `node` read a detached alias of it instead."""
    with graph.inserting_after(node):
        detached = graph.call_function(aten.detach.default, (node,))
    node.replace_all_uses_with(detached, delete_user_cb=lambda user: user is not detached)


def _load_ahead(graph: fx.Graph, storage: Storage) -> None:
    """Move the start of each load from `storage` `storage.ahead` loads ahead of where backward waits
    for it: the first ones to the program's start, each next one to right after the wait for the one
    `ahead` places before it. See NOTE [offloading kept values]."""
    finishes = [node for node in graph.nodes if node.target is storage.finish_load]
    if not finishes:
        return
    anchor = [node for node in graph.nodes if node.op == "placeholder"][-1]  # a load reads one
    for k, finish in enumerate(finishes):
        if k >= storage.ahead:
            anchor = finishes[k - storage.ahead]
        anchor.append(finish.args[0])  # type: ignore[arg-type]
        anchor = finish.args[0]  # the next start goes after this one


# NOTE [replay just in time]
# Replaying every discarded call at the start of backward would hold all of
# them at once and raise the backward peak above eager's. Emitting each replay
# right before the first backward node that reads it, with FX's code
# generation freeing each value after its last use, keeps the replayed values
# alive only while the gradient formulas that read them run. The kept values
# go the same way: autograd lets go of them as the backward starts
# (`release_saved_tensors`), and the program, taking them in a list it
# empties, holds the last reference to each until its last use, as eager
# autograd frees each node's saved tensors once that node's backward has run.


@dataclasses.dataclass(frozen=True, eq=False)
class PureForward:
    """*kept -> targets, recomputed from inputs with random calls replayed: a pure,
    differentiable function. See NOTE [differentiating the forward again].

    `inputs` maps each primal to the kept node that holds its value (itself, or
    the node of its copy when the forward overwrites it), and each random call
    whose kept output stands for it to itself. `stored` kept values arrive
    in their storage's form and are loaded first (NOTE [kinds of storage]).

    Its program is built on its first call: only second derivatives and forward mode run it, and
    the planners that partition a graph to predict a peak never do.
    """

    joint: JointGraph
    forward_mode: bool
    kept: tuple[tuple[fx.Node, bool], ...]
    stored: tuple[tuple[fx.Node, Storage], ...]
    inputs: Mapping[fx.Node, fx.Node]
    targets: tuple[fx.Node, ...]
    reapply: bool = False  # custom Functions applied again: NOTE [custom Functions applied again]

    def forward(self, *kept: Any) -> Any:
        return self.module.forward(*kept)

    def tangents_to_differentiate(self, *kept: Any) -> Any:
        """`forward`, for forward mode whose tangents will be differentiated: NOTE [tangents that will be
        differentiated]."""
        return self.module_for_differentiated_tangents.forward(*kept)

    @functools.cached_property
    def module_for_differentiated_tangents(self) -> fx.GraphModule:
        return decomposed(self.module, _quirks.TANGENT_FORMULAS_READ_STATISTICS.table)

    @functools.cached_property
    def computed(self) -> tuple[fx.Node, ...]:
        """The nodes the program computes, in the order `fn` computed them: autograd runs the gradient
        formulas of the calls recorded last first, and the order in which gradients reach a value decides
        the layout of their sum. (A custom Function applied again is computed from its arguments.)"""
        reached, stack = set(), list(self.targets)
        while stack:
            node = stack.pop()
            if node in reached or node in self.inputs:
                continue
            reached.add(node)
            found = application_of(node) if self.reapply else None
            stack.extend(found[0].argument_nodes() if found is not None else node.all_input_nodes)
        position = {node: i for i, node in enumerate(self.joint.graph.nodes)}
        return tuple(sorted(reached, key=position.__getitem__))

    @functools.cached_property
    def reads_only_what_is_kept(self) -> bool:
        """Whether the targets can be recomputed from the kept values: no input it reaches is missing,
        and no random call it reaches would draw afresh (its state or its output is kept)."""
        states = {node for node, is_state in self.kept if is_state}
        live = set(self.joint.graph.nodes) if self.reapply else set()
        for node in self.computed:
            found = application_of(node) if self.reapply else None
            if found is not None:  # applied again: NOTE [custom Functions applied again]
                if not states.issuperset(first_draws(found[0], self.joint, live)):
                    return False
            elif node.op == "placeholder" or (draws_random_numbers(node) and node not in states):
                return False
        return True

    @functools.cached_property
    def module(self) -> fx.GraphModule:
        """The program (two threads' first calls may both build it: either is the same program)."""
        graph = fx.Graph()
        holders, states = _kept_placeholders(graph, self.kept)
        for node, storage in self.stored:
            if node in self.inputs.values():
                holders[node] = graph.call_function(
                    storage.load_now,  # type: ignore[arg-type]
                    (holders[node], device_of(node), *storage.static_args(node)),
                )
        env = {primal: holders[holder] for primal, holder in self.inputs.items()}
        emit = _emitter(graph, env, states, self.forward_mode, reapply_in=self.joint if self.reapply else None)
        if self.reapply:  # a fill's kept value, read as it is, keeps its derivative: NOTE [a fill's derivative]
            for node in [n for n in self.inputs if n.op == "call_function" and fill_of(n) is not None]:
                filled = node.args[0]
                if isinstance(filled, fx.Node):
                    env[node] = graph.call_function(with_a_fills_derivative, (env[node], emit(filled)))
        for node in self.computed:
            emit(node)
        graph.output(tuple(emit(target) for target in self.targets))
        return _module(self.joint, graph)


# NOTE [differentiating the forward again]
# A second-order derivative (double backward, grad of grad, hessian) flows
# through the values backward keeps, and forward mode needs the tangents of
# every output. Both come from one pure program that recomputes the forward's
# outputs and kept values from the inputs, replaying random calls from their
# generator states and skipping in-place updates of inputs. Autograd (or
# `torch.func.jvp`) differentiates it like any function. Its graph keeps what
# `fn` told autograd not to see through (`detach()`, `torch.no_grad()`), and
# drops the detaches that autograd itself put in when it saved tensors: those
# saved values are exactly what a second derivative must see through.


def views_of_inputs(
    joint: JointGraph, returned: Sequence[int], overwritten: Mapping[fx.Node, fx.Node], first: Sequence[int]
) -> tuple[fx.GraphModule | None, fx.GraphModule]:
    """The prologue, primals -> the user outputs in `first` (views of inputs taken before the
    Function, None if there are none), and the epilogue, (*primals, *the prologue's outputs,
    *returned outputs) -> the user's outputs, rebuilding the other views among them.

    `overwritten` maps the final value of each input updated in place to that
    input, which holds the value after forward.
    """
    prologue = None
    if first:
        graph = fx.Graph()
        env = {primal: graph.placeholder(primal.name) for primal in joint.primals}
        graph.output(tuple(_emit_views(graph, env, joint.outputs[i], frozenset(), before=True) for i in first))
        prologue = _module(joint, graph)
    graph = fx.Graph()
    env = {primal: graph.placeholder(primal.name) for primal in joint.primals}
    for i in first:
        env.setdefault(joint.outputs[i], graph.placeholder(f"view_{i}"))
    for i in returned:
        placeholder = graph.placeholder(f"output_{i}")
        env.setdefault(joint.outputs[i], placeholder)
    for value, primal in overwritten.items():
        env.setdefault(value, env[primal])
    updated = frozenset(overwritten.values())  # after the Function, these inputs hold their new values
    outputs = joint.outputs[: joint.n_user_outputs]
    graph.output(tuple(_emit_views(graph, env, output, updated, before=False) for output in outputs))
    return prologue, _module(joint, graph)


def _emit_views(
    graph: fx.Graph, env: dict[fx.Node, fx.Node], node: fx.Node, updated: Collection[fx.Node], *, before: bool
) -> fx.Node:
    """Copy into `graph` the views from `node` down to a node already in `env`, and the numbers they
    take that `fn` read from tensors' values (`x[: n.item()]`): see `_emit_number`. The graph runs
    `before` the Function (a prologue), or after it, when the inputs in `updated` hold new values."""
    chain = []  # without recursion: a chain may be long
    while node not in env:
        if not is_free(node):  # the rules return every output that is not a view of one that is there
            raise AssertionError(f"remat: rebuilding the views would compute {node.format_node()}; please report this.")
        chain.append(node)
        node = node.args[0]  # type: ignore[assignment]
    for view in reversed(chain):
        for number in view.all_input_nodes[1:]:
            _emit_number(graph, env, number, updated, before)
        env[view] = graph.node_copy(view, lambda n: env[n])
        if stop_gradient_of(view) == "no_grad":  # a view `fn` took under no_grad
            env[view].target, env[view].args = _run_under_no_grad, (view.target, *env[view].args)  # type: ignore[arg-type]
    return env[chain[0] if chain else node]


def _emit_number(
    graph: fx.Graph, env: dict[fx.Node, fx.Node], node: fx.Node, updated: Collection[fx.Node], before: bool
) -> None:
    """Copy into `graph` the arithmetic of a size or offset a view takes, down to the tensor values it
    reads: an input's (as `fn` read it), or an output's the Function returned. Any other value is not
    there to read: refused."""
    if node in env:
        return
    read_updated = node.target is torch.ops.aten._local_scalar_dense.default and node.args[0] in updated
    if read_updated or isinstance(node.meta.get("val"), torch.Tensor):
        if read_updated:
            why, way_out = "an input it then updates in place, which holds its new value once the function has run", ""
        elif before:
            why = (
                "a tensor it computed, and it uses that input again after the view: remat rebuilds such views "
                "before the function runs, when that value is not computed yet"
            )
            way_out = ", or after its last use of the input"
        else:
            why, way_out = "a tensor it computed and does not return", ", or return that tensor too"
        raise TraceError(
            "remat: the checkpointed function returns a view of an input whose size or offset it read from the "
            f"value of {why} ({node.target}). Take the view outside the checkpointed function{way_out}."
        )
    for used in node.all_input_nodes:
        _emit_number(graph, env, used, updated, before)
    env[node] = graph.node_copy(node, lambda n: env[n])


def _copied(destination: torch.Tensor, source: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """`aten.copy(destination, source)` (what a slice assignment functionalizes into, in `fn` and in
    the gradient formulas of one) as ops that autograd and forward-mode AD differentiate, which they
    do not `aten.copy`: `source`, cast and broadcast, copied into a new tensor laid out as
    `aten.copy`'s result was when traced (`stride`). The new tensor is made from `source`, so that
    under a torch.func transform it lives at `source`'s level: the result depends on `source` alone."""
    source = source.to(dtype=destination.dtype, device=destination.device).expand(destination.shape)
    return source.new_empty_strided(destination.shape, stride).copy_(source)


class _WithHistoryOf(torch.autograd.Function):
    """`value` with `tensor`'s history: what autograd sees of a tensor updated in place where it does not
    see (its new `value`, its old history). See NOTE [updates under no_grad keep their tensors' histories]."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        return value.clone()  # a new tensor: a Function's output may not be one of its inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad

    @staticmethod
    def jvp(ctx: Any, value_tangent: torch.Tensor | None, tensor_tangent: torch.Tensor | None) -> torch.Tensor | None:
        # Only a pure forward for forward mode has it (where the update was through a detached alias:
        # forward mode sees one under no_grad), and the tensor keeps its tangent too.
        return tensor_tangent


def _computable(node: fx.Node, env: Mapping[fx.Node, fx.Node], states: Collection[fx.Node]) -> bool:
    """Whether a program with the values in `env` can compute `node`: no input it reads is missing, and no
    random call it needs would draw afresh (its generator state is not in `states`)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in env or current in seen:
            continue
        if current.op == "placeholder" or (current not in states and draws_random_numbers(current)):
            return False
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return True


def _with_history_of(value: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    return _WithHistoryOf.apply(value, tensor)  # type: ignore[no-any-return]


def _run_under_no_grad(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`op` run as `fn` ran it, under `torch.no_grad()` (in a view rebuilt outside the Function)."""
    with torch.no_grad():
        return op(*args, **kwargs)


def _kept_placeholders(
    graph: fx.Graph, kept: Sequence[tuple[fx.Node, bool]]
) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
    values: dict[fx.Node, fx.Node] = {}
    states: dict[fx.Node, fx.Node] = {}
    for node, is_state in kept:
        if is_state:
            states[node] = graph.placeholder(f"rng_state_of_{node.name}")
        else:
            values.setdefault(node, graph.placeholder(f"kept_{node.name}"))
    return values, states


def _emitter(
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
    states: Mapping[fx.Node, fx.Node],
    forward_mode: bool,
    forms: Mapping[fx.Node, tuple[fx.Node, Storage]] | None = None,
    reapply_in: JointGraph | None = None,
) -> Callable[[fx.Node], fx.Node]:
    """A function that copies a node of the joint graph into `graph` (and, first, the nodes
    it reads that are not there yet), replaying random calls from their kept states, so
    that autograd (forward-mode AD, with `forward_mode`) can differentiate the copy. See
    NOTE [differentiating the forward again]. A node in `forms` (a placeholder of its stored
    form, and its storage) is loaded where it is first read. With `reapply_in` (the joint graph
    copied from), custom Functions are applied again: NOTE [custom Functions applied again]."""
    forms = forms or {}
    live = set(reapply_in.graph.nodes) if reapply_in is not None else set()
    reapplications: dict[CustomApplication, Reapplication] = {}

    def reapplication(node: fx.Node) -> Reapplication | None:
        """How the program applies again the custom Function whose output `node` is, if it does."""
        found = application_of(node)
        if found is None or reapply_in is None:
            return None
        application = found[0]
        if application not in reapplications:
            draws = first_draws(application, reapply_in, live)
            reapplications[application] = Reapplication(application, [(d, device_of(d)) for d in draws])
        return reapplications[application]

    def apply_again(again: Reapplication) -> None:
        generators = [draw.kwargs.get("generator") for draw, _ in again.draws]
        applied = graph.call_function(
            again,
            (
                *(env[n] for n in again.inputs),
                *(states[draw] for draw, _ in again.draws),
                *(emit(g) if isinstance(g, fx.Node) else g for g in generators),
            ),
        )
        for k, output in enumerate(again.application.outputs):
            if output not in env:
                env[output] = graph.call_function(operator.getitem, (applied, k))
                env[output].meta = dict(output.meta)

    def load(node: fx.Node) -> fx.Node:
        form, storage = forms[node]
        if storage.start_load is None:  # one call
            loaded = graph.call_function(
                storage.finish_load,  # type: ignore[arg-type]
                (form, device_of(node), *storage.static_args(node)),
            )
            loaded.meta["val"] = node.meta["val"]
            if storage.load_bytes is not None:
                loaded.meta[TRANSIENT] = storage.load_bytes(node.meta["val"])
            return loaded
        started = graph.call_function(storage.start_load, (form, device_of(node)))  # type: ignore[arg-type]
        started.meta["val"] = node.meta["val"]  # the device memory it takes (see `_peak`)
        finished = graph.call_function(storage.finish_load, (started,))  # type: ignore[arg-type]
        finished.meta["val"] = node.meta["val"]
        return finished

    def emit_one(node: fx.Node) -> None:
        """Copy `node`, whose inputs are all in `env` already."""
        if node in states:
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            copy = graph.call_function(
                _rng.replay_with_rng_state,
                (states[node], device_of(node), runnable(node), *args),  # type: ignore[arg-type]
                kwargs,
            )
            copy.meta = dict(node.meta)
            # The generator's state as found, held while the call replays: NOTE [replaying random calls].
            copy.meta[HELD_STATE] = _rng.state_nbytes(device_of(node))
        elif node.target is aten.detach.default and not stops_gradient(node):
            copy = env[node.args[0]]  # type: ignore[index]  # autograd's own detach of a saved value
        elif node.target is aten.copy.default:  # no derivative of its own, in either mode
            stride = tuple(node.meta["val"].stride())
            copy = graph.call_function(_copied, (env[node.args[0]], env[node.args[1]], stride))  # type: ignore[index]
            copy.meta = dict(node.meta)
        else:
            copy = _copy(graph, node, env)
            updated = _UNDECLARED_UPDATES.get(node.target)
            if updated is not None and node.args[updated[0]] is True:  # NOTE [replays update no running statistics]
                copy.args = tuple(None if i in updated[1] else a for i, a in enumerate(copy.args))
            if _value_stops_gradient(node, forward_mode):
                copy = graph.call_function(aten.detach.default, (copy,))
            history = history_of(node, forward_mode=forward_mode)
            if history is not None and _computable(history, env, states):
                # See NOTE [updates under no_grad keep their tensors' histories].
                copy = graph.call_function(_with_history_of, (copy, emit(history)))
                copy.meta = dict(node.meta)
        env[node] = copy

    def emit(target: fx.Node) -> fx.Node:
        # Depth first, with a stack of our own: a chain of calls may be far deeper than Python's
        # recursion limit. A node is copied once its inputs are, in the order it reads them.
        stack = [(target, False)]
        while stack:
            node, inputs_done = stack.pop()
            if node in env:
                continue
            if node in forms:
                env[node] = load(node)
                continue
            again = reapplication(node)
            if again is not None:  # See NOTE [custom Functions applied again].
                if inputs_done:
                    apply_again(again)
                else:
                    stack.append((node, True))
                    stack.extend((arg, False) for arg in reversed(again.inputs) if arg not in env)
                continue
            if not inputs_done:
                stack.append((node, True))
                stack.extend((arg, False) for arg in reversed(node.all_input_nodes) if arg not in env)
                continue
            emit_one(node)
            if isinstance(node.meta.get("val"), (tuple, list)):  # See NOTE [outputs of multi-output calls].
                picks = [user for user in node.users if user.target is operator.getitem]
                stack.extend((user, False) for user in reversed(picks))
        return env[target]

    return emit


# NOTE [replays update no running statistics]
# The batch norm kernels a GPU runs in training (cuDNN's, MIOpen's) update the running statistics in
# place without their schemas saying so (`_quirks.BATCH_NORM_UPDATES_UNDECLARED`),
# so the trace holds them as pure ops and every run of one updates the statistics. The forward program
# runs each once, as eager does. The programs built here run calls again (a replay in backward, the pure
# forward of a second derivative or of forward mode): there such a call is given no running statistics.
# In training it normalizes by the batch's own, so its outputs are the same, and it updates nothing.
_UNDECLARED_UPDATES = _quirks.BATCH_NORM_UPDATES_UNDECLARED.table


# NOTE [outputs of multi-output calls]
# FX's code frees a value after its last use, and a multi-output call's value
# is the tuple of its outputs: while any output is still to be picked out of
# it, the tuple holds all of them. Picking every output right after the call
# frees the tuple at once, and each output at its own last use (batch norm's
# output in backward, for one, long before its saved statistics are read).


def _copy(graph: fx.Graph, node: fx.Node, env: Mapping[fx.Node, fx.Node]) -> fx.Node:
    """A copy of `node` in `graph` that runs as eager ran it. See NOTE [random fills draw in eager's layout]."""
    ignored = _RUNNING_STATS_IGNORED.get(node.target)
    if ignored is not None and node.args[ignored[0]] is True:
        # A replayed training-mode batch norm does not read its running statistics (it drops the ones it
        # computes): they go in detached, for the functional op refuses ones that require grad at some
        # level, as an input `fn` hands it (instance norm's, under `grad` of `grad`) may.
        stats = {a for i, a in enumerate(node.args) if i in ignored[1] and isinstance(a, fx.Node)}
        env = {**env, **{a: graph.call_function(aten.detach.default, (env[a],)) for a in stats}}
    copy = graph.node_copy(node, lambda n: env[n])
    fill = fill_of(node)
    if fill is not None:  # a NamedTuple prints as an argument, not as a target
        copy.target, copy.args = fill_in_eager_layout, (fill, *copy.args)
    elif node.target in _SCATTERS:
        copy.target, copy.args = _scattered_in_base_layout, (node.target, *copy.args)
    elif node.target is aten.as_strided_scatter.default:
        copy.target = _as_strided_scattered
    elif node.target is aten.index_fill.int_Tensor:
        copy.target = _index_filled
    elif node.target in RRELU:
        copy.target = run_rrelu_as_eager
    elif node.target in _UPDATING_BATCH_NORM:
        copy.target, copy.args = _batch_norm_updating_copies, (node.target, *copy.args)  # type: ignore[arg-type]
    if stacked_under_vmap(node):
        copy.target, copy.args = _as_stacked_under_vmap, (copy.target, *copy.args)  # type: ignore[arg-type]
    return copy


# Whether the innermost torch.func level where the checkpointed function was called is a vmap: only
# there does vmap meet a composite op before an inner level (`grad`, `jvp`) has split it into its ops.
STACKS_UNDER_VMAP: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_stacks_under_vmap", default=False)


def _as_stacked_under_vmap(op: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`op(*args, **kwargs)`, the value of an op vmap runs example by example: contiguous where vmap's stack
    of the examples' values is (NOTE [ops vmap runs example by example] in `remat/_noting_modes.py`)."""
    value = op(*args, **kwargs)
    if isinstance(value, torch.Tensor) and STACKS_UNDER_VMAP.get() and vmap_levels(value):
        return value.contiguous()
    return value


# NOTE [batch norm under vmap]
# Batch norm with running statistics in training updates them in place; the
# trace holds its functional form, which returns new statistics. Under vmap,
# torch has a batching rule for the in-place op (it folds the batch into the
# channels, and the output keeps that layout) and none for the functional one,
# whose fallback runs example by example and stacks a contiguous result. There
# the functional op runs as its definition: the in-place op on copies of the
# statistics, eager's batching rule, layout and errors included.
_UPDATING_BATCH_NORM = _quirks.BATCH_NORM_FUNCTIONAL_UNBATCHED.table


def _batch_norm_updating_copies(
    op: Any,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """The functional batch norm `op`, under vmap as the in-place op on copies of the running statistics:
    see NOTE [batch norm under vmap]."""
    if not vmap_levels(input):
        return op(input, weight, bias, running_mean, running_var, training, momentum, eps)  # type: ignore[no-any-return]
    mean, var = running_mean.clone(), running_var.clone()
    out, saved_mean, saved_invstd = _UPDATING_BATCH_NORM[op](input, weight, bias, mean, var, training, momentum, eps)
    return out, saved_mean, saved_invstd, mean, var


# The functions `_copy` runs ops as, taking the op they stand for first (its decomposition replaces either).
_RUN_AS = frozenset({_batch_norm_updating_copies})


# NOTE [an index fill of a batched value]
# Under vmap, torch's batching rule for `index_fill` with a tensor value fills
# every example with the last example's value where the tensor filled is not
# batched and the value is (`zeros(25).index_fill(0, idx, v)` for a batched
# `v`): in torch alone, though eager rarely meets it. remat's programs do:
# `trace`'s gradient formula is such a fill of zeros, by the incoming gradient,
# which is batched under `vmap`. There the fill runs as a `where` over a mask of
# the filled positions, which selects the same elements and is batched right.
def _index_filled(base: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`aten.index_fill(base, dim, index, value)`; as a `where` where `value` is batched under vmap and
    `base` is not: see NOTE [an index fill of a batched value]."""
    if not vmap_levels(value) - vmap_levels(base):
        return aten.index_fill.int_Tensor(base, dim, index, value)
    mask = torch.zeros_like(base, dtype=torch.bool).index_fill(dim, index, True)
    return torch.where(mask, value.to(base.dtype), base)


# NOTE [a write through as_strided runs as one]
# torch's forward-mode derivative of `as_strided_scatter` (what a write through
# `as_strided` functionalizes into) is wrong to a reverse-mode level outside it:
# `grad` of a `jvp` of such a write differs from eager's, in torch alone. The
# op is run as its own definition, a write into a clone through `as_strided`,
# which eager's write is, and whose derivatives are right at every order.
def _as_strided_scattered(
    base: torch.Tensor, source: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None
) -> torch.Tensor:
    """`aten.as_strided_scatter(base, source, size, stride, storage_offset)`, as a write into a clone of
    `base` (the op's definition): see NOTE [a write through as_strided runs as one]."""
    out = base.clone()
    out.as_strided(size, stride, storage_offset).copy_(source)
    return out


# The functional forms of writes through views. Eager's write keeps the layout of the tensor written
# into, and so do these, except under `vmap`, whose batching rules for them return contiguous tensors.
_SCATTERS = SCATTERS - {aten.as_strided_scatter.default}  # (run as a write through `as_strided`: above)


def _scattered_in_base_layout(op: Any, base: torch.Tensor, /, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`op(base, *args, **kwargs)`, in the layout of `base`, as eager's write through a view leaves it."""
    if base.is_complex() and torch.is_grad_enabled():  # See NOTE [complex writes through views].
        return _written_through_view(op, base, *args, **kwargs)
    scatter = _select_scattered if op is aten.select_scatter.default else op
    if op in _NEGATIVE_BOUNDS_UNDER_VMAP:
        args, kwargs = _bounds_from_the_start(base, *args, **kwargs), {}
    out: torch.Tensor = scatter(base, *args, **kwargs)
    # Under vmap, the layout is that of the batched tensors, the batch dimension's place in memory too.
    layout = memory_layout(base)
    _, shape, stride = layout
    if memory_layout(out) == layout or not is_dense(shape, stride):
        return out
    return torch.empty_like(base).copy_(out)


_RUNNING_STATS_IGNORED = _quirks.BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS.table["replay"]


# NOTE [slice scatters count from the start]
# Under vmap, torch's batching rule for `slice_scatter` raises on a negative
# bound ("upper bound and lower bound inconsistent with step sign"), which a
# write through `t[:, 1:-1]` functionalizes into. The bounds are counted from
# the start of the dimension instead, the same elements
# (`_quirks.SLICE_SCATTER_NEGATIVE_BOUNDS_UNDER_VMAP`).
_NEGATIVE_BOUNDS_UNDER_VMAP = _quirks.SLICE_SCATTER_NEGATIVE_BOUNDS_UNDER_VMAP.table


def _bounds_from_the_start(
    base: torch.Tensor,
    source: torch.Tensor,
    dim: int = 0,
    start: int | None = None,
    end: int | None = None,
    step: int = 1,
) -> tuple[Any, ...]:
    """The arguments after `base` of a `slice_scatter`, with negative bounds counted from the start:
    see NOTE [slice scatters count from the start]."""
    size = base.shape[dim]
    if start is not None and start < 0:
        start = max(start + size, 0)
    if end is not None and end < 0:
        end = max(end + size, 0)
    return source, dim, start, end, step


# NOTE [a select scatter runs as a slice scatter]
# Under vmap, torch's forward-mode derivative of `select_scatter` (what a write
# through `t[:, 0]` functionalizes into) is wrong to a reverse-mode level
# outside it: `grad` of a `jvp` of a `vmap` of a function that writes through a
# selected row differs from the same of eager's in-place write, in torch alone.
# A `slice_scatter` of the source with the selected dimension put back writes
# the same elements, and is differentiated right at every order.
# NOTE [complex writes through views]
# Autograd has no formula for the scatters of complex tensors (`slice_scatter`
# "does not support automatic differentiation for outputs with complex dtype"),
# which a backward traced in grad mode holds where a gradient formula writes
# into a slice of a complex buffer (the FFTs' of a real input: `fft.ihfft2`'s
# under `torch.func.grad`). Where they will be recorded, they run as eager's
# write: a `copy_` into the view of a clone of the base, which autograd records.
_VIEWS = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
}


def _written_through_view(op: Any, base: torch.Tensor, source: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """`op(base, source, *args, **kwargs)`, a scatter, as a write into the view of a clone of `base`: see
    NOTE [complex writes through views]."""
    out = base.clone()
    _VIEWS[op](out, *args, **kwargs).copy_(source)
    return out


def _select_scattered(base: torch.Tensor, source: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    """`aten.select_scatter(base, source, dim, index)`, as a `slice_scatter`: see NOTE [a select scatter
    runs as a slice scatter]."""
    dim = dim % base.dim()
    index = index % base.shape[dim]
    return aten.slice_scatter.default(base, source.unsqueeze(dim), dim, index, index + 1)


def _value_stops_gradient(node: fx.Node, forward_mode: bool) -> bool:
    """Whether `fn` computed the tensor `node` where autograd does not see (see `stops_gradient`)."""
    producer = node.args[0] if node.target is operator.getitem else node
    if node is producer and not isinstance(node.meta.get("val"), torch.Tensor):
        return False  # a multi-output call: its getitems are detached one by one
    return isinstance(producer, fx.Node) and stops_gradient(producer, forward_mode=forward_mode)


def _module(joint: JointGraph, graph: fx.Graph) -> fx.GraphModule:
    constants = {n.target: joint.constants[n.target] for n in graph.nodes if n.op == "get_attr"}
    graph.lint()
    return LazyGraphModule(constants, graph)  # its code is built on its first call
