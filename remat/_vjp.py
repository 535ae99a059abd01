"""Execution: the `torch.autograd.Function` that runs the forward and backward programs."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._calls import TensorMeta
from ._partition import Programs
from ._trace import autocast_disabled

__all__ = ["Executable", "run"]


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


def run(executable: Executable, primals: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run the forward program, keeping what backward needs; return the user's outputs."""
    programs = executable.programs
    if torch._C._are_functorch_transforms_active():
        results = _CheckpointFunction.apply(executable, *primals)
    else:
        # `Function.apply` binds the arguments with `inspect.signature` on every
        # call, a third of the overhead of a small call; `forward` takes plain
        # positional arguments, so go straight to the C++ apply it ends in.
        results = _apply_without_binding(executable, *primals)
    returned = results[: len(programs.returned)]
    if programs.epilogue is None:
        return tuple(returned[: executable.n_user_outputs])
    return tuple(programs.epilogue.forward(*primals, *returned))


# NOTE [kept activations are outputs]
# Activations the backward keeps are returned by the Function's forward as
# extra (differentiable) outputs and saved from `setup_context`. Saving them
# through `ctx.save_for_backward` lets a user's `saved_tensors_hooks` see
# exactly what remat keeps (and nothing else). Being outputs, they stay
# connected to the graph: a second-order derivative that flows through them
# reaches this Function's backward instead of being silently dropped.
class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(executable: Executable, *primals: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        with autocast_disabled():
            return tuple(executable.programs.forward.forward(*primals))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        executable: Executable = inputs[0]
        primals = inputs[1:]
        programs = executable.programs
        n_returned = len(programs.returned)
        ctx.executable = executable
        kept = [
            primals[k.primal]
            if k.primal is not None
            else output[k.output]
            if k.output is not None
            else output[n_returned + k.activation]  # type: ignore[operator]
            for k in programs.kept
        ]
        ctx.save_for_backward(*kept)
        ctx.mark_dirty(*(primals[i] for i in executable.dirty))
        differentiable = set(executable.differentiable_outputs)
        ctx.mark_non_differentiable(
            *(o for i, o in zip(programs.returned, output, strict=False) if i not in differentiable),
            *(a for a in output[n_returned:] if not (a.is_floating_point() or a.is_complex())),
        )
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        executable: Executable = ctx.executable
        programs = executable.programs
        n_returned = len(programs.returned)
        if any(g is not None for g in grads[n_returned:]):
            raise NotImplementedError(
                "remat.checkpoint: a higher-order derivative flowed through a value kept for backward "
                "(`create_graph=True` followed by another backward). Double backward through a checkpointed "
                "function is not supported yet."
            )
        grad_of_output = dict(zip(programs.returned, grads, strict=False))
        tangents = []
        for i in executable.differentiable_outputs:
            # Outputs rebuilt by the epilogue send their gradients through autograd's view nodes.
            grad = grad_of_output.get(i)
            if grad is None:
                meta = executable.output_metas[i]
                grad = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
            tangents.append(grad)
        with autocast_disabled():
            computed = programs.backward.forward(*ctx.saved_tensors, *tangents)
        grad_inputs: list[torch.Tensor | None] = [None] * executable.n_primals
        for primal, grad in zip(executable.grad_of, computed, strict=True):
            grad_inputs[primal] = grad
        return (None, *grad_inputs)


_apply_without_binding = super(torch.autograd.Function, _CheckpointFunction).apply
