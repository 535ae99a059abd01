"""Custom autograd Functions applied in `fn`: noted while tracing, applied again where programs are
differentiated.

Imports only the torch door and the facts of graph nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .._core import _rng
from .._torch import is_custom_op, is_custom_op_autograd, node_behind, tree_leaves
from ._facts import CustomApplication, application_of, note_application

__all__ = ["ApplicationRecorder", "Reapplication", "application_of"]


# NOTE [custom Functions applied again]
# make_fx runs a custom autograd Function's forward as the ops it calls, under
# `no_grad`, and traces its backward as ops too. That is exact for first
# derivatives. But where a gradient formula of another op reads an output of
# the Function (`x * x * Cube.apply(x)`: the product's formula reads the cube),
# eager differentiates that output again through the Function's own backward,
# run in grad mode; the traced ops say only that the output has no derivative
# (it was computed under `no_grad`). So tracing notes each application of a
# Function (`Function.apply`, wrapped while `fn` runs, and each Function
# class's `forward`, for an `apply` taken before: `my_op = MyFunction.apply`):
# the class, its arguments as graph nodes, its outputs' nodes and the nodes its
# forward made. A program that autograd will differentiate again (the pure
# forward, NOTE [a backward that will be differentiated]) applies the Function
# again on its inputs, as eager does, where an output of it is needed: its
# values are its forward's, and its derivative is its backward. That program
# recomputes the function's outputs, so what it reads is kept whatever the
# policy (`ValueGraph.recomputes_returned` in the rules): the generator state of
# a random call they are computed from, a copy of an input overwritten after.
# A forward that draws random numbers is applied again from the generator states
# kept before its first draw on each generator (`_program_graphs.first_draws`; the
# rules keep them wherever an output is recomputed), so it draws what it drew,
# and the generators are put back after. An application whose arguments tracing
# could not place is not applied again: its first derivatives are exact, and a
# second derivative through its outputs is refused, saying why.


class ApplicationRecorder:
    """Notes each custom Function applied while `fn` is traced (a `FunctionApplications` listener): the
    outputs' nodes of `graph` are given their application (`_facts.application_of`)."""

    def __init__(self, graph: fx.Graph, substitute: Callable[[Any], Any]):
        self.graph = graph
        self.substitute = substitute  # a closed-over tensor -> the graph input standing for it
        # per application running: the graph's last node before it, and its arguments as graph nodes
        self.started_after: list[tuple[fx.Node, Any]] = []

    def started(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The arguments are placed before the forward runs: one it updates in place (and marks dirty) is the
        # node of its new value after, which is the application's output.
        try:
            arguments = _with_nodes((args, kwargs), self._node_of)
        except _Unplaced:
            arguments = None
        self.started_after.append((next(iter(reversed(self.graph.nodes))), arguments))

    def finished(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any) -> None:
        before, arguments = self.started_after.pop()
        region, node = [], before.next
        while node.op != "root":
            region.append(node)
            node = node.next
        found = [self._node_of(t) for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        placed = [n for n in found if n is not None]
        if len(placed) < len(found) or arguments is None:
            return
        args, kwargs = arguments
        application = CustomApplication(cls, args, kwargs, tuple(placed), tuple(region))
        for index, output in enumerate(placed):
            note_application(output, application, index)

    def _node_of(self, tensor: Any) -> fx.Node | None:
        return node_behind(self.substitute(tensor))  # type: ignore[no-any-return]


class _Unplaced(Exception):
    """A tensor argument tracing cannot place in the graph."""


def _with_nodes(tree: Any, node_of: Callable[[Any], fx.Node | None]) -> Any:
    """`tree` with each tensor as its graph node."""

    def place(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        node = node_of(value)
        if node is None:
            raise _Unplaced
        return node

    return fx.node.map_aggregate(tree, place)


class Reapplication:
    """A program's call applying `application`'s Function again, on the values of its tensor arguments
    (in the order of `inputs`) and, for each of `draws` (its forward's first random call on each
    generator), the generator state kept before it and the generator (None for a default one), returning
    its tensor outputs as a tuple. See NOTE [custom Functions applied again]."""

    def __init__(self, application: CustomApplication, draws: Sequence[tuple[fx.Node, torch.device]]):
        self.application = application
        self.inputs = application.argument_nodes()
        self.draws = tuple(draws)
        self.custom_op = _custom_op_applying(application)
        # What FX's code calls it by (a target must have a name).
        self.__name__ = f"apply_{application.function.__name__}"
        self.__module__ = __name__

    def __call__(self, *values: Any) -> tuple[torch.Tensor, ...]:
        n = len(self.inputs)
        value_of = dict(zip(self.inputs, values[:n], strict=True))
        states, generators = values[n : n + len(self.draws)], values[n + len(self.draws) :]
        args, kwargs = fx.node.map_arg((self.application.args, self.application.kwargs), value_of.__getitem__)
        at = [
            (state, device, generator)
            for state, (_, device), generator in zip(states, self.draws, generators, strict=True)
        ]
        with _rng.generators_at(at):  # it draws the numbers it drew in forward
            if self.custom_op is not None:
                *positional, metadata = args
                outputs = self.custom_op(*positional, **metadata.keyword_only_args)
            else:
                outputs = self.application.function.apply(*args, **kwargs)  # type: ignore[attr-defined]
        return tuple(t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor))


def _custom_op_applying(application: CustomApplication) -> Any:
    """The `torch.library` custom op whose autograd Function (made by `register_autograd`) `application`
    applies, or None. Such a Function is applied again by calling the op, which applies it with the
    dispatch keys of the moment: its last argument holds the keys of the trace, which torch 2.11
    assert against when it is applied again."""
    if not is_custom_op_autograd(application.function):
        return None
    ops = [node.target for node in application.region if is_custom_op(node.target)]
    return ops[0] if len(ops) == 1 else None
