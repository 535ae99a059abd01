"""Accounting: what a set of saved calls keeps and replays, as `remat.report`, the planners and the log read it.

It counts what the rules (`_rules`) resolve for the decisions, which is what `partition` builds its
programs from: the values kept, the copies of inputs, the generator states, the calls replayed.
The tests check these figures against the programs themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .._core._calls import Decision, Trace, Value
from .._storing._storage import DEVICE, Storage, storage_of
from ._rules import rules_of
from ._value_graph import ValueGraph

__all__ = ["Accounting", "KeptOutputs", "account", "account_for", "saved_calls", "stored_calls"]


@dataclasses.dataclass(frozen=True)
class KeptOutputs:
    """What is kept of one saved call's outputs, where, and what reads it."""

    nbytes: int  # as kept: on the device (in their stored form there), or in host memory
    read_by: frozenset[str]  # "backward" (the gradient formulas) and/or "replay" (replayed calls)
    storage: Storage = DEVICE  # where its decision keeps them (NOTE [kinds of storage])
    stored_nbytes: int = 0  # the bytes of those values in `storage` (the function's outputs stay on the device)

    @property
    def offloaded(self) -> bool:
        """Whether the call's kept outputs are in host memory."""
        return self.stored_nbytes > 0 and not self.storage.on_device


@dataclasses.dataclass(frozen=True)
class Accounting:
    """The bytes kept from forward to backward and the calls replayed in backward."""

    kept_by_call: Mapping[int, KeptOutputs]  # for each saved call whose outputs are kept
    replayed_calls: tuple[int, ...]
    rng_state_calls: tuple[int, ...]  # random calls whose generator state is kept
    saved_bytes: int  # on the device: activations, copies of overwritten inputs and generator states
    rng_state_bytes: int
    recompute_flops: int  # of the replayed calls
    offloaded_bytes: int = 0  # activations kept in host memory (copied there and back once each)

    @property
    def saved_calls(self) -> tuple[int, ...]:
        """The calls whose outputs are kept."""
        return tuple(sorted(self.kept_by_call))


def recomputation_reads(graph: ValueGraph, recomputed: Collection[int]) -> set[Value]:
    """The kept values that recomputing `recomputed` to differentiate again reads as they were kept: those of
    calls it does not recompute as well."""
    return {v for c in recomputed for v in graph.reads[c] if v[0] not in recomputed}


def account(trace: Trace, saved: Collection[int], stored: Mapping[int, Storage] | None = None) -> Accounting:
    """What saving exactly the calls `saved` of `trace` (and recomputing the others) keeps and replays.

    The kept values of the calls in `stored` (some of `saved`) are kept in their storage, except the
    function's outputs, which the caller holds on the device anyway; the others' on their device.
    """
    stored = stored or {}
    graph = trace.values
    if graph is None:
        raise ValueError("remat: this trace has no dataflow (it was made of hand-picked calls); trace a function")
    resolved = rules_of(graph, inputs=False).resolve(saved)
    rng_state_bytes = sum(graph.rng_state_nbytes[c] for c in resolved.states)
    replay_reads = {v for c in resolved.replayed for v in graph.reads[c]}
    read_again = replay_reads | recomputation_reads(graph, resolved.recomputed)
    backward_reads = set(graph.backward_reads)
    by_call: dict[int, set[Value]] = {}
    for value in resolved.kept:
        by_call.setdefault(value[0], set()).add(value)
    elsewhere = {
        v: stored[v[0]]
        for v in resolved.kept
        if v[0] in stored and v not in graph.returned and stored[v[0]].can_hold(graph.nodes[v], v in read_again)
    }

    def as_kept(v: Value) -> int:  # its bytes where it is kept: a stored form on the device counts as it is
        storage = elsewhere.get(v)
        if storage is None or not storage.on_device:
            return graph.nbytes[v]
        return storage.device_bytes(graph.nbytes[v], _value(graph, v))

    kept_by_call = {
        call: KeptOutputs(
            sum(as_kept(v) for v in values),
            frozenset(
                reader
                for reader, reads in (("backward", backward_reads), ("replay", replay_reads))
                if any(v in reads for v in values)
            ),
            storage=stored.get(call, DEVICE),
            stored_nbytes=sum(graph.nbytes[v] for v in values if v in elsewhere),
        )
        for call, values in sorted(by_call.items())
    }
    on_device = sum(graph.nbytes[v] for v in (resolved.kept | resolved.copied) if v not in elsewhere)
    return Accounting(
        kept_by_call=kept_by_call,
        replayed_calls=tuple(sorted(resolved.replayed)),
        rng_state_calls=resolved.states,
        saved_bytes=on_device + sum(as_kept(v) for v, s in elsewhere.items() if s.on_device) + rng_state_bytes,
        rng_state_bytes=rng_state_bytes,
        recompute_flops=sum(trace[c].flops for c in resolved.replayed),
        offloaded_bytes=sum(s.host_bytes(graph.nbytes[v]) for v, s in elsewhere.items()),
    )


def _value(graph: ValueGraph, value: Value) -> Any:
    return graph.nodes[value].meta.get("val")


def account_for(trace: Trace, decisions: Sequence[Decision]) -> Accounting:
    """What `decisions` (one per call of `trace`) keep, where, and replay."""
    return account(trace, saved_calls(decisions), stored_calls(decisions))


def saved_calls(decisions: Sequence[Decision]) -> set[int]:
    """The calls `decisions` keep (SAVE or OFFLOAD)."""
    return {i for i, decision in enumerate(decisions) if decision.keeps}


def stored_calls(decisions: Sequence[Decision]) -> dict[int, Storage]:
    """The calls `decisions` keep elsewhere than on their device as they are, with their storage."""
    storages = {i: storage_of(decision) for i, decision in enumerate(decisions)}
    return {i: storage for i, storage in storages.items() if storage is not None and storage is not DEVICE}
