"""The joint graph's calls described for policies: each call node as a `Call` of the `Trace`."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from .._core._calls import Call, TensorMeta, Trace
from .._eager._facts import site_of, tags_of
from .._eager._nodes import draws_random_numbers
from .._memory._measure import estimate_flops, output_nbytes
from .._torch import OpOverload, op_schema

__all__ = ["describe_all"]


def describe_all(call_nodes: Sequence[fx.Node]) -> Trace:
    occurrences: collections.Counter[Any] = collections.Counter()
    calls = []
    for index, node in enumerate(call_nodes):
        calls.append(_describe(index, node, occurrences[node.target]))
        occurrences[node.target] += 1
    return Trace(calls)


def _describe(index: int, node: fx.Node, occurrence: int) -> Call:
    def meta(value: Any) -> Any:
        if isinstance(value, fx.Node):
            val = value.meta.get("val")
            return TensorMeta.of(val) if isinstance(val, torch.Tensor) else val
        return value

    args = fx.node.map_aggregate(node.args, meta)
    kwargs = fx.node.map_aggregate(node.kwargs, meta)
    out = node.meta.get("val")
    fake_args = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    fake_kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    site = site_of(node)
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    return Call(
        index=index,
        op=node.target,
        occurrence=occurrence,
        inputs=tuple(args),
        kwargs=tuple(kwargs.items()),
        outputs=tuple(TensorMeta.of(o) for o in outputs if isinstance(o, torch.Tensor)),
        tags=tags_of(node),
        module=site.module,
        source=site.source,
        scope=_custom_op_name(node.target) or site.scope,
        flops=estimate_flops(node.target, tuple(fake_args), dict(fake_kwargs), out),
        nbytes=output_nbytes(out),
        is_random=draws_random_numbers(node),
    )


def _custom_op_name(op: Any) -> str | None:
    """`mylib::attention` for a custom op (one that is not from aten or prims)."""
    if isinstance(op, OpOverload) and op.namespace not in ("aten", "prims"):
        return op_schema(op).name  # type: ignore[no-any-return]
    return None
