"""Execution: the `torch.autograd.Function` that runs the programs of a partition."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from . import _step
from ._cache import requires_grad_at_any_level
from ._calls import TensorMeta
from ._compiled import CompiledPrograms
from ._contexts import autocast_disabled
from ._engine import release_saved_tensors, walk_as_the_engine
from ._partition import KeptActivation, KeptGeneratorState, KeptInput, KeptOutput, Programs
from ._programs import STACKS_UNDER_VMAP, differentiable_again
from ._strides import is_dense
from ._torch import (
    CtxCustomSave,
    CtxWithSavedTensors,
    HigherOrderOperator,
    TransformType,
    apply_without_binding,
    batched_at,
    batched_level,
    forward_ad_level,
    forward_grad_enabled,
    functorch_active,
    functorch_interpreters,
    functorch_level,
    inplace_requires_grad_allowed,
    is_functorch_wrapped,
    make_dual,
    tangent_of,
    unbatched_at,
    unwrap_batched,
    unwrap_dead_wrappers,
    unwrap_level,
    vmap_levels,
)

__all__ = ["Executable", "forward_mode_active", "nested_forward_mode", "run", "unsupported_under", "vmap_active"]


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


_UPDATED_INPUT_UNDER_FUNC_JVP = (
    "remat.checkpoint: under torch.func.jvp (or jacfwd, hessian) the function updates an input in place, "
    "whose tangent must then be updated in place too, which torch.func does not allow a custom "
    "autograd.Function to do. Update a copy of the input (`x = x.clone()` first), or use "
    "torch.autograd.forward_ad, where this works."
)


def run(executable: Executable, primals: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run the forward program, keeping what backward needs; return the user's outputs."""
    programs = executable.programs
    if executable.not_under_forward_ad is not None and not _func_jvp_active():
        raise NotImplementedError(executable.not_under_forward_ad)  # traced for forward mode: it is on
    if executable.dirty and _func_jvp_active():
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
            _check_transforms_support(executable.higher_order_ops)
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
                ctx.remat_output_layouts = [_Layout.of(o) for o in output]
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
        kept, anchor = _saved(ctx, programs)
        if _differentiated_again(programs, kept, grads):  # See NOTE [a backward that will be differentiated].
            return (None, *_pure_vjp(programs, kept, grads, ctx.needs_input_grad[1:]))
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
            _accumulate(grad_inputs, _activations_vjp(programs, kept, activation_grads, ctx.needs_input_grad[1:]))
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
        output_tangents = list(_pure_jvp(programs, kept, chosen, ctx.needs_input_grad[1:], vmap_inside))
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


def _pure_jvp(
    programs: Programs,
    kept: Sequence[torch.Tensor],
    chosen: Sequence[tuple[int, torch.Tensor]],
    needs_grad: Sequence[bool],
    vmap_inside: bool = False,
) -> Sequence[torch.Tensor | None]:
    """Tangents of the pure forward's outputs for tangents on some of its inputs, by the forward-mode
    formulas of its ops, as eager computes them: a level outside this one (the `jacrev` of a `jacfwd`,
    a backward of a forward-mode tangent) differentiates them as it does eager's. (Differentiating a
    vector-Jacobian product with respect to its vector gives the same tangents, but not the same
    derivatives of them: backward formulas written with statistics their op returns without a
    derivative, layer norm's, are exact only to the order they are written for.)"""
    if not chosen:  # no input the pure forward reads has a tangent (or it reads none)
        return [None] * (len(programs.returned) + programs.n_activations)
    # See NOTE [tangents that will be differentiated].
    differentiated = torch.is_grad_enabled() and any(
        requires_grad_at_any_level(t) for t in (*kept, *(tangent for _, tangent in chosen))
    )
    run = programs.pure.tangents_to_differentiate if differentiated else programs.pure.forward
    if _func_jvp_active():  # torch.func.jvp nests: forward mode of our own
        if vmap_inside:
            return _jvp_outside_vmap(run, kept, chosen)
        return _jvp_in_forward_mode(run, kept, chosen)
    return _jvp_at_the_dual_level(programs, run, kept, chosen, needs_grad)


