"""Autograd's backward, walked node by node in this thread: for tensors of a device this machine lacks.

torch's autograd engine needs the devices of the graph it runs (it records their current streams before it
starts), so the backward of fake CUDA tensors cannot run on a machine without a GPU, where the forward runs.
remat traces backward to plan it; there it walks the graph itself, as the engine would. See NOTE [a
backward walked without the engine].
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from ._torch import autograd_node_inputs, autograd_node_order, is_custom_function_node

__all__ = ["engine_can_run", "walked_gradients"]


# NOTE [a backward walked without the engine]
# The walk does what the engine does for `torch.autograd.grad(outputs, inputs, grad_outputs,
# allow_unused=True, create_graph=...)`: it counts each node's dependencies over the graph reachable
# from the outputs, runs only the nodes from which an input can be reached, takes each input's gradient
# from the buffer of its node (an `AccumulateGrad` node for a leaf, which does not run), sums the
# gradients that reach one input of a node, conforms each to the shape and dtype its node expects
# (`validate_outputs`), and runs the ready nodes in the engine's order: the one created last first (the
# highest sequence number), in grad mode where the gradients will be differentiated. A custom
# Function's node runs its `backward` with zeros for the gradients it did not get, and its gradients
# go to the inputs that required grad. What the walk does not do: run hooks registered on the graph's
# tensors or nodes (torch keeps them out of Python's reach), keep the `None`s of a Function that turned
# materialization off (it gets zeros), and record streams. The walk's trace equals the engine's on
# the CPU (`tests/test_engine.py` traces random programs both ways).


def engine_can_run(tensors: Sequence[Any]) -> bool:
    """Whether torch's engine can run the backward of `tensors`: it can unless one is a CUDA tensor and
    this machine has no GPU."""
    return torch.cuda.is_available() or not any(
        isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors
    )


def walked_gradients(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    create_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, create_graph=create_graph)`,
    walked node by node in this thread. See NOTE [a backward walked without the engine]."""
    roots = [get_gradient_edge(output) for output in outputs]
    captures: dict[Any, list[tuple[int, int]]] = {}
    for k, tensor in enumerate(inputs):
        edge = get_gradient_edge(tensor)
        captures.setdefault(edge.node, []).append((edge.output_nr, k))
    dependencies, reachable = _dependencies([root.node for root in roots])
    needed = _needed(reachable, captures)
    buffers: dict[Any, list[torch.Tensor | None]] = {}
    for root, given in zip(roots, grad_outputs, strict=True):
        _add(buffers, root.node, root.output_nr, given)
    results: list[torch.Tensor | None] = [None] * len(inputs)
    created = itertools.count()  # (ties broken by the order nodes became ready)
    ready: list[tuple[int, int, Any]] = []
    for node in dict.fromkeys(root.node for root in roots):
        if dependencies.get(node, 0) == 0:
            heapq.heappush(ready, (-autograd_node_order(node), next(created), node))
    with torch.set_grad_enabled(create_graph):
        while ready:
            node = heapq.heappop(ready)[2]
            grads = buffers.pop(node, None) or [None] * len(autograd_node_inputs(node))
            for position, k in captures.get(node, ()):
                results[k] = grads[position]
            runs = node in needed and bool(node.next_functions)  # (a captured leaf's node does not run)
            computed = _run(node, grads) if runs else [None] * len(node.next_functions)
            # Every gradient is conformed before any is summed into a buffer, as the engine does.
            computed = [
                grad
                if grad is None or next_node is None
                else _conformed(grad, autograd_node_inputs(next_node)[position])
                for (next_node, position), grad in zip(node.next_functions, computed, strict=True)
            ]
            for (next_node, position), grad in zip(node.next_functions, computed, strict=True):
                if next_node is None or next_node not in needed:
                    continue
                _add(buffers, next_node, position, grad)
                dependencies[next_node] -= 1
                if dependencies[next_node] == 0:
                    heapq.heappush(ready, (-autograd_node_order(next_node), next(created), next_node))
    return tuple(results)


def _dependencies(roots: Sequence[Any]) -> tuple[dict[Any, int], list[Any]]:
    """The number of edges into each node reachable from `roots`, and those nodes."""
    dependencies: dict[Any, int] = {}
    reachable, stack, seen = [], list(roots), set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        reachable.append(node)
        for next_node, _ in node.next_functions:
            if next_node is not None:
                dependencies[next_node] = dependencies.get(next_node, 0) + 1
                stack.append(next_node)
    return dependencies, reachable


def _needed(reachable: Sequence[Any], captures: dict[Any, Any]) -> set[Any]:
    """The nodes from which a captured node can be reached (themselves included)."""
    parents: dict[Any, list[Any]] = {}
    for node in reachable:
        for next_node, _ in node.next_functions:
            if next_node is not None:
                parents.setdefault(next_node, []).append(node)
    needed, stack = set(), list(captures)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(parents.get(node, ()))
    return needed


def _add(buffers: dict[Any, list[torch.Tensor | None]], node: Any, position: int, grad: torch.Tensor | None) -> None:
    buffer = buffers.setdefault(node, [None] * len(autograd_node_inputs(node)))
    if grad is not None:
        held = buffer[position]
        buffer[position] = grad if held is None else held + grad


def _conformed(grad: torch.Tensor, metadata: Any) -> torch.Tensor:
    """`grad` summed to the shape, and cast to the dtype, its node expects (as the engine's
    `validate_outputs` does)."""
    if tuple(grad.shape) != tuple(metadata.shape):
        grad = grad.sum_to_size(metadata.shape)
    return grad if grad.dtype == metadata.dtype else grad.to(metadata.dtype)


def _run(node: Any, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The gradients `node` sends along its `next_functions`."""
    if not is_custom_function_node(node):
        computed = node(*grads)
        return list(computed) if isinstance(computed, tuple) else [computed]
    zeros = [
        torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
        for g, m in zip(grads, autograd_node_inputs(node), strict=True)
    ]
    returned = node.apply(*zeros)
    returned = returned if isinstance(returned, tuple) else (returned,)
    # One gradient per argument of `forward`; the edges are those of the tensors that required grad, in order.
    wanted = iter(g for g, needs in zip(returned, node.needs_input_grad, strict=False) if needs)
    return [next(wanted) if next_node is not None else None for next_node, _ in node.next_functions]
