"""Choose what the programs run for a traced node: its op, or the kernel eager ran where the op traced
computes otherwise.

`F.rrelu` traces to a functional op whose derivative, forward-mode formula and CPU layout differ from
those of the in-place kernel eager runs: the programs run `rrelu_as_eager` in its place (NOTE [rrelu runs
as eager's]). `runnable` picks for any node: its op, rrelu as eager's, or a random fill in eager's layout
(`_random_fills`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _quirks
from ._facts import fill_of

__all__ = [
    "RRELU",
    "rrelu_as_eager",
    "run_rrelu_as_eager",
    "runnable",
]

aten = torch.ops.aten


def runnable(node: Any) -> Callable[..., Any]:
    """What the programs call for a traced node: its op, or how eager ran it."""
    if node.target in RRELU:
        return rrelu_as_eager  # type: ignore[return-value]  # (a callable NamedTuple)
    return fill_of(node) or node.target  # type: ignore[no-any-return]


# NOTE [rrelu runs as eager's]
# `F.rrelu` traces to the functional `rrelu_with_noise`, which differs from the
# in-place one eager runs (`_quirks.RRELU_FUNCTIONAL_DERIVATIVE`): its
# derivative reads the `noise` it is given (uninitialized) instead of the noise
# it draws, it has no forward-mode formula, and on the CPU it lays its output
# out as the input, where eager's is contiguous (a dropout after it then draws
# its mask in another order). remat's programs run it on a detached input for
# the noise, and compute the output as eager's kernel does, from ops autograd
# and forward-mode AD differentiate as eager's formulas do: in training, the
# input times the noise drawn (exactly the kernel's product); otherwise a leaky
# ReLU with the mean slope.
RRELU = _quirks.RRELU_FUNCTIONAL_DERIVATIVE.table
(_FUNCTIONAL_RRELU,) = RRELU


class _RreluOfNoise(torch.autograd.Function):
    """`x` times the `noise` rrelu drew for it (exactly the kernel's output), differentiated by eager's
    formulas for the in-place `rrelu_with_noise` in training."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, noise: torch.Tensor, lower: float, upper: float) -> torch.Tensor:  # type: ignore[override]
        return x * noise

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, noise, ctx.lower, ctx.upper = inputs
        ctx.save_for_backward(x, noise)
        ctx.save_for_forward(noise)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        x, noise = ctx.saved_tensors
        return (
            aten.rrelu_with_noise_backward.default(grad, x, noise, ctx.lower, ctx.upper, True, False),
            None,
            None,
            None,
        )

    @staticmethod
    def jvp(ctx: Any, x_tangent: torch.Tensor | None, *_: Any) -> torch.Tensor | None:
        (noise,) = ctx.saved_tensors
        return None if x_tangent is None else x_tangent * noise


class _RreluAsEager(NamedTuple):
    """The functional `rrelu_with_noise`, as eager's in-place one computes it: see NOTE [rrelu runs as
    eager's]. (A NamedTuple, so that a program's code can name it where it is an argument.)"""

    def __call__(
        self,
        x: torch.Tensor,
        noise: torch.Tensor,
        lower: float = 0.125,
        upper: float = 1.0 / 3.0,
        training: bool = False,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, drawn = _FUNCTIONAL_RRELU(x.detach(), noise, lower, upper, training, generator=generator)
        if training:
            output = _RreluOfNoise.apply(x, drawn, lower, upper)
        else:
            output = aten.leaky_relu.default(x, (float(lower) + float(upper)) / 2)
        if output.device.type == "cpu":
            output = output.contiguous()
        return output, drawn


rrelu_as_eager = _RreluAsEager()


def run_rrelu_as_eager(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`rrelu_as_eager` as a program's call (a target needs a plain function)."""
    return rrelu_as_eager(*args, **kwargs)
