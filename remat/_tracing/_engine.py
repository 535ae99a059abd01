"""Autograd's backward, walked node by node in this thread: for tensors of a device this machine lacks.

torch's autograd engine needs the devices of the graph it runs (it records their current streams before it
starts), so the backward of fake CUDA tensors cannot run on a machine without a GPU, where the forward runs.
remat traces backward to plan it; there it walks the graph itself, as the engine would. See NOTE [a
backward walked without the engine].
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from .._torch import (
    accumulated_leaf,
    autograd_node_inputs,
    autograd_node_order,
    dense_without_overlap,
    is_custom_function_node,
)
from .._torch import release_saved_tensors as release_autograd_saved_tensors

__all__ = [
    "SavedTensors",
    "engine_can_run",
    "engine_runs_on",
    "release_saved_tensors",
    "walk_as_the_engine",
    "walked_backward",
    "walked_gradients",
]


# NOTE [a backward walked without the engine]
# The walk does what the engine does: it counts each node's dependencies over the graph reachable from
# the outputs, sums the gradients that reach one input of a node, conforms each to the shape and dtype
# its node expects (`validate_outputs`), and runs the ready nodes in the engine's order: the one created
# last first (the highest sequence number; a leaf's `AccumulateGrad` has the highest of all), in grad mode
# where the gradients will be differentiated. A node's incoming gradients are dropped once it has run.
# A custom Function's node runs its `backward` with zeros for the gradients it did not get, and its
# gradients go to the inputs that required grad.
# - For `torch.autograd.grad(outputs, inputs, allow_unused=True)` it runs only the nodes from which an
#   input can be reached and takes each input's gradient from the buffer of its node (a leaf's
#   `AccumulateGrad` does not run); the graph is kept.
# - For `torch.autograd.backward(tensors)` it runs every node and accumulates into each leaf's `.grad`
#   as `AccumulateGrad` does: a gradient nothing else holds, in the leaf's layout, becomes `.grad` itself;
#   another is copied into the leaf's layout; an existing `.grad` is added to in place. With the saved
#   tensors of the forward packed by `SavedTensors`, each node's are released once it has run, as the
#   engine releases them when the graph is not retained, so that memory falls as it will on the device.
# What the walk does not do: run hooks registered on the graph's tensors or nodes (torch keeps them out of
# Python's reach; a leaf with hooks is refused), keep the `None`s of a Function that turned
# materialization off (it gets zeros), give an output a Function marked non-differentiable zeros of its
# shape and dtype (torch keeps them from Python: it gets a zero scalar), and record streams. remat's own
# Function is the exception to the first two: it tells the walk its pre-hook and that it takes `None`s
# (`walk_as_the_engine`). The walk's trace equals the engine's on the CPU, and so do its gradients and
# its memory (`tests/test_engine.py`).


def engine_can_run(tensors: Sequence[Any]) -> bool:
    """Whether torch's engine can run the backward of `tensors`: it can unless one is a CUDA tensor and
    this machine has no GPU."""
    return all(engine_runs_on(t.device) for t in tensors if isinstance(t, torch.Tensor))


def engine_runs_on(device: torch.device) -> bool:
    """Whether torch's engine can run a backward on `device` on this machine."""
    return device.type != "cuda" or torch.cuda.is_available()


