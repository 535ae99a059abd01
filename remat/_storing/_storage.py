"""Where a kept value lives from forward to backward: on its device as it is, or in another form somewhere
else. See NOTE [kinds of storage].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._core._calls import Decision
from .._memory._cuda_allocator import allocated_nbytes
from ..costs import Device
from . import _bits, _lossy, _offload

__all__ = [
    "BFLOAT16",
    "BITS",
    "DEVICE",
    "FLOAT16",
    "FP8",
    "HOST",
    "STORAGES",
    "Storage",
    "exact",
    "program_functions",
    "shrinking",
    "storage_of",
]


# NOTE [kinds of storage]
# A call whose values backward reads is either replayed or kept, and a kept
# value lives somewhere from forward to backward: on its device as it is
# (SAVE), in host memory (OFFLOAD), as bits (PACK: NOTE [values kept as
# bits]), or in another form. Each kind is one `Storage`: what its stored form
# costs on the device and what storing and loading it moves, and the functions
# the programs call for it. The forward program stores each kept value right
# after the call that makes it; the backward program loads it before the
# gradient formula that first reads it (a kind whose loads take time of their
# own, such as a copy from the host, starts `ahead` of them sooner); the pure
# programs (differentiating again, forward mode) load it at once. Everything
# else (the accounting, the peak prediction, the planners, the report, the
# compiled and Dynamo paths) reads a kept value's kind from `storage_of` and
# its figures from the kind. A new kind is one module holding its functions,
# and one entry in `STORAGES`.


@dataclasses.dataclass(frozen=True, eq=False)
class Storage:
    """One kind of storage for kept values.

    Attributes:
        name: what the report calls it ("device", "host").
        decision: the decision that keeps a call's values in it.
        exact: whether a value comes back bit for bit.
        on_device: whether the stored form takes the value's bytes on its device until backward.
        store: the forward program's call, value -> stored form (None: kept as it is).
        start_load: the backward program's call, (stored form, device) -> a load under way; None: the
            load is one call, `finish_load(stored form, device, *load_args(node))`.
        finish_load: the backward program's call, a load under way -> the value.
        load_now: (stored form, device, *load_args(node)) -> the value, differentiably (the pure programs).
        load_args: a kept node -> the static arguments its loads take after the device (None: none).
        holds: whether a kept node's value can be stored so (None: every value); a value it cannot
            hold stays on its device as it is.
        whole: whether a kept node's value comes back as itself (None: every value), not as a stand-in
            that only the gradient formulas read alike; a value that a replay, or a recomputation to
            differentiate again, reads stays on its device as it is where it would not.
        store_args: a kept node -> the static arguments its store takes after the value (None: none).
        store_bytes, load_bytes: a value's tensor -> the most bytes storing or loading it takes on the
            device besides the value and the result, at once (None: none), for the peak prediction.
        ahead: how many loads backward starts ahead of the one it waits for.
        form: a value's tensor -> its stored form's, for shapes and dtypes only (None: the same).
        form_nbytes: a value's tensor -> its stored form's bytes (with `form`).
        seconds: (device, bytes) -> the seconds storing (or loading) that many bytes takes one way on
            the device's cost model, on a stream of its own (None: nothing moves).
        passes: the passes over a value's elements its store and load make together (compares, shifts,
            conversions), which the FLOPs cost model counts as one FLOP per element each.
    """

    name: str
    decision: Decision
    exact: bool = True
    on_device: bool = True
    store: Callable[..., Any] | None = None
    start_load: Callable[[Any, Any], Any] | None = None
    finish_load: Callable[..., Any] | None = None
    load_now: Callable[..., Any] | None = None
    ahead: int = 0
    form: Callable[[Any], Any] | None = None
    form_nbytes: Callable[[Any], int] | None = None
    seconds: Callable[[Device, float], float] | None = None
    load_args: Callable[[Any], tuple[Any, ...]] | None = None
    holds: Callable[[Any], bool] | None = None
    store_bytes: Callable[[Any], int] | None = None
    load_bytes: Callable[[Any], int] | None = None
    whole: Callable[[Any], bool] | None = None
    store_args: Callable[[Any], tuple[Any, ...]] | None = None
    passes: int = 0

    def can_hold(self, node: Any, read_again: bool = False) -> bool:
        """Whether `node`'s value (an fx node of a trace) can be stored so; `read_again`: a replay, or a
        recomputation to differentiate again, reads it."""
        if self.holds is not None and not self.holds(node):
            return False
        return not read_again or self.whole is None or self.whole(node)

    def store_static_args(self, node: Any) -> tuple[Any, ...]:
        """What its store of `node`'s value takes after the value."""
        return () if self.store_args is None else self.store_args(node)

    def static_args(self, node: Any) -> tuple[Any, ...]:
        """What its loads of `node`'s value take after the device."""
        return () if self.load_args is None else self.load_args(node)

    def move_seconds(self, device: Device, nbytes: float) -> float:
        """Seconds storing (or loading) `nbytes` takes one way on `device` (NOTE [kinds of storage])."""
        return 0.0 if self.seconds is None else self.seconds(device, nbytes)

    def device_bytes(self, nbytes: int, value: Any = None) -> int:
        """Bytes a kept value of `nbytes` (`value`, a fake tensor of the trace) takes on its device between
        forward and backward."""
        if not self.on_device:
            return 0
        if self.form_nbytes is None or value is None:
            return nbytes
        return allocated_nbytes(self.form_nbytes(value), value.device)

    def stored_form(self, value: Any) -> Any:
        """What the stored form of `value` (a fake tensor of a trace) is on its device, for the peak
        prediction: None where it is not on the device."""
        if not self.on_device or value is None:
            return None
        return value if self.form is None else self.form(value)

    def host_bytes(self, nbytes: int) -> int:
        """Bytes it takes in host memory."""
        return 0 if self.on_device else nbytes

    def __repr__(self) -> str:
        return f"<storage {self.name}>"


