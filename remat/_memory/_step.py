"""One training step, measured: the bytes live along forward, loss and backward, split at the calls of
checkpointed blocks. `remat.fit` plans on it. See NOTE [a step's timeline].
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._torch import TorchDispatchMode
from ._cuda_allocator import allocated_nbytes
from ._measure import storage_key, storage_nbytes, tensors_in

__all__ = [
    "BlockCall",
    "KernelWorkspaces",
    "Phase",
    "Segment",
    "Timeline",
    "kernel_workspaces",
    "recorder",
    "recording",
    "run_step",
    "timeline_of",
]


# NOTE [a step's timeline]
# `remat.fit` runs one probe step (forward, loss, backward) with every block
# checkpointed under one plan, and records the bytes live along it: every
# storage an op allocates counts from its allocation until it is freed, as
# MemTracker counts (the memory live before the step is not counted). The step
# is cut into segments at the start and end of each block call's forward and
# of its backward, and each segment keeps the most bytes live in it. Under
# another plan, a segment's peak moves by what the plans' predictions differ
# by: for a segment inside a block call's forward (or backward), the change of
# that call's predicted forward (backward) peak; for every block call whose
# kept values are live across the segment (its forward done, its backward not
# begun), the change of what it keeps. Outside the blocks nothing changes: the
# embeddings, the head, the loss and the parameter gradients are measured, not
# predicted.


class Phase(enum.Enum):
    """Where a segment of the step lies: in a block call's forward or backward, or outside the blocks."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OUTSIDE = "outside"


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One call of a checkpointed block during the probe step."""

    index: int
    name: str  # the module's qualified name in the model
    module: torch.nn.Module
    trace: Any  # the `remat.Trace` its call ran (set when the call has looked it up)
    regions: Any  # the nested checkpoints of the trace, which decide their own calls


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of the step between two block events: its peak bytes, the op that reached it, which
    block call it lies in (if any) and which block calls' kept values are live across it."""

    phase: Phase
    call: int | None  # the `BlockCall.index` of the block call it lies in, for FORWARD and BACKWARD
    alive: frozenset[int]
    peak: int
    op: str  # the op whose output reached the peak ("" if the peak is where the segment starts)
    # At its peak, under FSDP2 (NOTE [what FSDP2 adds]): the bytes of parameters gathered (storages resized in
    # place, and, once the step is over, all-gather buffers), of which other blocks' (prefetched), and of
    # full-size gradients of gathered parameters.
    resized: int = 0
    prefetched: int = 0
    unreduced: int = 0
    peak_at: int = 0  # when its peak was reached (the recorder's count of allocations then)
    start: int = 0  # when it began and ended, in the same count
    end: int = 0


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The probe step, measured."""

    calls: tuple[BlockCall, ...]
    segments: tuple[Segment, ...]
    peak: int  # the most bytes live at once
    gradients: int  # bytes of the parameter gradients the step left in `.grad`
    end: int  # bytes live at the end (the gradients, the loss, whatever the caller holds)


class _Recorder:
    """What the probe step's block calls report, while it runs (module global `recorder`)."""

    def __init__(self) -> None:
        self.calls: list[BlockCall] = []
        self.segments: list[Segment] = []
        self.live: dict[Any, int] = {}
        self.total = 0
        self.peak = 0
        self.segment_peak = 0
        self.segment_op = ""
        self.resized_keys: set[Any] = set()  # storages resized in place: NOTE [storages resized in place]
        self.resized_live = 0
        self.segment_resized = 0
        self.phase: Phase = Phase.OUTSIDE
        self.in_call: int | None = None  # the block call the current segment lies in
        self.alive: set[int] = set()
        self.applied: set[int] = set()
        self.current: int | None = None  # the block call whose forward runs
        self.workspace = 0  # the most bytes one op's kernel took of its own and freed
        # See NOTE [what FSDP2 adds].
        self.sequence = 0  # allocations, resizes and cuts so far: a moment of the step
        self.highs = [0]  # the most bytes live at each moment
        self.segment_peak_at = 0
        self.segment_start = 0
        self.lives: dict[Any, _Life] = {}  # of each live storage
        self.gathered: list[_Life] = []  # of storages resized from nothing (FSDP2's gathered parameters)
        self.owners: dict[Any, int] = {}  # gathered storage: id of the block module whose parameter it is
        self.gradients: list[_Life] = []  # of full-size gradients of gathered parameters
        self.buffers: list[_Life] = []  # of all-gathers' outputs
        self.copied: dict[_Life, _CopyOut] = {}  # a buffer's life: when and into which storages it was copied out
        self.hooked: dict[int, Any] = {}  # gathered parameters: their post-accumulate-grad hook's handle

    # --- bytes -----------------------------------------------------------------------------------------
    def allocated(self, tensor: torch.Tensor, op: Any) -> None:
        key = storage_key(tensor)
        if key in self.live:
            return
        storage = tensor.untyped_storage()
        nbytes = storage_nbytes(tensor)
        self.live[key] = nbytes
        self.total += nbytes
        self.sequence += 1
        self.lives[key] = _Life(nbytes, self.sequence)
        weakref.finalize(storage, self._freed, key)
        self._reached(self.total, str(op))

    def _reached(self, nbytes: int, op: str) -> None:
        """`nbytes` are live at once now, the last of them made by `op`."""
        self._note_high(nbytes)
        if nbytes > self.segment_peak:
            self.segment_peak, self.segment_op, self.segment_resized = nbytes, op, self.resized_live
            self.segment_peak_at = self.sequence
        self.peak = max(self.peak, nbytes)

    def _note_high(self, nbytes: int) -> None:
        """`nbytes` are live at this moment (each moment starts with `sequence` counted up by one)."""
        if len(self.highs) <= self.sequence:
            self.highs.append(0)
        self.highs[self.sequence] = max(self.highs[self.sequence], nbytes)

    def resized(self, storage: torch.UntypedStorage, op: str) -> None:
        """`storage` was resized in place (FSDP2 frees and remakes unsharded parameters so: NOTE [storages
        resized in place]): its bytes are what it holds now."""
        if storage.device.type == "meta":
            return
        key = StorageWeakRef(storage)
        nbytes = allocated_nbytes(storage.nbytes(), storage.device)
        if key not in self.live:
            if not nbytes:  # memory from before the step (not counted) freed
                return
            weakref.finalize(storage, self._freed, key)
        change = nbytes - self.live.get(key, 0)
        self.total += change
        self.resized_live += change if key in self.resized_keys else nbytes
        self.resized_keys.add(key)
        self.live[key] = nbytes
        self.sequence += 1
        life = self.lives.pop(key, None)
        if life is not None:
            life.end = self.sequence
        if nbytes:
            self.lives[key] = _Life(nbytes, self.sequence, key)
            self.gathered.append(self.lives[key])
        self._reached(self.total, op)

    def took_and_freed(self, nbytes: int, op: Any) -> None:
        """An op's kernel took `nbytes` of its own and freed them (NOTE [kernels' workspaces])."""
        self._reached(self.total + nbytes, f"{op} (its kernel's workspace)")
        self.workspace = max(self.workspace, nbytes)

    def _freed(self, key: Any) -> None:
        nbytes = self.live.pop(key, 0)
        self.total -= nbytes
        if key in self.resized_keys:
            self.resized_live -= nbytes
        life = self.lives.pop(key, None)
        if life is not None:
            life.end = self.sequence

    def all_gathered(self, tensors: Sequence[torch.Tensor]) -> None:
        """An all-gather wrote `tensors` (FSDP2 gathers a block's parameters into one buffer, then copies
        them out into their own storages): NOTE [what FSDP2 adds]."""
        for tensor in tensors:
            life = self.lives.get(storage_key(tensor))
            if life is not None and life not in self.buffers:
                self.buffers.append(life)

    def copied_out(self, buffer: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
        """`buffer`, an all-gather's output, was copied out `into` parameters' storages: it held theirs."""
        life = self.lives.get(storage_key(buffer))
        if life is not None and life in self.buffers:
            self.copied[life] = _CopyOut(self.sequence, [StorageWeakRef(t.untyped_storage()) for t in into])

    def _reads_gathered(self, module: torch.nn.Module) -> None:
        """`module` runs (its forward or backward): its gathered parameters are its own, and their
        gradients are watched (NOTE [what FSDP2 adds])."""
        for parameter in module.parameters():
            key = StorageWeakRef(parameter.untyped_storage())
            if key not in self.resized_keys:
                continue
            self.owners[key] = id(module)
            if parameter.requires_grad and id(parameter) not in self.hooked:
                self.hooked[id(parameter)] = parameter.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, parameter: torch.Tensor) -> None:
        life = None if parameter.grad is None else self.lives.get(storage_key(parameter.grad))
        if life is not None:
            self.gradients.append(life)

    def forget_hooks(self) -> None:
        for handle in self.hooked.values():
            handle.remove()

    # --- events ----------------------------------------------------------------------------------------
    def _cut(self, phase: Phase, call: int | None) -> None:
        self.segments.append(
            Segment(
                self.phase,
                self.in_call,
                frozenset(self.alive),
                self.segment_peak,
                self.segment_op,
                resized=self.segment_resized,
                peak_at=self.segment_peak_at,
                start=self.segment_start,
                end=self.sequence,
            )
        )
        self.sequence += 1  # the next segment's first moment: what is live when it starts
        self._note_high(self.total)
        self.phase, self.in_call = phase, call
        self.segment_peak, self.segment_op, self.segment_resized = self.total, "", self.resized_live
        self.segment_peak_at = self.segment_start = self.sequence

    def forward_started(self, name: str, module: torch.nn.Module) -> int:
        index = len(self.calls)
        self.calls.append(BlockCall(index, name, module, None, ()))
        self._cut(Phase.FORWARD, index)
        self._reads_gathered(module)
        self.current = index
        return index

    def forward_traced(self, joint: Any) -> None:
        if self.current is not None:
            call = self.calls[self.current]
            self.calls[self.current] = dataclasses.replace(call, trace=joint.trace, regions=joint.regions)

    def function_applied(self) -> int | None:
        """The block call whose forward applied remat's Function (its backward will report as it)."""
        if self.current is not None:
            self.applied.add(self.current)
        return self.current

    def forward_ended(self, index: int) -> None:
        self._cut(Phase.OUTSIDE, None)
        self.current = None
        if index in self.applied:  # it keeps values for a backward
            self.alive.add(index)

    def backward_started(self, index: int) -> None:
        self._cut(Phase.BACKWARD, index)
        self._reads_gathered(self.calls[index].module)
        self.alive.discard(index)  # its kept values are the backward's now

    def backward_ended(self, index: int) -> None:
        self._cut(Phase.OUTSIDE, None)


