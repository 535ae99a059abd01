"""Execution: the `torch.autograd.Function` that runs the programs of a partition."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from ._calls import TensorMeta
from ._partition import Programs
from ._trace import autocast_disabled

__all__ = ["Executable", "forward_mode_active", "run"]


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
# reaches this Function's backward as their cotangents, and is carried on to
# the inputs by differentiating the pure forward. See NOTE [differentiating the
# forward again].
class _CheckpointFunction(torch.autograd.Function):
    generate_vmap_rule = True

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
        if programs.pure_returns_outputs:  # traced under forward mode: the jvp rule reads them
            ctx.save_for_forward(*kept)
        ctx.mark_dirty(*(primals[i] for i in executable.dirty))
        # Outputs that do not depend on an input requiring grad do not require grad, as in
        # eager; under forward mode (where inputs need not require grad), only integer ones.
        differentiable = set(executable.differentiable_outputs)
        ctx.remat_without_tangent = [
            not _is_float(o) or (i not in differentiable and not forward_mode_active())
            for i, o in zip(programs.returned, output, strict=False)
        ] + [not _is_float(a) for a in output[n_returned:]]
        ctx.mark_non_differentiable(*(o for o, skip in zip(output, ctx.remat_without_tangent, strict=True) if skip))
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        executable: Executable = ctx.executable
        programs = executable.programs
        n_returned = len(programs.returned)
        kept = ctx.saved_tensors
        grad_inputs: list[torch.Tensor | None] = [None] * executable.n_primals
        grad_of_output = dict(zip(programs.returned, grads, strict=False))
        if any(g is not None for g in grads[:n_returned]):
            tangents = []
            for i in executable.differentiable_outputs:
                # Outputs rebuilt by the epilogue send their gradients through autograd's view nodes.
                grad = grad_of_output.get(i)
                if grad is None:
                    meta = executable.output_metas[i]
                    grad = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
                tangents.append(grad)
            with autocast_disabled():
                computed = programs.backward.forward(*kept, *tangents)
            for primal, grad in zip(executable.grad_of, computed, strict=True):
                grad_inputs[primal] = grad
        activation_grads = grads[n_returned : n_returned + programs.n_activations]
        if any(g is not None for g in activation_grads):
            _accumulate(grad_inputs, _activations_vjp(programs, kept, activation_grads))
        return (None, *grad_inputs)

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        executable: Executable = ctx.executable
        programs = executable.programs
        assert programs.pure_returns_outputs, "traced without forward mode: see forward_mode_active()"
        kept = list(ctx.saved_tensors)
        primal_tangents = tangents[1:]
        positions = [i for i, primal in programs.pure_inputs if primal_tangents[primal] is not None]

        def pure(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            inputs = list(kept)
            for position, value in zip(positions, values, strict=True):
                inputs[position] = value
            with autocast_disabled():
                return tuple(programs.pure.forward(*inputs))

        primal_of = dict(programs.pure_inputs)
        _, output_tangents = torch.func.jvp(
            pure,
            tuple(kept[i] for i in positions),
            tuple(primal_tangents[primal_of[i]] for i in positions),  # type: ignore[misc]
        )
        n_states = sum(k.rng_state for k in programs.kept)
        return tuple(
            None if skip else tangent
            for tangent, skip in zip((*output_tangents, *([None] * n_states)), ctx.remat_without_tangent, strict=True)
        )


def _activations_vjp(
    programs: Programs, kept: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Gradients of the inputs for cotangents on the kept activations (a higher-order
    derivative), by differentiating the pure forward. See NOTE [differentiating the forward again]."""
    n_returned = len(programs.returned)
    differentiable = [(i, primal) for i, primal in programs.pure_inputs if kept[i].requires_grad]
    grads: list[torch.Tensor | None] = [None] * (1 + max((p for _, p in programs.pure_inputs), default=-1))
    if not differentiable:
        return grads
    # Only the inputs are differentiated: every other kept value the pure forward reads is a
    # constant to it (and an output of this Function, so autograd must not be led back here).
    inputs = {i for i, _ in differentiable}
    constants = [value if i in inputs else value.detach() for i, value in enumerate(kept)]
    with torch.enable_grad(), autocast_disabled():
        recomputed = programs.pure.forward(*constants)[n_returned if programs.pure_returns_outputs else 0 :]
    pairs = [
        (value, grad)
        for value, grad in zip(recomputed, cotangents, strict=True)
        if grad is not None and value.requires_grad
    ]
    if not pairs:
        return grads
    computed = torch.autograd.grad(
        [value for value, _ in pairs],
        [kept[i] for i, _ in differentiable],
        [grad for _, grad in pairs],
        allow_unused=True,
        create_graph=torch.is_grad_enabled(),
    )
    for (_, primal), grad in zip(differentiable, computed, strict=True):
        grads[primal] = grad
    return grads


def _is_float(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def forward_mode_active() -> bool:
    """Whether forward-mode AD (`torch.func.jvp`, `jacfwd`, `torch.autograd.forward_ad`) is running."""
    if torch.autograd.forward_ad._current_level >= 0:
        return True
    return any(interpreter.key() == TransformType.Jvp for interpreter in retrieve_all_functorch_interpreters())


def _accumulate(into: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    for i, grad in enumerate(grads):
        if grad is not None:
            current = into[i]
            into[i] = grad if current is None else current + grad


_apply_without_binding = super(torch.autograd.Function, _CheckpointFunction).apply
