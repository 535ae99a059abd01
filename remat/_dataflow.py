"""The dataflow of a traced joint graph, as plain data for planners (`remat.Dataflow`).

It follows the partitioner's rules exactly (see `_partition`): which forward values
backward reads, which values each replayed call reads, what keeping each one costs.
"""

from __future__ import annotations

import dataclasses
import operator

from torch import fx

from . import _rng
from ._calls import Dataflow, Trace, Value
from ._joint import JointGraph
from ._measure import tensor_nbytes
from ._programs import device_of
from ._rules import (
    backward_nodes_of,
    kept_bytes,
    mutated_inputs,
    needed_by_backward,
    reads_any_value,
    returned_outputs,
    varying,
)

__all__ = ["with_dataflow"]


def with_dataflow(joint: JointGraph) -> JointGraph:
    """`joint`, its trace carrying what planners read: the graph's `Dataflow`, and the graph itself,
    whose programs under any decisions give their peak (`remat._peak.peak_of`)."""
    trace = Trace(joint.trace, dataflow_of(joint), joint)
    return dataclasses.replace(joint, trace=trace)


def dataflow_of(joint: JointGraph) -> Dataflow:
    call_index = {node: i for i, node in enumerate(joint.call_nodes)}
    mutated = mutated_inputs(joint, returned_outputs(joint))
    primal_index = {node: i for i, node in enumerate(joint.primals)}
    value_nodes: dict[Value, fx.Node] = {}
    resolved: dict[fx.Node, frozenset[Value]] = {}

    def values_read(node: fx.Node) -> frozenset[Value]:
        """The values reading `node` reads: itself if it is one, else those it shows."""
        if node in resolved:
            return resolved[node]
        found: frozenset[Value]
        if node.op == "placeholder":
            found = frozenset({(-1 - primal_index[node], 0)}) if node in mutated else frozenset()
            if found:
                value_nodes.setdefault(next(iter(found)), node)
        elif node.op == "get_attr":
            found = frozenset()
        elif node in call_index:
            outputs = node.meta.get("val")
            if isinstance(outputs, (tuple, list)):  # the whole tuple of a multi-output call
                found = frozenset((call_index[node], i) for i in range(len(outputs)))
            else:
                found = frozenset({(call_index[node], 0)})
                value_nodes.setdefault((call_index[node], 0), node)
        elif node.target is operator.getitem and node.args[0] in call_index:
            found = frozenset({(call_index[node.args[0]], node.args[1])})  # type: ignore[arg-type, index]
            value_nodes.setdefault(next(iter(found)), node)
        else:  # a view, or a copy back into an input: replaying it reads what it reads
            found = frozenset().union(*(values_read(n) for n in node.all_input_nodes))
        resolved[node] = found
        return found

    def replay_reads(node: fx.Node) -> frozenset[Value]:
        # Inputs whose value the replay does not use are read as they are now: no copy is kept.
        any_value = reads_any_value(node)
        return frozenset().union(*(values_read(n) for n in node.all_input_nodes if n not in any_value))

    reads = tuple(map(replay_reads, joint.call_nodes))
    backward_reads = frozenset().union(*map(values_read, needed_by_backward(joint, backward_nodes_of(joint))))
    # getitems the graph never reads still name values a replayed multi-output call makes
    for node in joint.forward_nodes:
        if node.target is operator.getitem and node.args[0] in call_index:
            values_read(node)
    nbytes = {
        value: nbytes_of_input(joint, value) if node.op == "placeholder" else kept_bytes([node], joint.primals)
        for value, node in value_nodes.items()
    }

    random_calls = {node for node in joint.call_nodes if joint.trace[call_index[node]].is_random}
    for node in mutated:
        value = (-1 - primal_index[node], 0)
        nbytes.setdefault(value, nbytes_of_input(joint, value))
    with_derivative = varying(joint, forward_mode=False)
    returned = {joint.outputs[i] for i in returned_outputs(joint)}
    return Dataflow(
        reads=reads,
        backward_reads=backward_reads,
        nbytes=nbytes,
        rng_state_nbytes=tuple(
            _rng.state_nbytes(device_of(node)) if node in random_calls else 0 for node in joint.call_nodes
        ),
        varying=frozenset(v for v, node in value_nodes.items() if node in with_derivative),
        returned=frozenset(v for v, node in value_nodes.items() if node in returned),
    )


def nbytes_of_input(joint: JointGraph, value: Value) -> int:
    """Bytes of a copy of the input `value` names."""
    node = joint.primals[-1 - value[0]]
    return tensor_nbytes(node.meta["val"])
