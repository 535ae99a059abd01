"""The clean-up of the graph `make_fx` traced: the copies of dirty inputs removed, views rewritten to run
as eager ran them, arguments backward does not read dropped, dead code removed, remat's checks kept.
"""

from __future__ import annotations

from torch import fx

from .. import _quirks
from .._eager._capture import redirect_histories
from .._eager._error_checks import kept_as_dead_code
from .._eager._specialize import check_coverage, use_remat_checks
from ._view_fixups import end_slices_at_the_size, use_reshape_for_view

__all__ = ["clean_up"]


def clean_up(graph: fx.Graph, copies: list[fx.Node], guarded_ints: set[str]) -> None:
    """Remove the copies of dirty inputs, rewrite views to run as eager ran them, drop dead code."""
    originals = {copy: copy.args[0] for copy in copies}
    for copy, original in originals.items():
        copy.replace_all_uses_with(original)  # type: ignore[arg-type]
        graph.erase_node(copy)
    redirect_histories(graph, originals)  # type: ignore[arg-type]
    use_reshape_for_view(graph)
    end_slices_at_the_size(graph)
    _drop_unread_batch_norm_arguments(graph)
    graph.eliminate_dead_code(is_impure_node=kept_as_dead_code)
    use_remat_checks(graph)  # after removing dead code: FX knows torch's assertions, not remat's, to be live
    check_coverage(graph, guarded_ints)


def _drop_unread_batch_norm_arguments(graph: fx.Graph) -> None:
    """A training-mode batch norm's backward takes the running statistics but does not read
    them (it uses the batch statistics): pass None, so that backward does not keep them."""
    unread_by = _quirks.BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS.table["backward"]
    for node in graph.nodes:
        unread = unread_by.get(node.target)
        if unread is not None and (unread[0] is None or node.args[unread[0]] is True):
            node.args = tuple(None if i in unread[1] else a for i, a in enumerate(node.args))
