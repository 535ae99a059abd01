"""Rewrite a program so that autograd differentiates it as it would eager's ops.

Each call of an op autograd cannot differentiate (or whose formulas it
differentiates wrongly) becomes torch's decomposition of it, and each value
the trace computed with grad mode off is detached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from .._eager._facts import computed_without_grad
from .._torch import LazyGraphModule, OpOverload, decomposition_of, has_no_derivative
from ._eager_copies import RUN_AS

__all__ = ["decomposed", "differentiable_again"]

aten = torch.ops.aten


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
    """Replace each call of an op (or of a function `eager_copy` runs one as) that `wanted` picks and torch has
    a decomposition of by that decomposition; whether any was."""
    replaced = False
    for node in graph.nodes:
        run_as = node.op == "call_function" and node.target in RUN_AS
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
    arguments = node.args[1:] if node.target in RUN_AS else node.args
    args, kwargs = fx.node.map_arg((arguments, node.kwargs), lambda n: n.meta.get("val"))
    return has_no_derivative(op, args, kwargs)


def _detach_uses(graph: fx.Graph, node: fx.Node) -> None:
    """Make every user of `node` read a detached alias of it instead."""
    with graph.inserting_after(node):
        detached = graph.call_function(aten.detach.default, (node,))
    node.replace_all_uses_with(detached, delete_user_cb=lambda user: user is not detached)
