"""Run in-place random fills in eager's memory layout.

The numbers an in-place random fill draws depend on the memory layout of the tensor it fills, and
functionalization traces the fill as an out-of-place op that fills a fresh tensor of its own layout (see
NOTE [random fills draw in eager's layout]). This module holds how eager ran a fill
(`FillInEagerLayout`, noted on its node while tracing), running it so in the programs
(`fill_in_eager_layout`, differentiated as autograd differentiates the fill: NOTE [a fill's derivative]),
the in-place random ops that are fills (`RANDOM_FILLS`), and the mode that tells when a dropout
function is filling (`InsideDropout`, NOTE [dropout under torch.func]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._torch import drawn_per_example_but_unbatched, empty_in_memory_layout, memory_layout, under_torch_func
from ._strides import is_dense

__all__ = [
    "FillInEagerLayout",
    "InsideDropout",
    "RANDOM_FILLS",
    "fill_in_eager_layout",
    "with_a_fills_derivative",
]

aten = torch.ops.aten


# NOTE [random fills draw in eager's layout]
# `t.bernoulli_(p)`, `t.normal_()` and the fill inside CPU dropout write
# random numbers into `t` in its memory order, and some kernels take another
# path (and draw another count) when `t` is not contiguous. Functionalization
# traces them as their out-of-place forms (`bernoulli.p`, `normal_functional`),
# which fill a fresh tensor of their own layout: other numbers, and the
# stream left elsewhere, whenever `t` is transposed, permuted or strided. So
# the trace notes the strides `t` had (a FunctionalTensor keeps eager's view
# metadata), and the programs run such a call as the in-place op itself on a
# fresh tensor of those strides (`FillInEagerLayout`). Under `vmap` the fresh
# tensor is made from the batched input, so the batching rule of the in-place
# op fills the whole batch as eager's does, in the memory order eager's
# batched tensor has: its batch dimension need not lead (an embedding's
# output keeps it in the middle), so the fresh tensor takes the layout of the
# value it replaces, batch dimension included, and is made at each torch.func
# level that value is at (a tangent's replay adds a gradient level of its
# own, which lets a fill write only into a tensor of its level). The traced
# call's value is given those strides too (the tracing fake mode's
# `fill_strides`): what reads the filled tensor (a view, attention choosing
# its kernel) is traced for the layout it will have, not for the contiguous
# one of `bernoulli.p`.
class FillInEagerLayout(NamedTuple):
    """How eager ran an in-place random fill: its op and the strides of the tensor it filled.

    Plain data (the op by name), so that FX programs can carry it as an argument; calling it
    runs the fill (`fill_in_eager_layout`).
    """

    op: str  # the in-place op, e.g. "aten::bernoulli_.float"
    strides: tuple[int, ...] | None  # None: the filled tensor's own, whose sizes depend on values
    dense: bool  # whether those strides cover their storage exactly (a strided slice does not)
    of_fns_tensor: bool  # whether it filled a tensor of `fn`'s (not one a dropout function made for its mask)

    def __call__(self, like: torch.Tensor, /, *args: Any, **kwargs: Any) -> torch.Tensor:
        return fill_in_eager_layout(self, like, *args, **kwargs)


def fill_in_eager_layout(fill: FillInEagerLayout, like: torch.Tensor, /, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Run the in-place random fill `fill.op` on a fresh tensor shaped like `like` with eager's strides."""
    if fill.strides is None:  # (sizes that depend on values: the strides are the tensor's own, as traced)
        fill = fill._replace(strides=tuple(like.stride()), dense=is_dense(like.shape, like.stride()))
    assert fill.strides is not None
    out = _empty_as_batched(fill, like, fill.strides) if under_torch_func(like) else None
    if out is None:
        out = like.new_empty_strided(like.shape, fill.strides)
    if fill.op == _BERNOULLI_FILL and drawn_per_example_but_unbatched(out):
        # (a dropout of a tensor the vmap does not batch: eager draws the batch's masks out of place)
        out = aten.bernoulli.p(out, *args, **kwargs)
    else:
        _op_named(fill.op)(out, *args, **kwargs)
        # A non-dense layout (a strided view in eager) is only written back into its base:
        # hand on a compact copy, the size the trace accounted for.
        out = out if fill.dense else out.contiguous()
    return with_a_fills_derivative(out, like)