recorder: _Recorder | None = None  # set while a probe step runs (one at a time)


class _CopyOut(NamedTuple):
    """An all-gather's buffer copied out: when, and into which storages (of the parameters it held)."""

    at: int
    into: list[Any]


@dataclasses.dataclass(eq=False)  # one per life: compared by identity
class _Life:
    """When a storage was live during the probe step, in the recorder's count of allocations."""

    nbytes: int
    start: int
    key: Any = None  # a gathered storage's (to find whose parameter it is)
    end: int | None = None  # None: live at the end

    def at(self, moment: int) -> bool:
        return self.start <= moment and (self.end is None or self.end >= moment)


# NOTE [what FSDP2 adds]
# Under FSDP2 a rank's peak holds, beside activations, the parameters FSDP2 has
# gathered (the running block's, the next block's where it prefetched them, the
# root's) and the full-size gradients of a block before their reduce-scatter.
# The probe step records when each was live, in its count of allocations: a
# parameter's storage from its resize to full size to its resize to nothing;
# an all-gather's output buffer (a block's parameters gathered at once, copied
# out into their own storages when the block needs them) from its allocation
# to its free; a gradient likewise, known as one when autograd accumulates it
# into a gathered parameter (a hook). A storage is the running block's if it is
# one of its parameters' when the block's forward or backward starts, and a
# buffer is the block's whose parameters it is copied out into: another
# block's are prefetched (outside the blocks' forwards and backwards, none is
# called so). The step report reads them at the moment of the peak. A fresh
# model's first gathers are allocations like any other: a step before the
# probe (as training has taken) shows them apart.
#
# When a buffer is freed varies from step to step. FSDP2 lets go of it once
# its parameters are copied out (in the forward, at the next block's copy-out),
# but the communication backend's thread that ran the all-gather may hold it a
# little longer: under gloo, how much longer depends on when the OS schedules
# that thread. With the CPU busy, one step in 60 still held a block's buffer
# when the next block's was allocated, where the probe step had seen it freed
# at once (a CI run measured such a step 8.7% above its plan's target). So
# each segment's peak is the worst case: at each moment of the segment, what
# the probe step had live then plus the buffers it had freed that a step may
# still hold, until the end of the first block's forward or backward to end
# after the buffer's copy-out at the latest (by then its parameters have been
# read and the collective is long done). A step that frees a buffer at once
# measures up to one block's gathered parameters below the prediction.


