"""What one signature runs: its programs and the facts about its inputs and outputs that calling them needs.

The backward runs eager, compiled, or made differentiable again, as the
moment asks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from .._core._calls import TensorMeta
from .._partitioning._differentiable_programs import differentiable_again
from .._partitioning._partition import Programs
from .._torch import HigherOrderOperator, functorch_active
from ._compiled import CompiledPrograms

__all__ = ["Executable"]


@dataclasses.dataclass(frozen=True)
class Executable:
    """The programs of one signature and what is needed to call them."""

    programs: Programs
    differentiable_outputs: tuple[int, ...]  # indices of the outputs the joint graph took tangents for
    grad_of: tuple[int, ...]  # primal index of each gradient the backward program returns
    n_primals: int
    n_user_outputs: int
    dirty: tuple[int, ...]  # primals fn updates in place that require grad: returned marked dirty
    output_metas: tuple[TensorMeta, ...]
    compiled: CompiledPrograms | None = None  # see NOTE [compiling remat's programs]
    unbatchable: str | None = None  # why the programs cannot run under `vmap`, if they cannot
    not_under_forward_ad: str | None = None  # why they cannot under `torch.autograd.forward_ad`, if so
    higher_order_ops: frozenset[HigherOrderOperator] = frozenset()  # called by the programs (flex attention)
    sized_by_values: tuple[int, ...] = ()  # returned differentiable outputs whose sizes depend on values
    backward_error: str | None = None  # what eager's backward raises: NOTE [a backward eager cannot run]

    def forward(self, *primals: torch.Tensor) -> Sequence[torch.Tensor]:
        if self.compiled is not None and not functorch_active():
            return self.compiled.forward(*primals)  # type: ignore[no-any-return]
        return self.programs.forward.forward(*primals)  # type: ignore[no-any-return]

    def backward(self, kept_and_tangents: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Run the backward program; the eager one empties the list as it reads it (see NOTE [replay
        just in time]), the compiled one takes its arguments as they are."""
        if self.compiled is not None and not torch.is_grad_enabled() and not functorch_active():
            # Detached: nothing records here, and Dynamo would otherwise inspect the `.grad` of the
            # kept outputs that reach a call it leaves to eager (an offload copy) as graph inputs.
            return self.compiled.backward(*(t if t is None else t.detach() for t in kept_and_tangents))  # type: ignore[no-any-return]
        if torch.is_grad_enabled():  # its gradients will be differentiated
            return self.differentiable_backward.forward(kept_and_tangents)  # type: ignore[no-any-return]
        return self.programs.backward.forward(kept_and_tangents)  # type: ignore[no-any-return]

    @functools.cached_property
    def differentiable_backward(self) -> torch.fx.GraphModule:
        """The backward program to run where grad mode is on, made on first need: NOTE [a backward that
        will be differentiated]."""
        return differentiable_again(self.programs.backward)
