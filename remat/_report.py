"""`remat.Report`: what a policy keeps and replays, call by call."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._core._calls import Call, Decision, Trace, _module_label, format_bytes, format_seconds, format_table
from ._storing._storage import HOST
from .costs import Device, resolve_device

__all__ = ["Peak", "Report", "ReportRow"]


@dataclasses.dataclass(frozen=True)
class Peak:
    """Predicted bytes at the peaks of a checkpointed function's forward and backward.

    Bytes above the inputs (arguments, parameters, closed-over tensors) and the
    gradients handed to backward, with the function's outputs held by the caller
    until backward ends (as `torch.autograd.backward(out, grad)` holds them).
    Predicted from the liveness of remat's programs: each value lives until its
    last use, kept values until their last use in backward.

    Attributes:
        forward: the most bytes live while the forward runs.
        after_forward: bytes live once it returns: its outputs, what it keeps, generator states.
        backward: the most bytes live while the backward runs, the outputs (which
            the caller holds) and the gradients it has computed so far included.
    """

    forward: int
    after_forward: int
    backward: int

    @property
    def bytes(self) -> int:
        """The peak of forward and backward together."""
        return max(self.forward, self.backward)


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One call of a report: its decision and what that decision costs.

    Attributes:
        call: the call.
        decision: what the policy decided.
        saved: whether some output of the call is kept for backward.
        replayed: whether backward runs the call again.
        rng_state_kept: whether the generator state it started from is kept, to replay it.
        saved_bytes: bytes of its kept outputs (distinct storages) as kept: on the device
            (as bits, where `storage` is `"bits"`) or, when `offloaded`, in host memory.
        read_by: who reads the kept outputs in backward: `"backward"` (the gradient
            formulas) and/or `"replay"` (calls replayed from them). Empty when only
            a second derivative would read them.
        offloaded: whether its kept outputs are kept in host memory (the call is
            OFFLOADed; the function's own outputs stay on the device, where the caller
            holds them).
        storage: where its kept outputs live until backward: `"device"` as they are,
            `"host"` (offloaded), `"bits"` (packed), `"float16"`, `"bfloat16"` or `"fp8"`
            (compressed, approximately); empty where nothing is kept.
        error: for compressed outputs, the largest absolute difference between a kept value and
            what backward reads of it, on the report's arguments (None: not compressed, or the
            arguments are not real tensors).
    """

    call: Call
    decision: Decision
    saved: bool
    replayed: bool
    rng_state_kept: bool = False
    saved_bytes: int = 0
    read_by: frozenset[str] = frozenset()
    offloaded: bool = False
    storage: str = ""
    error: float | None = None

    @property
    def replay_flops(self) -> int:
        """FLOPs backward spends replaying this call (0 unless replayed)."""
        return self.call.flops if self.replayed else 0

    @property
    def saves_nothing(self) -> bool:
        """Whether the policy said SAVE (or OFFLOAD) but nothing of the call is kept: backward
        reads none of its outputs, so the decision buys nothing."""
        return self.decision.keeps and not self.saved

    def to_dict(self) -> dict[str, Any]:
        """The row as plain data (strings and numbers)."""
        call = self.call
        return {
            "index": call.index,
            "op": call.name,
            "decision": self.decision.name,
            "saved": self.saved,
            "saved_bytes": self.saved_bytes,
            "offloaded": self.offloaded,
            "storage": self.storage,
            "error": self.error,
            "read_by": sorted(self.read_by),
            "replayed": self.replayed,
            "replay_flops": self.replay_flops,
            "rng_state_kept": self.rng_state_kept,
            "saves_nothing": self.saves_nothing,
            "outputs": [str(meta) for meta in call.outputs],
            "output_bytes": call.nbytes,
            "flops": call.flops,
            "tags": sorted(call.tags),
            "module": call.module,
            "scope": call.scope,
            "source": call.source,
        }


