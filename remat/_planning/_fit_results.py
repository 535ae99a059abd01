"""What `remat.fit` returns: the plan of each block call (`BlockPlan`), the step report (`StepReport`) and
the whole record (`Fit`)."""

from __future__ import annotations

import dataclasses

from .._core._calls import Decision, format_bytes

__all__ = ["BlockPlan", "Fit", "StepReport"]


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """What `remat.fit` chose for one checkpointed block at one input signature.

    Attributes:
        name: the block's qualified name in the model.
        label: the candidate plan it took (a built-in policy, or a budget).
        decisions: one per call of the block's trace.
        kept_bytes: bytes it keeps for its backward beyond what saving nothing keeps (its inputs and
            generator states), predicted.
        replay_cost: what its backward replays, in `fit`'s cost model (FLOPs, or estimated seconds), with
            the copy time to and from host memory that compute does not hide (with `offload=True`).
        host_bytes: bytes it keeps in host memory (offloaded) from its forward to its backward.
    """

    name: str
    label: str
    decisions: tuple[Decision, ...]
    kept_bytes: int
    replay_cost: float
    host_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class StepReport:
    """A training step's memory, predicted for `remat.fit`'s plan (bytes above what was live before).

    Attributes:
        parameters: bytes of the model's parameters (live before the step; not in the peak).
        gradients: bytes of the parameter gradients the step leaves in `.grad`.
        optimizer_state: bytes of optimizer state its step allocates (on a first step, all of it; 0
            without `optimizer=`).
        kept: per block, the bytes it keeps from its forward to its backward under the plan, beyond what
            saving nothing keeps.
        peak: the step's predicted peak.
        where: where the peak happens (in a block call's forward or backward, or outside the blocks), with
            the op that reached it in the probe step.
        peak_keeping_everything: the predicted peak with every block saving everything.
        peak_keeping_nothing: the predicted peak with every block saving nothing.
        activations: bytes of activations at the peak, at least: the peak less all the step's gradients.
        measured_peak: the probe step's measured peak (its blocks saving nothing).
        unsharded: of the peak, the bytes of parameters FSDP2 holds gathered, in their own storages and in
            all-gather buffers not yet freed (the running block's, the next one's where prefetched by then,
            the root's), as measured in the probe step at the peak; 0 without FSDP2.
        prefetched: of `unsharded`, the bytes of blocks other than the one whose forward or backward holds
            the peak (gathered ahead of it); 0 where the peak lies outside the blocks.
        unreduced_gradients: of the peak, the bytes of full-size gradients of gathered parameters, before
            FSDP2 reduce-scatters them into `gradients`' shards; 0 without FSDP2. See NOTE [what FSDP2 adds].
    """

    parameters: int
    gradients: int
    optimizer_state: int
    kept: dict[str, int]
    peak: int
    where: str
    peak_keeping_everything: int
    peak_keeping_nothing: int
    activations: int
    measured_peak: int
    unsharded: int = 0
    prefetched: int = 0
    unreduced_gradients: int = 0

    def __str__(self) -> str:
        share = self.activations / self.peak if self.peak else 0.0
        lines = [
            f"step peak {format_bytes(self.peak)} (predicted), {self.where}: activations are {share:.0%} of it; "
            f"keeping everything it would be {format_bytes(self.peak_keeping_everything)}, keeping nothing "
            f"{format_bytes(self.peak_keeping_nothing)}",
            f"  parameters  {format_bytes(self.parameters):>12}  (live before the step)",
            f"  gradients   {format_bytes(self.gradients):>12}",
            f"  optimizer   {format_bytes(self.optimizer_state):>12}  (state its step allocates)",
            f"  kept        {format_bytes(sum(self.kept.values())):>12}  by {len(self.kept)} blocks",
        ]
        if self.unsharded:
            prefetched = f"; {format_bytes(self.prefetched)} prefetched" if self.prefetched else ""
            lines[3:3] = [
                f"  unreduced   {format_bytes(self.unreduced_gradients):>12}  (full-size gradients before "
                "their reduce-scatter)",
                f"  unsharded   {format_bytes(self.unsharded):>12}  (FSDP2's gathered parameters at the peak"
                f"{prefetched})",
            ]
        for name, kept in self.kept.items():
            lines.append(f"    {name:<24}  {format_bytes(kept):>12}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Fit:
    """What `remat.fit` planned: the target, the predicted peak, each block's plan and the step report.

    Attributes:
        peak_bytes: the target.
        predicted_peak: the step's predicted peak under the plan (at most `peak_bytes`).
        blocks: one `BlockPlan` per checkpointed block call, in the order they ran.
        replay_cost: the sum of the blocks' replay costs.
        report: the `StepReport`.
        seconds: how long planning took (the probe step included).
    """

    peak_bytes: int
    predicted_peak: int
    blocks: tuple[BlockPlan, ...]
    replay_cost: float
    report: StepReport
    seconds: float

    def __str__(self) -> str:
        rows = [f"remat.fit: predicted peak {format_bytes(self.predicted_peak)} of {format_bytes(self.peak_bytes)}"]
        for block in self.blocks:
            host = f"  (host {format_bytes(block.host_bytes)})" if block.host_bytes else ""
            replays = f"{block.replay_cost:,.0f}" if block.replay_cost >= 1 else f"{block.replay_cost:.3g}"
            rows.append(
                f"  {block.name:<24} keeps {format_bytes(block.kept_bytes):>10}{host}  replays {replays}  {block.label}"
            )
        return "\n".join([*rows, str(self.report)])
