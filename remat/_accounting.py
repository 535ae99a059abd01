"""Accounting: what a set of saved calls keeps and replays, as `remat.report`, the planners and the log read it.

It follows the partitioner's rules on the trace's `Dataflow` (see `_partition`): backward reads
some values; a value of a saved call (or an input) is kept, one of another call is recomputed by
replaying that call, which reads its own inputs in turn. Keeping a value with a derivative also
keeps what differentiating it again needs (the generator states and overwritten inputs behind it).
The tests check these figures against the programs `partition` builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from ._calls import Dataflow, Decision, Trace, Value

__all__ = ["Accounting", "KeptOutputs", "account", "offloaded_calls", "saved_calls"]


@dataclasses.dataclass(frozen=True)
class KeptOutputs:
    """What is kept of one saved call's outputs, where, and what reads it."""

    nbytes: int
    read_by: frozenset[str]  # "backward" (the gradient formulas) and/or "replay" (replayed calls)
    offloaded_nbytes: int = 0  # of `nbytes`, those kept in host memory

    @property
    def offloaded(self) -> bool:
        """Whether the call's kept outputs are in host memory."""
        return self.offloaded_nbytes > 0


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


def account(trace: Trace, saved: Collection[int], offloaded: Collection[int] = ()) -> Accounting:
    """What saving exactly the calls `saved` of `trace` (and recomputing the others) keeps and replays.

    The kept values of the calls in `offloaded` (some of `saved`) are kept in host memory, except
    the function's outputs, which the caller holds on the device anyway.
    """
    dataflow = trace.dataflow
    if dataflow is None:
        raise ValueError("remat: this trace has no dataflow (it was made of hand-picked calls); trace a function")
    kept, replayed = _kept_and_replayed(dataflow, saved)
    recomputed, copies = _recomputed_to_differentiate(dataflow, kept)
    states = sorted(c for c in replayed | recomputed if dataflow.rng_state_nbytes[c])
    rng_state_bytes = sum(dataflow.rng_state_nbytes[c] for c in states)
    replay_reads = frozenset().union(*(dataflow.reads[c] for c in replayed))
    by_call: dict[int, set[Value]] = {}
    for value in kept:
        if value[0] >= 0:
            by_call.setdefault(value[0], set()).add(value)
    on_host = {v for v in kept if v[0] in offloaded and v not in dataflow.returned}
    kept_by_call = {
        call: KeptOutputs(
            sum(dataflow.nbytes.get(v, 0) for v in values),
            frozenset(
                reader
                for reader, reads in (("backward", dataflow.backward_reads), ("replay", replay_reads))
                if any(v in reads for v in values)
            ),
            offloaded_nbytes=sum(dataflow.nbytes.get(v, 0) for v in values & on_host),
        )
        for call, values in sorted(by_call.items())
    }
    return Accounting(
        kept_by_call=kept_by_call,
        replayed_calls=tuple(sorted(replayed)),
        rng_state_calls=tuple(states),
        saved_bytes=sum(dataflow.nbytes.get(v, 0) for v in (kept | copies) - on_host) + rng_state_bytes,
        rng_state_bytes=rng_state_bytes,
        recompute_flops=sum(trace[c].flops for c in replayed),
        offloaded_bytes=sum(dataflow.nbytes.get(v, 0) for v in on_host),
    )


def saved_calls(decisions: Sequence[Decision]) -> set[int]:
    """The calls `decisions` keep (SAVE or OFFLOAD)."""
    return {i for i, decision in enumerate(decisions) if decision.keeps}


def offloaded_calls(decisions: Sequence[Decision]) -> set[int]:
    """The calls `decisions` offload."""
    return {i for i, decision in enumerate(decisions) if decision is Decision.OFFLOAD}


def _kept_and_replayed(dataflow: Dataflow, saved: Collection[int]) -> tuple[set[Value], set[int]]:
    """The values backward reads without replaying (inputs are negative calls), and the calls it replays."""
    replayed: set[int] = set()
    kept: set[Value] = set()
    stack = list(dataflow.backward_reads)
    while stack:
        value = stack.pop()
        call = value[0]
        if call < 0 or call in saved:
            kept.add(value)
        elif call not in replayed:
            replayed.add(call)
            stack.extend(dataflow.reads[call])
    return kept, replayed


def _recomputed_to_differentiate(dataflow: Dataflow, kept: set[Value]) -> tuple[set[int], set[Value]]:
    """The calls the pure forward recomputes to differentiate the kept values again (see `partition`),
    and the copies of overwritten inputs kept: those backward reads, and those the recomputation reads."""
    recomputed: set[int] = set()
    copies = {v for v in kept if v[0] < 0}
    stack = [v for v in kept if v[0] >= 0 and v in dataflow.varying and v not in dataflow.returned]
    while stack:
        value = stack.pop()
        call = value[0]
        if call < 0:
            copies.add(value)
        elif call not in recomputed:
            recomputed.add(call)
            stack.extend(v for v in dataflow.reads[call] if v not in kept or v in dataflow.varying or v[0] < 0)
    return recomputed, copies