DEVICE = Storage("device", Decision.SAVE)

HOST = Storage(
    "host",
    Decision.OFFLOAD,
    on_device=False,
    store=_offload.to_host,
    start_load=_offload.start_reload,
    finish_load=_offload.finish_reload,
    load_now=_offload.reload_now,
    ahead=_offload.PREFETCH,
    seconds=lambda device, nbytes: device.copy_seconds(nbytes),  # type: ignore[arg-type]
)

BITS = Storage(
    "bits",
    Decision.PACK,
    store=_bits.pack,
    finish_load=_bits.unpack,
    load_now=_bits.unpack,
    form=_bits.packed_like,
    form_nbytes=_bits.packed_nbytes,
    # Memory-bound, about three passes over the value each way (a comparison, combining the bits; shifting
    # them out, converting, the value's own op): 1.25 ms to pack and unpack 2 MiB of float32 on one CPU core.
    seconds=lambda device, nbytes: 3 * nbytes / device.bandwidth,
    passes=6,
    load_args=_bits.load_args,
    store_args=_bits.store_args,
    holds=_bits.packable,
    whole=_bits.whole,
    store_bytes=_bits.packing_bytes,
    load_bytes=_bits.unpacking_bytes,
)


def _narrowed(narrowing: _lossy.Narrowing, decision: Decision) -> Storage:
    """The storage of a narrower format (NOTE [values kept lossy]): approximate, read only by the gradient
    formulas (`whole`: no replay reads it)."""
    return Storage(
        narrowing.name,
        decision,
        exact=False,
        store=narrowing.store,
        finish_load=narrowing.load,
        load_now=narrowing.load,
        form=narrowing.form,
        form_nbytes=narrowing.form_nbytes,
        # Memory-bound: the value read and its narrow form written, then read and the value written again.
        seconds=lambda device, nbytes: 2 * nbytes / device.bandwidth,
        passes=6 if narrowing.scaled else 2,
        load_args=narrowing.load_args,
        store_args=narrowing.store_args,
        holds=narrowing.holds,
        whole=lambda node: False,
        store_bytes=narrowing.store_bytes,
        load_bytes=narrowing.load_bytes,
    )


FLOAT16 = _narrowed(_lossy.FLOAT16, Decision.FLOAT16)
BFLOAT16 = _narrowed(_lossy.BFLOAT16, Decision.BFLOAT16)
FP8 = _narrowed(_lossy.FP8, Decision.FP8)

STORAGES: tuple[Storage, ...] = (DEVICE, HOST, BITS, FLOAT16, BFLOAT16, FP8)

_BY_DECISION = {storage.decision: storage for storage in STORAGES}


def storage_of(decision: Decision) -> Storage | None:
    """Where `decision` keeps a call's values (None: it keeps none, it replays the call)."""
    return _BY_DECISION.get(decision)


def shrinking(pack: bool, compress: str | None) -> tuple[Storage, ...]:
    """The storages of fewer device bytes a planner may keep values in: bits (with `pack`), and the narrower
    format named `compress` (None: none)."""
    return (BITS,) * pack + tuple(s for s in STORAGES if not s.exact and s.name == compress)


def exact(decision: Decision) -> bool:
    """Whether backward reads what `decision` keeps exactly as forward made it (or replays it)."""
    storage = storage_of(decision)
    return storage is None or storage.exact


def program_functions() -> tuple[Callable[..., Any], ...]:
    """Every function the programs call to store and load kept values (which torch.compile must leave
    alone: they use streams and events of their own)."""
    found = []
    for storage in STORAGES:
        found += [f for f in (storage.store, storage.start_load, storage.finish_load, storage.load_now) if f]
    return tuple(found)
