"""What the programs' graphs share, for the modules that build them and those that read them.

The device of a node's value, the meta keys of the bytes a program's node
takes besides its value (which `_peak` reads), the random calls a custom
Function applied again starts from, and the module a built graph becomes.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import fx

from .._eager._facts import CustomApplication
from .._eager._nodes import draws_random_numbers
from .._torch import LazyGraphModule
from .._tracing._joint import JointGraph

__all__ = ["HELD_STATE", "TRANSIENT", "device_of", "first_draws", "program_module"]

# The meta key of the bytes a node takes on the device besides its inputs and its result, at once (`_peak`).
TRANSIENT = "remat_transient_bytes"
HELD_STATE = "remat_held_state_bytes"  # a replay's generator state as found, besides TRANSIENT


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


def program_module(joint: JointGraph, graph: fx.Graph) -> fx.GraphModule:
    constants = {n.target: joint.constants[n.target] for n in graph.nodes if n.op == "get_attr"}
    graph.lint()
    return LazyGraphModule(constants, graph)  # its code is built on its first call