# NOTE [kernels' workspaces]
# On a GPU, some kernels take memory of their own from the caching allocator for
# the length of a call (cuDNN's convolution workspace, chosen with its
# algorithm), which `torch.cuda.max_memory_allocated` counts and no tensor
# shows. Where the probe step runs real CUDA kernels, each op call is measured
# by the allocator's counters: the bytes allocated during it, less the bytes it
# left allocated, were taken and freed inside it, and count on top of what is
# live after the call (an upper bound: workspaces taken one after another count
# as their sum). What a library keeps once allocated (cuBLAS's workspace, per
# handle and stream) stays allocated: live before every later step, not part of
# a step's peak. On fake tensors (a model on meta, or no GPU) no kernel runs and
# nothing is counted (docs/fit.md).


class KernelWorkspaces:
    """The bytes the kernels of one op call take and free on `device` (NOTE [kernels' workspaces])."""

    def __init__(self, device: torch.device):
        self.device = device

    def _allocated(self) -> tuple[int, int]:
        """(bytes ever allocated, bytes allocated now) on the device, by its caching allocator's counters."""
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("allocated_bytes.all.allocated", 0), stats.get("allocated_bytes.all.current", 0)

    def run(self, op: Any, call: Callable[[], Any]) -> tuple[Any, int]:
        """`call()` (a call of `op`), and the bytes its kernels took and freed before it returned."""
        ever, now = self._allocated()
        out = call()
        ever_after, now_after = self._allocated()
        return out, max(0, (ever_after - ever) - (now_after - now))


