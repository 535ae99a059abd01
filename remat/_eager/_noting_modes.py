"""Note, while `fn` is traced, what eager does that the traced graph cannot say.

Two facts of `_facts`, each noted by a mode of its own: the values of the ops vmap runs example by
example, which eager's vmap stacks into a contiguous tensor (`StackedUnderVmap`, NOTE [ops vmap runs
example by example]), and the nodes a backward traced in grad mode makes with grad mode off
(`NodesWithoutGrad`, NOTE [regions of a backward without grad]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._torch import HigherOrderOperator, TorchDispatchMode, node_behind, runs_per_example_under_vmap, tree_leaves
from ._facts import note_computed_without_grad, note_stacked_under_vmap

__all__ = [
    "NodesWithoutGrad",
    "StackedUnderVmap",
]


# NOTE [ops vmap runs example by example]
# Under vmap, torch runs a composite op that has neither a batching rule nor a
# decomposition registered for vmap (`stft`, `istft`, `fft.ihfft2`, `fft.ihfftn`,
# `linalg.tensorsolve`: found by asking the dispatcher, not from a list) example
# by example, and stacks the results into a contiguous tensor, whatever layout
# one example's result has. remat's trace holds the ops such an op is made of,
# which vmap batches one by one, each in its own rule's layout (`stft`'s
# transposed). While tracing, the node of the value such an op returns is
# noted (not an input it returns as it is: `conj` of a real tensor); where vmap
# was the innermost level of the call, the programs make that value contiguous,
# as the stack is.
class StackedUnderVmap(TorchFunctionMode):
    """Notes the nodes of the values of the ops vmap runs example by example: NOTE [ops vmap runs example
    by example]."""

    def __init__(self) -> None:
        super().__init__()
        self.noted = 0  # values noted so far

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        noted_before = self.noted
        result = func(*args, **(kwargs or {}))
        # The innermost call of the op is noted: a Python wrapper of the same name (`torch.stft` around
        # `_VF.stft`) may take a view of its value after.
        if self.noted > noted_before or not runs_per_example_under_vmap(getattr(func, "__name__", "")):
            return result
        for value in tree_leaves(result):
            node = node_behind(value) if isinstance(value, torch.Tensor) else None
            if node is not None and node.op == "call_function":
                note_stacked_under_vmap(node)
                self.noted += 1
        return result


# NOTE [regions of a backward without grad]
# A backward traced in grad mode (NOTE [a backward traced as it will run]) may
# run parts with grad mode off: a custom Function's `once_differentiable`
# backward computes under `no_grad`, so eager never differentiates it (torch.func
# takes its derivative as zero; plain autograd raises where one is asked for).
# A traced graph does not say which ops ran so. While the backward is traced,
# the nodes made with grad mode off are noted, and where the backward program
# runs to be differentiated, their values are detached.
class NodesWithoutGrad(TorchDispatchMode):
    """Notes each graph node made while grad mode is off, as a backward is traced in grad mode."""

    def __init__(self, graph: Any):
        super().__init__()
        self.graph = graph

    supports_higher_order_operators = True  # See NOTE [higher-order ops under remat's modes].

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if torch.is_grad_enabled() or isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        last = next(iter(reversed(self.graph.nodes)), None)  # (before 2.12 `reversed` gives no iterator)
        result = func(*args, **(kwargs or {}))
        for node in reversed(self.graph.nodes):
            if node is last:
                break
            note_computed_without_grad(node)
        return result
