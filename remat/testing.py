"""Property-test your own code with remat: random functions, inputs, policies and an equivalence check.

`remat.checkpoint` promises the outputs and gradients of the function it
wraps, whatever the policy. This module lets users (and remat's own test
suite) check that promise on their models and on random programs: hypothesis
strategies that draw random functions from a catalog of aten-level behaviours
(`functions`), inputs for them (`inputs`) and per-call policies for a trace
(`policies`), and `assert_checkpoint_equivalent`, which compares a function
with its checkpoint and explains any difference.

It needs `hypothesis` (an optional dependency), so `import remat` does not
import it; use `import remat.testing`.

>>> import torch, remat.testing
>>> remat.testing.assert_checkpoint_equivalent(lambda x: x.sin().exp(), torch.randn(3, requires_grad=True))
CheckpointedRun(outputs=Tensor(shape=(3,), dtype=torch.float32), input_grads=(Tensor(shape=(3,), dtype=torch.float32),), param_grads=())
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from . import _objects, _offload
from . import policies as _policies
from ._calls import Call, Decision, Trace
from ._checkpoint import checkpoint as _remat_checkpoint
from ._pytree import NAMESPACE
from ._torch import import_jvp_decompositions, version_counter

__all__ = [
    "AS_STRIDED_WRITES",
    "CATALOG",
    "CheckpointedRun",
    "RandomFunction",
    "Step",
    "assert_checkpoint_equivalent",
    "functions",
    "inputs",
    "offloading_on_cpu",
    "policies",
    "transforms_for",
]

# --- the catalog -----------------------------------------------------------------------------------


class CatalogState(torch.nn.Module):
    """What the stateful catalog ops of one random function keep between its calls.

    A user `torch.Generator` that `rand_from_generator` and `branch_on_generator` draw from, and a
    `BatchNorm1d(rows, momentum=None)` in training mode that `batch_norm_momentum_none` runs (its
    running statistics and `num_batches_tracked` change at every call, and its update reads
    `num_batches_tracked` in Python: a value read). Both start from the function's seed.
    `assert_checkpoint_equivalent` puts both back before the checkpoint's run and compares them after.

    >>> import remat.testing
    >>> state = remat.testing.CatalogState(rows=2, seed=0)
    >>> state.batch_norm.momentum is None and state.batch_norm.training
    True
    >>> state.generator.initial_seed()
    0
    """

    def __init__(self, rows: int, seed: int):
        super().__init__()
        self.batch_norm = torch.nn.BatchNorm1d(rows, momentum=None, dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(seed)


@dataclasses.dataclass(frozen=True)
class Constants:
    """Fixed tensors a random function closes over (weights, valid indices), for values shaped `(rows, cols)`,
    and the state its stateful ops keep (`CatalogState`)."""

    weight: torch.Tensor  # (cols, cols)
    bias: torch.Tensor  # (cols,)
    kernel: torch.Tensor  # (1, 1, 3), a conv1d weight
    permutation: torch.Tensor  # (cols,) a permutation of range(cols)
    column_index: torch.Tensor  # (rows, cols) integers in [0, cols)
    row_index: torch.Tensor  # (rows,) integers in [0, rows)
    state: CatalogState  # a user generator and a batch norm, which change at every call

    @staticmethod
    def make(rows: int, cols: int, seed: int) -> Constants:
        generator = torch.Generator().manual_seed(seed)
        return Constants(
            weight=torch.randn(cols, cols, generator=generator, dtype=torch.float64) / cols**0.5,
            bias=torch.randn(cols, generator=generator, dtype=torch.float64),
            kernel=torch.randn(1, 1, 3, generator=generator, dtype=torch.float64),
            permutation=torch.randperm(cols, generator=generator),
            column_index=torch.randint(0, cols, (rows, cols), generator=generator),
            row_index=torch.randint(0, rows, (rows,), generator=generator),
            state=CatalogState(rows, seed),
        )


def _c(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A constant moved to `like`'s device (and dtype, when floating)."""
    if tensor.is_floating_point():
        return tensor.to(device=like.device, dtype=like.dtype)
    return tensor.to(device=like.device)


