"""Build the prologue and the epilogue: the programs around the Function that rebuild views of inputs.

The user's outputs that are views of inputs (or of other outputs) are rebuilt
outside the autograd.Function, so that autograd tracks them as the views they
are, as eager does.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import fx

from .._eager._facts import stop_gradient_of
from .._eager._nodes import is_free
from .._tracing._errors import TraceError
from .._tracing._joint import JointGraph
from ._eager_copies import run_under_no_grad
from ._program_graphs import program_module

__all__ = ["views_of_inputs"]


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
        prologue = program_module(joint, graph)
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
    return prologue, program_module(joint, graph)


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
            env[view].target, env[view].args = run_under_no_grad, (view.target, *env[view].args)  # type: ignore[arg-type]
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
