"""Checkpoints nested in a traced function: whether a trace is running on this thread, and the graph
nodes each nested checkpoint creates, recorded with its policy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import fx

from .._torch import get_proxy_mode

__all__ = ["is_tracing", "nested_checkpoint", "nested_regions"]


# NOTE [nested checkpoints]
# A checkpointed function called while another one is being traced does not
# trace itself: it runs inline, so its calls become part of the outer graph,
# and the calls it made are remembered with its policy. The outer partition
# then takes their decisions from that policy (asked about them as a trace of
# their own, indexed from 0), and the outer policy decides the rest, as
# `jax.checkpoint` inside `jax.checkpoint` does.
class _Regions(threading.local):
    recorded: list[tuple[Any, frozenset[fx.Node]]] | None = None


nested_regions = _Regions()


def is_tracing() -> bool:
    """Whether a remat trace is running `fn` on this thread right now."""
    return nested_regions.recorded is not None


@contextmanager
def nested_checkpoint(policy: Any) -> Iterator[None]:
    """Run a nested checkpointed function inline, noting the graph nodes it creates."""
    proxy_mode = get_proxy_mode()
    if proxy_mode is None or nested_regions.recorded is None:  # the discovery pass records no graph
        yield
        return
    graph = proxy_mode.tracer.graph
    before = next(iter(reversed(graph.nodes)))
    yield
    # The nodes made since, noted now: make_fx may yet remove some (sizes it no longer needs).
    created, node = [], before.next
    while node.op != "root":
        created.append(node)
        node = node.next
    nested_regions.recorded.append((policy, frozenset(created)))
