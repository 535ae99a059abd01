"""The Function's forward-mode rule: its outputs' tangents, by forward mode over the pure forward.

Under torch.func's `jvp`, outside a `vmap` the rule is called in, or at
`torch.autograd.forward_ad`'s level; each tangent laid out as its output is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._core._cache import requires_grad_at_any_level
from .._core._contexts import autocast_disabled
from .._partitioning._partition import Programs
from .._torch import batched_at, forward_grad_enabled, functorch_interpreters, make_dual, tangent_of, unbatched_at
from ._active_transforms import func_jvp_active

__all__ = ["Layout", "pure_jvp"]


def pure_jvp(
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
    if func_jvp_active():  # torch.func.jvp nests: forward mode of our own
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
class Layout:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage_size: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Layout:
        storage_size = tensor.untyped_storage().nbytes() // tensor.element_size()
        return cls(tuple(tensor.shape), tensor.stride(), int(tensor.storage_offset()), storage_size)

    def laid_out(self, tangent: torch.Tensor) -> torch.Tensor:
        """`tangent` in this layout. Where elements share memory they agree (it is the tangent of such an
        output), so writing each into its one place in the storage keeps its value."""
        if Layout.of(tangent) == self:
            return tangent
        positions = torch.full((), self.offset, dtype=torch.long, device=tangent.device)
        for size, stride in zip(self.shape, self.stride, strict=True):
            positions = positions.unsqueeze(-1) + torch.arange(size, device=tangent.device) * stride
        storage = tangent.new_zeros(self.storage_size).index_put((positions.reshape(-1),), tangent.reshape(-1))
        return storage.as_strided(self.shape, self.stride, self.offset)
