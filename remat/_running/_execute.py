"""Run a partition's programs through autograd: the `torch.autograd.Function` and `run`, the call into it.

The Function's forward runs the forward program and saves what backward
keeps; its backward runs the backward program.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._core._calls import TensorMeta
from .._core._contexts import autocast_disabled
from .._memory import _step
from .._partitioning._eager_copies import STACKS_UNDER_VMAP
from .._partitioning._partition import KeptActivation, KeptGeneratorState, KeptInput, KeptOutput, Programs
from .._torch import (
    CtxCustomSave,
    CtxWithSavedTensors,
    TransformType,
    apply_without_binding,
    batched_level,
    functorch_active,
    functorch_interpreters,
    unwrap_batched,
)
from .._tracing._engine import release_saved_tensors, walk_as_the_engine
from ._active_transforms import check_transforms_support, forward_mode_active, func_jvp_active, vmap_active
from ._executable import Executable
from ._forward_mode import Layout, pure_jvp
from ._second_order import activations_vjp, differentiated_again, pure_vjp

__all__ = ["run"]


_UPDATED_INPUT_UNDER_FUNC_JVP = (
    "remat.checkpoint: under torch.func.jvp (or jacfwd, hessian) the function updates an input in place, "
    "whose tangent must then be updated in place too, which torch.func does not allow a custom "
    "autograd.Function to do. Update a copy of the input (`x = x.clone()` first), or use "
    "torch.autograd.forward_ad, where this works."
)


def run(executable: Executable, primals: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run the forward program, keeping what backward needs; return the user's outputs."""
    programs = executable.programs
    if executable.not_under_forward_ad is not None and not func_jvp_active():
        raise NotImplementedError(executable.not_under_forward_ad)  # traced for forward mode: it is on
    if executable.dirty and func_jvp_active():
        # (Under `vmap` of `jvp`, torch's own check of the Function's dirty inputs would raise first.)
        raise NotImplementedError(_UPDATED_INPUT_UNDER_FUNC_JVP)
    # See NOTE [updated inputs that are views].
    # (Under forward mode a dual tensor is a view of its primal: one the function updates, running
    # statistics say, is updated through a clone too, which carries the tangent on as eager's update does.)
    views = [
        i for i in executable.dirty if primals[i]._is_view() and (primals[i].requires_grad or forward_mode_active())
    ]
    if views and any(primals[i].requires_grad for i in views) and forward_mode_active():
        raise NotImplementedError(
            "remat.checkpoint: under forward mode the function updates in place an input that is a view of "
            "another tensor (a dual tensor of a tensor that requires grad is one), which autograd does not let "
            "remat's Function do. Pass a tensor that is not a view (`x.clone()`), or update a copy of the "
            "input inside the function."
        )
    # See NOTE [where views of inputs are rebuilt].
    taken_before = () if programs.prologue is None else tuple(programs.prologue.forward(*primals))
    updated = [primals[i] for i in views]
    if views:
        primals = list(primals)
        for i in views:
            primals[i] = primals[i].clone()
    if functorch_active():
        if executable.unbatchable is not None and vmap_active():
            raise NotImplementedError(executable.unbatchable)
        if executable.higher_order_ops:
            check_transforms_support(executable.higher_order_ops)
        stacks = STACKS_UNDER_VMAP.set(functorch_interpreters()[-1].key() == TransformType.Vmap)
        try:
            results = _CheckpointFunction.apply(executable, *primals)
        finally:
            STACKS_UNDER_VMAP.reset(stacks)
    else:
        # `Function.apply` binds the arguments with `inspect.signature` on every
        # call, a third of the overhead of a small call; `forward` takes plain
        # positional arguments, so go straight to the C++ apply it ends in.
        results = _apply_without_binding(executable, *primals)
    returned = results[: len(programs.returned)]
    if views:
        returned = list(returned)
        for i, view in zip(views, updated, strict=True):
            view.copy_(primals[i])
            returned[programs.returned.index(executable.n_user_outputs + executable.dirty.index(i))] = view
            primals[i] = view
    if programs.epilogue is None:
        return tuple(returned[: executable.n_user_outputs])
    return tuple(programs.epilogue.forward(*primals, *taken_before, *returned))


# NOTE [updated inputs that are views]
# Autograd lets a Function update in place an input that is a view of another
# tensor that requires grad only if the Function returns nothing else, and
# remat's returns its kept values too. Such an input (`x = h[:, 0]`, then
# `x += mlp(x)` inside the function) is cloned, the Function updates the
# clone, and the view takes the clone's new value with a `copy_` outside,
# which autograd records on the view and its base as eager records the update.
# The clone costs one copy of the input per call. Under forward mode an input is updated in place even
# where autograd does not record the update (under `no_grad`), and the `copy_`
# would record it: there remat raises instead.


