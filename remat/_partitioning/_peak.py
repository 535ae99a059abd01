"""The peak bytes of a checkpointed function's forward and backward, from the liveness of its programs.

Each program is walked in order, as its FX code runs it: a call's outputs are
allocated (unless they are views of memory already there), and a value is
freed after its last use, its storage once no live value shows it. See NOTE
[what the peak counts].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from .._core import _rng
from .._core._calls import Decision, Trace
from .._memory._measure import storage_key, storage_nbytes, tensors_in
from .._report import Peak
from .._tracing._joint import JointGraph
from ._partition import Programs, partition
from ._program_graphs import HELD_STATE, TRANSIENT, device_of

__all__ = ["predict_peak"]


# NOTE [what the peak counts]
# Bytes above those of the inputs (arguments, parameters, buffers and closed-
# over tensors, which live anyway) and of the gradients handed to backward
# (the caller's). Counted: every output of every call the programs run, from
# its allocation to the last use of the last value that shows its memory; the
# function's outputs until the end of backward, as if the caller held them
# (as `torch.autograd.backward(out, grad)` does); the kept values until their
# last use in backward; the gradients of the inputs from when they are
# computed, and a copy of each that autograd cannot store in `.grad` as it is
# (one that is a tangent, or shares memory with another). Not counted: memory
# a kernel allocates for itself and frees before it returns, and memory of the
# caller's own (a loss, say). Sizes that depend on data count at their bound:
# see NOTE [data-dependent sizes count at their bound].

# NOTE [generator states in the peak]
# To replay a random call, the programs keep the state its generator was in
# (NOTE [replaying random calls]), and a replay holds the generator's state as
# found while it runs. `remat.report`'s peak counts them: they are memory of the
# process (5 KiB each, for the CPU's generator). But torch makes them outside
# the dispatcher, so no allocator-side measure sees them: not MemTracker, not
# `remat.fit`'s probe step; and a CUDA generator's state is 16 bytes of host
# memory, none of the GPU's. `fit` predicts its plans as its probe step measures
# (`generator_states=False`), so that a plan's prediction and the probe's
# measurement count alike.


def predict_peak(joint: JointGraph, programs: Programs, generator_states: bool = True) -> Peak:
    """The peak bytes of running `programs`' forward, then its backward; without `generator_states`, as an
    allocator counts them (NOTE [generator states in the peak])."""
    inputs = {storage_key(t) for p in joint.primals for t in tensors_in(p.meta.get("val"))}
    forward = programs.forward
    forward_peak, after = _walk(forward.graph, inputs, _placeholder_values(forward.graph, joint.primals))

    results = _output_node(forward.graph).args[0]
    returned = [results[i] for i in range(len(programs.returned))]  # type: ignore[index]
    # The caller holds the outputs.
    held = {s for node in returned if isinstance(node, fx.Node) for s, _ in _allocated(node, {})} - inputs
    held_bytes = sum(after.get(s, 0) for s in held)

    backward = programs.backward
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    handed_over = {  # a value stored off its device takes no device bytes until loaded (NOTE [kinds of storage])
        placeholder: kept.storage.stored_form(kept.node.meta.get("val"))
        for placeholder, kept in zip(placeholders, programs.kept, strict=False)
        if not kept.rng_state and kept.storage.on_device
    }
    # A generator state is freed once its replay has read it, as a kept value is.
    states_of = {
        placeholder: torch.empty(_rng.state_nbytes(device_of(kept.node)), dtype=torch.uint8, device="meta")
        for placeholder, kept in zip(placeholders, programs.kept, strict=False)
        if kept.rng_state and generator_states
    }
    handed_over.update(states_of)
    for placeholder, tangent in zip(placeholders[len(programs.kept) :], joint.tangents, strict=False):
        handed_over[placeholder] = tangent.meta.get("val")
    tangents = {storage_key(t) for node in joint.tangents for t in tensors_in(node.meta.get("val"))}  # the caller's
    free = inputs | held | tangents
    backward_peak, at_end = _walk(backward.graph, free, handed_over, generator_states)
    # A gradient that is the caller's memory (a tangent passed through), or a second gradient in one
    # storage, is copied when autograd stores it in `.grad`: then all the gradients are alive.
    seen: set[Any] = set()
    copied = 0
    for grad in _output_node(backward.graph).all_input_nodes:
        for storage, nbytes in _allocated(grad, handed_over):
            if storage in free or storage in seen:
                copied += nbytes
            seen.add(storage)
    backward_peak = max(backward_peak, sum(at_end.values()) + copied)
    # Generator states (a few KiB each) count from the forward's start (an upper bound) to their replay.
    states = sum(t.untyped_storage().nbytes() for t in states_of.values())
    return Peak(
        forward=forward_peak + states, after_forward=sum(after.values()) + states, backward=held_bytes + backward_peak
    )


def _walk(
    graph: fx.Graph, free_storages: set[Any], values: Mapping[fx.Node, Any], generator_states: bool = True
) -> tuple[int, dict[Any, int]]:
    """(peak bytes, storages live at the end -> bytes) of running `graph` once (with the generator states
    replays hold while they run, or without).

    Storages in `free_storages` cost nothing here (inputs, memory held by others). A placeholder
    with a value in `values` is memory handed over to the program, freed at its last use.
    """
    last_use: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for used in node.all_input_nodes:
            last_use[used] = node
    outputs = set(_output_node(graph).all_input_nodes)
    holders: dict[Any, set[fx.Node]] = {}
    live: dict[Any, int] = {}
    storages_of: dict[fx.Node, list[Any]] = {}
    total = peak = 0
    for node in graph.nodes:
        if node.op == "output":
            break
        allocated = _allocated(node, values)
        storages_of[node] = [storage for storage, _ in allocated]
        for storage, nbytes in allocated:
            holders.setdefault(storage, set()).add(node)
            if storage not in live and storage not in free_storages:
                live[storage] = nbytes
                total += nbytes
        peak = max(peak, total + node.meta.get(TRANSIENT, 0) + generator_states * node.meta.get(HELD_STATE, 0))
        # Values whose last use this was, and values nobody uses, are freed now (FX's code does so).
        done = [used for used in node.all_input_nodes if last_use.get(used) is node and used not in outputs]
        if node not in last_use and node not in outputs:
            done.append(node)
        for finished in done:
            for storage in storages_of.get(finished, ()):
                holders[storage].discard(finished)
                if not holders[storage]:
                    total -= live.pop(storage, 0)
    return peak, live


def _allocated(node: fx.Node, values: Mapping[fx.Node, Any]) -> list[tuple[Any, int]]:
    """(storage, bytes) of each tensor `node` holds."""
    if node.op == "placeholder":
        return [(storage_key(t), storage_nbytes(t)) for t in tensors_in(values.get(node))]
    if "val" not in node.meta:
        if node.target is torch.ops.aten.clone.default:  # the forward's copy of an input it overwrites
            source = node.args[0]
            value = source.meta.get("val") if isinstance(source, fx.Node) else None
            value = value if value is not None else values.get(source)  # type: ignore[arg-type]
            return [(node, storage_nbytes(t)) for t in tensors_in(value)]
        return []  # generator states and the tuples of random calls: counted apart
    return [(storage_key(t), storage_nbytes(t)) for t in tensors_in(node.meta["val"])]


def _placeholder_values(graph: fx.Graph, nodes: Sequence[fx.Node]) -> dict[fx.Node, Any]:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return {p: n.meta.get("val") for p, n in zip(placeholders, nodes, strict=False)}


def _output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def peak_of(trace: Trace, decisions: Sequence[Decision], generator_states: bool = True) -> Peak:
    """The predicted peak of running the function `trace` was traced from under `decisions` (for
    planners): its joint graph partitioned, then `predict_peak`."""
    if trace.joint is None:
        raise ValueError("remat: this trace was made of hand-picked calls: it has no graph to predict a peak from.")
    return predict_peak(trace.joint, partition(trace.joint, decisions), generator_states)
