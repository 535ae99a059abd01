"""The probe step's timeline (`remat._memory._step`): what it counts at each segment's peak."""

from __future__ import annotations

import torch
from torch import nn

from remat._memory import _step


def _buffer(recorder: _step._Recorder, nbytes: int) -> torch.Tensor:
    """An all-gather's output buffer of `nbytes`, copied out at once (as FSDP2 does in a block's pre-hook)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    recorder.all_gathered([buffer])
    recorder.copied_out(buffer, [])
    return buffer


def test_a_buffer_freed_at_its_copy_out_counts_until_its_blocks_forward_ends() -> None:
    # The backend's thread may hold an all-gather's buffer after FSDP2 lets go of it (NOTE [what FSDP2 adds]):
    # the block's forward counts it on top of what the probe step had live, the segment after does not.
    block = nn.Linear(1, 1)
    with _step.recording() as recorder:
        buffer = _buffer(recorder, 1000)
        del buffer  # FSDP2 lets go at once; this step's thread did too
        index = recorder.forward_started("0", block)
        activation = torch.empty(5000, dtype=torch.uint8)
        del activation
        recorder.forward_ended(index)
        after = torch.empty(3000, dtype=torch.uint8)
    timeline = _step.timeline_of(recorder, 0)
    outside, forward, last = timeline.segments
    assert (outside.peak, forward.peak, last.peak) == (1000, 6000, 3000)
    assert forward.resized == 1000  # the buffer, held late
    assert timeline.peak == 5000  # what the probe step measured
    del after


def test_a_buffer_fsdp2_holds_past_its_block_is_counted_where_it_was_live() -> None:
    # In the forward FSDP2 keeps a block's buffer until the next block's copy-out: freed after its block, it
    # was live wherever the probe step saw it, and nothing is added.
    block = nn.Linear(1, 1)
    with _step.recording() as recorder:
        buffer = _buffer(recorder, 1000)
        index = recorder.forward_started("0", block)
        activation = torch.empty(5000, dtype=torch.uint8)
        del activation
        recorder.forward_ended(index)
        del buffer
        later = torch.empty(3000, dtype=torch.uint8)
        del later
    outside, forward, last = _step.timeline_of(recorder, 0).segments
    assert (outside.peak, forward.peak, last.peak) == (1000, 6000, 3000)
    assert forward.resized == 1000  # live at the peak, as measured


def test_a_buffer_held_late_adds_at_the_moment_it_could_be_live() -> None:
    # Freed before a segment's own peak, a buffer held late adds where it can reach, not to the peak itself:
    # here to a smaller allocation after its free, still within its block's forward.
    block = nn.Linear(1, 1)
    with _step.recording() as recorder:
        index = recorder.forward_started("0", block)
        big = torch.empty(5000, dtype=torch.uint8)
        del big
        buffer = _buffer(recorder, 1000)
        del buffer
        small = torch.empty(4500, dtype=torch.uint8)
        del small
        recorder.forward_ended(index)
    _, forward, _ = _step.timeline_of(recorder, 0).segments
    assert forward.peak == 5500  # 4500 live with the buffer held late, above the 5000 measured
