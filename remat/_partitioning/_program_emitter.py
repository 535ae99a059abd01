"""Copy nodes of the joint graph into a program on demand, each after the nodes it reads.

Random calls are replayed from their kept generator states, stored values
loaded where they are first read, and custom Functions applied again, in a form
that autograd (or forward-mode AD) differentiates as it does eager's.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
from torch import fx

from .. import _quirks
from .._core import _rng
from .._eager._applications import Reapplication, application_of
from .._eager._capture import history_of
from .._eager._eager_kernels import runnable
from .._eager._facts import CustomApplication
from .._eager._nodes import draws_random_numbers, stops_gradient
from .._storing._storage import Storage
from .._tracing._joint import JointGraph
from ._eager_copies import copied, eager_copy, with_history_of
from ._program_graphs import HELD_STATE, TRANSIENT, device_of, first_draws

__all__ = ["emitter", "kept_placeholders"]

aten = torch.ops.aten


def kept_placeholders(
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


def emitter(
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
            copy = graph.call_function(copied, (env[node.args[0]], env[node.args[1]], stride))  # type: ignore[index]
            copy.meta = dict(node.meta)
        else:
            copy = eager_copy(graph, node, env)
            updated = _UNDECLARED_UPDATES.get(node.target)
            if updated is not None and node.args[updated[0]] is True:  # NOTE [replays update no running statistics]
                copy.args = tuple(None if i in updated[1] else a for i, a in enumerate(copy.args))
            if _value_stops_gradient(node, forward_mode):
                copy = graph.call_function(aten.detach.default, (copy,))
            history = history_of(node, forward_mode=forward_mode)
            if history is not None and _computable(history, env, states):
                # See NOTE [updates under no_grad keep their tensors' histories].
                copy = graph.call_function(with_history_of, (copy, emit(history)))
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


def _value_stops_gradient(node: fx.Node, forward_mode: bool) -> bool:
    """Whether `fn` computed the tensor `node` where autograd does not see (see `stops_gradient`)."""
    producer = node.args[0] if node.target is operator.getitem else node
    if node is producer and not isinstance(node.meta.get("val"), torch.Tensor):
        return False  # a multi-output call: its getitems are detached one by one
    return isinstance(producer, fx.Node) and stops_gradient(producer, forward_mode=forward_mode)
