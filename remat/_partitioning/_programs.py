"""Build the FX programs one partition runs: the forward, the backward and the pure (differentiable) forward.

Each is built from nodes of the joint graph and knows nothing of how it is
called; `_partition` decides what goes in them, `_execute` runs them. The
views around them are `_views_of_inputs`'s; copying a node is
`_program_emitter`'s and `_eager_copies`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from .. import _quirks
from .._core import _rng
from .._eager._applications import application_of
from .._eager._eager_kernels import runnable
from .._eager._facts import fill_of
from .._eager._nodes import draws_random_numbers
from .._eager._random_fills import with_a_fills_derivative
from .._storing._storage import Storage
from .._torch import BoxedCodeGen
from .._tracing._joint import JointGraph
from ._differentiable_programs import decomposed
from ._eager_copies import eager_copy
from ._program_emitter import emitter, kept_placeholders
from ._program_graphs import TRANSIENT, device_of, first_draws, program_module

__all__ = ["PureForward", "backward_program", "forward_program"]

aten = torch.ops.aten


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
                env[node] = eager_copy(graph, node, env)
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
    return program_module(joint, graph)


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
    env, states = kept_placeholders(graph, kept)
    forms = {node: (env.pop(node), storage) for node, storage in stored.items()}
    for tangent in joint.tangents:
        env[tangent] = graph.placeholder(tangent.name)
    for node, placeholder in env.items():  # for `differentiable_again` to call ops on
        placeholder.meta.setdefault("val", node.meta.get("val"))
    emit = emitter(graph, env, states, forward_mode=False, forms=forms)
    for node in backward_nodes:
        emit(node)
    graph.output(tuple(emit(g) for g in joint.grads))
    for storage in {storage for _, storage in forms.values() if storage.ahead}:
        _load_ahead(graph, storage)
    graph.set_codegen(BoxedCodeGen())
    return program_module(joint, graph)


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
        holders, states = kept_placeholders(graph, self.kept)
        for node, storage in self.stored:
            if node in self.inputs.values():
                holders[node] = graph.call_function(
                    storage.load_now,  # type: ignore[arg-type]
                    (holders[node], device_of(node), *storage.static_args(node)),
                )
        env = {primal: holders[holder] for primal, holder in self.inputs.items()}
        emit = emitter(graph, env, states, self.forward_mode, reapply_in=self.joint if self.reapply else None)
        if self.reapply:  # a fill's kept value, read as it is, keeps its derivative: NOTE [a fill's derivative]
            for node in [n for n in self.inputs if n.op == "call_function" and fill_of(n) is not None]:
                filled = node.args[0]
                if isinstance(filled, fx.Node):
                    env[node] = graph.call_function(with_a_fills_derivative, (env[node], emit(filled)))
        for node in self.computed:
            emit(node)
        graph.output(tuple(emit(target) for target in self.targets))
        return program_module(self.joint, graph)


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