def _jvp_in_forward_mode(
    run: Callable[..., Any], kept: Sequence[torch.Tensor], chosen: Sequence[tuple[int, torch.Tensor]]
) -> Sequence[torch.Tensor]:
    positions = [i for i, _ in chosen]

    def pure(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(kept)
        for position, value in zip(positions, inputs, strict=True):
            values[position] = value
        with autocast_disabled():
            return tuple(run(*values))

    return torch.func.jvp(pure, tuple(kept[i] for i in positions), tuple(t for _, t in chosen))[1]  # type: ignore[no-any-return]


# NOTE [forward mode outside vmap]
# Under `jvp` of `vmap` (`jacfwd` of a `vmap`ped function, `grad` of that),
# torch.func runs a Function's forward-mode rule inside a vmap of its own
# (`generate_vmap_rule`): the rule's ops are batched after their tangents are
# formed, where eager batches them first. The order shows where vmap runs an
# op as other ops, which have forward-mode formulas where the op has none
# (`native_dropout_backward`, under vmap `grad * mask * scale`): eager's `jvp`
# of `vmap` works, remat's rule raised. There the rule steps out of the vmap
# it is called in and runs the pure forward under `jvp` of a `vmap` of it, on
# the batched tensors' storage, as eager does. (`vmap` of `jvp` calls the rule
# outside any vmap of its own, and raises there as eager does.)
def _jvp_outside_vmap(
    run: Callable[..., Any], kept: Sequence[torch.Tensor], chosen: Sequence[tuple[int, torch.Tensor]]
) -> Sequence[torch.Tensor]:
    interpreter = functorch_interpreters()[-1]
    level, size, randomness = interpreter.level(), interpreter.batch_size(), interpreter.randomness()
    tangents = dict(chosen)
    positions = [i for i, _ in chosen]
    with interpreter.lower():
        values, dims = [], []
        for value in kept:
            unbatched, dim = unbatched_at(value, level)
            values.append(unbatched)
            dims.append(dim)
        primals, given = [], []
        for i in positions:
            tangent, tangent_dim = unbatched_at(tangents[i], level)
            primal, primal_dim = values[i], dims[i]
            if primal_dim is None and tangent_dim is None:
                primals.append(primal)
                given.append(tangent)
                continue
            # `jvp` takes a tangent shaped as its primal: both batched, at the primal's dimension
            dim = 0 if primal_dim is None else primal_dim
            primals.append(primal if primal_dim is not None else _stacked(primal, size))
            given.append(
                (tangent if tangent_dim is not None else _stacked(tangent, size)).movedim(tangent_dim or 0, dim)
            )
            dims[i] = dim
        in_dims = tuple(dims)

        def per_example(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with autocast_disabled():
                return tuple(run(*inputs))

        batched = torch.func.vmap(per_example, in_dims=in_dims, randomness=randomness)

        def pure(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            every = list(values)
            for position, value in zip(positions, inputs, strict=True):
                every[position] = value
            return batched(*every)  # type: ignore[no-any-return]

        out_tangents = torch.func.jvp(pure, tuple(primals), tuple(given))[1]
    return [batched_at(t, 0, level) for t in out_tangents]


def _stacked(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """`size` copies of `tensor` along a new first dimension (an expanded view)."""
    return tensor.unsqueeze(0).expand(size, *tensor.shape)


def _jvp_at_the_dual_level(
    programs: Programs,
    run: Callable[..., Any],
    kept: Sequence[torch.Tensor],
    chosen: Sequence[tuple[int, torch.Tensor]],
    needs_grad: Sequence[bool],
) -> Sequence[torch.Tensor | None]:
    """Under torch.autograd.forward_ad, whose levels do not nest: the pure forward run on the kept
    inputs at the level the rule is called for, where they carry their tangents (autograd turns forward
    mode off around the rule; it is turned back on for this).

    Autograd records the tangents' formulas where a primal requires grad, as in eager. An input the
    Function also returns is kept as that output, which requires grad whenever any input does: it is
    detached where the input does not require grad, so that autograd records exactly what eager
    records (recording more differentiates formulas eager never differentiates, some of which torch
    cannot: log_softmax's tangent updates a saved exp in place)."""
    values = list(kept)
    tangents = dict(chosen)
    with forward_grad_enabled():  # See NOTE [forward-mode tangents under vmap].
        for i, primal in programs.pure_inputs:
            own = tangent_of(kept[i])  # None where it was saved without it (a copy of an input)
            tangent = tangents.get(i) if own is None else own
            if not needs_grad[primal]:  # (under vmap, `requires_grad` does not show through the batching)
                values[i] = kept[i].detach()  # (without its tangent too)
            elif own is not None:
                continue
            if tangent is not None:
                values[i] = make_dual(values[i], tangent)
        with autocast_disabled():
            outputs = run(*values)
        return [tangent_of(o) for o in outputs]


def _activations_vjp(
    programs: Programs,
    kept: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor | None],
    needs_grad: Sequence[bool],
) -> list[torch.Tensor | None]:
    """Gradients of the inputs for cotangents on the kept activations (a higher-order
    derivative), by differentiating the pure forward. See NOTE [differentiating the forward again]."""
    grads: list[torch.Tensor | None] = [None] * len(needs_grad)
    chosen = [(i, primal) for i, primal in programs.pure_inputs if needs_grad[primal]]
    if not chosen:
        return grads
    values, inputs = _differentiable(kept, [i for i, _ in chosen])
    with torch.enable_grad(), autocast_disabled():
        recomputed = programs.pure.forward(*values)[len(programs.returned) if programs.traced_for_forward_mode else 0 :]
    pairs = [  # the cotangent of an offloaded value is in host memory, as the value was
        (v, g.to(v.device)) for v, g in zip(recomputed, cotangents, strict=True) if g is not None and v.requires_grad
    ]
    if pairs:
        computed = torch.autograd.grad(
            [v for v, _ in pairs],
            inputs,
            [g for _, g in pairs],
            allow_unused=True,
            create_graph=torch.is_grad_enabled(),
        )
        for (_, primal), grad in zip(chosen, computed, strict=True):
            grads[primal] = grad
    return grads


def _differentiated_again(
    programs: Programs, kept: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> bool:
    """Whether this backward's gradients may be differentiated, and autograd can compute them as eager
    does, from the pure forward. They may where grad mode is on (`create_graph=True`, a torch.func
    transform) and something they are computed from requires grad at some level: a transform over the
    one running this backward, or autograd under it. A single `torch.func.grad` runs backward in grad
    mode too, with nothing to differentiate: there the backward program runs, as for `.backward()`."""
    if not torch.is_grad_enabled():
        return False
    pure = programs.pure_with_outputs
    if pure is None or not pure.reads_only_what_is_kept:
        return False
    interpreters = functorch_interpreters()
    if len(interpreters) == 1 and interpreters[0].key() == TransformType.Grad:
        # One `grad` alone (and no pullback of an ended level: its wrapper is not this one): the backward
        # running is its own, and what requires grad there only is differentiated by nothing again.
        return any(t is not None and _requires_grad_beyond(t, interpreters[0].level()) for t in (*kept, *grads))
    if not interpreters:  # (a pullback whose level has ended: only what requires grad below counts)
        kept = unwrap_dead_wrappers(kept)
    return any(t is not None and requires_grad_at_any_level(t) for t in (*kept, *grads))


def _requires_grad_beyond(tensor: torch.Tensor, level: int | None) -> bool:
    """Whether `tensor` requires grad at some level of torch.func transforms, or of autograd under them,
    other than `level` (the `grad` whose backward runs now, which differentiates nothing again)."""
    while is_functorch_wrapped(tensor):
        if tensor.requires_grad and functorch_level(tensor) != level:
            return True
        tensor = unwrap_level(tensor)
    return tensor.requires_grad


def _pure_vjp(
    programs: Programs,
    kept: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    needs_grad: Sequence[bool],
) -> list[torch.Tensor | None]:
    """The gradients of the inputs for the cotangents of the Function's outputs and kept values, by
    differentiating the pure forward with grad mode on: each op's gradient formula as eager runs it
    where its result will be differentiated, and differentiable in turn.

    Under a torch.func transform, by `torch.func.vjp`, a level of its own: where a transform's level has
    ended before its pullback runs backward (`jacrev` of `jacrev`), `torch.autograd.grad` here would
    differentiate at the level outside it, which never saw the recomputation. Under plain autograd, by
    `torch.autograd.grad` (`torch.func` refuses old-style Functions, which the pure forward may apply
    again). Inputs not differentiated here stay connected to whatever differentiates them below
    (`.backward()` of a `torch.func.grad`)."""
    result: list[torch.Tensor | None] = [None] * len(needs_grad)
    pure = programs.pure_with_outputs
    assert pure is not None
    chosen = [(i, primal) for i, primal in programs.pure_inputs if needs_grad[primal]]
    if not chosen:
        return result
    positions = [i for i, _ in chosen]
    # A pullback whose level has ended: its tensors are unwrapped from that level, as `Function.apply` takes
    # them (NOTE [custom Functions applied again]), and as `torch.func.vjp` below must.
    kept = unwrap_dead_wrappers(kept)
    values = [
        value if isinstance(k.where, KeptInput) and requires_grad_at_any_level(value) else value.detach()
        for value, k in zip(kept, programs.kept, strict=False)  # (`kept` may have the anchor of `_saved` after)
    ]
    differentiated = [
        k for k, (value, g) in enumerate(zip(pure.targets, grads, strict=False)) if g is not None and _is_float(value)
    ]
    if not differentiated:
        return result

    def recompute(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        arguments = list(values)
        for position, value in zip(positions, inputs, strict=True):
            arguments[position] = value
        with autocast_disabled():
            outputs = pure.forward(*arguments)
        return tuple(outputs[k] for k in differentiated)

    if functorch_active():
        recomputed, pullback = torch.func.vjp(recompute, *(kept[i] for i in positions))[:2]
        computed = pullback(_cotangents(grads, differentiated, recomputed))
    else:  # (plain autograd: an old-style Function, with a `ctx` forward, is applied again there too)
        inputs = [kept[i] if kept[i].requires_grad else kept[i].detach().requires_grad_() for i in positions]
        with torch.enable_grad():
            recomputed = recompute(*inputs)
        cotangents = _cotangents(grads, differentiated, recomputed)
        pairs = [(v, g) for v, g in zip(recomputed, cotangents, strict=True) if v.requires_grad]
        computed = (None,) * len(inputs)
        if pairs:
            outputs, cotangents = zip(*pairs, strict=True)
            computed = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True, create_graph=True)
        # (a gradient of an input only this level differentiated: nothing below differentiates it again)
        computed = tuple(
            g if g is None or kept[i].requires_grad else g.detach() for i, g in zip(positions, computed, strict=True)
        )
    # A backward traced for `.backward()` lays gradients out as its fused kernels do, not as the grad-mode
    # formulas eager runs here do (autograd's over the pure forward are those).
    joint = pure.joint
    traced = dict(zip(joint.grad_of, joint.grads, strict=True)) if joint.backward_in_grad_mode else {}
    for (i, primal), grad in zip(chosen, computed, strict=True):
        if grad is None and primal in joint.grad_of:  # zeros where eager's formulas give them (a `copy_` over
            grad = torch.zeros_like(kept[i]).detach()  # the input), which autograd over the program does not
        result[primal] = grad if grad is None or primal not in traced else _in_traced_layout(grad, traced[primal])
    return result


def _in_traced_layout(grad: torch.Tensor, traced: Any) -> torch.Tensor:
    """`grad` laid out as the traced backward lays out that gradient (eager's layout): autograd's formulas
    over the pure forward may lay it out otherwise. (Not where the trace's sizes are symbols, nor under
    `vmap`, whose batched gradients are laid out as the batching rules give them.)"""
    value = traced.meta.get("val")
    if not isinstance(value, torch.Tensor) or vmap_levels(grad):
        return grad
    stride = value.stride()
    if tuple(grad.stride()) == tuple(stride) or not all(isinstance(n, int) for n in (*value.shape, *stride)):
        return grad
    if tuple(grad.shape) != tuple(value.shape) or not is_dense(value.shape, stride):
        return grad
    return grad.new_empty_strided(grad.shape, stride).copy_(grad)


def _cotangents(
    grads: Sequence[torch.Tensor | None], differentiated: Sequence[int], recomputed: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """The cotangents of the recomputed values (that of an offloaded value is in host memory, as the
    value was)."""
    return tuple(grads[k].to(v.device) for k, v in zip(differentiated, recomputed, strict=True))  # type: ignore[union-attr]


def _is_float(node: Any) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _differentiable(
    kept: Sequence[torch.Tensor], positions: Sequence[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The kept tensors to run the pure forward on, and those of them at `positions` to
    differentiate with respect to.

    Every other kept value is a constant to the pure forward (and an output of this
    Function: autograd must not be led back here), so it is detached. An input that does
    not require grad here (under a torch.func transform, the level below it) is
    differentiated locally, through a fresh leaf.
    """
    values = [value.detach() for value in kept]
    with inplace_requires_grad_allowed():
        for i in positions:
            values[i] = kept[i] if kept[i].requires_grad else kept[i].detach().requires_grad_()
    return values, [values[i] for i in positions]


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


# NOTE [tangents in their outputs' layouts]
# Under torch.autograd.forward_ad, autograd gives an output of the Function
# the tangent its jvp rule returns only where both have one layout (strides,
# offset, and the size of their storage); otherwise it copies the tangent into
# the output's strides, which fails an internal assert for an output that is a
# view (and would fail for one whose elements share memory, which the Function
# never returns: NOTE [outputs whose elements may share memory]). Eager's ops
# give their tangents their outputs' layouts; the pure forward's outputs need
# not have the forward program's, so the rule lays each tangent out as its
# output is. (Under torch.func, autograd sees wrappers, and the tangents of
# torch.func.jvp already have the layouts.)
@dataclasses.dataclass(frozen=True)
class _Layout:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage_size: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Layout:
        storage_size = tensor.untyped_storage().nbytes() // tensor.element_size()
        return cls(tuple(tensor.shape), tensor.stride(), int(tensor.storage_offset()), storage_size)

    def laid_out(self, tangent: torch.Tensor) -> torch.Tensor:
        """`tangent` in this layout. Where elements share memory they agree (it is the tangent of such an
        output), so writing each into its one place in the storage keeps its value."""
        if _Layout.of(tangent) == self:
            return tangent
        positions = torch.full((), self.offset, dtype=torch.long, device=tangent.device)
        for size, stride in zip(self.shape, self.stride, strict=True):
            positions = positions.unsqueeze(-1) + torch.arange(size, device=tangent.device) * stride
        storage = tangent.new_zeros(self.storage_size).index_put((positions.reshape(-1),), tangent.reshape(-1))
        return storage.as_strided(self.shape, self.stride, self.offset)


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
    needs_grad = ctx.needs_input_grad[1:]
    for skip, sources in zip(programs.non_differentiable, programs.output_sources, strict=True):
        yield skip or (per_level and not any(needs_grad[i] for i in sources))


def _as_seen_by_autograd(ctx: Any, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors autograd knows as `outputs` (or inputs). Under `vmap`, `setup_context` sees
    batched views of the Function's real inputs and outputs, which `mark_non_differentiable`
    and `mark_dirty` (identity checks) would miss; unwrap them to the tensors autograd has."""
    if isinstance(ctx, CtxCustomSave):
        return list(unwrap_batched(tuple(outputs), batched_level(ctx))[0])
    return outputs


def forward_mode_active() -> bool:
    """Whether forward-mode AD (`torch.func.jvp`, `jacfwd`, `torch.autograd.forward_ad`) is running."""
    if forward_ad_level() >= 0:
        return True
    return functorch_active() and _func_jvp_active()


def _func_jvp_active() -> bool:
    """Whether a `torch.func.jvp` (or `jacfwd`, `hessian`) is running."""
    return any(interpreter.key() == TransformType.Jvp for interpreter in functorch_interpreters())


# NOTE [forward mode over forward mode]
# Under two levels of torch.func's forward mode (`jvp` of `jvp`, `jacfwd` of
# `jacfwd`, and `grad` of those), torch does not differentiate the tangents an
# autograd.Function's jvp rule returns at the outer level: every derivative
# through the rule comes out zero, for any Function (pytorch/pytorch#197867).
# Forward mode keeps nothing for a backward, so there is nothing to leave out:
# the checkpointed function runs as it is written, and its derivatives are
# eager's (a reverse-mode level inside, as in `jvp(grad(jvp(f)))`, keeps what
# eager keeps).
def nested_forward_mode() -> bool:
    """Whether two or more levels of torch.func's forward mode are running. See NOTE [forward mode over
    forward mode]."""
    if not functorch_active():  # (the common case, without listing the interpreters)
        return False
    return sum(interpreter.key() == TransformType.Jvp for interpreter in functorch_interpreters()) > 1


def vmap_active() -> bool:
    """Whether a `torch.func.vmap` is running."""
    return any(interpreter.key() == TransformType.Vmap for interpreter in functorch_interpreters())


# Ops of the functional graph that torch.func.vmap has no batching rule for, and that remat does not
# differentiate exactly under torch.autograd.forward_ad (differentiating their derivative again, as it
# does there, gives zero tangents outside the written elements; torch.func.jvp is exact): op -> what
# the user wrote.
_UNSUPPORTED_UNDER_TRANSFORMS = {
    torch.ops.aten.as_strided_scatter.default: "a write through `as_strided` (or an `unfold` with gaps)"
}


def unsupported_under(transform: str, nodes: Iterable[Any], works_under: str | None = None) -> str | None:
    """Why programs with these graph nodes cannot run under `transform`, if so."""
    for node in nodes:
        written = _UNSUPPORTED_UNDER_TRANSFORMS.get(node.target)
        if written is not None:
            instead = f"use {works_under}, where this works, " if works_under is not None else ""
            return (
                f"remat.checkpoint: under {transform}, the function makes {written}, whose functional form "
                f"(`{node.target}`) remat cannot run there yet. Call the checkpointed function outside it, "
                f"{instead}or write through a view such as a slice or an `unfold` whose windows cover their "
                "dimension."
            )
    return None


def _check_transforms_support(ops: Iterable[HigherOrderOperator]) -> None:
    """Raise if a torch.func transform now active has no rule for one of the higher-order `ops` (torch's own
    error is a bare KeyError naming the transform)."""
    for interpreter in functorch_interpreters():
        for op in sorted(ops, key=lambda op: op.name()):
            if interpreter.key() not in op.functorch_table:
                transform = str(interpreter.key()).rsplit(".", 1)[-1].lower()
                raise NotImplementedError(
                    f"remat.checkpoint: the function calls `{op.name()}`, a higher-order op that torch.func's "
                    f"{transform} transform does not support on this torch (eager PyTorch fails under it too). "
                    "Call the checkpointed function outside torch.func, and take gradients with "
                    "`loss.backward()` or `torch.autograd.grad`."
                )


def _accumulate(into: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    for i, grad in enumerate(grads):
        if grad is not None:
            current = into[i]
            into[i] = grad if current is None else current + grad


_apply_without_binding = apply_without_binding(_CheckpointFunction)
