"""Execution: the `torch.autograd.Function` that runs the forward and backward programs."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._calls import TensorMeta
from ._partition import Programs

__all__ = ["Executable", "run"]


@dataclasses.dataclass(frozen=True)
class Executable:
    """The programs of one signature and what is needed to call them."""

    programs: Programs
    n_outputs: int
    differentiable_outputs: tuple[int, ...]
    grad_of: tuple[int, ...]  # primal index of each gradient the backward program returns
    n_primals: int
    output_metas: tuple[TensorMeta, ...]


def run(executable: Executable, primals: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run the forward program, keeping what backward needs; return the user's outputs."""
    if torch._C._are_functorch_transforms_active():
        results = _CheckpointFunction.apply(executable, *primals)
    else:
        # `Function.apply` binds the arguments with `inspect.signature` on every
        # call, a third of the overhead of a small call; `forward` takes plain
        # positional arguments, so go straight to the C++ apply it ends in.
        results = _apply_without_binding(executable, *primals)
    return tuple(results[: executable.n_outputs])


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
        return tuple(executable.programs.forward.forward(*primals))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        executable: Executable = inputs[0]
        primals = inputs[1:]
        programs = executable.programs
        ctx.executable = executable
        kept = [
            primals[k.primal]
            if k.primal is not None
            else output[k.output]
            if k.output is not None
            else output[executable.n_outputs + k.activation]  # type: ignore[operator]
            for k in programs.kept
        ]
        ctx.save_for_backward(*kept)
        differentiable = set(executable.differentiable_outputs)
        ctx.mark_non_differentiable(
            *(o for i, o in enumerate(output[: executable.n_outputs]) if i not in differentiable),
            *(a for a in output[executable.n_outputs :] if not (a.is_floating_point() or a.is_complex())),
        )
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        executable: Executable = ctx.executable
        if any(g is not None for g in grads[executable.n_outputs :]):
            raise NotImplementedError(
                "remat.checkpoint: a higher-order derivative flowed through a value kept for backward "
                "(`create_graph=True` followed by another backward). Double backward through a checkpointed "
                "function is not supported yet."
            )
        tangents = []
        for i in executable.differentiable_outputs:
            grad = grads[i]
            if grad is None:
                meta = executable.output_metas[i]
                grad = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
            tangents.append(grad)
        computed = executable.programs.backward.forward(*ctx.saved_tensors, *tangents)
        grad_inputs: list[torch.Tensor | None] = [None] * executable.n_primals
        for primal, grad in zip(executable.grad_of, computed, strict=False):
            grad_inputs[primal] = grad
        return (None, *grad_inputs)


_apply_without_binding = super(torch.autograd.Function, _CheckpointFunction).apply