# NOTE [kept activations are outputs]
# Activations the backward keeps are returned by the Function's forward as
# extra (differentiable) outputs and saved from `setup_context`. Saving them
# through `ctx.save_for_backward` lets a user's `saved_tensors_hooks` see
# exactly what remat keeps (and nothing else). Being outputs, they stay
# connected to the graph: a second-order derivative that flows through them
# reaches this Function's backward as their cotangents, and is carried on to
# the inputs by differentiating the pure forward. See NOTE [differentiating the
# forward again].
#
# A kept copy of an input (NOTE [kept inputs]) is such an output too, and the
# backward that will be differentiated differentiates the pure forward with
# respect to it: the gradient it gives reads the copy, so the graph behind it
# leads back into this Function. Autograd, asked there for the gradient of an
# input this Function also reads (a parameter), runs this Function's backward to
# see whether that path reaches it, with a cotangent for the copy alone; and
# differentiating the pure forward again would ask again, without end. The
# copy's derivative is the identity of its input: a backward that gets
# cotangents for copies of inputs only hands them on as those inputs'
# gradients, and asks autograd nothing.
class _CheckpointFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(executable: Executable, *primals: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        with autocast_disabled():
            return tuple(executable.forward(*primals))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        executable: Executable = inputs[0]
        primals = inputs[1:]
        programs = executable.programs
        n_returned = len(programs.returned)
        ctx.executable = executable
        kept = [_kept_value(k.where, primals, output, n_returned) for k in programs.kept]
        if programs.backward_not_differentiable is not None:
            # An input that requires grad, saved last, for the gradients' refusal to be differentiated to
            # hang on: see NOTE [second derivatives of gradients that read LU factors] and `_saved`.
            kept += [p for p in primals if p.requires_grad][:1]
        ctx.save_for_backward(*kept)
        if programs.traced_for_forward_mode:  # for the jvp rule
            ctx.save_for_forward(*kept)
            ctx.remat_output_metas = [TensorMeta.of(o) for o in output]  # zeros where it finds no tangent
            if not functorch_active():  # See NOTE [tangents in their outputs' layouts].
                ctx.remat_output_layouts = [Layout.of(o) for o in output]
        if executable.sized_by_values:  # the zeros backward makes where it gets no gradient take these sizes
            ctx.remat_sizes = {i: output[programs.returned.index(i)].shape for i in executable.sized_by_values}
        if executable.dirty:  # (each skipped call is a microsecond of every cached call's overhead)
            ctx.mark_dirty(*_as_seen_by_autograd(ctx, [primals[i] for i in executable.dirty]))
        non_differentiable = [
            o for o, skip in zip(output, _marked_non_differentiable(ctx, programs), strict=True) if skip
        ]
        if non_differentiable:
            ctx.mark_non_differentiable(*_as_seen_by_autograd(ctx, non_differentiable))
        ctx.set_materialize_grads(False)
        if _step.recorder is not None:  # a probe step of `remat.fit`: see NOTE [a step's timeline]
            ctx.remat_step_call = _step.recorder.function_applied()
        prehook = None
        if not functorch_active():  # See NOTE [the backward owns its gradients].
            taken: list[tuple[torch.Tensor | None, ...]] = []
            ctx.remat_taken_grads = taken
            prehook = functools.partial(_take_grads, taken)
            ctx.register_prehook(prehook)
        walk_as_the_engine(ctx, prehook, materialize_grads=False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        probe, call = _step.recorder, getattr(ctx, "remat_step_call", None)
        if probe is None or call is None:
            return _CheckpointFunction._backward(ctx, *grads)
        probe.backward_started(call)
        try:
            return _CheckpointFunction._backward(ctx, *grads)
        finally:
            probe.backward_ended(call)

    @staticmethod
    def _backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        executable: Executable = ctx.executable
        if executable.backward_error is not None:  # See NOTE [a backward eager cannot run].
            raise RuntimeError(executable.backward_error)
        programs = executable.programs
        n_returned = len(programs.returned)
        taken = getattr(ctx, "remat_taken_grads", None)
        if taken:
            grads = taken.pop()
        if _for_input_copies_only(programs, grads):  # See NOTE [kept activations are outputs].
            return (None, *_gradients_of_input_copies(executable, grads))
        kept, anchor = _saved(ctx, programs)
        if differentiated_again(programs, kept, grads):  # See NOTE [a backward that will be differentiated].
            return (None, *pure_vjp(programs, kept, grads, ctx.needs_input_grad[1:]))
        refused = programs.backward_not_differentiable if torch.is_grad_enabled() else None
        grad_inputs: list[torch.Tensor | None] = [None] * executable.n_primals
        grad_of_output = dict(zip(programs.returned, grads, strict=False))
        activation_grads = grads[n_returned : n_returned + programs.n_activations]
        kept_after = any(g is not None for g in activation_grads)  # a second derivative through them
        if any(g is not None for g in grads[:n_returned]):
            # Outputs rebuilt by the epilogue send their gradients through autograd's view nodes. (A
            # comprehension: a loop variable would keep the last gradient alive through the backward.)
            sizes = getattr(ctx, "remat_sizes", {})
            tangents = [
                _zeros(executable.output_metas[i], sizes.get(i)) if grad_of_output.get(i) is None else grad_of_output[i]
                for i in executable.differentiable_outputs
            ]
            arguments = [*kept, *tangents]
            if not kept_after:  # See NOTE [replay just in time].
                release_saved_tensors(ctx)
                del kept, tangents, grads, grad_of_output
            with autocast_disabled():
                computed = executable.backward(arguments)
            for primal, grad in zip(executable.grad_of, computed, strict=True):
                grad_inputs[primal] = (
                    grad if refused is None or grad is None else _NotDifferentiableAgain.apply(grad, refused, anchor)
                )
        if kept_after:
            _accumulate(grad_inputs, activations_vjp(programs, kept, activation_grads, ctx.needs_input_grad[1:]))
        return (None, *grad_inputs)

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        executable: Executable = ctx.executable
        programs = executable.programs
        assert programs.traced_for_forward_mode, "traced without forward mode: see forward_mode_active()"
        primal_tangents = tangents[1:]
        chosen: list[tuple[int, torch.Tensor]] = []
        for i, primal in programs.pure_inputs:
            tangent = primal_tangents[primal]
            if tangent is not None:
                chosen.append((i, tangent))
        if executable.dirty and functorch_active():
            raise NotImplementedError(_UPDATED_INPUT_UNDER_FUNC_JVP)
        kept, _ = _saved(ctx, programs)
        vmap_inside = isinstance(ctx, CtxWithSavedTensors)  # See NOTE [forward mode outside vmap].
        output_tangents = list(pure_jvp(programs, kept, chosen, ctx.needs_input_grad[1:], vmap_inside))
        # An input the forward updated in place keeps its tangent tensor, updated in place too (as
        # autograd asks of a Function that marks an input dirty).
        for j, primal in enumerate(executable.dirty):
            position = programs.returned.index(executable.n_user_outputs + j)
            given, new = primal_tangents[primal], output_tangents[position]
            if given is not None:
                if new is None:
                    given.zero_()
                elif new is not given:
                    given.copy_(new)
                else:  # unchanged (an update through a detached alias), but autograd checks for an update
                    torch.autograd.graph.increment_version(given)
                output_tangents[position] = given
        n_states = sum(k.rng_state for k in programs.kept)
        tangents = tuple(
            None if skip else _zeros(meta) if tangent is None else tangent.to(meta.device)  # offloaded: the host's
            for tangent, skip, meta in zip(
                (*output_tangents, *([None] * n_states)),
                programs.non_differentiable,
                ctx.remat_output_metas,
                strict=True,
            )
        )
        layouts = getattr(ctx, "remat_output_layouts", None)
        if layouts is None:
            return tangents
        return tuple(t if t is None else layout.laid_out(t) for t, layout in zip(tangents, layouts, strict=True))


# NOTE [the backward owns its gradients]
# Autograd holds the gradients it hands a Function's backward until the
# backward returns, so the gradient of a checkpointed block's output would
# live through the whole replayed backward of the block, where eager frees it
# after the first gradient formula that reads it. A pre-hook on the Function's
# node takes them out of autograd's hands (autograd passes None instead: the
# Function does not materialize gradients), and the backward program, taking
# them in the list it empties, frees each at its last use.
def _take_grads(taken: list[tuple[torch.Tensor | None, ...]], grads: tuple[torch.Tensor | None, ...]) -> Any:
    taken.append(grads)
    return (None,) * len(grads)


# NOTE [second derivatives of gradients that read LU factors]
# The gradient formulas of `linalg.solve`, `det` and `slogdet` reuse the LU
# factors their forward computed where grad mode is off as they run, and work
# from the matrix again where it is on (`create_graph=True`: the gradient will
# be differentiated). The factors are outputs autograd does not differentiate,
# so differentiating the first form misses how they depend on the matrix.
# remat traces backward with grad mode off, so its backward program has the
# first form: a second derivative through it (`create_graph=True`, `grad` of
# `grad`, `hessian`, a `torch.func.vjp` pullback differentiated) would come out
# silently wrong. Where it may be differentiated, the backward is autograd's over
# the pure forward, eager's second form (NOTE [a backward that will be
# differentiated]). Where that cannot be (a custom autograd Function in the
# trace), remat hands out each gradient through a Function that raises where it
# is differentiated, in either mode; a gradient used as it is, as the pullback
# of `torch.func.vjp` or `torch.func.grad` alone give it, is exact
# (`_quirks.GRADIENTS_READ_LU_FACTORS`).
class _NotDifferentiableAgain(torch.autograd.Function):
    """A gradient (a copy) that raises, naming `why`, where it is differentiated: in reverse or forward mode.
    It depends on `anchor` (an input that requires grad), as the gradient does in eager, where the traced
    formula may not (slogdet's reads only the LU factors)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad: torch.Tensor, why: str, anchor: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        return grad.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.why = inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError(_second_derivative_refused(ctx.why))

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(_second_derivative_refused(ctx.why))


def _saved(ctx: Any, programs: Programs) -> tuple[Any, torch.Tensor | None]:
    """(what the programs kept, the input saved after them for `_NotDifferentiableAgain`, if any)."""
    saved = ctx.saved_tensors
    if len(saved) == len(programs.kept):
        return saved, None
    return saved[:-1], saved[-1]


def _second_derivative_refused(why: str) -> str:
    return f"remat.checkpoint: a second-order derivative differentiates the backward of call {why}."


def _kept_value(
    where: KeptInput | KeptOutput | KeptActivation | KeptGeneratorState,
    primals: Sequence[torch.Tensor],
    output: Sequence[torch.Tensor],
    n_returned: int,
) -> torch.Tensor:
    """The tensor `setup_context` saves for one kept value: an input, a returned output, or an extra output."""
    match where:
        case KeptInput(index):
            return primals[index]
        case KeptOutput(position):
            return output[position]
        case KeptActivation(index) | KeptGeneratorState(index):
            return output[n_returned + index]


def _zeros(meta: TensorMeta, shape: Sequence[int] | None = None) -> torch.Tensor:
    """The gradient of an output that got none: zeros of its `meta`, in this call's `shape` (its sizes
    that depend on values are given in `meta` at their bounds)."""
    return torch.zeros(meta.shape if shape is None else shape, dtype=meta.dtype, device=meta.device)


def _marked_non_differentiable(ctx: Any, programs: Programs) -> Iterator[bool]:
    """For each output of the Function, whether it is marked non-differentiable: as traced,
    and, under torch.func transforms, also when it has a derivative from no input that
    requires grad at this level.

    The trace differentiates the inputs that require grad at any level (see `joint_graph_of`),
    so its answer is eager's outside transforms; never under forward mode, where inputs carry
    tangents without requiring grad.
    """
    per_level = not programs.traced_for_forward_mode and functorch_active()
    # A kept copy of an input that does not require grad has no derivative (NOTE [kept activations are
    # outputs]), though autograd takes every output of a Function to have one from every input.
    n_returned = len(programs.returned)
    copies = () if programs.traced_for_forward_mode else {n_returned + k for k in programs.input_copies}
    needs_grad = ctx.needs_input_grad[1:]
    for position, (skip, sources) in enumerate(zip(programs.non_differentiable, programs.output_sources, strict=True)):
        yield skip or ((per_level or position in copies) and not any(needs_grad[i] for i in sources))


def _as_seen_by_autograd(ctx: Any, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors autograd knows as `outputs` (or inputs). Under `vmap`, `setup_context` sees
    batched views of the Function's real inputs and outputs, which `mark_non_differentiable`
    and `mark_dirty` (identity checks) would miss; unwrap them to the tensors autograd has."""
    if isinstance(ctx, CtxCustomSave):
        return list(unwrap_batched(tuple(outputs), batched_level(ctx))[0])
    return outputs


def _for_input_copies_only(programs: Programs, grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether the only cotangents are those of kept copies of inputs (NOTE [kept activations are outputs])."""
    n_returned = len(programs.returned)
    given = [k for k, g in enumerate(grads) if g is not None]
    return bool(given) and all(k - n_returned in programs.input_copies for k in given)


def _gradients_of_input_copies(
    executable: Executable, grads: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """The inputs' gradients for the cotangents of kept copies of them: the same cotangents, on the inputs'
    devices (that of an offloaded copy is in host memory, as the copy was)."""
    programs = executable.programs
    n_returned = len(programs.returned)
    device = {primal: programs.kept[i].node.meta["val"].device for i, primal in programs.pure_inputs}
    result: list[torch.Tensor | None] = [None] * executable.n_primals
    for index, primal in programs.input_copies.items():
        grad = grads[n_returned + index]
        if grad is not None:
            _accumulate_one(result, primal, grad.to(device[primal]))
    return result


def _accumulate_one(into: list[torch.Tensor | None], i: int, grad: torch.Tensor) -> None:
    current = into[i]
    into[i] = grad if current is None else current + grad


def _accumulate(into: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    for i, grad in enumerate(grads):
        if grad is not None:
            _accumulate_one(into, i, grad)


_apply_without_binding = apply_without_binding(_CheckpointFunction)
