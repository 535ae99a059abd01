"""What a node of the traced joint graph is, asked by every stage: a call a policy decides about, or
free (a view or alias that names its base's memory); a call that draws random numbers; a value `fn`
computed where autograd does not see.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from .._torch import op_schema
from ._facts import stop_gradient_of
from ._specialize import CHECKS

__all__ = ["draws_random_numbers", "is_call", "is_free", "is_free_op", "stops_gradient"]

aten = torch.ops.aten

# Ops whose output is a view of (or a fresh alias of) their first argument:
# keeping one costs nothing beyond its base, so they are not offered to a
# policy and follow their base. See NOTE [free ops follow their base].
_ALIASING_OPS = frozenset({aten._unsafe_view.default, aten.reshape.default, aten.alias.default})


def stops_gradient(node: fx.Node, *, forward_mode: bool = False) -> bool:
    """Whether `fn` computed `node` where autograd does not see: through a `detach()`, or under
    `no_grad`, which forward-mode AD sees through (as it does in eager). `capture_mode` notes
    which (`_facts.stop_gradient_of`): "detach", "no_grad" or "no_grad_update"."""
    why = stop_gradient_of(node)
    return why == "detach" if forward_mode else why is not None


# NOTE [free ops follow their base]
# A view (or alias, or getitem of a multi-output call) shares memory with its
# base, so keeping it costs nothing more than keeping the base, and replaying it
# costs nothing. Such nodes are not calls of the Trace; a policy decides about
# the call that produced their base.
def is_free(node: fx.Node) -> bool:
    """Whether `node` only names (part of) the memory of another node."""
    if node.op == "get_attr":
        return True
    return node.op == "call_function" and is_free_op(node.target)


def is_free_op(target: Any) -> bool:
    """Whether calls of `target` only name (part of) the memory of their first argument."""
    return target is operator.getitem or target in _ALIASING_OPS or bool(getattr(target, "is_view", False))


def is_call(node: fx.Node) -> bool:
    """Whether `node` is an op call a policy decides about (not a view, nor a number such as a
    data-dependent size, which is computed again wherever backward needs it)."""
    return node.op == "call_function" and not is_free(node) and not _is_number(node) and node.target not in CHECKS


def _is_number(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether the call really draws from an RNG: attention with `dropout_p=0` does not."""
    op = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    for position, argument in enumerate(op_schema(op).arguments):
        if argument.name == "dropout_p":
            if position < len(node.args):
                probability = node.args[position]
            else:
                probability = node.kwargs.get(argument.name, argument.default_value)
            return bool(probability != 0)
    return True