def kernel_workspaces(tensors: Sequence[torch.Tensor]) -> KernelWorkspaces | None:
    """What measures kernels' workspaces for a step on `tensors` (the model's parameters): on a GPU's real
    tensors; None elsewhere."""
    device = next((t.device for t in tensors if t.is_cuda and _real(t)), None)
    return KernelWorkspaces(device) if device is not None and torch.cuda.is_available() else None


class _Allocations(TorchDispatchMode):
    """Reports every real tensor an op allocates (fake tensors of remat's tracing are not memory), and
    every fake tensor of `counted`, the fake mode a step on fake tensors runs under."""

    # A higher-order op (flex attention) passes through like any op: its outputs are counted, not what
    # its implementation allocates and frees inside.
    supports_higher_order_operators = True

    def __init__(self, into: _Recorder, counted: Any = None, workspaces: KernelWorkspaces | None = None):
        super().__init__()
        self.into = into
        self.counted = counted
        self.workspaces = workspaces

    def _memory(self, tensor: torch.Tensor) -> bool:
        return _real(tensor) or (self.counted is not None and getattr(tensor, "fake_mode", None) is self.counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.workspaces is None:
            out, taken = func(*args, **kwargs), 0
        else:
            out, taken = self.workspaces.run(func, lambda: func(*args, **kwargs))
        if taken:
            self.into.took_and_freed(taken, func)
        name = getattr(func, "__name__", "")
        if "gather" in name and func.namespace in ("c10d", "_c10d_functional"):
            gathered = [*tensors_in(out), *(t for a in (*args, *kwargs.values()) for t in tensors_in(a))]
            self.into.all_gathered([t for t in gathered if self._memory(t)])
        elif "split_with_sizes_copy" in name and isinstance(args[0], torch.Tensor):  # FSDP2's copy-out
            self.into.copied_out(args[0], tensors_in(kwargs.get("out")))
        # An output in the memory of an input (a view, an in-place update) is no allocation; the memory
        # of a tensor that existed before the step is not counted.
        made = [t for t in tensors_in(out) if self._memory(t)]
        if not made:
            return out
        fresh = func is torch.ops.aten.lift_fresh.default  # `torch.tensor(data)`: made outside the dispatcher
        read = set() if fresh else {_storage(t) for t in tensors_in([*args, *kwargs.values()]) if self._memory(t)}
        for tensor in made:
            if _storage(tensor) not in read:
                self.into.allocated(tensor, func)
        return out


def _storage(tensor: torch.Tensor) -> int:
    """Which storage `tensor` views, while it is alive (`storage_key`'s identity, without its weak reference)."""
    return tensor.untyped_storage()._cdata


def _real(tensor: torch.Tensor) -> bool:
    """A plain tensor: not one of tracing's fake tensors, nor any other subclass."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


# NOTE [storages resized in place]
# FSDP2 frees a block's unsharded parameters by resizing their storage to
# nothing, and remakes them by resizing it back (`UntypedStorage.resize_`),
# which the dispatcher never sees: the storage object lives on. So while the
# probe step runs, `resize_` reports to the recorder, which counts a storage at
# the bytes it holds now (MemTracker does the same), and a storage from before
# the step that is remade counts from then on.


@contextmanager
def _resizes_recorded(into: _Recorder) -> Iterator[None]:
    resize = torch.UntypedStorage.resize_

    @functools.wraps(resize)
    def recorded(storage: torch.UntypedStorage, size: int) -> Any:
        result = resize(storage, size)
        into.resized(storage, "UntypedStorage.resize_")
        return result

    torch.UntypedStorage.resize_ = recorded  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]


@contextmanager
def recording(fake_mode: Any = None, workspaces: KernelWorkspaces | None = None) -> Iterator[_Recorder]:
    """Record the step run inside (on fake tensors of `fake_mode`, if given; with its kernels' workspaces
    where `workspaces` measures them): `Timeline` of it from `timeline_of` once it ends."""
    global recorder
    if recorder is not None:
        raise RuntimeError("remat.fit: a probe step is already running (plan one model at a time).")
    recorder = _Recorder()
    try:
        with _Allocations(recorder, fake_mode, workspaces), _resizes_recorded(recorder):
            yield recorder
    finally:
        recorder.forget_hooks()
        recorder = None


def timeline_of(done: _Recorder, gradients: int) -> Timeline:
    """The `Timeline` of a finished recording, its last segment closed. Each segment's peak is the worst
    case over when the backend lets go of all-gathers' buffers (NOTE [what FSDP2 adds])."""
    done._cut(Phase.OUTSIDE, None)
    blocks = {id(call.module) for call in done.calls}
    freed = _freed_late(done)
    segments = []
    for segment in done.segments:
        moment, late = _worst_moment(done, segment, freed)
        peak = done.highs[moment] + sum(life.nbytes for life in late) if late else segment.peak
        in_place = segment.resized if not late else sum(life.nbytes for life in done.gathered if life.at(moment))
        running = None if segment.call is None else id(done.calls[segment.call].module)
        others = set() if running is None else blocks - {running}
        prefetched = sum(
            life.nbytes for life in done.gathered if life.at(moment) and done.owners.get(life.key) in others
        )
        buffers = [life for life in done.buffers if life.at(moment)] + late
        for life in buffers:
            copy = done.copied.get(life)
            if copy is not None and {done.owners.get(key) for key in copy.into} & others:
                prefetched += life.nbytes
        unreduced = sum(life.nbytes for life in done.gradients if life.at(moment))
        resized = in_place + sum(life.nbytes for life in buffers)
        segments.append(
            dataclasses.replace(
                segment, peak=peak, peak_at=moment, resized=resized, prefetched=prefetched, unreduced=unreduced
            )
        )
    return Timeline(tuple(done.calls), tuple(segments), done.peak, gradients, done.total)


def _freed_late(done: _Recorder) -> list[tuple[_Life, int, int]]:
    """The all-gathers' buffers that a step may free later than the probe step did: each with when the probe
    step freed it and when a step frees it at the latest, the end of the first block's forward or backward
    to end after its copy-out (NOTE [what FSDP2 adds])."""
    block_ends = [s.end for s in done.segments if s.phase is not Phase.OUTSIDE]
    late = []
    for life in done.buffers:
        copied_at = done.copied[life].at if life in done.copied else life.start
        until = next((end for end in block_ends if end >= copied_at), None)
        if life.end is not None and until is not None and until > life.end:
            late.append((life, life.end, until))
    return late


def _worst_moment(done: _Recorder, segment: Segment, freed: list[tuple[_Life, int, int]]) -> tuple[int, list[_Life]]:
    """The moment of `segment` when the most bytes could be live, in a step that frees all-gathers' buffers
    as late as `freed` says, and the buffers held late then (none: its peak, as measured)."""
    moment, most, held = segment.peak_at, segment.peak, list[_Life]()
    reaching = [(life, end, until) for life, end, until in freed if end < segment.end and until >= segment.start]
    if not reaching:
        return moment, held
    first, last = (
        max(segment.start, min(end for _, end, _ in reaching) + 1),
        min(segment.end, max(u for *_, u in reaching)),
    )
    for at in range(first, last + 1):
        late = [life for life, end, until in reaching if end < at <= until]
        if late and done.highs[at] + sum(life.nbytes for life in late) > most:
            moment, most, held = at, done.highs[at] + sum(life.nbytes for life in late), late
    return moment, held


def run_step(step: Callable[[], Any], fake_mode: Any = None, workspaces: KernelWorkspaces | None = None) -> _Recorder:
    """Run `step()` while recording it (a step on fake tensors of `fake_mode`, if given; with its kernels'
    workspaces where `workspaces` measures them)."""
    with recording(fake_mode, workspaces) as active:
        step()
    return active
