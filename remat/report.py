"""`remat.Report`: what a policy keeps and replays, call by call."""

from __future__ import annotations

import dataclasses

from ._calls import Call, Decision, Trace, _module_label, format_bytes, format_table

__all__ = ["Report", "ReportRow"]


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One call of a report: its decision and what that decision costs."""

    call: Call
    decision: Decision
    saved: bool  # whether some output of the call is kept for backward
    replayed: bool  # whether backward runs the call again
    rng_state_kept: bool = False  # whether the generator state it started from is kept, to replay it


@dataclasses.dataclass(frozen=True)
class Report:
    """What `remat.checkpoint` keeps between forward and backward under one policy.

    Attributes:
        saved_bytes: bytes kept from forward to backward: activations (distinct
            storages; inputs and closed-over tensors excluded, since keeping a
            reference to them costs nothing) and generator states.
        rng_state_bytes: the part of `saved_bytes` that is generator states,
            kept so that random calls whose outputs are not kept can be replayed
            bit-identically (in backward, or to differentiate the forward again).
        recompute_flops: estimated FLOPs of the calls replayed in backward.
        replayed_calls: indices of the calls replayed in backward.
        rows: one `ReportRow` per call of the trace.
        trace: the traced calls.

    `str(report)` is a table in the spirit of JAX's `print_saved_residuals`.
    """

    saved_bytes: int
    rng_state_bytes: int
    recompute_flops: int
    replayed_calls: tuple[int, ...]
    rows: tuple[ReportRow, ...]
    trace: Trace

    def __str__(self) -> str:
        header = ("#", "op", "decision", "kept", "replayed", "outputs", "bytes", "module", "scope", "source")
        body = [
            (
                str(row.call.index),
                row.call.name,
                row.decision.name,
                "yes" if row.saved else "rng state" if row.rng_state_kept else "",
                "yes" if row.replayed else "",
                ", ".join(map(str, row.call.outputs)),
                format_bytes(row.call.nbytes),
                _module_label(row.call.module),
                row.call.scope or "",
                row.call.source or "",
            )
            for row in self.rows
        ]
        rng = f" (of which {format_bytes(self.rng_state_bytes)} generator states)" if self.rng_state_bytes else ""
        summary = (
            f"kept: {format_bytes(self.saved_bytes)}{rng} from {sum(r.saved for r in self.rows)} calls; "
            f"replayed in backward: {len(self.replayed_calls)} calls, {self.recompute_flops:,} FLOPs"
        )
        return f"{format_table(header, body)}\n{summary}"
