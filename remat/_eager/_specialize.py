"""Traces specialized on the tensor values Python reads, and the checks that keep them honest.

See NOTE [values Python reads].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .. import _quirks

__all__ = [
    "CHECKS",
    "FloatRead",
    "UncheckedValue",
    "ValuesChanged",
    "check_coverage",
    "refuse_float_reads",
    "check_value",
    "checks_of",
    "describe",
    "use_remat_checks",
]

aten = torch.ops.aten


# NOTE [values Python reads]
# Code that reads a tensor's value in Python (`if t == k:`, `for i in t.nonzero():`, `.item()`)
# takes one path for one value. The fake tensors of a trace have no values, so such a read first
# fails; remat then traces again with the real inputs carried beside the fake ones (every op
# runs on both, on copies of the data, with every generator it drew from put back afterwards:
# the default ones, and the user's `torch.Generator`s, each as before its first draw), and each
# read takes its real value. The trace is then right for the inputs whose reads give the same
# answers: each answer becomes a check in the forward program, right where the value is
# computed. A run whose check fails stops there, before it has updated anything (updates of
# inputs come last); the random streams are put back (the user's generators the graph draws
# from too: `JointGraph.generators`), and the call runs again with another
# trace of the same signature whose checks pass, or a new one. Sizes that depend on data
# (`nonzero`) stay symbolic unless Python reads them: a mixture-of-experts layer that loops over
# the experts its router picked is traced once per set of picked experts, not once per routing.
# The checks that hold in backward are those of forward; a trace whose backward would read a
# value of its own is refused.
class ValuesChanged(Exception):
    """A tensor value Python read while tracing differs in this call: the trace does not apply."""


class FloatRead(Exception):
    """Python read a float value of a tensor: a trace for that value would hold for no other."""

    def __init__(self, source: str | None):
        super().__init__(source)
        self.source = source


class UncheckedValue(Exception):
    """The trace depends on values Python read that no check of the forward program covers."""


def check_value(condition: bool, message: str) -> None:
    """The forward program's check of one value a trace specialized on."""
    if not condition:
        raise ValuesChanged(message)


# Graph nodes that check a value rather than compute one: never a call a policy decides about.
CHECKS = frozenset(
    {
        check_value,
        aten._assert_scalar.default,
        aten.sym_constrain_range_for_size.default,
        aten.sym_constrain_range.default,
    }
)


def use_remat_checks(graph: fx.Graph) -> None:
    """Make the runtime assertions of a specialized trace raise `ValuesChanged`."""
    for node in graph.nodes:
        if node.target is aten._assert_scalar.default:
            node.target = check_value


def checks_of(graph: fx.Graph) -> list[fx.Node]:
    """The check nodes of `graph`."""
    return [node for node in graph.nodes if node.op == "call_function" and node.target in CHECKS]


def refuse_float_reads(floats: dict[str, str | None]) -> None:
    """Refuse a trace specialized on a float value (`floats`: symbol -> the line that read it): nearly
    every call would fail its check and trace again (and torch does not check floats)."""
    if floats:
        raise FloatRead(next(iter(floats.values())))


def check_coverage(graph: fx.Graph, ints: set[str]) -> None:
    """Refuse a trace specialized on an int value that no check of `graph` is about."""
    symbol_names = _quirks.UNBACKED_SYMBOL_NAMES.table
    checked = {symbol for check in checks_of(graph) for symbol in symbol_names.findall(str(describe(check)))}
    if ints - checked:
        raise UncheckedValue(sorted(ints - checked))


def describe(check: fx.Node) -> Any:
    """What a check asserts, as torch wrote it (`Runtime assertion failed for expression Eq(u0, 4) ...`)."""
    return check.args[1] if len(check.args) > 1 else check.target
