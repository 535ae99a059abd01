"""The GPU assumed where none is present (remat/_memory/_gpu.py): SDPA's kernel chosen as that GPU would choose it,
and CUDA programs on fake CUDA tensors traced and planned with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fit import square_loss
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import _torch, policies
from remat._core import _cache
from remat._memory._gpu import DEFAULT_GPU, Gpu, assumed_gpu, sdpa_backend
from remat._tracing._engine import walked_backward

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
        assert not any(
            isinstance(m.__dict__.get("forward"), remat._api._apply.CheckpointedForward) for m in model.modules()
        )
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
    # Its backward op reads the Philox seed and offset the forward kernel returned: the dropout mask is drawn
    # again, never kept.
    graph_nodes = list(trace._joint.graph.nodes)
    (forward,) = [node for node in graph_nodes if node.target is ops[kernel]]
    (backward,) = [
        node for node in graph_nodes if str(node.target) == str(ops[kernel]).replace(".default", "_backward.default")
    ]
    read = {
        a.name: arg.meta["val"].numel()
        for a, arg in zip(backward.target._schema.arguments, backward.args, strict=False)
        if a.name.startswith("philox") and arg.args[0] is forward  # outputs of the forward kernel
    }
    assert read.keys() == {"philox_seed", "philox_offset"} and max(read.values()) <= 2  # (a seed and an offset)
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


class _OpCalls(TorchDispatchMode):
    """Every op call below it, with its arguments as given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))

    def of(self, op: Any) -> list[tuple[Any, ...]]:
        return [args for func, args in self.calls if func is op]


def _step(fn: Any, x: torch.Tensor) -> None:
    """Forward and backward, the backward walked (autograd's engine needs the GPU)."""
    loss = fn(x).sum()
    walked_backward([loss], [torch.ones_like(loss)])


def _same_memory(*pairs: Any) -> bool:
    """Whether each tensor of the pairs `a, b, c, d, ...` is in the memory of its partner (a Function may
    hand its kernels aliases of what it was given)."""
    return all(
        isinstance(a, torch.Tensor) and a.untyped_storage()._cdata == b.untyped_storage()._cdata
        for a, b in zip(pairs[::2], pairs[1::2], strict=True)
    )


def _rounded_as_cuda(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the caching allocator's smallest blocks (docs/fit.md)


@needs_fake_cuda
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_cuda_batch_norm_updates_its_statistics_once(policy: Any) -> None:
    # On a GPU, training-mode batch norm is cuDNN's kernel, which updates the running statistics in place
    # without its schema saying so (`_quirks.BATCH_NORM_UPDATES_UNDECLARED`): a replay would update them
    # again. Its backward takes the running statistics and does not read them: nothing keeps them.
    aten = torch.ops.aten
    with _torch.FakeTensorMode(), torch.device("cuda"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        x = torch.empty(2, 3, 16, 16, requires_grad=True)
    norm = model[1]
    checkpointed = remat.checkpoint(model, policy=policy)
    _step(checkpointed, x)  # traced here
    for fn in (model, checkpointed):
        with _OpCalls() as ops:
            _step(fn, x)
        forward = ops.of(aten.cudnn_batch_norm.default)
        updating = [args for args in forward if _same_memory(args[3], norm.running_mean, args[4], norm.running_var)]
        assert len(updating) == 1
        replays = [args for args in forward if args[3] is None and args[4] is None]
        assert len(replays) == (1 if fn is checkpointed and policy is policies.save_nothing else 0)
        assert len(forward) == len(updating) + len(replays)
        (backward,) = ops.of(aten.cudnn_batch_norm_backward.default)
        assert (backward[3] is None) == (fn is checkpointed)  # eager's autograd passes them on
    # What saving everything keeps is what eager's autograd saves, in blocks of CUDA's allocator: the
    # convolution's and ReLU's outputs, the batch statistics (and cuDNN's empty reserve).
    saved: dict[int, int] = {}
    kept_anyway = {id(t) for t in (x, *model.parameters(), *model.buffers())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in kept_anyway:
            saved[id(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    report = remat.report(model, x, policy=policies.save_everything)
    assert report.saved_bytes == sum(_rounded_as_cuda(n) for n in saved.values()) > 0
    assert remat.report(model, x, policy=policies.save_nothing).saved_bytes == 0


@needs_fake_cuda
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")  # torch's RNN module's
@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_an_op_that_runs_only_on_a_gpu_says_so(rnn: type[nn.RNNBase]) -> None:
    # torch asks the CUDA driver for cuDNN's RNNs (and for the fused GRU cell) even on fake tensors.
    with _torch.FakeTensorMode(), torch.device("cuda"):
        layer, x = rnn(8, 8, batch_first=True), torch.empty(2, 5, 8, requires_grad=True)

    def run(x: torch.Tensor) -> torch.Tensor:
        return layer(x)[0]

    with pytest.raises(remat.TraceError, match=r"runs only on a GPU, and this machine has none.*cudnn.flags"):
        remat.trace(run, x)
    if rnn is nn.LSTM:  # what the message offers: the kernels without cuDNN (the fused GRU cell, before
        with torch.backends.cudnn.flags(enabled=False):  # torch 2.15, asks the driver too)
            assert "aten._thnn_fused_lstm_cell.default" in {call.name for call in remat.trace(run, x)}


def test_cuda_rms_norm_kernel_is_differentiated_as_eager() -> None:
    # On CUDA, `F.rms_norm` runs the fused kernel, whose gradient formula switches form in grad mode and
    # whose tangent formula reads the inverse deviation it returns (with a derivative of its own). torch has
    # a CPU kernel of it too: first and second derivatives, and `grad` of `jvp`, against float64 differences.
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(8, dtype=torch.float64, requires_grad=True)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._fused_rms_norm(x, [8], weight, 1e-5)[0].sin()

    checkpointed = remat.checkpoint(norm)
    if next(call.name for call in remat.trace(norm, x, weight)) != "aten._fused_rms_norm.default":
        release = ".".join(torch.__version__.split(".")[:2])
        pytest.skip(
            f"torch {release}: the CPU runs `_fused_rms_norm` as its decomposition (the fused kernel from 2.14)"
        )
    for a, b in zip(
        torch.autograd.grad(norm(x, weight).sum(), (x, weight)),
        torch.autograd.grad(checkpointed(x, weight).sum(), (x, weight)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.autograd.gradgradcheck(checkpointed, (x, weight))
    tangent = torch.ones_like(x)
    assert torch.autograd.gradcheck(
        lambda x, w: torch.func.jvp(lambda x: checkpointed(x, w), (x,), (tangent,))[1], (x, weight)
    )