class _Box:
    """One saved tensor, held until the node that saved it has run (or the graph dies)."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor | None):
        self.tensor = tensor


class SavedTensors:
    """The saved tensors of a forward run inside `packing()`, held so that a walked backward can release
    each node's own once it has run, as the engine does (NOTE [a backward walked without the engine])."""

    def __init__(self) -> None:
        # (weakly: a node that lets go of its saved tensors while it runs frees them then, as in the engine)
        self._unpacked: list[weakref.ref[_Box]] | None = None

    @contextlib.contextmanager
    def packing(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @staticmethod
    def _pack(tensor: torch.Tensor) -> _Box:
        # (detached: a node's saved output would otherwise hold the node through its own box)
        return _Box(tensor.detach())

    def _unpack(self, box: _Box) -> torch.Tensor:
        if box.tensor is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time: its saved tensors were released when "
                "the walked backward ran it."
            )
        if self._unpacked is not None:
            self._unpacked.append(weakref.ref(box))
        return box.tensor

    @contextlib.contextmanager
    def released_after(self) -> Iterator[None]:
        """Release the saved tensors unpacked inside (those of the node that runs there)."""
        global _releasing
        outer, self._unpacked = self._unpacked, []
        outer_releasing, _releasing = _releasing, self
        try:
            yield
        finally:
            self._release_unpacked()
            self._unpacked, _releasing = outer, outer_releasing

    def _release_unpacked(self) -> None:
        for ref in self._unpacked or ():
            box = ref()
            if box is not None:
                box.tensor = None


_releasing: SavedTensors | None = None  # the walk whose running node's saved tensors are released after it


def release_saved_tensors(ctx: Any) -> None:
    """Let go of what a custom Function saved, from its backward, where the graph is not retained: the
    references its backward unpacked are then the only ones. Autograd's own (in the engine), or those
    the walked backward holds for the node running now."""
    release_autograd_saved_tensors(ctx)
    if _releasing is not None:
        _releasing._release_unpacked()


