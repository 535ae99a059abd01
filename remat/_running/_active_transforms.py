"""Which torch.func transforms and forward-mode AD are running, and what programs cannot run under them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._torch import HigherOrderOperator, TransformType, forward_ad_level, functorch_active, functorch_interpreters

__all__ = [
    "check_transforms_support",
    "forward_mode_active",
    "func_jvp_active",
    "nested_forward_mode",
    "unsupported_under",
    "vmap_active",
]


def forward_mode_active() -> bool:
    """Whether forward-mode AD (`torch.func.jvp`, `jacfwd`, `torch.autograd.forward_ad`) is running."""
    if forward_ad_level() >= 0:
        return True
    return functorch_active() and func_jvp_active()


def func_jvp_active() -> bool:
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


def check_transforms_support(ops: Iterable[HigherOrderOperator]) -> None:
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