@dataclasses.dataclass(frozen=True)
class Report:
    """What `remat.checkpoint` keeps between forward and backward under one policy.

    Attributes:
        saved_bytes: bytes kept on the device from forward to backward: activations
            (distinct storages; inputs and closed-over tensors excluded, since keeping
            a reference to them costs nothing) and generator states.
        rng_state_bytes: the part of `saved_bytes` that is generator states,
            kept so that random calls whose outputs are not kept can be replayed
            bit-identically (in backward, or to differentiate the forward again).
        recompute_flops: estimated FLOPs of the calls replayed in backward.
        replayed_calls: indices of the calls replayed in backward.
        rows: one `ReportRow` per call of the trace.
        trace: the traced calls.
        policy: the policy reported on.
        nested_policies: the policies of checkpointed functions called inside (such as modules
            wrapped by `remat.checkpoint_modules`), which decide the calls they make.
        peak: the predicted peak bytes of forward and backward, by phase (`remat.Peak`);
            `peak_bytes` is the larger of the two.
        value_checks: what the trace assumes of tensor values the function read in Python
            (`if t > 0:`), each checked as forward runs; a call for which one fails runs
            another trace. Empty for a function that reads none.
        offloaded_bytes: bytes kept in host memory from forward to backward (the kept
            values of OFFLOAD calls): copied to the host in forward and back in backward,
            so also the bytes copied each way. `copy_seconds` predicts the time.

    `str(report)` is a table in the spirit of JAX's `print_saved_residuals`;
    `report.to_dict()` gives the same as data.

    >>> import torch, remat
    >>> r = remat.report(lambda x: x.sin().sin().sum(), torch.ones(4, requires_grad=True))
    >>> r.saved_bytes, r.replayed_calls  # save_nothing: backward replays the first sin
    (0, (0,))
    >>> [row.decision for row in r.rows]
    [remat.RECOMPUTE, remat.RECOMPUTE, remat.RECOMPUTE]
    """

    saved_bytes: int
    rng_state_bytes: int
    recompute_flops: int
    replayed_calls: tuple[int, ...]
    rows: tuple[ReportRow, ...]
    trace: Trace
    policy: Any = None
    nested_policies: tuple[Any, ...] = ()  # policies of nested checkpoints, which decide their own calls
    peak: Peak = Peak(0, 0, 0)
    value_checks: tuple[str, ...] = ()
    offloaded_bytes: int = 0

    def copy_seconds(self, device: str | Device = "h100") -> float:
        """Predicted seconds of the copies one way (to the host in forward, or back in backward),
        at `device`'s host bandwidth (`remat.costs.Device.host_bandwidth`): the time the copies
        take on their own stream, hidden if the compute around them takes longer."""
        return HOST.move_seconds(resolve_device(device), self.offloaded_bytes)

    @property
    def peak_bytes(self) -> int:
        """The predicted peak bytes of forward and backward together (see `Peak`)."""
        return self.peak.bytes

    @property
    def forward_flops(self) -> int:
        """Estimated FLOPs of one forward: every call once."""
        return sum(call.flops for call in self.trace)

    @property
    def replayed_fraction(self) -> float:
        """`recompute_flops` as a fraction of `forward_flops` (0 for a trace without FLOPs)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    @property
    def saves_nothing(self) -> tuple[int, ...]:
        """Indices of the calls the policy saves to no effect: backward reads none of their outputs."""
        return tuple(row.call.index for row in self.rows if row.saves_nothing)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (strings, numbers, lists and dicts), ready for `json.dumps`."""
        return {
            "policy": repr(self.policy),
            "nested_policies": [repr(p) for p in self.nested_policies],
            "saved_bytes": self.saved_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "peak_bytes": self.peak_bytes,
            "peak": dataclasses.asdict(self.peak),
            "rng_state_bytes": self.rng_state_bytes,
            "recompute_flops": self.recompute_flops,
            "forward_flops": self.forward_flops,
            "replayed_fraction": self.replayed_fraction,
            "replayed_calls": list(self.replayed_calls),
            "saves_nothing": list(self.saves_nothing),
            "value_checks": list(self.value_checks),
            "rows": [row.to_dict() for row in self.rows],
        }

    def __str__(self) -> str:
        header = ("#", "op", "decision", "kept", "read by", "replayed", "outputs", "module", "scope", "source")
        body = [
            (
                str(row.call.index),
                row.call.name,
                row.decision.name + (" (unused)" if row.saves_nothing else ""),
                (format_bytes(row.saved_bytes) + _storage_label(row))
                if row.saved
                else "rng state"
                if row.rng_state_kept
                else "",
                ", ".join(sorted(row.read_by)),
                f"{row.call.flops:,} FLOPs" if row.replayed else "",
                ", ".join(map(str, row.call.outputs)),
                _module_label(row.call.module),
                row.call.scope or "",
                row.call.source or "",
            )
            for row in self.rows
        ]
        rng = f" (of which {format_bytes(self.rng_state_bytes)} generator states)" if self.rng_state_bytes else ""
        lines = [
            format_table(header, body),
            f"policy: {self.policy!r}"
            + (
                f"; nested checkpoints decide their own calls with {', '.join(map(repr, self.nested_policies))}"
                if self.nested_policies
                else ""
            ),
            f"kept: {format_bytes(self.saved_bytes)}{rng} from {sum(r.saved and not r.offloaded for r in self.rows)} "
            "calls"
            + (
                f"; in host memory: {format_bytes(self.offloaded_bytes)} from {sum(r.offloaded for r in self.rows)} "
                f"calls, copied there in forward and back in backward ({format_seconds(self.copy_seconds())} each "
                "way over an h100's host link)"
                if self.offloaded_bytes
                else ""
            ),
            f"peak: {format_bytes(self.peak_bytes)} (forward {format_bytes(self.peak.forward)}, "
            f"after forward {format_bytes(self.peak.after_forward)}, backward {format_bytes(self.peak.backward)})",
            f"replayed in backward: {len(self.replayed_calls)} calls, {self.recompute_flops:,} FLOPs "
            f"({self.replayed_fraction:.0%} of the forward's {self.forward_flops:,})",
        ]
        if self.value_checks:
            lines.append(
                f"traced for the values it read in Python: {len(self.value_checks)} checks as forward runs "
                "(another call's values trace again)"
            )
        if self.saves_nothing:
            lines.append(
                f"unused: the policy saves calls {', '.join(map(str, self.saves_nothing))}, but backward reads "
                "none of their outputs; saving them keeps nothing"
            )
        return "\n".join(lines)


def _storage_label(row: ReportRow) -> str:
    if row.storage in ("", "device"):
        return ""
    return f" ({row.storage}{'' if row.error is None else f', error {row.error:.3g}'})"
