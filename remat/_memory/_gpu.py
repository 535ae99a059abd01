"""The GPU a CUDA program is planned for on a machine without one: its architecture, and the attention kernel
it would run. See NOTE [kernels of a GPU this machine lacks].
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .._quirks import SDPA_CHOOSES_BELOW_THE_DISPATCHER
from .._torch import TorchFunctionMode, sdp_priority_order

__all__ = ["Gpu", "asks_for_the_missing_gpu", "assume_gpu", "assumed_gpu", "attention_as_on_the_gpu", "sdpa_backend"]


# NOTE [kernels of a GPU this machine lacks]
# A CUDA build of torch runs programs on fake CUDA tensors without a GPU, and
# most ops run the kernel they would run on one. Attention does not: SDPA picks
# its kernel below the dispatcher, from the device's compute capability, and
# with no device it falls back to the math kernel (bmm, softmax, dropout), which
# keeps the T x T probabilities for backward where flash or memory-efficient
# attention keep a row of log-sum-exps. So where no GPU is present, remat
# chooses as SDPA would on an assumed GPU (an H100, compute capability 9.0,
# unless `remat.assume_gpu` names another): in torch's order of backends
# (flash, memory-efficient, math, cuDNN, those enabled by
# `torch.backends.cuda`/`sdpa_kernel`), the first whose conditions hold for the
# dtypes, shapes, mask and architecture, and calls its op as SDPA does (the
# head dimension padded to a multiple of 8 for flash, a mask made additive and
# aligned for memory-efficient attention). The conditions are the main ones of
# torch's `sdp_utils` (below); a corner they do not cover may be planned with
# another kernel than the GPU runs, which `docs/fit.md` lists. Where a GPU is
# present, SDPA chooses itself and the assumption is not used.


# What torch raises where an op on CUDA tensors asks the CUDA driver and this machine has no GPU.
_NO_DRIVER = ("NVIDIA driver", "CUDA driver version is insufficient", "no CUDA GPUs are available")


def asks_for_the_missing_gpu(error: BaseException) -> bool:
    """Whether `error` is torch asking the CUDA driver for a GPU this machine lacks: a few CUDA ops run only
    on a device, fake tensors or not (cuDNN's RNNs, grid sampler and CTC loss; the fused GRU cell)."""
    return not torch.cuda.is_available() and any(text in str(error) for text in _NO_DRIVER)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU that programs on fake CUDA tensors are planned for: a name and its compute capability."""

    name: str
    capability: tuple[int, int]

    def __str__(self) -> str:
        return f"{self.name} (sm{self.capability[0]}{self.capability[1]})"


_KNOWN = {
    "V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A10": (8, 6), "A6000": (8, 6), "L4": (8, 9), "L40S": (8, 9),
    "RTX4090": (8, 9), "H100": (9, 0), "H200": (9, 0), "GH200": (9, 0), "B200": (10, 0), "GB200": (10, 0),
}  # fmt: skip

DEFAULT_GPU = Gpu("H100", _KNOWN["H100"])


class _Assumed(threading.local):
    gpu: Gpu = DEFAULT_GPU


_assumed = _Assumed()


def assumed_gpu() -> Gpu:
    """The GPU that CUDA programs traced on a machine without one are planned for (an H100 by default)."""
    return _assumed.gpu


@contextlib.contextmanager
def assume_gpu(gpu: str | tuple[int, int]) -> Iterator[Gpu]:
    """Plan CUDA programs traced inside for `gpu` where this machine has no GPU: its kernels are chosen
    as on that GPU (attention's, above all). `gpu` is a name (`"A100"`, `"H100"`, `"L4"`, ...) or a
    compute capability (`(8, 0)`). Where a GPU is present, the GPU itself decides.

    ```python
    with remat.assume_gpu("A100"):
        remat.fit(model_on_meta, Block, batch, peak_bytes=70 * 2**30, device="cuda")
    ```
    """
    if isinstance(gpu, str):
        capability = _KNOWN.get(gpu.upper().replace(" ", ""))
        if capability is None:
            raise ValueError(
                f"remat.assume_gpu: unknown GPU {gpu!r}; name one of {', '.join(_KNOWN)} or give its compute "
                "capability, e.g. (8, 0)."
            )
        target = Gpu(gpu, capability)
    elif isinstance(gpu, tuple) and len(gpu) == 2 and all(isinstance(v, int) and v >= 0 for v in gpu):
        target = Gpu(f"sm{gpu[0]}{gpu[1]}", (gpu[0], gpu[1]))
    else:
        raise TypeError(
            f"remat.assume_gpu: expected a GPU's name or its compute capability (major, minor), got {gpu!r}."
        )
    outer, _assumed.gpu = _assumed.gpu, target
    try:
        yield target
    finally:
        _assumed.gpu = outer


# --- attention ---------------------------------------------------------------------------------------------

Mask = torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class _Attention:
    """One call of `F.scaled_dot_product_attention`: its arguments, as the kernels' conditions and
    launchers read them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Mask = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v


def sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    gpu: Gpu | None = None,
) -> str:
    """The kernel SDPA runs on `gpu` for these arguments: "flash", "efficient", "math" or "cudnn"."""
    call = _Attention(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa)
    return _backend(call, gpu or assumed_gpu())


def _backend(call: _Attention, gpu: Gpu) -> str:
    conditions = {
        "flash": (torch.backends.cuda.flash_sdp_enabled, _flash_conditions),
        "efficient": (torch.backends.cuda.mem_efficient_sdp_enabled, _efficient_conditions),
        "math": (torch.backends.cuda.math_sdp_enabled, _no_conditions),
        "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, _cudnn_conditions),
    }
    for backend in sdp_priority_order():
        if backend not in conditions:
            continue
        enabled, failed = conditions[backend]
        if enabled() and not failed(call, gpu):
            return backend
    return "math"  # (SDPA raises "no available kernel" here; the math kernel says so in its own words)


def _no_conditions(call: _Attention, gpu: Gpu) -> list[str]:
    return []


def _common_conditions(call: _Attention, gqa_allowed: bool) -> list[str]:
    q, k, v = call.tensors
    failed = []
    if any(t.dim() != 4 or t.is_nested for t in (q, k, v)):
        failed.append("query, key and value are not all 4-dimensional dense tensors")
        return failed
    if not (q.size(0) == k.size(0) == v.size(0)):
        failed.append("batch sizes differ")
    if k.size(1) != v.size(1) or (
        q.size(1) != k.size(1) and not (gqa_allowed and call.enable_gqa and q.size(1) % k.size(1) == 0)
    ):
        failed.append("numbers of heads differ")
    if any(t.size(2) == 0 or t.size(3) == 0 for t in (q, k, v)):
        failed.append("a sequence length or head dimension is 0")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        failed.append("the last dimension is not contiguous")
    return failed


def _half_precision_from_sm80(kernel: str, q: torch.Tensor, gpu: Gpu) -> list[str]:
    """What a kernel for float16 and bfloat16 on sm80 and newer (flash, cuDNN) finds wrong."""
    failed = []
    if gpu.capability < (8, 0):
        failed.append(f"{kernel} needs sm80 or newer ({gpu})")
    if q.dtype not in (torch.float16, torch.bfloat16):
        failed.append(f"{kernel} takes float16 and bfloat16")
    return failed


def _flash_conditions(call: _Attention, gpu: Gpu) -> list[str]:
    q, k, v = call.tensors
    failed = _common_conditions(call, gqa_allowed=True)
    failed += _half_precision_from_sm80("flash attention", q, gpu)
    if call.mask is not None:
        failed.append("flash attention takes no mask")
    if not (q.size(-1) == k.size(-1) == v.size(-1)) or q.size(-1) > 256:
        failed.append("flash attention needs one head dimension of at most 256")
    if call.is_causal and q.size(-2) != k.size(-2):
        failed.append("flash attention's causal mask needs equal sequence lengths")
    if (
        gpu.capability in ((8, 6), (8, 9))
        and q.size(-1) > 192
        and any(t.requires_grad for t in (q, k, v))
        and torch.is_grad_enabled()
    ):
        failed.append("flash attention's backward on sm86 and sm89 takes head dimensions of at most 192")
    return failed


def _efficient_conditions(call: _Attention, gpu: Gpu) -> list[str]:
    q, k, v = call.tensors
    failed = _common_conditions(call, gqa_allowed=False)
    if gpu.capability < (5, 0):
        failed.append(f"memory-efficient attention needs sm50 or newer ({gpu})")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or (
        q.dtype == torch.bfloat16 and gpu.capability < (8, 0)
    ):
        failed.append(f"memory-efficient attention does not take {q.dtype} on {gpu}")
    if q.size(-1) != k.size(-1) or q.size(-1) % 8 or v.size(-1) % 8:
        failed.append("memory-efficient attention needs head dimensions that are multiples of 8")
    return failed


def _cudnn_conditions(call: _Attention, gpu: Gpu) -> list[str]:
    q, k, v = call.tensors
    failed = _common_conditions(call, gqa_allowed=False)
    failed += _half_precision_from_sm80("cuDNN attention", q, gpu)
    if not (q.size(-1) == k.size(-1) == v.size(-1)) or q.size(-1) % 8 or q.size(-1) > 128:
        failed.append("cuDNN attention needs one head dimension, a multiple of 8 of at most 128")
    return failed


def _computes_logsumexp(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive one SDPA makes of it (0 where kept, -inf where masked)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def _aligned_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The mask as memory-efficient attention takes it: its rows padded to a multiple of 16 elements (then
    sliced back) where they are not, expanded to (batch, heads, queries, keys)."""
    alignment = 16
    if any(stride % alignment for stride in mask.stride()[:-1]):
        length = mask.size(-1)
        mask = F.pad(mask, (0, alignment - length % alignment))[..., :length]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _run_flash(call: _Attention) -> torch.Tensor:
    q, k, v = call.tensors
    head = q.size(-1)
    scale = call.scale if call.scale is not None else 1.0 / math.sqrt(head)
    if head % 8:
        q, k, v = (F.pad(t, (0, 8 - head % 8)) for t in (q, k, v))
    out = _OPS["flash"](q, k, v, call.dropout_p, call.is_causal, False, scale=scale)[0]
    return out[..., :head] if head % 8 else out


def _run_efficient(call: _Attention) -> torch.Tensor:
    q, k, v = call.tensors
    bias = _additive(call.mask, q.dtype)
    if bias is not None:
        bias = _aligned_bias(bias, q, k)
    return _OPS["efficient"](  # type: ignore[no-any-return]
        q, k, v, bias, _computes_logsumexp(call.tensors), call.dropout_p, call.is_causal, scale=call.scale
    )[0]


def _run_cudnn(call: _Attention) -> torch.Tensor:
    q, k, v = call.tensors
    bias = _additive(call.mask, q.dtype)
    if bias is not None:
        bias = bias.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    return _OPS["cudnn"](  # type: ignore[no-any-return]
        q, k, v, bias, _computes_logsumexp(call.tensors), call.dropout_p, call.is_causal, False, scale=call.scale
    )[0]


_OPS = SDPA_CHOOSES_BELOW_THE_DISPATCHER.table
_RUN = {"flash": _run_flash, "efficient": _run_efficient, "cudnn": _run_cudnn}


class _AttentionAsOnTheGpu(TorchFunctionMode):
    """Runs `F.scaled_dot_product_attention` on CUDA tensors with the kernel the assumed GPU would choose."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = _Attention(*args, **_renamed(kwargs))
            if all(isinstance(t, torch.Tensor) and t.is_cuda for t in call.tensors):
                backend = _backend(call, assumed_gpu())
                if backend in _RUN:
                    return _RUN[backend](call)
        return func(*args, **kwargs)


# SDPA's keyword names -> `_Attention`'s, which follow its positions.
_KEYWORDS = {"query": "q", "key": "k", "value": "v", "attn_mask": "mask"}


def _renamed(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {_KEYWORDS.get(name, name): value for name, value in kwargs.items()}


def attention_as_on_the_gpu(tensors: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """Where this machine has no GPU and `tensors` hold a CUDA tensor: attention inside runs the kernel the
    assumed GPU would choose (NOTE [kernels of a GPU this machine lacks]). Elsewhere, nothing changes."""
    if torch.cuda.is_available() or not any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return contextlib.nullcontext()
    return _AttentionAsOnTheGpu()
