"""The traced graph's views rewritten to run as eager ran them: on tensors of any strides, slices that end
at the size, and each base returned for a view put where the view's chain of views starts (NOTE [outputs
whose elements may share memory], in `_discovery`, which chooses the bases).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .._eager._nodes import is_free
from ._discovery import Discovery
from ._errors import TraceError

__all__ = ["end_slices_at_the_size", "put_bases_on_their_views", "use_reshape_for_view"]

aten = torch.ops.aten


# NOTE [views are traced as reshapes]
# `aten.view` is chosen by the tracer from the fake tensors' strides; at run
# time the same graph can meet tensors with other strides (an incoming
# gradient that is an expanded scalar, a batched tensor under vmap), where
# `view` fails. `reshape` is a view whenever `view` would succeed, and copies
# otherwise, so it is always safe.
def use_reshape_for_view(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default


# NOTE [slices end at the size]
# `t[:, ::2]` traces as `slice(t, 1, 0, 9223372036854775807, 2)`, and an in-place
# update of it as a `slice_scatter` with the same end, which functorch's batching
# rule for `slice_scatter` refuses ("invalid size, possible overflow?") under
# `vmap`. An end past the size means the size: the graph says so.
_SLICE_DIMENSION = {aten.slice.Tensor: 1, aten.slice_scatter.default: 2}


def end_slices_at_the_size(graph: fx.Graph) -> None:
    for node in graph.nodes:
        position = _SLICE_DIMENSION.get(node.target)  # type: ignore[arg-type]
        if position is None or len(node.args) <= position + 2:
            continue
        base = node.args[0].meta.get("val")  # type: ignore[union-attr]
        dim, end = node.args[position], node.args[position + 2]
        if isinstance(base, torch.Tensor) and isinstance(dim, int) and isinstance(end, int):
            size = base.shape[dim]
            if isinstance(size, int) and end > size:
                node.args = (*node.args[: position + 2], size, *node.args[position + 3 :])


def put_bases_on_their_views(
    output_node: fx.Node, returned: list[Any], discovery: Discovery, inputs: set[fx.Node]
) -> tuple[int, ...]:
    """Make each base returned for a view the node its view's chain of views starts from, which the
    epilogue takes the view from again (in place, in `returned` and the graph's output); the outputs
    rebuilt from them. The tensor autograd calls the view's base may have been traced as another node of
    the same value (a second `detach` of one tensor), and a view of a detach of an input (a new tensor to
    autograd) is a view of the input's memory, which the epilogue rebuilds from the input (`inputs`:
    the primals and the final values of those `fn` updates; its base stays an output nothing reads)."""
    first_base = len(discovery.output_fakes) + len(discovery.dirty)
    rebuilt = []
    for output, position in discovery.rebuilt.items():
        base = returned[first_base + position]
        chain = [returned[output]]
        while (
            chain[-1] is not base and chain[-1] not in inputs and chain[-1].op == "call_function" and is_free(chain[-1])
        ):
            chain.append(chain[-1].args[0])
        if chain[-1] in inputs:
            continue  # a view of an input: rebuilt from it, as any
        rebuilt.append(output)
        if chain[-1] is base:
            continue
        same = [n for n in chain if _same_view(n, base)]
        if not same:
            raise TraceError(
                f"remat.checkpoint: output {output} of fn is a view whose elements share memory, and remat "
                "could not find the tensor it views among the views it was taken through; please report this."
            )
        returned[first_base + position] = same[0]
        output_node.args = (returned,)
    return tuple(rebuilt)


def _same_view(a: fx.Node, b: fx.Node) -> bool:
    """Whether `a` and `b` are the same chain of views (`detach`es, say) of one node."""
    while a is not b:
        if not (a.op == b.op == "call_function" and is_free(a) and (a.target, a.kwargs) == (b.target, b.kwargs)):
            return False
        if len(a.args) != len(b.args) or a.args[1:] != b.args[1:]:
            return False
        a, b = a.args[0], b.args[0]  # type: ignore[assignment]
    return True
