"""The data a policy sees: `Decision`, `TensorMeta`, `Call` and `Trace`."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._memory._measure import tensor_nbytes
from .._torch import OpOverload, size_bound

__all__ = ["Call", "Dataflow", "Decision", "TensorMeta", "Trace", "Value"]


class Decision(enum.Enum):
    """What to do with the outputs of one forward call.

    `SAVE` keeps the outputs that backward (or a replay) reads on their device;
    `OFFLOAD` keeps them too, in host memory: copied there as forward makes
    them and back to their device before backward first reads them (see
    docs/offload.md), with gradients exactly those of `SAVE`; `PACK` keeps
    them on their device in fewer bytes where that is exact, bit for bit
    (booleans, dropout's masks and a ReLU's output as bits: docs/storage.md), as they are
    elsewhere; `RECOMPUTE` keeps nothing and replays the call in backward if
    something backward needs depends on it.

    `FLOAT16`, `BFLOAT16` and `FP8` keep float32 values (and, for `FP8`,
    bfloat16 values) that only gradient formulas read in that narrower format,
    approximately: the gradients then differ from eager's by the rounding
    (docs/storage.md). No planner chooses them; a policy asks for them
    (`remat.policies.compress`).

    Combined (`|`, `&` of policies), the decisions rank `SAVE`, `PACK`,
    `OFFLOAD`, `FLOAT16`, `BFLOAT16`, `FP8`, `RECOMPUTE`, highest first:
    `p | q` takes the higher decision of the two, `p & q` the lower.

    >>> import remat
    >>> remat.Decision.SAVE is remat.SAVE, remat.Decision.PACK is remat.PACK
    (True, True)
    """

    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"
    PACK = "pack"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FP8 = "fp8"

    @property
    def keeps(self) -> bool:
        """Whether the call's outputs are kept for backward (every decision but RECOMPUTE)."""
        return self is not Decision.RECOMPUTE

    def __repr__(self) -> str:
        # The exact decisions are also names of the package itself (`remat.SAVE`); the lossy ones are not.
        return (
            f"remat.{self.name}"
            if self.value in ("save", "recompute", "offload", "pack")
            else f"remat.Decision.{self.name}"
        )


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype, device and size of one tensor seen while tracing.

    >>> import torch, remat
    >>> remat.TensorMeta.of(torch.zeros(2, 3))
    TensorMeta(shape=(2, 3), dtype=torch.float32, device=device(type='cpu'), nbytes=24)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    # The dims whose size depends on values, given in `shape` at the largest they can be.
    data_dependent: tuple[int, ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        """Describe `tensor` (real or fake). A size that depends on the values of the inputs (the
        length of `nonzero`'s output) is given at the largest it can be; `data_dependent` names it."""
        shape = tuple(size_bound(size) for size in tensor.shape)
        data_dependent = tuple(dim for dim, size in enumerate(tensor.shape) if not isinstance(size, int))
        return cls(shape, tensor.dtype, tensor.device, tensor_nbytes(tensor), data_dependent)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        sizes = (f"<={size}" if dim in self.data_dependent else str(size) for dim, size in enumerate(self.shape))
        return f"{dtype}[{','.join(sizes)}]"


@dataclasses.dataclass(frozen=True)
class Call:
    """One forward op call of a trace: what a policy decides about.

    Fields:
        index: position in the trace's list of calls (0-based).
        op: the op overload called, e.g. `torch.ops.aten.mm.default`.
        occurrence: how many earlier calls in the trace had the same `op`.
        inputs: the positional arguments, with tensors as `TensorMeta` and
            other values as themselves.
        kwargs: the keyword arguments, as `(name, value)` pairs in the same form.
        outputs: `TensorMeta` of each tensor the call returns.
        tags: names given to its outputs with `remat.tag`.
        module: qualified path of the `nn.Module` whose forward issued the
            call (`""` for the root module), or `None`.
        scope: the custom `autograd.Function` or custom op the call belongs
            to, or `None`.
        flops: estimated forward FLOPs.
        nbytes: bytes of its tensor outputs.
        is_random: whether it draws from a random number generator.
        source: `file:line` of the user code that issued it, when known.

    >>> import torch, remat
    >>> mm, relu = remat.trace(lambda a, b: (a @ b).relu(), torch.ones(2, 3), torch.ones(3, 4))
    >>> mm.name, mm.flops, mm.nbytes
    ('aten.mm.default', 48, 32)
    >>> print(relu)
    #1 aten.relu.default -> float32[2,4]
    """

    index: int
    op: Any
    occurrence: int
    inputs: tuple[Any, ...]
    outputs: tuple[TensorMeta, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    tags: frozenset[str] = frozenset()
    module: str | None = None
    scope: str | None = None
    flops: int = 0
    nbytes: int = 0
    is_random: bool = False
    source: str | None = None

    @property
    def name(self) -> str:
        """The op's short name, e.g. `aten.mm.default`."""
        return op_name(self.op)

    def __str__(self) -> str:
        outputs = ", ".join(map(str, self.outputs))
        return f"#{self.index} {self.name} -> {outputs}"


def op_name(op: Any) -> str:
    """Return `aten.mm.default` for `torch.ops.aten.mm.default`."""
    if isinstance(op, OpOverload):
        return str(op)
    return getattr(op, "__name__", str(op))


Value = tuple[int, int]
"""One output of a call: `(call index, output position)`; an input of the function that backward
must read as a copy (it is overwritten) is `(-1 - input position, 0)`."""


@dataclasses.dataclass(frozen=True)
class Dataflow:
    """What a whole-graph planner needs to know beyond the calls: who reads which value.

    A SAVE call keeps the values (outputs) that backward or a replayed call reads; a
    RECOMPUTE call is replayed when backward, or another replayed call, reads one of its
    values. Reads go through views to the value whose memory they show; the function's
    inputs are always at hand, so they are not values (except overwritten ones, kept as
    copies).

    Attributes:
        reads: per call, the values its replay reads.
        backward_reads: the values the gradient formulas read.
        nbytes: the bytes one value costs when kept.
        rng_state_nbytes: per call, the bytes of generator state kept to replay it (0 if
            it draws no random numbers).
        varying: the values with a derivative with respect to an input that requires grad.
        returned: the values the checkpointed function returns.

    Keeping a varying value that is not returned also keeps what recomputing it needs, so
    that it can be differentiated again: the overwritten inputs and generator states behind
    it, up to kept values without a derivative (see `partition`'s pure forward).

    >>> import torch, remat
    >>> flow = remat.trace(lambda x: x.sin().sin(), torch.ones(4, requires_grad=True)).dataflow
    >>> flow.backward_reads  # the second sin's gradient reads the first sin's output
    frozenset({(0, 0)})
    >>> flow.reads[1], flow.nbytes[0, 0]  # replaying the second sin reads it too; keeping it costs 16 bytes
    (frozenset({(0, 0)}), 16)
    """

    reads: tuple[frozenset[Value], ...]
    backward_reads: frozenset[Value]
    nbytes: dict[Value, int]
    rng_state_nbytes: tuple[int, ...]
    varying: frozenset[Value]
    returned: frozenset[Value]


class Trace(Sequence[Call]):
    """The ordered forward calls of one traced function.

    Views, `getitem`s of multi-output calls and in-place copies back into inputs
    are not listed: they cost nothing to keep and follow the call that produced
    their base. `str(trace)` is a table, one row per call.

    >>> import torch, remat
    >>> trace = remat.trace(lambda x: x.sin().cos(), torch.ones(3))
    >>> [call.name for call in trace]
    ['aten.sin.default', 'aten.cos.default']
    """

    def __init__(self, calls: Sequence[Call], values: Any = None, joint: Any = None):
        self._calls = tuple(calls)
        self._values = values
        self._joint = joint
        self._dataflow: Dataflow | None = None

    @property
    def values(self) -> Any:
        """The value graph the rules run on (`remat._partitioning._value_graph.ValueGraph`: who reads which value, what
        keeping it costs); None for a trace made of hand-picked calls."""
        return self._values

    @property
    def dataflow(self) -> Dataflow | None:
        """Who reads which value (for planners); None for a trace made of hand-picked calls."""
        if self._dataflow is None and self._values is not None:
            self._dataflow = self._values.dataflow()
        return self._dataflow

    @property
    def joint(self) -> Any:
        """The joint graph the calls were traced from, which planners partition to predict a peak
        (`remat._partitioning._peak.peak_of`); None for a trace made of hand-picked calls."""
        return self._joint

    def __len__(self) -> int:
        return len(self._calls)

    def __getitem__(self, index: Any) -> Any:
        return self._calls[index]

    def __iter__(self) -> Iterator[Call]:
        return iter(self._calls)

    def __repr__(self) -> str:
        return f"remat.Trace({len(self)} calls)"

    def __str__(self) -> str:
        header = ("#", "op", "outputs", "bytes", "FLOPs", "module", "scope", "source")
        rows = [
            (
                str(call.index),
                call.name + (" (random)" if call.is_random else ""),
                ", ".join(map(str, call.outputs)),
                format_bytes(call.nbytes),
                f"{call.flops:,}",
                _module_label(call.module),
                call.scope or "",
                call.source or "",
            )
            for call in self._calls
        ]
        return format_table(header, rows)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Render rows as a plain-text table with aligned columns."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_bytes(nbytes: int) -> str:
    """`1.5 MiB` for 1572864."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """`1.5 ms` for 0.0015; `0 s` for 0 (or a CPU's infinitely fast host link)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale or unit == "us":
            return f"{seconds / scale:.3g} {unit}" if seconds else "0 s"
    raise AssertionError("unreachable")


def _module_label(path: str | None) -> str:
    return "<root>" if path == "" else (path or "")
