"""The Function's gradients by reverse mode over the pure forward, for derivatives of a higher order.

Used where the backward's gradients will be differentiated again, and where a
second derivative reaches the kept values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._core._cache import requires_grad_at_any_level
from .._core._contexts import autocast_disabled
from .._eager._strides import is_dense
from .._partitioning._partition import KeptInput, Programs
from .._torch import (
    TransformType,
    functorch_active,
    functorch_interpreters,
    functorch_level,
    inplace_requires_grad_allowed,
    is_functorch_wrapped,
    unwrap_dead_wrappers,
    unwrap_level,
    vmap_levels,
)

__all__ = ["activations_vjp", "differentiated_again", "pure_vjp"]


def activations_vjp(
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


def differentiated_again(
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


def pure_vjp(
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
        for value, k in zip(kept, programs.kept, strict=False)  # (`kept` may have `_execute._saved`'s anchor after)
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
