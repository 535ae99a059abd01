"""The GPU assumed where none is present (remat/_gpu.py): SDPA's kernel chosen as that GPU would choose it,
and CUDA programs on fake CUDA tensors traced and planned with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fit import square_loss
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import remat
from remat import _cache, _torch, policies
from remat._gpu import DEFAULT_GPU, Gpu, assumed_gpu, sdpa_backend

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H100, A100, L4, V100 = Gpu("H100", (9, 0)), Gpu("A100", (8, 0)), Gpu("L4", (8, 9)), Gpu("V100", (7, 0))

needs_fake_cuda = pytest.mark.skipif(
    not torch.backends.cuda.is_built() or torch.cuda.is_available(),
    reason="needs a CUDA build of torch on a machine without a GPU (with one, SDPA chooses itself)",
)


def _qkv(
    dtype: torch.dtype, head: int = 64, q_len: int = 128, k_len: int = 128, heads: int = 8, kv_heads: int = 8
) -> Any:
    """Query, key and value on meta (the conditions read only dtypes, shapes and strides)."""
    q = torch.empty(2, heads, q_len, head, dtype=dtype, device="meta")
    k, v = (torch.empty(2, kv_heads, k_len, head, dtype=dtype, device="meta") for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    ("case", "gpu", "expected"),
    [
        ({"dtype": BF16}, H100, "flash"),
        ({"dtype": FP16}, A100, "flash"),
        ({"dtype": FP32}, H100, "efficient"),  # flash takes only half precision
        ({"dtype": BF16, "mask": True}, H100, "efficient"),  # flash takes no mask
        ({"dtype": BF16, "head": 512}, H100, "efficient"),  # flash: head dimensions up to 256
        ({"dtype": BF16, "head": 12}, H100, "flash"),  # (padded to 16)
        ({"dtype": FP32, "head": 12}, H100, "math"),  # memory-efficient: multiples of 8
        ({"dtype": BF16, "causal": True, "k_len": 64}, H100, "efficient"),  # flash's causal mask: square
        ({"dtype": BF16, "head": 256}, L4, "efficient"),  # flash's backward on sm89: up to 192
        ({"dtype": BF16, "head": 256}, A100, "flash"),
        ({"dtype": BF16}, V100, "math"),  # no flash before sm80, no bfloat16 memory-efficient either
        ({"dtype": FP16}, V100, "efficient"),
        ({"dtype": BF16, "kv_heads": 2, "gqa": True}, H100, "flash"),  # grouped-query attention
        ({"dtype": FP32, "kv_heads": 2, "gqa": True}, H100, "math"),
    ],
    ids=lambda value: str(value),
)
def test_sdpa_backend_is_the_one_the_gpu_would_choose(case: dict[str, Any], gpu: Gpu, expected: str) -> None:
    q, k, v = _qkv(case["dtype"], case.get("head", 64), k_len=case.get("k_len", 128), kv_heads=case.get("kv_heads", 8))
    q.requires_grad_()
    mask = torch.ones(128, case.get("k_len", 128), dtype=torch.bool, device="meta") if case.get("mask") else None
    chosen = sdpa_backend(q, k, v, mask, 0.1, case.get("causal", False), case.get("gqa", False), gpu=gpu)
    assert chosen == expected


def test_sdpa_backend_follows_the_enabled_kernels() -> None:
    q, k, v = _qkv(BF16)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert sdpa_backend(q, k, v) == "efficient"
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert sdpa_backend(q, k, v) == "cudnn"
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_backend(q, k, v) == "math"


def test_assume_gpu_names_the_gpu_and_keys_the_trace_cache() -> None:
    assert assumed_gpu() == DEFAULT_GPU == H100
    default_key = _cache.ambient_key([])
    with remat.assume_gpu("a100") as gpu:
        assert gpu.capability == (8, 0) and assumed_gpu() is gpu
        with remat.assume_gpu((7, 5)) as inner:
            assert str(inner) == "sm75 (sm75)" and assumed_gpu() is inner
        assert assumed_gpu() is gpu
        assert _cache.ambient_key([]) != default_key  # a trace made for one GPU is not taken for another
    assert assumed_gpu() == H100 and _cache.ambient_key([]) == default_key
    with pytest.raises(ValueError, match=r"unknown GPU 'Z80'.*compute capability"), remat.assume_gpu("Z80"):
        pass
    with pytest.raises(TypeError, match=r"compute capability \(major, minor\)"), remat.assume_gpu(9.0):  # type: ignore[arg-type]
        pass


class NoisyAttentionBlock(nn.Module):
    """Attention with dropout on its probabilities and after its projection: random calls to replay."""

    def __init__(self, d: int = 64, heads: int = 4, p: float = 0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.norm, self.qkv, self.out, self.drop = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p)
        return x + self.drop(self.out(a.transpose(1, 2).reshape(b, t, d)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="for machines without a GPU")
def test_fit_plans_for_cuda_without_a_gpu() -> None:
    # The probe step runs on fake CUDA tensors (a CUDA build of torch), its backward walked (autograd's
    # engine would need the GPU), its random calls keeping 16-byte CUDA generator states.
    with torch.device("meta"):
        model = nn.Sequential(*[NoisyAttentionBlock() for _ in range(3)])
    x = torch.empty(4, 64, 64, device="meta")
    if not torch.backends.cuda.is_built():
        with pytest.raises(ValueError, match=r"device=.cuda.*need a CUDA build of torch"):
            remat.fit(model, NoisyAttentionBlock, x, peak_bytes=2**30, loss=square_loss, device="cuda")
        assert not any(isinstance(m.__dict__.get("forward"), remat._apply.CheckpointedForward) for m in model.modules())
        return
    everything = remat.fit(model, NoisyAttentionBlock, x, peak_bytes=2**40, loss=square_loss, device="cuda").report
    remat.uncheckpoint_modules(model)
    assert everything.peak_keeping_nothing < everything.peak_keeping_everything
    target = (everything.peak_keeping_everything + everything.peak_keeping_nothing) // 2
    plan = remat.fit(model, NoisyAttentionBlock, x, peak_bytes=target, loss=square_loss, device="cuda")
    assert plan.predicted_peak <= target
    assert any(remat.RECOMPUTE in block.decisions for block in plan.blocks)
    assert all(p.is_meta for p in model.parameters())
    # A random call replayed keeps its CUDA generator's state: 16 bytes, not the CPU generator's 5,056.
    with _torch.FakeTensorMode(), torch.device("cuda"):
        block, cuda_x = NoisyAttentionBlock(), torch.empty(4, 64, 64)
    report = remat.report(block, cuda_x, policy=policies.save_nothing)
    random_calls = [call for call in remat.trace(block, cuda_x) if call.is_random]
    assert random_calls and report.saved_bytes == 16 * len(random_calls)


def _fake_cuda(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    with _torch.FakeTensorMode():
        return torch.empty(*shape, device="cuda", dtype=dtype, requires_grad=True)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1).square()


@needs_fake_cuda
@pytest.mark.parametrize(
    ("dtype", "gpu", "kernel"),
    [(BF16, "H100", "flash"), (FP32, "H100", "efficient"), (BF16, "V100", None)],
    ids=["flash", "efficient", "math"],
)
def test_a_cuda_trace_without_a_gpu_runs_the_assumed_gpus_attention(dtype: torch.dtype, gpu: str, kernel: Any) -> None:
    q, k, v = (_fake_cuda(2, 4, 128, 64, dtype=dtype) for _ in range(3))
    ops = remat._quirks.SDPA_CHOOSES_BELOW_THE_DISPATCHER.table
    with remat.assume_gpu(gpu):
        trace = remat.trace(_attention, q, k, v)
        report = remat.report(_attention, q, k, v, policy=policies.save_nothing)
        keep_attention = remat.report(_attention, q, k, v, policy=policies.save_ops(*ops.values()))
    called = [call.op for call in trace]
    if kernel is None:  # the math kernel: the T x T probabilities, dropout drawn by its own call
        assert not set(called) & set(ops.values())
        assert any(call.op is torch.ops.aten.native_dropout.default for call in trace)
        return
    (attention,) = [call for call in trace if call.op is ops[kernel]]
    # Dropout is drawn inside the kernel, from the CUDA generator: saving nothing keeps one 16-byte state
    # and replays the kernel in backward with it.
    assert attention.is_random and sum(call.is_random for call in trace) == 1
    assert report.saved_bytes == 16
    assert attention.index in {row.call.index for row in report.rows if row.replayed}
    # Saved, the kernel keeps its output, its log-sum-exps and its Philox seed and offset, never T x T.
    assert 0 < keep_attention.saved_bytes < 2 * 4 * 128 * 128 * dtype.itemsize
    assert attention.index not in {row.call.index for row in keep_attention.rows if row.replayed}


@needs_fake_cuda
def test_fit_plans_attention_for_the_assumed_gpu() -> None:
    # The math kernel (a V100 in bfloat16) keeps the T x T probabilities that flash (an H100) does not.

    peaks = {}
    for gpu in ("H100", "V100"):
        with torch.device("meta"):
            model = torch.nn.Sequential(*[NoisyAttentionBlock() for _ in range(2)]).to(BF16)
        x = torch.empty(4, 256, 64, device="meta", dtype=BF16)
        with remat.assume_gpu(gpu):
            plan = remat.fit(model, NoisyAttentionBlock, x, peak_bytes=2**40, loss=square_loss, device="cuda")
        peaks[gpu] = plan.report.peak_keeping_everything
    assert peaks["V100"] > peaks["H100"] + 2 * 4 * 4 * 256 * 256 * 2  # at least the probabilities of one block