def with_a_fills_derivative(value: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """`value`, a random fill of `filled`, with autograd's zero derivative with respect to `filled` where it is
    differentiated: NOTE [a fill's derivative]."""
    if torch.is_grad_enabled() and filled.requires_grad:
        return _ZeroDerivative.apply(value, filled)  # type: ignore[no-any-return]
    return value


# NOTE [a fill's derivative]
# Autograd gives an in-place random fill a derivative of zero with respect to
# the tensor filled (its draws do not depend on its values), so eager's gradients
# stay connected, through zeros, to that tensor's history: a gradient taken with
# `create_graph=True` requires grad, and its derivative is zeros, not None. The
# fill on a fresh tensor, where it is differentiated, is connected so too, and
# so is a fill's kept value that a recomputed forward reads as it is.
class _ZeroDerivative(torch.autograd.Function):
    """`value`, with a derivative of zero with respect to `filled`: NOTE [a fill's derivative]."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return value.view_as(value)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        return None, torch.zeros_like(grad)

    @staticmethod
    def jvp(ctx: Any, value_tangent: Any, filled_tangent: Any) -> Any:
        return value_tangent


_BERNOULLI_FILL = "aten::bernoulli_.float"


def _empty_as_batched(fill: FillInEagerLayout, like: torch.Tensor, strides: Sequence[int]) -> torch.Tensor | None:
    """The tensor to fill under vmap, laid out as eager's batched tensor, if `like` shows that layout.

    Eager fills `fn`'s tensor with its whole batch in its memory order, and the batch dimension may
    lie anywhere in memory (after an embedding, in the middle): `like`, the value the fill replaces,
    is laid out as that tensor. (A dropout function's mask under vmap is contiguous: NOTE [dropout
    under torch.func])"""
    if not fill.of_fns_tensor or not _ordered_as(like, strides):
        return None
    if not fill.dense:
        return empty_in_memory_layout(like)  # a strided view of it: its strides, gaps and all
    return torch.empty_like(like) if is_dense(*memory_layout(like)[1:]) else None


def _ordered_as(tensor: torch.Tensor, strides: Sequence[int]) -> bool:
    """Whether `tensor` orders its dimensions in memory as `strides` do."""
    sizes = tensor.shape

    def order(of: Sequence[Any]) -> list[int]:
        return sorted((d for d in range(len(sizes)) if sizes[d] != 1), key=lambda d: -of[d])

    return order(tensor.stride()) == order(strides)


def _op_named(name: str) -> Any:
    namespace, _, rest = name.partition("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


# In-place random ops that only write their `self` (`rrelu_with_noise_` reads it, so it is not one).
RANDOM_FILLS = frozenset(
    {
        aten.bernoulli_, aten.normal_, aten.uniform_, aten.exponential_, aten.geometric_, aten.cauchy_,
        aten.log_normal_, aten.random_,
    }
)  # fmt: skip


# NOTE [dropout under torch.func]
# Eager dropout fills `empty_like(input)` in place, in the input's layout; but
# on a tensor wrapped by a torch.func transform (`grad`, `vmap`), torch's
# dropout functions draw their mask out of place, into a contiguous tensor.
# The two draw the same numbers when the input is contiguous, and then one
# trace serves calls with and without transforms. When it is not, a function
# traced to run under a transform keeps the functional form of the fills made
# inside a dropout function, and its trace serves only calls under a transform
# (and the other trace only calls without): `JointGraph.under_functorch`.
_DROPOUTS = frozenset(
    {
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
        torch.dropout, torch.dropout_, torch.feature_dropout, torch.feature_dropout_, torch.alpha_dropout,
        torch.alpha_dropout_, torch.feature_alpha_dropout, torch.feature_alpha_dropout_,
    }
)  # fmt: skip


class InsideDropout(TorchFunctionMode):
    """Notes, for `EagerFidelity`, when a dropout function is running."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        inside = func in _DROPOUTS
        self.depth += inside
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= inside