def _bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    a, b = x.reshape(rows, 2, cols // 2), y.reshape(rows, 2, cols // 2)
    return torch.bmm(torch.bmm(a, b.transpose(1, 2)), a).reshape(rows, cols) / cols


def _permute(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    return x.reshape(rows, 2, cols // 2).permute(2, 0, 1).mul(2.0).permute(1, 2, 0).reshape(rows, cols)


def _inplace_view(x: torch.Tensor) -> torch.Tensor:
    t = x.clone()
    t[:, 0].mul_(2.0)
    return t


def _max_with_indices(x: torch.Tensor) -> torch.Tensor:
    values, indices = x.max(dim=1, keepdim=True)
    return x - values + x.gather(1, indices) * 0.5


def _topk(x: torch.Tensor) -> torch.Tensor:
    values, indices = x.topk(2, dim=1)
    return x + values.sum(1, keepdim=True) + indices.sum(1, keepdim=True).to(x.dtype) * 0.1


def _var_mean(x: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(x, dim=1, keepdim=True)
    return (x - mean) / (var + 1.0).sqrt()


def _argmax_one_hot(x: torch.Tensor) -> torch.Tensor:
    hot = x.argmax(dim=1, keepdim=True) == torch.arange(x.shape[1], device=x.device)
    return x + hot.to(x.dtype) * x


def _split_swap(x: torch.Tensor) -> torch.Tensor:
    head, tail = x.split([1, x.shape[1] - 1], dim=1)
    return torch.cat([tail, head * 2.0], dim=1)


def _chunk(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=1)
    c, d = y.chunk(2, dim=1)
    return torch.cat([a * d, b + c], dim=1)


def _cat_split(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a, b = torch.cat([x, y], dim=0).sin().split(x.shape[0], dim=0)
    return a * b


def _normal_in_strided_view(x: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t[:, ::2].normal_()  # an in-place random fill of a non-contiguous view
    return t * x


def _exponential_in_row_view(x: torch.Tensor) -> torch.Tensor:
    t = x.cos()
    t[::2].exponential_()
    return t * x


def _batch_norm_transposed(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (2, cols, rows): a non-contiguous input. Not `stack([x, y])`: for y = x, every channel's variance
    # would be zero, its gradient amplified by 1 / sqrt(eps), and bfloat16's rounding of it anyone's guess.
    channels_first = torch.stack([x, 0.5 * y + 1.0]).transpose(1, 2)
    out = F.batch_norm(channels_first, None, None, training=True)
    # The CPU kernel returns a contiguous tensor whatever its input's layout: `view` relies on it.
    return out.view(-1)[: x.numel()].view(x.shape[1], x.shape[0]).t()


def _scale_without_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # an update autograd does not record, of whatever `x` is (an input too)
        x.mul_(0.5)
    return x


def _neg_split_output(x: torch.Tensor) -> torch.Tensor:
    head, tail = x.detach().sin().split([1, x.shape[1] - 1], dim=1)
    tail.neg_()  # in place on an output of a multi-output view op
    return x * torch.cat([head, tail], dim=1)


def _fill_through_expand(x: torch.Tensor) -> torch.Tensor:
    t = x * 1.0
    t.expand(*t.shape).uniform_(-1.0, 1.0)  # an `expand` that expands nothing: a plain alias
    return t * x


def _rand_from_generator(x: torch.Tensor, c: Constants) -> torch.Tensor:
    # Drawn on the CPU in float64 whatever `x` is, so that one generator serves every device and dtype.
    noise = torch.rand(x.shape, generator=c.state.generator, dtype=torch.float64)
    return x + 0.1 * noise.to(x)


def _branch_on_generator(x: torch.Tensor, c: Constants) -> torch.Tensor:
    # A value read of a draw from a user generator: another branch at a later call, which a traced
    # function meets as a failed value check.
    if torch.rand((), generator=c.state.generator, dtype=torch.float64) < 0.5:
        return x.sin()
    return x.cos()


def _batch_norm_momentum_none(x: torch.Tensor, y: torch.Tensor, c: Constants) -> torch.Tensor:
    # (2, rows, cols): `rows` channels of 2 * cols values each, so training mode always has more than
    # one value per channel. With momentum=None the update of the running statistics reads
    # num_batches_tracked in Python. On the CPU in float64, where the module lives.
    out = c.state.batch_norm(torch.stack([x, y]).to(device="cpu", dtype=torch.float64)).to(x)
    return out[0] + 0.5 * out[1]


def _detached_rows_view(x: torch.Tensor) -> torch.Tensor:
    return x.detach()[:1].expand(x.shape)  # a view (of a view) of a detached alias


def _mul_through_unfold_window(x: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.unfold(1, t.shape[1], 1).mul_(2.0)  # one window as long as a row: no two elements overlap
    return t


def _normal_through_unfold_window(x: torch.Tensor) -> torch.Tensor:
    t = x.cos()
    t.unfold(1, t.shape[1], 1).normal_()
    return t * x


def _mul_through_unfold_gaps(x: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.unfold(1, 1, 2).mul_(2.0)  # windows of one element, two apart: the elements between are not in it
    return t


def _mul_through_as_strided_of_view(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    t = x.sin().contiguous()  # as_strided's strides count in the storage: that of a contiguous tensor
    t.view(-1).as_strided((rows, cols // 2), (cols, 2)).mul_(2.0)  # every other column, through a view
    return t


def _mul_through_interleaved_as_strided(x: torch.Tensor) -> torch.Tensor:
    t = x.sin().repeat(4, 1)  # at least 8 elements
    # Elements 2i + 3j: 0, 3, 2, 5, 4, 7, distinct, though each stride is within the other's extent.
    t.as_strided((3, 2), (2, 3)).mul_(2.0)
    return t.view(4, *x.shape).mean(0)


def _normal_through_leading_expand(x: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.expand(1, *t.shape)[0, :, ::2].normal_()  # an `expand` that adds a dimension of one: no overlap
    return t * x


def _bernoulli_transposed_attention(x: torch.Tensor) -> torch.Tensor:
    t = x.cos().unsqueeze(0).mT  # (1, cols, rows), transposed
    t.bernoulli_(0.5)
    out = F.scaled_dot_product_attention(t, t.sin(), t, is_causal=True)  # its strides follow its inputs'
    return out.squeeze(0).t() * x


def _bernoulli_reshaped_transposed(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    t = x.cos().reshape(rows, 2, cols // 2).mT  # a transpose of a view of an intermediate
    t.bernoulli_(0.5)
    return t.mT.reshape(rows, cols) * x


def _log_sigmoid_transposed(x: torch.Tensor) -> torch.Tensor:
    # The CPU kernel returns a contiguous tensor whatever its input's layout (a CUDA one follows the
    # input's): `view` relies on it.
    rows, cols = x.shape
    return F.logsigmoid(x.t().to("cpu")).view(-1).view(cols, rows).t().to(x.device)


def _slice_assign_transposed_clone(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    t = x.contiguous().t().clone()  # keeps the transposed strides, so that t.t() is contiguous
    t[1:] = y.t()[1:] * 2.0
    flat = F.logsigmoid(t.to("cpu")).view(-1).to(x.device)  # contiguous on the CPU, as above
    return t.t().view(-1).view(x.shape) * flat.view(cols, rows).t()


def _uniform_transposed_clone(x: torch.Tensor) -> torch.Tensor:
    t = x.contiguous().t().clone()
    t[::2].uniform_()  # a random fill, in memory order, of rows of a non-contiguous intermediate
    return t.t().view(-1).view(x.shape) * x


def _normal_transposed_reduced(x: torch.Tensor) -> torch.Tensor:
    t = x.sin().t().contiguous().t()  # a copy of x.sin() in column-major layout
    t.normal_()
    return x * t.sum(1, keepdim=True) + t.amax(0, keepdim=True)


def _scale_transposed_slice_without_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # through a transposed slice: a view of `x` that is not a plain slice of it
        x.t()[1:].mul_(0.5)
    return x


def _assign_transposed_column_without_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # an assignment (`__setitem__`) through a selected column of the transpose
        # (of a tensor, not a scalar: eager refuses it, as remat does, where `x`'s elements overlap)
        x.t()[-1] = x.t()[0] * 0.5
    return x


# Each entry maps (x, y, constants) -> a tensor shaped like x; y is another value of the same shape.
# Every one is well-defined and differentiable almost everywhere on random float inputs.
_Op = Callable[[torch.Tensor, torch.Tensor, Constants], torch.Tensor]
CATALOG: dict[str, tuple[int, _Op]] = {
    # pointwise unary
    "sin": (1, lambda x, y, c: x.sin()),
    "cos": (1, lambda x, y, c: x.cos()),
    "exp_tanh": (1, lambda x, y, c: x.tanh().exp()),
    "tanh": (1, lambda x, y, c: x.tanh()),
    "relu": (1, lambda x, y, c: F.relu(x)),
    "gelu": (1, lambda x, y, c: F.gelu(x)),
    "sigmoid": (1, lambda x, y, c: x.sigmoid()),
    "abs": (1, lambda x, y, c: x.abs()),
    "square": (1, lambda x, y, c: x.pow(2)),
    "sqrt_1p_sq": (1, lambda x, y, c: (x * x + 1.0).sqrt()),
    "log_1p_sq": (1, lambda x, y, c: torch.log(x * x + 1.0)),
    "rsqrt": (1, lambda x, y, c: (x * x + 1.0).rsqrt()),
    "clamp": (1, lambda x, y, c: x.clamp(-1.0, 1.0)),
    "leaky_where": (1, lambda x, y, c: torch.where(x > 0, x, 0.1 * x)),
    "masked_fill": (1, lambda x, y, c: x.masked_fill(x < -1.0, 0.0)),
    # pointwise binary
    "mul": (2, lambda x, y, c: x * y),
    "add": (2, lambda x, y, c: x + y),
    "sub_alpha": (2, lambda x, y, c: torch.sub(x, y, alpha=0.5)),
    "div_safe": (2, lambda x, y, c: x / (1.0 + y * y)),
    "pow_tensor": (2, lambda x, y, c: (x * x + 1.0).pow(y.tanh())),
    "where_compare": (2, lambda x, y, c: torch.where(x > y, x, 0.5 * y)),
    # reductions
    "sum_keepdim": (1, lambda x, y, c: x - x.sum(-1, keepdim=True) / x.shape[-1]),
    "sum": (1, lambda x, y, c: x * x.sum(1).tanh().unsqueeze(1)),
    "sum_all": (1, lambda x, y, c: x * x.sum().tanh()),
    "mean_keepdim": (1, lambda x, y, c: x + x.mean(0, keepdim=True)),
    "mean": (1, lambda x, y, c: x - x.mean(1)[:, None]),
    "amax_keepdim": (1, lambda x, y, c: x - x.amax(-1, keepdim=True)),
    "amax": (1, lambda x, y, c: x * x.amax(0).sigmoid()),
    "logsumexp": (1, lambda x, y, c: x - torch.logsumexp(x, -1, keepdim=True)),
    "logsumexp_nokeep": (1, lambda x, y, c: x + torch.logsumexp(x, 0)),
    "var_mean": (1, lambda x, y, c: _var_mean(x)),
    "cumsum": (1, lambda x, y, c: x.cumsum(1) * 0.5),
    # matmuls
    "matmul": (2, lambda x, y, c: (x @ y.t()) @ x / x.shape[1]),
    "bmm": (2, lambda x, y, c: _bmm(x, y)),
    "linear": (1, lambda x, y, c: F.linear(x, _c(c.weight, x), _c(c.bias, x))),
    # views
    "reshape": (1, lambda x, y, c: x.reshape(-1).sin().reshape(x.shape)),
    "transpose_flip": (1, lambda x, y, c: x.t().flip(0).t()),
    "expand": (1, lambda x, y, c: x + x[:, :1].expand(x.shape)),
    "slice_roll": (1, lambda x, y, c: torch.cat([x[:, 1:], x[:, :1]], dim=1)),
    "permute": (1, lambda x, y, c: _permute(x)),
    # indexing
    "index_select": (1, lambda x, y, c: x.index_select(1, _c(c.permutation, x))),
    "advanced_index": (1, lambda x, y, c: x[:, _c(c.permutation, x)] + x[_c(c.row_index, x)]),
    "gather": (1, lambda x, y, c: x.gather(1, _c(c.column_index, x))),
    "scatter_add": (2, lambda x, y, c: x.scatter_add(1, _c(c.column_index, x), y)),
    "embedding": (1, lambda x, y, c: F.embedding(_c(c.row_index, x), x)),
    # joining and splitting
    "cat_split": (2, lambda x, y, c: _cat_split(x, y)),
    "stack": (2, lambda x, y, c: torch.stack([x, y], dim=-1).sin().sum(-1)),
    "split": (1, lambda x, y, c: _split_swap(x)),
    "chunk": (2, lambda x, y, c: _chunk(x, y)),
    # in-place ops on intermediates
    "add_": (2, lambda x, y, c: x.clone().add_(y).mul_(0.5)),
    "mul_": (2, lambda x, y, c: x.sin().mul_(y)),
    "inplace_view": (1, lambda x, y, c: _inplace_view(x)),
    # multi-output ops
    "layer_norm": (1, lambda x, y, c: F.layer_norm(x, (x.shape[1],), _c(c.bias, x), _c(c.bias, x) * 0.5)),
    "max_with_indices": (1, lambda x, y, c: _max_with_indices(x)),
    "topk": (1, lambda x, y, c: _topk(x)),
    # normalisation
    "softmax": (1, lambda x, y, c: x.softmax(-1)),
    "log_softmax": (1, lambda x, y, c: F.log_softmax(x, dim=0)),
    # convolution
    "conv1d": (1, lambda x, y, c: F.conv1d(x.unsqueeze(1), _c(c.kernel, x), padding=1).squeeze(1)),
    # integer and boolean intermediates
    "argmax": (1, lambda x, y, c: _argmax_one_hot(x)),
    # random ops
    "dropout": (1, lambda x, y, c: F.dropout(x, 0.3, training=True)),
    "bernoulli": (1, lambda x, y, c: x * torch.bernoulli(torch.full_like(x, 0.7))),
    "rand_like": (1, lambda x, y, c: x + 0.1 * torch.rand_like(x)),
    "randn_like": (1, lambda x, y, c: x * (1.0 + 0.1 * torch.randn_like(x))),
    # random ops on non-contiguous tensors, and in place: they draw in memory order
    "dropout_transposed": (1, lambda x, y, c: F.dropout(x.t(), 0.3, training=True).t()),
    "bernoulli_transposed_": (1, lambda x, y, c: x * x.t().sin().bernoulli_(0.5).t()),
    "normal_strided_": (1, lambda x, y, c: _normal_in_strided_view(x)),
    "exponential_rows_": (1, lambda x, y, c: _exponential_in_row_view(x)),
    "uniform_through_expand_": (1, lambda x, y, c: _fill_through_expand(x)),
    # random ops whose derivative is zero: their outputs still require grad, as in eager
    "normal_of_bernoulli": (1, lambda x, y, c: torch.normal(torch.bernoulli(x.sigmoid()), 0.5)),
    # kernels that choose their output's layout (CPU batch norm and log-sigmoid: contiguous)
    "batch_norm_transposed": (2, lambda x, y, c: _batch_norm_transposed(x, y)),
    "log_sigmoid_transposed": (1, lambda x, y, c: _log_sigmoid_transposed(x)),
    # views of the operand (an input, maybe) through multi-output view ops, and updates of them
    "split_view": (1, lambda x, y, c: x.split(x.shape[0])[0]),
    "unbind_expand_view": (1, lambda x, y, c: x.unbind(0)[0].expand(x.shape)),
    "chunk_view": (1, lambda x, y, c: x.chunk(1, dim=1)[0]),
    "scale_without_grad_": (1, lambda x, y, c: _scale_without_grad(x)),
    "neg_split_output_": (1, lambda x, y, c: _neg_split_output(x)),
    # detached aliases of the operand (an input, an intermediate also returned, maybe) and views of them
    "detach": (1, lambda x, y, c: x.detach()),
    "detach_view": (1, lambda x, y, c: x.detach().view(x.shape)),
    "detach_rows_view": (1, lambda x, y, c: _detached_rows_view(x)),
    # stateful ops: a user generator, a value read of one of its draws, a batch norm that reads a buffer
    "rand_from_generator": (1, lambda x, y, c: _rand_from_generator(x, c)),
    "branch_on_generator": (1, lambda x, y, c: _branch_on_generator(x, c)),
    "batch_norm_momentum_none": (2, lambda x, y, c: _batch_norm_momentum_none(x, y, c)),
    # in-place ops through `unfold`, `as_strided` and `expand` views whose elements do not overlap
    "mul_unfold_window_": (1, lambda x, y, c: _mul_through_unfold_window(x)),
    "normal_unfold_window_": (1, lambda x, y, c: _normal_through_unfold_window(x)),
    "mul_unfold_gaps_": (1, lambda x, y, c: _mul_through_unfold_gaps(x)),
    "mul_as_strided_of_view_": (1, lambda x, y, c: _mul_through_as_strided_of_view(x)),
    "mul_interleaved_as_strided_": (1, lambda x, y, c: _mul_through_interleaved_as_strided(x)),
    "normal_leading_expand_": (1, lambda x, y, c: _normal_through_leading_expand(x)),
    # slice assignments and random fills of non-contiguous intermediates, then views, attention, reductions
    "bernoulli_transposed_attention_": (1, lambda x, y, c: _bernoulli_transposed_attention(x)),
    "bernoulli_reshaped_transposed_": (1, lambda x, y, c: _bernoulli_reshaped_transposed(x)),
    "slice_assign_transposed_clone": (2, lambda x, y, c: _slice_assign_transposed_clone(x, y)),
    "uniform_transposed_clone_": (1, lambda x, y, c: _uniform_transposed_clone(x)),
    "normal_transposed_reduced_": (1, lambda x, y, c: _normal_transposed_reduced(x)),
    # updates of the operand (an input, maybe) under no_grad through views of its transpose, returning it
    "scale_transposed_slice_without_grad_": (1, lambda x, y, c: _scale_transposed_slice_without_grad(x)),
    "assign_transposed_column_without_grad_": (1, lambda x, y, c: _assign_transposed_column_without_grad(x)),
}

# Catalog ops with which a program can be one eager refuses (at backward, when an earlier op saved the
# value they update); `functions()` leaves them out unless `refusable=True` or asked for by name.
REFUSABLE_OPS = frozenset(
    {"scale_without_grad_", "scale_transposed_slice_without_grad_", "assign_transposed_column_without_grad_"}
)

# Catalog ops that draw random numbers; `functions(random_ops=False)` leaves them out.
RANDOM_OPS = frozenset(
    {
        "dropout", "bernoulli", "rand_like", "randn_like", "dropout_transposed", "bernoulli_transposed_",
        "normal_strided_", "exponential_rows_", "uniform_through_expand_", "normal_of_bernoulli",
        "rand_from_generator", "branch_on_generator", "normal_unfold_window_", "bernoulli_transposed_attention_",
        "bernoulli_reshaped_transposed_", "uniform_transposed_clone_", "normal_transposed_reduced_",
        "normal_leading_expand_",
    }
)  # fmt: skip

# Catalog ops that write through an `as_strided` view: `torch.func.vmap` has no batching rule for their
# functional form, and remat's derivative under `torch.autograd.forward_ad` is not exact through them
# (remat says so under both; docs/testing.md). `transforms_for` leaves those transforms out.
AS_STRIDED_WRITES = frozenset({"mul_as_strided_of_view_", "mul_interleaved_as_strided_"})

# Catalog ops that change the function's `CatalogState` (its user generator, its batch norm's buffers), so
# that two calls differ unless that state is put back between them, as `assert_checkpoint_equivalent` does;
# `functions()` leaves them out unless `stateful=True` or asked for by name.
STATEFUL_OPS = frozenset({"rand_from_generator", "branch_on_generator", "batch_norm_momentum_none"})


@dataclasses.dataclass(frozen=True)
class Step:
    """One op of a random function: `values[len(values)] = CATALOG[op](values[x], values[y])`.

    >>> import remat.testing
    >>> step = remat.testing.Step("mul", 0, 1)
    >>> step
    Step(op='mul', x=0, y=1)
    >>> remat.testing.CATALOG[step.op][0]  # how many operands the op reads (a unary op ignores `y`)
    2
    """

    op: str
    x: int
    y: int


@dataclasses.dataclass(frozen=True)
class RandomFunction:
    """A random straight-line program over same-shaped float tensors, drawn by `functions()`.

    Values `v0 .. v{n_inputs-1}` are the inputs (the tensor leaves of the
    arguments, in `optree` order, so any pytree of tensors works); each step
    appends one value; the function returns the values at `outputs`.

    Attributes:
        shape: the shape of every input and intermediate, `(rows, cols)`.
        n_inputs: how many input tensors it takes.
        steps: the ops, in order.
        outputs: indices of the returned values (a tensor if one, else a tuple).
        seed: the seed of its closed-over constants.

    >>> import torch, remat.testing
    >>> from remat.testing import RandomFunction, Step
    >>> fn = RandomFunction(shape=(2, 3), n_inputs=1, steps=(Step("sin", 0, 0), Step("mul", 0, 1)), outputs=(2,))
    >>> fn
    RandomFunction(shape=(2, 3), inputs=1, seed=0, ops=[v1 = sin(v0); v2 = mul(v0, v1)], outputs=(v2))
    >>> x = torch.ones(2, 3)
    >>> torch.equal(fn(x), x * x.sin())
    True
    """

    shape: tuple[int, int]
    n_inputs: int
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    seed: int = 0
    constants: Constants = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "constants", Constants.make(*self.shape, seed=self.seed))

    @property
    def state(self) -> CatalogState:
        """The module holding what its stateful ops change at every call (`CatalogState`): its
        parameters are the `params` that `assert_checkpoint_equivalent` compares by default, its
        buffers and generator are put back before each run and compared after."""
        return self.constants.state

    @property
    def input_shapes(self) -> tuple[tuple[int, int], ...]:
        """The shape of each input tensor."""
        return (self.shape,) * self.n_inputs

    @property
    def ops(self) -> tuple[str, ...]:
        """The catalog names of its steps."""
        return tuple(step.op for step in self.steps)

    def __call__(self, *args: Any) -> Any:
        values = _tensor_leaves(args)
        if len(values) != self.n_inputs:
            raise TypeError(f"{self!r}: expected {self.n_inputs} input tensors, but got {len(values)}.")
        for step in self.steps:
            values.append(CATALOG[step.op][1](values[step.x], values[step.y], self.constants))
        results = tuple(values[i] for i in self.outputs)
        return results[0] if len(results) == 1 else results

    def __repr__(self) -> str:
        lines = []
        for i, step in enumerate(self.steps, start=self.n_inputs):
            operands = f"v{step.x}, v{step.y}" if CATALOG[step.op][0] == 2 else f"v{step.x}"
            lines.append(f"v{i} = {step.op}({operands})")
        outputs = ", ".join(f"v{i}" for i in self.outputs)
        return (
            f"RandomFunction(shape={self.shape}, inputs={self.n_inputs}, seed={self.seed}, "
            f"ops=[{'; '.join(lines)}], outputs=({outputs}))"
        )


@st.composite
def functions(
    draw: st.DrawFn,
    *,
    min_ops: int = 1,
    max_ops: int = 6,
    max_inputs: int = 2,
    ops: Sequence[str] | None = None,
    random_ops: bool = True,
    return_inputs: bool = True,
    refusable: bool = False,
    stateful: bool = False,
) -> RandomFunction:
    """Draw a random function of float tensors built from the ops in `CATALOG`.

    Each step applies one catalog op to earlier values (inputs or results), so
    drawn functions mix pointwise ops, reductions, matmuls, views, indexing,
    in-place updates, multi-output ops, convolutions and random ops in any
    order. Hypothesis shrinks failures to short programs with readable reprs.

    Args:
        min_ops: fewest steps.
        max_ops: most steps.
        max_inputs: most input tensors (at least one).
        ops: catalog names to draw from (default: the whole catalog).
        random_ops: whether to include ops that draw random numbers.
        refusable: whether to include ops that can make a program eager refuses (`REFUSABLE_OPS`:
            an update, autograd does not see, of a value backward reads). Only a checker that
            expects errors where eager raises (`assert_checkpoint_equivalent` does) wants them.
        return_inputs: whether an input may also be returned as an extra output.
        stateful: whether to include ops that change the function's `CatalogState` (`STATEFUL_OPS`:
            draws from a user generator, a batch norm's running statistics), so that one call differs
            from the next. Only a checker that puts that state back between the runs it compares
            (`assert_checkpoint_equivalent` does) wants them.

    Returns:
        A strategy of `RandomFunction`s.

    >>> import torch, remat.testing
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5, derandomize=True, database=None)
    ... @given(remat.testing.functions(max_ops=3))
    ... def test(fn):
    ...     assert isinstance(fn(*[torch.randn(s) for s in fn.input_shapes]), (torch.Tensor, tuple))
    >>> test()
    """
    names = sorted(ops if ops is not None else CATALOG)
    if not random_ops:
        names = [name for name in names if name not in RANDOM_OPS]
    if not refusable and ops is None:
        names = [name for name in names if name not in REFUSABLE_OPS]
    if not stateful and ops is None:
        names = [name for name in names if name not in STATEFUL_OPS]
    unknown = set(names) - set(CATALOG)
    if unknown or not names:
        raise ValueError(
            f"remat.testing.functions: expected a non-empty list of names from remat.testing.CATALOG, "
            f"but got unknown names {sorted(unknown)}."
        )
    rows = draw(st.integers(1, 3))
    cols = draw(st.sampled_from([2, 4, 6]))
    n_inputs = draw(st.integers(1, max(1, max_inputs)))
    n_steps = draw(st.integers(min_ops, max_ops))
    steps = []
    for i in range(n_steps):
        n_values = n_inputs + i
        op = draw(st.sampled_from(names))
        # Prefer the latest value as the first operand, so programs are deep rather than wide.
        x = draw(st.one_of(st.just(n_values - 1), st.integers(0, n_values - 1)))
        y = draw(st.integers(0, n_values - 1)) if CATALOG[op][0] == 2 else x
        steps.append(Step(op, x, y))
    last = n_inputs + n_steps - 1
    first_returnable = 0 if return_inputs else n_inputs
    extra = (
        draw(st.lists(st.integers(first_returnable, last - 1), max_size=2, unique=True))
        if last > first_returnable
        else []
    )
    seed = draw(st.integers(0, 2**16))
    return RandomFunction((rows, cols), n_inputs, tuple(steps), (last, *extra), seed)


@st.composite
def inputs(
    draw: st.DrawFn,
    fn: RandomFunction,
    *,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    pytree: bool = False,
    all_require_grad: bool = False,
) -> tuple[Any, ...]:
    """Draw positional arguments for a random function: float tensors, optionally nested in a pytree.

    Each input requires grad unless hypothesis decides otherwise (at least
    one always does). With `pytree=True` the tensors come nested in a random
    structure of tuples, lists and dicts, which `RandomFunction` accepts.

    Args:
        fn: the function the inputs are for.
        dtype: a floating dtype.
        device: where to put the tensors.
        pytree: whether to nest them in tuples, lists and dicts.
        all_require_grad: make every input require grad (by default each may not).

    Returns:
        A strategy of argument tuples: call `fn(*args)`.

    >>> import torch, remat.testing
    >>> from hypothesis import given, settings
    >>> fn = remat.testing.RandomFunction((2, 4), 2, (remat.testing.Step("mul", 0, 1),), (2,))
    >>> fn
    RandomFunction(shape=(2, 4), inputs=2, seed=0, ops=[v2 = mul(v0, v1)], outputs=(v2))
    >>> @settings(max_examples=5, derandomize=True, database=None)
    ... @given(remat.testing.inputs(fn, pytree=True))
    ... def test(args):
    ...     assert fn(*args).shape == (2, 4)
    >>> test()
    """
    seed = draw(st.integers(0, 2**32 - 1))
    generator = torch.Generator().manual_seed(seed)
    if all_require_grad:
        requires_grad = [True] * fn.n_inputs
    else:
        requires_grad = draw(st.lists(st.booleans(), min_size=fn.n_inputs, max_size=fn.n_inputs))
        requires_grad[draw(st.integers(0, fn.n_inputs - 1))] = True
    tensors = [
        torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device).requires_grad_(rg)
        for shape, rg in zip(fn.input_shapes, requires_grad, strict=True)
    ]
    if not pytree:
        return tuple(tensors)
    groups: list[Any] = []
    remaining = list(tensors)
    while remaining:
        size = draw(st.integers(1, len(remaining)))
        group, remaining = remaining[:size], remaining[size:]
        kind = draw(st.sampled_from(["leaf", "tuple", "list", "dict"]))
        if kind == "leaf" and len(group) == 1:
            groups.append(group[0])
        elif kind == "list":
            groups.append(list(group))
        elif kind == "dict":
            groups.append({f"t{i}": t for i, t in enumerate(group)})
        else:
            groups.append(tuple(group))
    return tuple(groups)


# --- policies ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PerCallPolicy:
    """A callable policy answering from a fixed table of decisions by `Call.index`.

    Calls past the end of the table (a trace under a torch.func transform can have
    more calls than the trace the table was drawn for) are recomputed.
    """

    saved: tuple[bool, ...]
    as_decision: bool

    def __call__(self, call: Call) -> Decision | bool:
        save = call.index < len(self.saved) and self.saved[call.index]
        if self.as_decision:
            return Decision.SAVE if save else Decision.RECOMPUTE
        return save

    def __repr__(self) -> str:
        return f"per_call({''.join('S' if s else 'R' for s in self.saved)})"


def offloading_on_cpu() -> contextlib.AbstractContextManager[None]:
    """Within this context, offloaded CPU tensors are copied for real.

    A CPU tensor is its own host copy, so offloading on the CPU copies nothing. Inside this
    context the copies are made (a new tensor to the host in forward, another back in
    backward), so a test on any machine follows what a GPU run does: the value the forward
    made is freed once forward no longer reads it, the copy is what `saved_tensors_hooks`
    see, and backward reads a third tensor.

    >>> import torch, remat, remat.testing
    >>> f = remat.checkpoint(lambda x: x.sin().sin().sum(), policy=remat.policies.offload(remat.policies.save_everything))
    >>> x = torch.ones(3, requires_grad=True)
    >>> with remat.testing.offloading_on_cpu():
    ...     f(x).backward()
    >>> torch.allclose(x.grad, torch.cos(torch.sin(x)) * torch.cos(x))
    True
    """
    return _offload.copies_on_cpu()


@dataclasses.dataclass(frozen=True)
class _PerCallDecisions:
    """A callable policy answering from a fixed table of `remat.Decision`s by `Call.index` (recompute
    past its end)."""

    decisions: tuple[Decision, ...]

    def __call__(self, call: Call) -> Decision:
        return self.decisions[call.index] if call.index < len(self.decisions) else Decision.RECOMPUTE

    def __repr__(self) -> str:
        return f"per_call({''.join(d.name[0] for d in self.decisions)})"


def policies(trace: Trace, *, save_calls: bool = True, offload: bool = False) -> st.SearchStrategy[Any]:
    """Draw random policies for the calls of `trace`.

    Mixes the constant policies, `remat.policies.save_calls` of random subsets
    of the calls, plain callables that answer per call (with `bool`s or
    `remat.Decision`s), so that every save/recompute split is reachable, and,
    where scipy is installed, the planner `remat.policies.budget`. With
    `offload`, also per-call tables of SAVE, OFFLOAD and RECOMPUTE (every
    three-way split is reachable) and `remat.policies.offload_dots`.

    Args:
        trace: the `remat.Trace` of the function the policies are for.
        save_calls: whether to draw `save_calls` policies, which refuse a trace without the calls
            they name. Under a torch.func transform a function can trace to fewer calls (its inputs
            require grad otherwise): leave them out there.
        offload: whether to draw policies that offload some calls to host memory.

    Returns:
        A strategy of policies accepted by `remat.checkpoint(fn, policy=...)`.

    >>> import torch, remat, remat.testing
    >>> trace = remat.trace(lambda x: x.sin().cos(), torch.ones(3))
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5, derandomize=True, database=None, deadline=None)
    ... @given(remat.testing.policies(trace))
    ... def test(policy):
    ...     remat.testing.assert_checkpoint_equivalent(lambda x: x.sin().cos(), torch.ones(3, requires_grad=True), policy=policy)
    >>> test()
    """
    n = len(trace)
    subsets = st.lists(st.integers(0, n - 1), unique=True, max_size=n) if n else st.just([])
    choices: list[st.SearchStrategy[Any]] = [
        st.sampled_from([None, _policies.save_nothing, _policies.save_everything]),
        st.builds(_PerCallPolicy, st.lists(st.booleans(), min_size=n, max_size=n).map(tuple), st.booleans()),
    ]
    if save_calls:
        choices.append(subsets.map(lambda indices: _policies.save_calls(*sorted(indices))))
    if importlib.util.find_spec("scipy") is not None:  # the planner's solver
        choices.append(st.just(_policies.budget(fraction=1.0)))  # a smaller budget may be infeasible
    if offload:
        three_way = st.lists(st.sampled_from(list(Decision)), min_size=n, max_size=n).map(tuple)
        choices += [st.builds(_PerCallDecisions, three_way), st.just(_policies.offload_dots)]
    return st.one_of(*choices)


# --- the equivalence check ----------------------------------------------------------------------------

# In float64, remat runs the same aten kernels as eager, in the same order in the forward: the
# outputs and gradients differ by round-off at most.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.complex128: (1e-10, 1e-12),
    torch.float32: (1e-4, 1e-5),
    torch.complex64: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (1e-2, 1e-2),
}
TRANSFORMS = (
    "grad",
    "vmap",
    "jvp",
    "vjp",
    "jvp_of_vmap",
    "vmap_of_jvp",
    "forward_ad",
    "grad_of_jvp",
    "grad_of_jvp_of_vmap",
    "grad_of_forward_ad",
    "grad_of_grad",
)
_BATCHED = frozenset({"vmap", "jvp_of_vmap", "vmap_of_jvp", "grad_of_jvp_of_vmap"})  # of stacked arguments
_UNDER_FUNC_JVP = frozenset({"jvp", "jvp_of_vmap", "vmap_of_jvp", "grad_of_jvp", "grad_of_jvp_of_vmap"})
_FORWARD_MODE = _UNDER_FUNC_JVP | {"forward_ad", "grad_of_forward_ad"}


def transforms_for(fn: RandomFunction) -> tuple[str, ...]:
    """The transforms (of `TRANSFORMS`) that `assert_checkpoint_equivalent` can compare for `fn`.

    Left out: `torch.func.jvp` where a catalog op may update an input in place (`REFUSABLE_OPS`: torch.func
    does not let a Function update the input's tangent in place, which remat says; nor, under
    `"grad_of_forward_ad"`, update a dual tensor, a view of a tensor that requires grad), the batched
    transforms and `forward_ad` for writes through `as_strided` (`AS_STRIDED_WRITES`: remat says it does
    not support them there).

    >>> import remat.testing
    >>> fn = remat.testing.RandomFunction((2, 3), 1, (remat.testing.Step("sin", 0, 0),), (1,))
    >>> remat.testing.transforms_for(fn) == remat.testing.TRANSFORMS
    True
    """
    ops = set(fn.ops)
    left_out: set[str] = set()
    if REFUSABLE_OPS & ops:
        left_out |= _UNDER_FUNC_JVP | {"grad_of_forward_ad"}
    if AS_STRIDED_WRITES & ops:
        left_out |= _BATCHED | {"forward_ad", "grad_of_forward_ad"}
    return tuple(t for t in TRANSFORMS if t not in left_out)


_API = "remat.testing.assert_checkpoint_equivalent"


@dataclasses.dataclass(frozen=True, eq=False)
class CheckpointedRun:
    """What the checkpointed function computed in `assert_checkpoint_equivalent`, which returns it.

    The check runs both functions on fresh copies of the arguments, so the
    gradients it compared are on tensors the caller never sees. A test that
    says more about the run (that an output needs no grad, that no gradient
    reached an integer input) reads them here. Where the check passed, they
    are also what `fn` computed, to within its tolerances.

    Attributes:
        outputs: the output pytree of the call.
        input_grads: the `.grad` of each input tensor after backward, or None
            where no gradient reached it: the tensor leaves of the positional
            arguments, then of the keyword arguments, in `optree` order (a
            dict's keys sorted).
        param_grads: the `.grad` of each tensor of `params`, in order, or None.

    >>> import torch, remat.testing
    >>> x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    >>> y = torch.randn(3, dtype=torch.float64)
    >>> run = remat.testing.assert_checkpoint_equivalent(lambda x, y: (x * y).sin(), x, y)
    >>> [grad is not None for grad in run.input_grads]
    [True, False]
    >>> run.outputs.shape
    torch.Size([3])
    """

    outputs: Any
    input_grads: tuple[torch.Tensor | None, ...]
    param_grads: tuple[torch.Tensor | None, ...]

    def __repr__(self) -> str:  # the tensors by shape and dtype: a model's would fill the screen
        fields = (f"{field.name}={_summary(getattr(self, field.name))}" for field in dataclasses.fields(self))
        return f"CheckpointedRun({', '.join(fields)})"


@dataclasses.dataclass(frozen=True)
class _TensorSummary:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype})"


def _summary(tree: Any) -> str:
    def summary(leaf: Any) -> Any:
        return _TensorSummary(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf

    return repr(optree.tree_map(summary, tree, none_is_leaf=False))


def _checkpoint(fn: Callable[..., Any], policy: Any) -> Callable[..., Any]:
    """How `assert_checkpoint_equivalent` wraps `fn` (a seam for testing the checker itself)."""
    return _remat_checkpoint(fn, policy=policy)


def _through_objects(function: Callable[[Any], Any], tree: Any) -> Any:
    """`function` of every leaf of `tree`, the leaves inside the objects a checkpointed function is handed
    included (made again around the new leaves): see NOTE [objects handed to a checkpointed function]."""
    mapped = optree.tree_map(function, _objects.opened(tree, NAMESPACE), none_is_leaf=False, namespace=NAMESPACE)
    return _objects.closed(mapped, NAMESPACE)


def _to_device(tree: Any, device: str | torch.device | None) -> Any:
    def move(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and device is not None:
            return leaf.detach().to(device).requires_grad_(leaf.requires_grad)
        return leaf

    return _through_objects(move, tree)


def _fresh(tree: Any) -> Any:
    def copy(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        return leaf

    return _through_objects(copy, tree)


def _detach(leaf: Any) -> Any:
    return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf


def _detached(tree: Any) -> Any:
    return optree.tree_map(_detach, tree, none_is_leaf=False)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    leaves = optree.tree_leaves(_objects.opened(tree, NAMESPACE), none_is_leaf=False, namespace=NAMESPACE)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _random_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.dtype).to(tensor.device)


def _is_float(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _scalar(fn: Callable[..., Any], seed: int) -> Callable[..., torch.Tensor]:
    """A scalar reduction of `fn`: the sum of each float output times a fixed random weight."""

    def scalar(*args: Any, **kwargs: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed + 1)
        outputs = [o for o in _tensor_leaves(fn(*args, **kwargs)) if _is_float(o)]
        return sum(((o * _random_like(o, generator)).sum() for o in outputs), torch.zeros(()))

    return scalar


def _transformed(name: str, fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    """`fn` under the torch.func transform `name`, as a function of the same arguments (or stacked
    positional ones); keyword arguments are passed through, neither differentiated nor batched."""
    if name == "grad":
        return torch.func.grad(_scalar(fn, seed))
    if name == "grad_of_grad":  # reverse mode over reverse mode, as `hessian` by `jacrev(jacrev(fn))`
        # Compared by value: a second derivative's layout is that of how its paths meet, not of the program.
        # Where the first backward both replays a call from an input and reads a value kept from it, the
        # input's second derivative arrives by two paths, summed (into a fresh tensor) at the input; eager's
        # meets before the call's derivative, whose view of the sum (a `stack`'s `select`) it returns.
        return _valued(torch.func.grad(_scalar(torch.func.grad(_scalar(fn, seed)), seed + 4)))
    if name == "vmap":
        return torch.func.vmap(fn, randomness="different")
    if name in _FORWARD_MODE:
        # The first forward-mode AD call in a process imports torch's jvp decompositions, which
        # warn (an error where warnings are errors): import them here, quietly.
        import_jvp_decompositions()
    if name == "jvp_of_vmap":
        return _jvp(torch.func.vmap(fn, randomness="different"), seed)
    # The derivatives of forward mode's results are compared by value, as tangents are: see `_by_value`.
    if name == "grad_of_jvp":  # reverse mode over forward mode
        return _valued(torch.func.grad(_scalar(_jvp(fn, seed), seed)))
    if name == "grad_of_jvp_of_vmap":  # and over a batch, as `jacrev(jacfwd(fn))`
        return _valued(torch.func.grad(_scalar(_jvp(torch.func.vmap(fn, randomness="different"), seed), seed)))
    if name == "grad_of_forward_ad":
        return _valued(_backward_of(_forward_ad(fn, seed), seed))
    if name == "vmap_of_jvp":

        def jvp_per_example(*primals_and_tangents: Any, **kwargs: Any) -> Any:
            half = len(primals_and_tangents) // 2
            primals, tangents = primals_and_tangents[:half], primals_and_tangents[half:]
            return torch.func.jvp(_bound(fn, kwargs), primals, tangents)

        def vmap_of_jvp(*primals: Any, **kwargs: Any) -> Any:
            tangents = _tangents(primals, seed)
            outputs, output_tangents = torch.func.vmap(
                functools.partial(jvp_per_example, **kwargs), randomness="different"
            )(*primals, *tangents)
            return outputs, _by_value(output_tangents)

        return vmap_of_jvp
    if name == "jvp":
        return _jvp(fn, seed)
    if name == "forward_ad":
        return _forward_ad(fn, seed)

    def vjp(*primals: Any, **kwargs: Any) -> Any:
        outputs, pullback = torch.func.vjp(_bound(fn, kwargs), *primals)[:2]
        generator = torch.Generator().manual_seed(seed + 3)
        cotangents = optree.tree_map(lambda t: _random_like(t, generator) if _is_float(t) else None, outputs)
        return outputs, pullback(cotangents)

    return vjp


def _valued(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: _by_value(fn(*args, **kwargs))


def _backward_of(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    """The gradient, by `torch.autograd.grad`, of a fixed random weighted sum of `fn`'s outputs with respect
    to its first argument (zeros where they do not depend on it)."""

    def backward(first: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
        first = first.detach().requires_grad_()
        with torch.enable_grad():
            loss = _scalar(fn, seed)(first, *rest, **kwargs)
            if not loss.requires_grad:
                return torch.zeros_like(first)
            (grad,) = torch.autograd.grad(loss, first, allow_unused=True)
        return torch.zeros_like(first) if grad is None else grad

    return backward


def _bound(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """`fn` with the keyword arguments a transform passes through, neither differentiated nor batched."""
    return functools.partial(fn, **kwargs) if kwargs else fn


def _tangents(primals: Sequence[Any], seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed + 2)
    return tuple(_random_like(t, generator) for t in primals)


def _by_value(tangents: Any) -> Any:
    """Tangents (and their derivatives) to compare by value alone. Their layouts are those of torch's
    derivative formulas (a zero tangent of an op without a derivative may be a broadcast, under vmap
    unbatched), not of the program."""
    return optree.tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, tangents, none_is_leaf=False)


def _jvp(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    def jvp(*primals: Any, **kwargs: Any) -> Any:
        outputs, tangents = torch.func.jvp(_bound(fn, kwargs), primals, _tangents(primals, seed))[:2]
        return outputs, _by_value(tangents)

    return jvp


def _forward_ad(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    """`fn` on dual tensors of `torch.autograd.forward_ad`: each output becomes (primal, tangent), a
    tangent autograd did not attach given as zeros (eager attaches zeros where an op has a derivative of
    zero, a random draw from a dual mean, where remat attaches none)."""

    def forward_ad(*primals: Any, **kwargs: Any) -> Any:
        with torch.autograd.forward_ad.dual_level():
            duals = [
                torch.autograd.forward_ad.make_dual(p, t) if isinstance(p, torch.Tensor) and _is_float(p) else p
                for p, t in zip(primals, _tangents(primals, seed), strict=True)
            ]
            outputs = fn(*duals, **kwargs)

            def unpacked(leaf: Any) -> Any:
                if not isinstance(leaf, torch.Tensor):
                    return leaf
                primal, tangent = torch.autograd.forward_ad.unpack_dual(leaf)
                return primal, _by_value(torch.zeros_like(primal) if tangent is None else tangent)

            return optree.tree_map(unpacked, outputs, none_is_leaf=False)

    return forward_ad


@dataclasses.dataclass
class _Output:
    """What is compared of one tensor output beyond its value: how it relates to autograd and to the inputs."""

    requires_grad: bool
    grad_fn: str | None  # the name of its grad_fn's type; None for a leaf
    layout: tuple[int, ...] | None  # the strides of its dimensions of size > 1
    aliases: tuple[int, ...]  # the input tensors whose memory it shares
    identity: int | None  # the input tensor it is, if any
    view_of: int | None  # the input tensor it is a view of (its `_base`), if any
    versions: tuple[int, ...] = ()  # the input tensors it shares a version counter with (views, detaches)


@dataclasses.dataclass
class _Run:
    tree: Any  # the output pytree
    outputs: list[Any]  # its leaves
    spec: Any
    metadata: list[_Output | None]  # per output (None for a non-tensor)
    inputs_after: list[torch.Tensor]  # the input tensors' values after the call (in-place updates)
    input_grads: list[torch.Tensor | None]
    param_grads: list[torch.Tensor | None]
    backpropagated: tuple[int, ...]  # the outputs given a cotangent
    rng_after: torch.Tensor  # the CPU generator's state after the call and backward
    cuda_rng_after: list[torch.Tensor]  # each CUDA device's default generator state, where CUDA is in use
    buffers_after: list[tuple[str, torch.Tensor]]  # the buffers of the module whose state is compared
    generators_after: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # by id, user generators


@dataclasses.dataclass(frozen=True)
class _Call:
    """How both functions are called and backpropagated through."""

    args: Any
    kwargs: dict[str, Any]
    params: Sequence[torch.Tensor]  # closed-over tensors whose `.grad` is compared
    seed: int
    backward: bool
    backprop: frozenset[int] | None  # the outputs to backpropagate through; None: every one
    calls: int = 1  # how many times in a row each function is called


@dataclasses.dataclass(frozen=True)
class _State:
    """The state both functions change that is put back before the checkpoint's run and compared after
    each call: the buffers of the module each side runs (None: no module to compare)."""

    expected_buffers: list[tuple[str, torch.Tensor]] | None
    actual_buffers: list[tuple[str, torch.Tensor]] | None

    def snapshot(self) -> list[torch.Tensor]:
        return [buffer.detach().clone() for _, buffer in self.actual_buffers or ()]

    def restore(self, saved: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for (_, buffer), value in zip(self.actual_buffers or (), saved, strict=True):
                buffer.copy_(value)


def _state_module(fn: Any) -> torch.nn.Module | None:
    """The module whose parameters and buffers `fn` runs: itself, or a random function's `CatalogState`."""
    if isinstance(fn, torch.nn.Module):
        return fn
    if isinstance(fn, RandomFunction):
        return fn.state
    return None


def _buffers(fn: Any) -> list[tuple[str, torch.Tensor]] | None:
    module = _state_module(fn)
    return None if module is None else list(module.named_buffers())


class _UserGenerators(TorchFunctionMode):
    """Records the user generators (other than torch's default ones) that torch functions are given
    while active, each with the state it had when first seen: its state before the function drew
    from it. Only those that outlive the call count: a generator made inside the call (the checker's
    own for tangents, a user's seeded afresh at each call) is referenced by nothing else once it
    returns. (Held here, not weakly: a `torch.Generator` takes no weak reference before torch 2.13.)"""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, torch.Generator] = {}
        self.start: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator) and not _is_default(value) and id(value) not in self.seen:
                self.seen[id(value)] = value
                self.start[id(value)] = value.get_state()
        return func(*args, **kwargs)

    @property
    def generators(self) -> dict[int, torch.Generator]:
        """The generators seen that something other than this recorder still holds, by id, in the
        order first seen."""
        probe = {0: torch.Generator()}  # held only here: its count is that of a generator nothing else holds
        alone = _references(probe, 0)
        return {key: self.seen[key] for key in [key for key in self.seen if _references(self.seen, key) > alone]}

    def states(self) -> dict[int, torch.Tensor]:
        """The state of each live generator seen; the state it was first seen in for the others."""
        return {**self.start, **{key: generator.get_state() for key, generator in self.generators.items()}}

    def put_back(self) -> None:
        for key, generator in self.generators.items():
            generator.set_state(self.start[key])


def _references(held: dict[int, torch.Generator], key: int) -> int:
    """How many references the generator `held[key]` has, counted the same way for every one."""
    return sys.getrefcount(held[key])


def _is_default(generator: torch.Generator) -> bool:
    defaults = [torch.default_generator]
    if torch.cuda.is_available():
        defaults += list(torch.cuda.default_generators)
    return any(generator is default for default in defaults)


def _cuda_rng_states() -> list[torch.Tensor]:
    """The default CUDA generators' states, where CUDA is in use (asking would start it otherwise)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(torch.cuda.get_rng_state_all())


def _run(
    fn: Callable[..., Any],
    call: _Call,
    state: _State,
    index: int,
    recording: contextlib.AbstractContextManager[Any] | None = None,
) -> _Run:
    """Call `fn` (for the `index`-th time in a row) on fresh copies of the arguments and backpropagate,
    under `recording` (eager's run, whose user generators are found so) or as the checkpoint."""
    params, backward, backprop = call.params, call.backward, call.backprop
    seed = call.seed + index
    for param in params:
        param.grad = None
    args, kwargs = _fresh((call.args, call.kwargs))
    leaves = _tensor_leaves((args, kwargs))
    torch.manual_seed(seed)
    with recording or contextlib.nullcontext():
        tree = fn(*args, **kwargs)
    outputs, spec = optree.tree_flatten(tree, none_is_leaf=False)
    generator = torch.Generator().manual_seed(seed)
    # One cotangent per float output, drawn in order, so that an output gets the same one in both runs.
    cotangents = {
        i: _random_like(o, generator) for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and _is_float(o)
    }
    backpropagated = tuple(i for i in cotangents if outputs[i].requires_grad and (backprop is None or i in backprop))
    if backward and backpropagated:
        with recording or contextlib.nullcontext():
            torch.autograd.backward([outputs[i] for i in backpropagated], [cotangents[i] for i in backpropagated])
    buffers = state.actual_buffers if recording is None else state.expected_buffers
    run = _Run(
        tree=tree,
        outputs=outputs,
        spec=spec,
        metadata=[_output(o, leaves) for o in outputs],
        inputs_after=[t.detach().clone() for t in leaves],
        input_grads=[t.grad for t in leaves],
        param_grads=[None if p.grad is None else p.grad.clone() for p in params],
        backpropagated=backpropagated if backward else (),
        rng_after=torch.get_rng_state(),
        cuda_rng_after=_cuda_rng_states(),
        buffers_after=[(name, b.detach().clone()) for name, b in buffers or ()],
    )
    _find_shared_versions(run.metadata, outputs, leaves)  # last: it bumps the inputs' version counters
    return run


def _output(value: Any, leaves: Sequence[torch.Tensor]) -> _Output | None:
    if not isinstance(value, torch.Tensor):
        return None
    base = value._base if value._is_view() else None
    return _Output(
        requires_grad=value.requires_grad,
        grad_fn=None if value.grad_fn is None else type(value.grad_fn).__name__,
        layout=_layout(value),
        aliases=_aliased_inputs(value, leaves),
        identity=next((i for i, t in enumerate(leaves) if value is t), None),
        view_of=next((i for i, t in enumerate(leaves) if base is t), None),
    )


def _find_shared_versions(
    metadata: list[_Output | None], outputs: Sequence[Any], leaves: Sequence[torch.Tensor]
) -> None:
    """Which inputs each output shares a version counter with (a view or a `detach()` of one does):
    bump each input's counter and see which outputs' counters move."""
    # Inference tensors have no version counter.
    tensors = [(m, o) for m, o in zip(metadata, outputs, strict=True) if m is not None and not o.is_inference()]
    shared: list[list[int]] = [[] for _ in tensors]
    for i, leaf in enumerate(leaves):
        before = [version_counter(o) for _, o in tensors]
        torch.autograd.graph.increment_version(leaf)
        for k, ((_, output), version) in enumerate(zip(tensors, before, strict=True)):
            if version_counter(output) != version:
                shared[k].append(i)
    for (meta, _), inputs in zip(tensors, shared, strict=True):
        if meta is not None:
            meta.versions = tuple(inputs)


def _layout(value: Any) -> tuple[int, ...] | None:
    """The strides of a tensor's dimensions of size > 1 (the others' strides mean nothing)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    return tuple(stride for stride, size in zip(value.stride(), value.shape, strict=True) if size > 1)


def _aliased_inputs(value: Any, leaves: Sequence[torch.Tensor]) -> tuple[int, ...]:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or not value.numel():
        return ()
    storage = value.untyped_storage().data_ptr()
    return tuple(
        i
        for i, t in enumerate(leaves)
        if t.layout == torch.strided and t.numel() and t.untyped_storage().data_ptr() == storage
    )


def _kind(value: Any) -> str:
    return "a tensor" if isinstance(value, torch.Tensor) else f"{value!r} ({type(value).__name__})"


def _diff(what: str, actual: Any, expected: Any, rtol: float | None, atol: float | None) -> str | None:
    """Why `actual` does not match `expected`, or None if it does."""
    if expected is None or actual is None:
        if expected is None and actual is None:
            return None
        return f"{what}: expected {'no gradient' if expected is None else 'a gradient'}, got {'None' if actual is None else 'one'}"
    if isinstance(actual, torch.Tensor) != isinstance(expected, torch.Tensor):
        return f"{what}: expected {_kind(expected)}, got {_kind(actual)}"
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        return None if actual == expected else f"{what}: expected {expected!r}, got {actual!r}"
    if actual.shape != expected.shape or actual.dtype != expected.dtype or actual.device != expected.device:
        return (
            f"{what}: expected shape {tuple(expected.shape)} {expected.dtype} on {expected.device}, "
            f"got {tuple(actual.shape)} {actual.dtype} on {actual.device}"
        )
    default_rtol, default_atol = _TOLERANCES.get(expected.dtype, (0.0, 0.0))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if not _is_float(e):
        if torch.equal(a, e):
            return None
        mismatched = int((a != e).sum())
        return f"{what}: {mismatched} of {e.numel()} elements differ (shape {tuple(e.shape)}, {e.dtype})"
    if torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
        return None
    a64, e64 = (
        a.to(torch.complex128 if e.is_complex() else torch.float64),
        e.to(torch.complex128 if e.is_complex() else torch.float64),
    )
    error = (a64 - e64).abs().nan_to_num(nan=float("inf"))
    relative = error / e64.abs().clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(error.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), e.shape)) if e.dim() else ()
    return (
        f"{what} differs (shape {tuple(e.shape)}, {e.dtype}, rtol={rtol}, atol={atol}): "
        f"max abs error {error.max().item():.3g}, max rel error {relative.max().item():.3g}, "
        f"worst at index {index}: expected {e64.flatten()[worst].item():.6g}, got {a64.flatten()[worst].item():.6g}"
    )


def _compare(
    label: str,
    expected: _Run,
    actual: _Run,
    rtol: float | None,
    atol: float | None,
    generators: Sequence[torch.Generator] = (),
) -> list[str]:
    problems = []
    if actual.spec != expected.spec:
        return [f"{label}output structure differs: expected {expected.spec}, got {actual.spec}"]
    for i, (a, e) in enumerate(zip(actual.outputs, expected.outputs, strict=True)):
        problems.append(_diff(f"{label}output {i}", a, e, rtol, atol) or "")
        meta, expected_meta = actual.metadata[i], expected.metadata[i]
        if meta is not None and expected_meta is not None:
            same_values = _diff("", a, e, rtol, atol) is None
            problems += _compare_output(f"{label}output {i}", meta, expected_meta, a, e, same_values)
    for i, (after, expected_after) in enumerate(zip(actual.inputs_after, expected.inputs_after, strict=True)):
        problems.append(_diff(f"{label}input tensor {i} after the call", after, expected_after, rtol, atol) or "")
    problems += _compare_state(label, expected, actual, rtol, atol, generators)
    for i, (grad, expected_grad) in enumerate(zip(actual.input_grads, expected.input_grads, strict=True)):
        problems.append(_diff(f"{label}gradient of input tensor {i}", grad, expected_grad, rtol, atol) or "")
    for i, (grad, expected_grad) in enumerate(zip(actual.param_grads, expected.param_grads, strict=True)):
        problems.append(_diff(f"{label}gradient of parameter {i}", grad, expected_grad, rtol, atol) or "")
    return [p for p in problems if p]


def _compare_output(
    what: str, actual: _Output, expected: _Output, a: torch.Tensor, e: torch.Tensor, same_values: bool
) -> list[str]:
    """How an output relates to autograd and to the inputs, in eager and under the checkpoint."""
    problems = []
    if actual.requires_grad != expected.requires_grad:
        problems.append(f"{what}: requires_grad expected {expected.requires_grad}, got {actual.requires_grad}")
    elif (actual.grad_fn is None) != (expected.grad_fn is None):
        problems.append(f"{what}: expected {_autograd_words(expected.grad_fn)}, got {_autograd_words(actual.grad_fn)}")
    if actual.layout != expected.layout and same_values:
        problems.append(f"{what}: strides expected {_strides(e)}, got {_strides(a)}")
    if actual.identity != expected.identity:
        problems.append(
            f"{what}: {_identity_words(expected.identity)} in eager, but {_identity_words(actual.identity)}"
        )
    elif actual.view_of != expected.view_of:
        problems.append(f"{what}: {_view_words(expected.view_of)} in eager, but {_view_words(actual.view_of)}")
    if actual.aliases != expected.aliases:
        problems.append(
            f"{what}: shares memory with input tensors {list(expected.aliases)} in eager, but with {list(actual.aliases)}"
        )
    elif actual.versions != expected.versions:
        problems.append(
            f"{what}: shares its version counter with input tensors {list(expected.versions)} in eager (an in-place "
            f"update of one bumps the other's `_version`, as for a view or a `detach()`), but with {list(actual.versions)}"
        )
    return problems


def _autograd_words(grad_fn: str | None) -> str:
    return "a leaf (grad_fn None)" if grad_fn is None else f"a non-leaf (grad_fn {grad_fn})"


def _identity_words(index: int | None) -> str:
    return "a tensor that is no input" if index is None else f"input tensor {index} itself (`out is input`)"


def _view_words(index: int | None) -> str:
    return "not a view of an input tensor" if index is None else f"a view of input tensor {index} (its `_base`)"


def _compare_state(
    label: str,
    expected: _Run,
    actual: _Run,
    rtol: float | None,
    atol: float | None,
    generators: Sequence[torch.Generator],
) -> list[str]:
    """Where the random streams are left, and the buffers of the module whose state is compared."""
    problems = []
    if not torch.equal(actual.rng_after, expected.rng_after):
        problems.append(f"{label}the random stream is left elsewhere than eager leaves it")
    for device, (state, expected_state) in enumerate(zip(actual.cuda_rng_after, expected.cuda_rng_after, strict=False)):
        if not torch.equal(state, expected_state):
            problems.append(f"{label}the CUDA random stream of device {device} is left elsewhere than eager leaves it")
    for number, generator in enumerate(generators):
        key = id(generator)
        if not torch.equal(actual.generators_after[key], expected.generators_after[key]):
            problems.append(
                f"{label}user generator {number} ({generator.device} generator of initial seed "
                f"{generator.initial_seed()}, the {_ordinal(number)} fn drew from) is left elsewhere than eager leaves it"
            )
    if len(actual.buffers_after) == len(expected.buffers_after):
        for (name, buffer), (_, expected_buffer) in zip(actual.buffers_after, expected.buffers_after, strict=True):
            problems.append(_diff(f"{label}buffer {name} after the call", buffer, expected_buffer, rtol, atol) or "")
    elif actual.buffers_after and expected.buffers_after:
        problems.append(
            f"{label}the module of the checkpoint has {len(actual.buffers_after)} buffers, the module of fn "
            f"{len(expected.buffers_after)}: {[n for n, _ in expected.buffers_after]}"
        )
    return problems


def _ordinal(number: int) -> str:
    return {0: "first", 1: "second", 2: "third"}.get(number, f"{number + 1}th")


def _check_backprop_outputs(backprop: frozenset[int], expected: _Run) -> None:
    """Raise if `backprop` names an output of `fn` that cannot be backpropagated through."""
    differentiable = [
        i for i, o in enumerate(expected.outputs) if isinstance(o, torch.Tensor) and _is_float(o) and o.requires_grad
    ]
    for i in sorted(backprop):
        if i >= len(expected.outputs):
            raise ValueError(
                f"{_API}: backprop={sorted(backprop)} names output {i}, but fn returns {len(expected.outputs)} "
                f"outputs (the leaves of its output pytree). Choose among {differentiable}."
            )
        if i not in differentiable:
            output = expected.outputs[i]
            what = (
                f"a {output.dtype} tensor that does not require grad"
                if isinstance(output, torch.Tensor)
                else f"{output!r}, not a tensor"
            )
            raise ValueError(
                f"{_API}: backprop={sorted(backprop)} names output {i} of fn, {what}: no gradient flows "
                f"through it. Choose among the float outputs that require grad, {differentiable}."
            )


def _check_gradients_reach_something(expected: _Run) -> None:
    """Raise if backward ran through `fn` but no input or parameter got a gradient: nothing to compare."""
    if expected.backpropagated and all(g is None for g in (*expected.input_grads, *expected.param_grads)):
        raise ValueError(
            f"{_API}: backward through the outputs of fn reached no input tensor and no tensor of params, "
            f"so no gradient would be compared (outputs {list(expected.backpropagated)} require grad through "
            "tensors fn closes over). Pass those tensors as params=, such as params=module.parameters() for "
            "a function that calls a module, or give fn an input that requires grad."
        )


def _run_and_compare(
    label: str,
    fn: Callable[..., Any],
    checkpointed: Callable[..., Any],
    call: _Call,
    state: _State,
    rtol: float | None,
    atol: float | None,
) -> tuple[list[str], _Run | None]:
    """Run both, `call.calls` times each; compare what they computed, or, where `fn` raises, that the
    checkpoint raises too.

    The checkpoint starts from the state eager started from: its module's buffers and the user
    generators eager drew from are put back first. Returns the differences and the checkpoint's last
    run (None where `fn` raised). Under a transform (`label`), a program eager refuses is not compared:
    remat may run it where eager cannot (its views are traced as reshapes, which never fail)."""
    start = state.snapshot()
    recorder = _UserGenerators()
    expected_runs: list[_Run] = []
    refused: Exception | None = None
    for index in range(call.calls):
        try:
            run = _run(fn, call, state, index, recording=recorder)
        except Exception as error:  # eager refuses this program: so must the checkpoint
            refused = error
            break
        run.generators_after = recorder.states()
        expected_runs.append(run)
    if refused is not None and label:
        return [], None
    if expected_runs and call.backward and call.backprop is not None:
        _check_backprop_outputs(call.backprop, expected_runs[0])
    if expected_runs and call.backward and not label:
        _check_gradients_reach_something(expected_runs[0])
    generators = recorder.generators
    for run in expected_runs:  # a generator first seen at a later call was as first seen until then
        run.generators_after = {key: run.generators_after.get(key, recorder.start[key]) for key in generators}
    state.restore(start)
    recorder.put_back()
    problems: list[str] = []
    actual = None
    for index, expected in enumerate(expected_runs):
        actual = _run(checkpointed, call, state, index)
        actual.generators_after = {key: generator.get_state() for key, generator in generators.items()}
        problems += _compare(_label(label, index, call.calls), expected, actual, rtol, atol, list(generators.values()))
    if refused is None:
        return problems, actual
    at = _label(label, len(expected_runs), call.calls)
    try:
        _run(checkpointed, call, state, len(expected_runs))
    except type(refused):
        return problems, None
    except Exception as other:
        return [
            *problems,
            f"{at}eager raises {type(refused).__name__}: {refused}; the checkpoint raises {other!r}",
        ], None
    return [*problems, f"{at}eager raises {type(refused).__name__}: {refused}; the checkpoint does not"], None


def _label(label: str, index: int, calls: int) -> str:
    return f"{label}call {index + 1} of {calls}: " if calls > 1 else label


def _strides(value: Any) -> tuple[int, ...] | None:
    return tuple(value.stride()) if isinstance(value, torch.Tensor) and value.layout == torch.strided else None


def _stack(args: Any, size: int = 2) -> Any:
    def stack(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            copies = [leaf.detach() * (1.0 + 0.5 * k) for k in range(size)]
            return torch.stack(copies).requires_grad_(leaf.requires_grad)
        return leaf

    return optree.tree_map(stack, args, none_is_leaf=False)


def _checked_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise TypeError(
            f"{_API}: expected kwargs to be a dict from argument names to values (pytrees of tensors and "
            f"static values) for fn and the checkpoint, but got {type(kwargs).__name__}: {kwargs!r}."
        )
    return dict(kwargs)


def _checked_params(params: Any, fn: Callable[..., Any]) -> list[torch.Tensor]:
    if params is None:
        module = _state_module(fn)
        return [] if module is None else list(module.parameters())
    if isinstance(params, (torch.Tensor, torch.nn.Module, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(
            f"{_API}: expected params to be an iterable of tensors (such as module.parameters() or a list), "
            f"but got {type(params).__name__}. Wrap one tensor in a list; for a module pass module.parameters()."
        )
    params = list(params)
    for i, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{_API}: expected params to hold tensors, but params[{i}] is {_kind(param)}.")
        if not param.is_leaf:
            raise ValueError(
                f"{_API}: params[{i}] is not a leaf tensor (it was computed, by {type(param.grad_fn).__name__}): "
                "backward fills the .grad of leaves only. Pass the leaf tensors it is computed from."
            )
    return params


def _checked_backprop(backprop: Any) -> frozenset[int] | None:
    if backprop is None:
        return None
    if isinstance(backprop, (str, bytes)) or not isinstance(backprop, Iterable):
        raise TypeError(
            f"{_API}: expected backprop to be a sequence of output positions (ints), but got "
            f"{type(backprop).__name__}: {backprop!r}. For one output, pass [i]."
        )
    positions = list(backprop)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in positions):
        raise ValueError(
            f"{_API}: expected backprop to hold positions of outputs of fn (ints from 0, among the leaves of "
            f"its output pytree), but got {positions!r}."
        )
    return frozenset(positions)


def assert_checkpoint_equivalent(
    fn: Callable[..., Any],
    *args: Any,
    policy: Any = None,
    checkpointed: Callable[..., Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    params: Iterable[torch.Tensor] | None = None,
    backprop: Iterable[int] | None = None,
    transforms: Sequence[str] = (),
    device: str | torch.device | None = None,
    seed: int = 0,
    calls: int = 1,
    rtol: float | None = None,
    atol: float | None = None,
) -> CheckpointedRun | None:
    """Assert that `remat.checkpoint(fn, policy=policy)` computes what `fn` computes, gradients included.

    Both run on fresh copies of `args` and `kwargs` (any pytrees of tensors
    and static values), each after `torch.manual_seed(seed)` so random ops
    draw the same numbers; the same seeded random cotangents are
    backpropagated through every float output that requires grad (or those
    in `backprop`). Compared: the output structure and every output with its
    metadata (`requires_grad`, whether it is a leaf, device, the strides of
    its dimensions longer than one, whether it is an input itself or a view
    of one, which inputs it shares memory and a version counter with), the
    values of the inputs after the call (in-place updates), the gradient of
    every input tensor, the `.grad` of each tensor in `params` (for an
    `nn.Module` `fn`, its parameters), the module's buffers after the call
    (running statistics), and where the random streams are left after
    forward and backward: the CPU's, each CUDA device's where CUDA is in use,
    and each user `torch.Generator` that `fn` draws from (found while it
    runs). Before the checkpoint's run, the buffers and those generators are
    put back as they were before `fn`'s, so both start alike. With `calls`,
    each is called several times in a row, which is where a cached trace
    meets state (buffers, generators, values read in Python) that moved on.
    Where `fn` raises, the checkpoint must raise an exception of the same
    type. Tolerances depend on the dtype (tight for float64, loose for
    bfloat16 and float16) unless given.

    Args:
        fn: a function of tensors, or an `nn.Module`.
        *args: its positional arguments.
        policy: the policy to checkpoint with.
        checkpointed: compare `fn` with this callable instead of
            `remat.checkpoint(fn, policy=policy)`: a model after
            `remat.checkpoint_modules`, a method decorated with
            `remat.checkpoint`, a compiled checkpoint. Not with `policy`.
            Its buffers are compared with `fn`'s; one that is no module is
            taken to run `fn`'s (and is compared with them).
        kwargs: keyword arguments for both, copied fresh like `args`.
        params: tensors both functions close over (leaf tensors, such as
            `model.parameters()`) whose `.grad` is compared; each `.grad` is
            cleared before each run and holds the checkpoint's afterwards.
            Default: the parameters of `fn` if it is an `nn.Module` (of its
            `state` for a `RandomFunction`), else none.
        backprop: backpropagate only through the outputs at these positions
            (among the leaves of the output pytree, in `optree` order), each a
            float tensor that requires grad in `fn`.
        transforms: also compare these `torch.func` transforms of `fn` with
            those of its checkpoint: `"grad"` (the gradient of a fixed random
            weighted sum of the outputs, with respect to the first argument),
            `"vmap"` (over a batch of 2 stacked copies of the positional
            arguments, with `randomness="different"`), `"jvp"` and `"vjp"`
            (with seeded random tangents and cotangents), their compositions
            `"jvp_of_vmap"` and `"vmap_of_jvp"` (over the stacked arguments,
            the latter with a tangent per example, as `jacfwd` does),
            `"forward_ad"` (dual tensors of `torch.autograd.forward_ad`, each
            output compared as its primal and tangent), and the derivatives
            of forward mode's results: `"grad_of_jvp"` and
            `"grad_of_jvp_of_vmap"` (`grad` of a weighted sum of `"jvp"`'s or
            `"jvp_of_vmap"`'s outputs and tangents, the latter as
            `jacrev(jacfwd(fn))` differentiates) and `"grad_of_forward_ad"`
            (`torch.autograd.grad` of one of `"forward_ad"`'s), and
            `"grad_of_grad"` (`grad` of a weighted sum of `"grad"`'s
            gradient: reverse mode twice, as a Hessian-vector product). They
            differentiate with respect to the first argument. Tangents are
            compared by value, not layout. All but `vmap` take
            detached copies of the arguments; the `vmap` outputs are also
            backpropagated. Keyword arguments are passed through, neither
            differentiated nor batched.
        device: move the arguments, and `fn` and `checkpointed` where they
            are modules, there first (not the tensors of `params`).
        seed: the seed for random ops and cotangents (`seed + k` at the call
            `k`, counted from 0).
        calls: call `fn` this many times in a row, then as many times the
            checkpoint (one object, keeping its cached traces), on fresh
            copies of the arguments, comparing each call with the same call
            of `fn`; buffers and user generators carry over from call to call
            on each side. Under `transforms`, each is compared once.
        rtol: relative tolerance, instead of the dtype's.
        atol: absolute tolerance, instead of the dtype's.

    Returns:
        The checkpoint's run (`CheckpointedRun`): its outputs and gradients,
        for further assertions; None where `fn` raised (and the checkpoint
        raised alike).

    Raises:
        AssertionError: listing every output and gradient that differs, with
            its shape, dtype, maximum absolute and relative error and the worst
            element.
        ValueError: for both `policy` and `checkpointed`, for `backprop`
            naming an output that cannot be backpropagated through, where
            backward reaches no input and none of `params` (so no gradient
            would be compared), and for `calls` below 1.
        TypeError: for arguments of the wrong type.

    >>> import torch, remat, remat.testing
    >>> x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    >>> remat.testing.assert_checkpoint_equivalent(lambda x: (x @ x).relu().sum(1), x, transforms=["grad", "vjp"])
    CheckpointedRun(outputs=Tensor(shape=(4,), dtype=torch.float64), input_grads=(Tensor(shape=(4, 4), dtype=torch.float64),), param_grads=())

    Comparing with a function of your own, here one that `remat.checkpoint`
    decorates, which closes over a weight:

    >>> w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    >>> def layer(x):
    ...     return (x @ w).tanh()
    >>> @remat.checkpoint(policy=remat.policies.dots_saveable)
    ... def checkpointed_layer(x):
    ...     return (x @ w).tanh()
    >>> run = remat.testing.assert_checkpoint_equivalent(layer, x, checkpointed=checkpointed_layer, params=[w])
    >>> run.param_grads[0].shape
    torch.Size([4, 4])

    A function that draws from a generator of its own, called three times in a row: the generator
    is put back before the checkpoint's first call, and compared after each.

    >>> generator = torch.Generator().manual_seed(0)
    >>> def noisy(x):
    ...     return x * torch.rand(x.shape, generator=generator, dtype=x.dtype)
    >>> remat.testing.assert_checkpoint_equivalent(noisy, x, calls=3).outputs.shape
    torch.Size([4, 4])
    """
    unknown = [t for t in transforms if t not in TRANSFORMS]
    if unknown:
        raise ValueError(f"{_API}: expected transforms from {TRANSFORMS}, but got {unknown}.")
    if checkpointed is not None:
        if policy is not None:
            raise ValueError(
                f"{_API}: got both policy={policy!r} and checkpointed={checkpointed!r}. Give policy= to compare "
                "fn with remat.checkpoint(fn, policy=policy), or checkpointed= to compare fn with a callable "
                "of your own (checkpointed with the policy you want), not both."
            )
        if not callable(checkpointed):
            raise TypeError(
                f"{_API}: expected checkpointed to be a callable to compare with fn, but got "
                f"{type(checkpointed).__name__}: {checkpointed!r}."
            )
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
        raise ValueError(
            f"{_API}: expected calls to be how many times to call fn and the checkpoint in a row, an int of "
            f"at least 1, but got {calls!r}."
        )
    call_kwargs = _checked_kwargs(kwargs)
    positions = _checked_backprop(backprop)
    if device is not None:
        args = _to_device(args, device)
        call_kwargs = _to_device(call_kwargs, device)
        for module in (fn, checkpointed):
            if isinstance(module, torch.nn.Module):
                module.to(device)
    tensors = _checked_params(params, fn)
    expected_buffers = _buffers(fn)
    if checkpointed is None:
        checkpointed = _checkpoint(fn, policy)
        header = f"remat.checkpoint(fn, policy={policy!r}) differs from fn = {fn!r}:"
    else:
        header = f"checkpointed = {checkpointed!r} differs from fn = {fn!r}:"
    # A checkpoint that is not a module itself runs fn's (remat.checkpoint of a function, a lambda).
    actual_buffers = _buffers(checkpointed)
    state = _State(expected_buffers, expected_buffers if actual_buffers is None else actual_buffers)
    call = _Call(args, call_kwargs, tensors, seed, backward=True, backprop=positions, calls=calls)
    problems, run = _run_and_compare("", fn, checkpointed, call, state, rtol, atol)
    for name in transforms:
        # The transforms are compared as pure functions of detached inputs; vmap also backpropagates.
        batched = name in _BATCHED
        transformed_call = dataclasses.replace(
            call,
            args=(_stack(args) if name == "vmap" else _stack(_detached(args))) if batched else _detached(args),
            kwargs=call_kwargs if batched else _detached(call_kwargs),
            backward=name == "vmap",
            calls=1,
        )
        problems += _run_and_compare(
            f"[{name}] ",
            _transformed(name, fn, seed),
            _transformed(name, checkpointed, seed),
            transformed_call,
            state,
            rtol,
            atol,
        )[0]
    if problems:
        raise AssertionError("\n  ".join([header, *problems]))
    if run is None:
        return None
    return CheckpointedRun(run.tree, tuple(run.input_grads), tuple(run.param_grads))
