"""The bytes CUDA's caching allocator counts for a tensor: what `torch.cuda.max_memory_allocated` adds up.

The allocator does not hand out the bytes a tensor asks for. It rounds each request up (to 512 bytes, or
to a fraction of a power of two where `roundup_power2_divisions` is set), and it counts the whole block it
hands out: a large request carved from a new segment leaves the rest of the segment to the request where
the rest is too small to split off. remat's byte counts of CUDA tensors are these, so that a plan for a
GPU is judged by what the GPU's counter will say. See NOTE [what the CUDA allocator counts].
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

__all__ = ["AllocatorSettings", "allocated_nbytes", "block_nbytes", "settings_from_environment"]

_MIN_BLOCK = 512  # every request rounds up to a multiple of this
_SMALL = 2**20  # requests up to this come from 2 MiB segments of their own pool
_MIN_LARGE_ALLOC = 10 * 2**20  # requests from this up get a segment of their own size, rounded to 2 MiB
_ROUND_LARGE = 2 * 2**20
_INTERVALS = 16  # roundup_power2_divisions: one setting per power of two from 1 MiB to 32 GiB and up


# NOTE [what the CUDA allocator counts]
# `torch.cuda.memory_allocated` adds up the blocks handed out, and a block is the request
# rounded: up to 512 bytes, a multiple of 512 bytes, or, with `roundup_power2_divisions:N` in
# `PYTORCH_ALLOC_CONF` (`PYTORCH_CUDA_ALLOC_CONF` before), the next of N equal steps between two
# powers of two. Requests up to 1 MiB are packed into 2 MiB segments, and those from 1 MiB to
# 10 MiB into 20 MiB ones, always split: the block is the rounded request. A request of 10 MiB
# or more gets a segment of its own, rounded up to 2 MiB, and the rest is split off only if it is
# more than 1 MiB (and the request below `max_split_size_mb`; with `expandable_segments` it is
# always split): otherwise the block is the whole segment. A block taken from the cache is
# carved the same way from a freed one, which in a training loop is the segment the same request
# got before, so the rule holds there too. Not modelled: blocks cached bigger than a request asks
# (a request that finds only a larger free block, below `max_split_size_mb`, takes it whole when
# the rest is 1 MiB or less), and settings changed after the process started.


@dataclasses.dataclass(frozen=True)
class AllocatorSettings:
    """The settings of `PYTORCH_ALLOC_CONF` that change what a block counts."""

    divisions: tuple[int, ...] = (0,) * _INTERVALS  # roundup_power2_divisions per power of two from 1 MiB
    max_split_bytes: int | None = None  # max_split_size_mb
    expandable_segments: bool = False

    @classmethod
    def parse(cls, text: str) -> AllocatorSettings:
        """The settings in an allocator configuration string (`"expandable_segments:True,..."`)."""
        divisions, max_split, expandable = [0] * _INTERVALS, None, False
        for key, value in _options(text):
            if key == "roundup_power2_divisions":
                divisions = _divisions(value)
            elif key == "max_split_size_mb":
                max_split = int(value) * 2**20
            elif key == "expandable_segments":
                expandable = value == "True"
        return cls(tuple(divisions), max_split, expandable)


def _options(text: str) -> list[tuple[str, str]]:
    """`key:value` pairs separated by commas, where a value may be a bracketed list holding commas."""
    options, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            key, _, value = text[start:i].strip().partition(":")
            if key:
                options.append((key.strip(), value.strip()))
            start = i + 1
    return options


def _divisions(value: str) -> list[int]:
    """One number of divisions per interval: `4` for all, or `[256:1,512:2,>:4]` by size in MiB."""
    if not value.startswith("["):
        return [int(value)] * _INTERVALS
    divisions = [0] * _INTERVALS
    first, last = True, 0
    for item in value.strip("[]").split(","):
        size, _, count = item.partition(":")
        if size.strip() == ">":
            divisions[last + 1 :] = [int(count)] * (_INTERVALS - last - 1)
            continue
        index = min(int(size).bit_length() - 1, _INTERVALS - 1)
        if first:
            divisions[:index] = [int(count)] * index
            first = False
        divisions[index] = int(count)
        last = index
    return divisions


@functools.cache
def settings_from_environment() -> AllocatorSettings:
    """The settings the allocator read when the process started."""
    text = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    return AllocatorSettings.parse(text)


def _rounded(nbytes: int, settings: AllocatorSettings) -> int:
    if nbytes < _MIN_BLOCK:
        return _MIN_BLOCK
    index = min(max(nbytes.bit_length() - 1 - 20, 0), _INTERVALS - 1)  # the interval from 1 MiB up
    divisions = settings.divisions[index]
    if divisions > 1 and nbytes > _MIN_BLOCK * divisions and nbytes & (nbytes - 1):
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        below = nbytes & ~(step - 1)
        return nbytes if below == nbytes else below + step
    return -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK


def block_nbytes(nbytes: int, settings: AllocatorSettings) -> int:
    """The bytes of the block the allocator hands out for a request of `nbytes`, as its counters count
    them. See NOTE [what the CUDA allocator counts]."""
    if nbytes == 0:
        return 0  # (no block at all)
    size = _rounded(nbytes, settings)
    if size < _MIN_LARGE_ALLOC or settings.expandable_segments:
        return size
    segment = -(-size // _ROUND_LARGE) * _ROUND_LARGE
    splits = segment - size > _SMALL and (settings.max_split_bytes is None or size < settings.max_split_bytes)
    return size if splits else segment


def allocated_nbytes(nbytes: int, device: torch.device) -> int:
    """The bytes a storage of `nbytes` takes on `device` by its allocator's count: CUDA's caching
    allocator rounds it (NOTE [what the CUDA allocator counts]); elsewhere, `nbytes`."""
    if device.type != "cuda":
        return nbytes
    return block_nbytes(nbytes, settings_from_environment())