def walked_gradients(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    create_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, create_graph=create_graph)`,
    walked node by node in this thread. See NOTE [a backward walked without the engine]."""
    captures: dict[Any, list[tuple[int, int]]] = {}
    for k, tensor in enumerate(inputs):
        edge = get_gradient_edge(tensor)
        captures.setdefault(edge.node, []).append((edge.output_nr, k))
    results: list[torch.Tensor | None] = [None] * len(inputs)

    def take(node: Any, grads: list[torch.Tensor | None], _: Any) -> None:
        for position, k in captures.get(node, ()):
            results[k] = grads[position]

    _walk(outputs, grad_outputs, lambda reachable: _needed(reachable, captures), take, create_graph, None)
    return tuple(results)


def walked_backward(
    tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor], saved: SavedTensors | None = None
) -> None:
    """`torch.autograd.backward(tensors, grad_tensors)`, walked node by node in this thread: every leaf's
    `.grad` accumulated; each node's saved tensors released once it has run where the forward ran in
    `saved.packing()`. See NOTE [a backward walked without the engine]."""

    def take(node: Any, grads: list[torch.Tensor | None], buffers: dict[Any, list[Any]]) -> None:
        leaf = accumulated_leaf(node)
        if leaf is None or grads[0] is None:
            return
        if leaf._backward_hooks or getattr(leaf, "_post_accumulate_grad_hooks", None):
            raise RuntimeError(
                "remat: a backward walked without autograd's engine (CUDA tensors on a machine without a GPU) "
                "cannot run the hooks registered on a leaf tensor; remove them for planning, or plan on a "
                "machine with a GPU."
            )
        grad = grads[0]
        held_elsewhere = any(grad is t for t in grad_tensors) or any(
            grad is held for buffer in buffers.values() for held in buffer
        )
        _accumulate(leaf, grad, steal=not held_elsewhere)

    _walk(tensors, grad_tensors, lambda reachable: set(reachable), take, False, saved)


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor, steal: bool) -> None:
    """Add `grad` into `leaf.grad` as autograd's `AccumulateGrad` does outside grad mode."""
    with torch.no_grad():
        if leaf.grad is not None:
            leaf.grad += grad
        elif steal and not grad.is_sparse and _obeys_layout(grad, leaf):
            leaf.grad = grad.detach()
        elif dense_without_overlap(leaf):
            leaf.grad = torch.empty_strided(leaf.shape, leaf.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
        else:
            leaf.grad = grad.clone(memory_format=torch.contiguous_format)


def _obeys_layout(grad: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether `grad` is laid out as autograd keeps the `.grad` of `leaf`: with the leaf's strides where
    the leaf is dense (but for dimensions of size 1), else contiguous."""
    if not dense_without_overlap(leaf):
        return grad.is_contiguous()
    for size, stride, expected in zip(grad.shape, grad.stride(), leaf.stride(), strict=True):
        if (size != 1 and stride != expected) or (size == 1 and stride == 0):
            return False
    return True


def _walk(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    needed_of: Callable[[list[Any]], set[Any]],
    take: Callable[[Any, list[torch.Tensor | None], dict[Any, list[Any]]], None],
    create_graph: bool,
    saved: SavedTensors | None,
) -> None:
    """Run the graph behind `outputs` from `grad_outputs`: the nodes of `needed_of(reachable nodes)`, each
    node's incoming gradients shown to `take` before it runs."""
    roots = [get_gradient_edge(output) for output in outputs]
    dependencies, reachable = _dependencies([root.node for root in roots])
    needed = needed_of(reachable)
    buffers: dict[Any, list[torch.Tensor | None]] = {}
    for root, given in zip(roots, grad_outputs, strict=True):
        _add(buffers, root.node, root.output_nr, given)
    created = itertools.count()  # (ties broken by the order nodes became ready)
    ready: list[tuple[int, int, Any]] = []
    for node in dict.fromkeys(root.node for root in roots):
        if dependencies.get(node, 0) == 0:
            heapq.heappush(ready, (-autograd_node_order(node), next(created), node))
    with torch.set_grad_enabled(create_graph):
        while ready:
            node = heapq.heappop(ready)[2]
            grads = buffers.pop(node, None) or [None] * len(autograd_node_inputs(node))
            take(node, grads, buffers)
            runs = node in needed and bool(node.next_functions)  # (a leaf's node does not run)
            # A node's saved tensors are released once its gradients are conformed and its incoming ones
            # dropped, as the engine does.
            with saved.released_after() if saved is not None and runs else contextlib.nullcontext():
                computed = _run(node, grads) if runs else [None] * len(node.next_functions)
                # Every gradient is conformed before any is summed into a buffer, as the engine does.
                computed = [
                    grad
                    if grad is None or next_node is None
                    else _conformed(grad, autograd_node_inputs(next_node)[position])
                    for (next_node, position), grad in zip(node.next_functions, computed, strict=True)
                ]
                del grads  # (then the engine drops the node's incoming gradients)
            for (next_node, position), grad in zip(node.next_functions, computed, strict=True):
                if next_node is None or next_node not in needed:
                    continue
                _add(buffers, next_node, position, grad)
                dependencies[next_node] -= 1
                if dependencies[next_node] == 0:
                    heapq.heappush(ready, (-autograd_node_order(next_node), next(created), next_node))
            computed = grad = None  # type: ignore[assignment]


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


def walk_as_the_engine(ctx: Any, prehook: Callable[[tuple[Any, ...]], Any] | None, materialize_grads: bool) -> None:
    """Tell a walked backward what the engine knows of the custom Function whose `ctx` this is, and torch keeps
    from Python: the pre-hook registered on its node, and whether it turned off materializing gradients."""
    ctx.remat_walked_as = (prehook, materialize_grads)


def _run(node: Any, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The gradients `node` sends along its `next_functions`."""
    if not is_custom_function_node(node):
        computed = node(*grads)
        return list(computed) if isinstance(computed, tuple) else [computed]
    prehook, materialize_grads = getattr(node, "remat_walked_as", (None, True))
    replaced = None if prehook is None else prehook(tuple(grads))
    if replaced is not None:
        grads[:] = replaced
    if materialize_grads:
        grads[:] = [
            torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
            for g, m in zip(grads, autograd_node_inputs(node), strict=True)
        ]
    returned = node.apply(*grads)
    returned = returned if isinstance(returned, tuple) else (returned,)
    # One gradient per argument of `forward`; the edges are those of the tensors that required grad, in order.
    wanted = iter(g for g, needs in zip(returned, node.needs_input_grad, strict=False) if needs)
    return [next(wanted) if next_node is not None else None for next_node, _ in node.next_functions]
