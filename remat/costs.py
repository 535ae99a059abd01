"""What a call costs to replay: a roofline estimate of its time on a named device.

Every `remat.Call` carries its forward FLOPs (`Call.flops`, from
`torch.utils.flop_counter`'s formulas for matmuls, convolutions and attention;
one per output element otherwise) and the bytes of its outputs
(`Call.nbytes`). `estimate_seconds` turns them into time the way a roofline
model does: a call takes as long as the slower of doing its FLOPs at the
device's peak rate and moving its inputs and outputs through memory at the
device's bandwidth. That is an optimistic bound, good for comparing calls with
each other (which are cheap to replay per byte they keep), not a prediction of
wall time.

>>> import torch, remat
>>> from remat.costs import estimate_seconds
>>> trace = remat.trace(lambda a, b: (a @ b).relu(), torch.ones(1024, 1024), torch.ones(1024, 1024))
>>> mm, relu = trace
>>> f"{estimate_seconds(mm, 'h100') * 1e6:.1f} us"  # 2.1 GFLOP at 495 TFLOP/s (TF32) beats 12 MiB at 3.35 TB/s
'4.3 us'
>>> f"{estimate_seconds(relu, 'h100') * 1e6:.1f} us"  # 8 MiB through memory: 1024x fewer FLOPs, not 1024x faster
'2.5 us'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch

from ._core._calls import Call, TensorMeta
from ._memory._measure import estimate_flops
from ._torch import OpOverloadPacket

__all__ = ["DEVICES", "MATMUL_OPS", "Device", "estimate_flops", "estimate_seconds"]

aten = torch.ops.aten

# Matrix-multiply-like ops (they run on the matrix units of a GPU), by kind, as packets.
MATMUL_OPS: dict[str, frozenset[OpOverloadPacket]] = {
    # A product with no batch dimension (a linear layer on any number of leading dims traces as one).
    "unbatched": frozenset(
        {aten.mm, aten.addmm, aten.mv, aten.addmv, aten.dot, aten.vdot, aten.addr, aten._int_mm, aten._scaled_mm}
    ),
    "batched": frozenset({aten.bmm, aten.baddbmm, aten.addbmm, aten._grouped_mm, aten._scaled_grouped_mm}),
    "convolution": frozenset(
        {
            aten.convolution, aten._convolution, aten.convolution_overrideable, aten.cudnn_convolution,
            aten.cudnn_convolution_transpose, aten.mkldnn_convolution,
        }
    ),
    "attention": frozenset(
        {
            aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
            aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_attention_math, aten._scaled_dot_product_fused_attention_overrideable,
            aten._flash_attention_forward, aten._efficient_attention_forward,
        }
    ),
}  # fmt: skip
_ALL_MATMULS = frozenset().union(*MATMUL_OPS.values())


@dataclasses.dataclass(frozen=True)
class Device:
    """Peak rates of one device, for roofline estimates.

    Attributes:
        name: a label.
        matmul_flops: peak FLOP/s of matrix-multiply-like calls, per dtype
            (dense, no sparsity), as `(dtype, flops)` pairs; dtypes not listed
            run at `vector_flops`.
        vector_flops: peak FLOP/s of every other call (float32 on the vector units).
        bandwidth: memory bandwidth in bytes per second.
        host_bandwidth: bytes per second between the device and pinned host memory, each
            way (what offloading a value costs: see `copy_seconds`); `inf` for a CPU,
            whose tensors are their own host copies.

    >>> import torch, remat
    >>> from remat.costs import Device, estimate_seconds
    >>> slow = Device("slow", matmul_flops=((torch.float32, 1e9),), vector_flops=1e8, bandwidth=1e12)
    >>> mm = remat.trace(lambda a, b: a @ b, torch.ones(10, 10), torch.ones(10, 10))[0]
    >>> estimate_seconds(mm, slow)  # 2000 FLOPs at 1e9 FLOP/s take longer than 1200 bytes at 1e12 B/s
    2e-06
    """

    name: str
    matmul_flops: tuple[tuple[torch.dtype, float], ...]
    vector_flops: float
    bandwidth: float
    host_bandwidth: float = 50e9

    def copy_seconds(self, nbytes: int) -> float:
        """Seconds to copy `nbytes` between this device and pinned host memory, one way.

        >>> from remat.costs import DEVICES
        >>> f"{DEVICES['h100'].copy_seconds(2**30) * 1e3:.1f} ms"  # 1 GiB over PCIe 5.0 x16, as measured
        '21.5 ms'
        """
        return nbytes / self.host_bandwidth

    def peak_flops(self, call: Call) -> float:
        """The FLOP/s `call` can reach at best on this device."""
        if getattr(call.op, "overloadpacket", None) in _ALL_MATMULS and call.outputs:
            return dict(self.matmul_flops).get(call.outputs[0].dtype, self.vector_flops)
        return self.vector_flops


_HOPPER_MATMUL = (
    (torch.float8_e4m3fn, 1979e12),
    (torch.float8_e5m2, 1979e12),
    (torch.bfloat16, 989e12),
    (torch.float16, 989e12),
    (torch.float32, 495e12),  # TF32 matrix units, which PyTorch uses for float32 matmuls when allowed
    (torch.float64, 67e12),
)

DEVICES: dict[str, Device] = {
    # NVIDIA's datasheet figures for the SXM parts; to the host, PCIe 5.0 x16: 64 GB/s each way on
    # paper, about 50 GB/s measured for pinned copies.
    "h100": Device("h100", _HOPPER_MATMUL, vector_flops=67e12, bandwidth=3.35e12, host_bandwidth=50e9),
    "h200": Device("h200", _HOPPER_MATMUL, vector_flops=67e12, bandwidth=4.8e12, host_bandwidth=50e9),
    # A nominal server CPU socket: a few TFLOP/s of AVX-512 FMA, a few channels of DDR5.
    "cpu": Device(
        "cpu",
        ((torch.bfloat16, 2e12), (torch.float16, 2e12), (torch.float32, 2e12), (torch.float64, 1e12)),
        vector_flops=1e12,
        bandwidth=200e9,
        host_bandwidth=math.inf,
    ),
}
"""The named devices `estimate_seconds` (and `remat.policies.save_by_cost`) accept."""


def resolve_device(device: str | Device) -> Device:
    """The `Device` of a name in `DEVICES`, or `device` itself."""
    if isinstance(device, Device):
        return device
    if device not in DEVICES:
        raise ValueError(
            f"remat.costs: unknown device {device!r}; the named ones are {sorted(DEVICES)}. For another device, "
            "pass `remat.costs.Device(name, matmul_flops=..., vector_flops=..., bandwidth=...)`."
        )
    return DEVICES[device]


def estimate_seconds(call: Call, device: str | Device = "h100") -> float:
    """A roofline estimate of the time `call` takes (once) on `device`.

    The larger of its FLOPs over the device's peak FLOP/s for the call's kind and
    dtype, and the bytes of its tensor inputs and outputs over the memory bandwidth.

    Args:
        call: a call of a `remat.Trace`.
        device: a name in `remat.costs.DEVICES` (`"cpu"`, `"h100"`, `"h200"`) or a `Device`.

    Returns:
        Seconds.

    >>> import torch, remat
    >>> from remat.costs import estimate_seconds
    >>> relu = remat.trace(lambda x: x.relu(), torch.ones(1000))[0]
    >>> estimate_seconds(relu, "cpu")  # 8000 bytes in and out at 200 GB/s; its 1000 FLOPs take 1e-09 s
    4e-08
    """
    resolved = resolve_device(device)
    moved = _tensor_bytes(call.inputs) + _tensor_bytes(value for _, value in call.kwargs) + call.nbytes
    return max(call.flops / resolved.peak_flops(call), moved / resolved.bandwidth)


def _tensor_bytes(values: Iterable[object]) -> int:
    total = 0
    for value in values:
        if isinstance(value, TensorMeta):
            total += value.nbytes
        elif isinstance(value, (tuple, list)):
            total += _tensor_bytes(value)
    return total
