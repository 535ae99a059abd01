"""The catalog of aten-level behaviours random functions are drawn from (`remat.testing.CATALOG`):
each entry an op of one or two same-shaped float tensors, grouped by what it exercises in remat.

Its interface (`__all__`): the catalog and its sets of ops, re-exported by `remat.testing`, and the
tensors and state a random function closes over (`Constants`, for the strategies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .._api._checkpointed import DEFAULT_CACHE_SIZE, Checkpointed

__all__ = [
    "AS_STRIDED_WRITES",
    "CATALOG",
    "LOW_PRECISION_OPS",
    "RANDOM_OPS",
    "REFUSABLE_OPS",
    "STATEFUL_OPS",
    "CatalogState",
    "Constants",
]

# --- the catalog -----------------------------------------------------------------------------------


class CatalogState(torch.nn.Module):
    """What the stateful catalog ops of one random function keep between its calls.

    A user `torch.Generator` that `rand_from_generator` and `branch_on_generator` draw from, and a
    `BatchNorm1d(rows, momentum=None)` in training mode that `batch_norm_momentum_none` runs (its
    running statistics and `num_batches_tracked` change at every call, and its update reads
    `num_batches_tracked` in Python: a value read), and an `InstanceNorm1d(rows)` with affine parameters
    and running statistics that `instance_norm_running_stats` runs. All start from the function's seed.
    `assert_checkpoint_equivalent` puts them back before the checkpoint's run and compares them after.

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
        self.instance_norm = torch.nn.InstanceNorm1d(rows, affine=True, track_running_stats=True, dtype=torch.float64)
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


def _embedding_bag(x: torch.Tensor, c: Constants, **options: Any) -> torch.Tensor:
    """A bag of rows of `x` for each row of indices (`c.column_index`, kept within `x`'s rows)."""
    rows = x.shape[0]
    return F.embedding_bag(_c(c.column_index, x) % rows, x, **options)


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


def _group_norm(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    return F.group_norm(x.reshape(1, rows, cols), 1 if rows % 2 else 2).reshape(rows, cols)


def _cumprod_at_zeros(x: torch.Tensor) -> torch.Tensor:
    # Exact zeros, where cumprod's first-form gradient divides by zero: NOTE [a backward that will be
    # differentiated]
    return torch.cumprod(x * (x > 0.0), 1).tanh()


class _Cube(torch.autograd.Function):
    """A custom autograd Function whose backward, written by hand, is its derivative."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * x * x

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * 3 * x * x


class _NoisyScale(torch.autograd.Function):
    """A custom autograd Function whose forward draws random numbers (a stochastic layer written by hand)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * (1.0 + 0.5 * torch.rand_like(x))

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], output)  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        x, y = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * y / x


class _FirstColumn(torch.autograd.Function):
    """A custom autograd Function returning a view of its input, gradients not materialized."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.narrow(-1, 0, 1)

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.set_materialize_grads(False)  # type: ignore[attr-defined]
        ctx.shape = inputs[0].shape  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:
            return None
        return F.pad(grad, (0, ctx.shape[-1] - 1))  # type: ignore[attr-defined]


class _SortedWithRanks(torch.autograd.Function):
    """A custom autograd Function with an output marked not differentiable (the ranks), read again as floats."""

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        values, ranks = x.sort(dim=-1)
        return values, ranks

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[torch.Tensor], outputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        ctx.mark_non_differentiable(outputs[1])  # type: ignore[attr-defined]
        ctx.save_for_backward(outputs[1])  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor, grad_ranks: None) -> torch.Tensor:
        (ranks,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return torch.zeros_like(grad).scatter(-1, ranks, grad)


def _sorted_with_ranks(x: torch.Tensor) -> torch.Tensor:
    values, ranks = _SortedWithRanks.apply(x)
    return values * (1.0 + ranks.to(values.dtype) / values.shape[-1])


class _SquareOnce(torch.autograd.Function):
    """A custom autograd Function whose backward is `once_differentiable`: differentiating it twice raises."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * x

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]

    @staticmethod
    @once_differentiable
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return 2.0 * x * grad


# An `apply` taken once, as libraries define their ops: tracing cannot see it through `Function.apply`.
_first_column_of = _FirstColumn.apply


def _gram(x: torch.Tensor) -> torch.Tensor:
    """A well-conditioned symmetric positive definite matrix of `x`'s columns, `(cols, cols)`, in at least
    float32 (torch's linear algebra refuses lower precision)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    cols = x.shape[1]
    return torch.eye(cols, dtype=x.dtype, device=x.device) * cols + x.t() @ x / x.shape[0]


def _linalg_solve(x: torch.Tensor) -> torch.Tensor:
    gram = _gram(x)
    return torch.linalg.solve(gram, x.t().to(gram.dtype)).t().to(x.dtype)


def _slogdet(x: torch.Tensor) -> torch.Tensor:
    return x * torch.linalg.slogdet(_gram(x))[1].tanh().to(x.dtype)


def _autocast_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # A bfloat16 autocast region on the operands' device: its matmul runs in bfloat16 (in float32 or lower
    # precision inputs: autocast leaves float64 as it is, so the region casts to float32 first).
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        product = (x.float() @ y.float().t()).tanh() @ y.float()
    return x + product.to(x.dtype) / x.shape[1]


def _instance_norm_running_stats(x: torch.Tensor, c: Constants) -> torch.Tensor:
    # A module with running statistics that instance norm updates in training (one channel per row).
    return c.state.instance_norm(x.unsqueeze(0).to(device="cpu", dtype=torch.float64)).squeeze(0).to(x)


# A checkpoint called inside the checkpointed function: its calls join the outer trace, under its own
# policy (NOTE [nested checkpoints]).
_INNER = Checkpointed(lambda t: t.sin().exp() * 0.5, policy=None, cache_size=DEFAULT_CACHE_SIZE)


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
    # backward reads these through one test per element (NOTE [values kept as bits])
    "leaky_relu": (1, lambda x, y, c: F.leaky_relu(x, 0.2)),
    "relu6": (1, lambda x, y, c: F.relu6(x * 4.0)),
    "threshold": (1, lambda x, y, c: F.threshold(x, 0.25, -2.0)),
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
    # its gradient fills zeros by the incoming gradient: NOTE [an index fill of a batched value]
    "trace": (1, lambda x, y, c: x * torch.trace(x).tanh()),
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
    # bags of rows (as DLRM and bag-of-words models take them): every mode, weights per index, a padding row,
    # and an embedding whose rows are renormalized in place (through a detach) to a largest norm
    "embedding_bag_sum": (1, lambda x, y, c: _embedding_bag(x, c, mode="sum")),
    "embedding_bag_mean_padded": (1, lambda x, y, c: _embedding_bag(x, c, mode="mean", padding_idx=0)),
    "embedding_bag_max": (1, lambda x, y, c: _embedding_bag(x, c, mode="max")),
    "embedding_bag_weighted": (2, lambda x, y, c: _embedding_bag(x, c, mode="sum", per_sample_weights=y)),
    "embedding_max_norm": (1, lambda x, y, c: F.embedding(_c(c.row_index, x), x * 1.0, max_norm=1.0)),
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
    # gradient formulas that switch form where their result will be differentiated, and rrelu's kernel
    "silu": (1, lambda x, y, c: F.silu(x)),
    "mish": (1, lambda x, y, c: F.mish(x)),
    "logit_of_sigmoid": (1, lambda x, y, c: torch.logit(x.sigmoid(), eps=1e-3)),
    "group_norm": (1, lambda x, y, c: _group_norm(x)),
    "cumprod_at_zeros": (1, lambda x, y, c: _cumprod_at_zeros(x)),
    "rrelu_transposed_then_dropout": (1, lambda x, y, c: F.dropout(F.rrelu(x.t(), training=True), 0.2).t()),
    "nested_checkpoint": (1, lambda x, y, c: _INNER(x.tanh()) * x),
    # custom autograd Functions: a hand-written derivative, and a view with gradients not materialized
    "custom_cube": (1, lambda x, y, c: _Cube.apply(x.tanh())),
    "custom_view_of_first_column": (1, lambda x, y, c: x * _FirstColumn.apply(x.sin())),
    "custom_view_taken_before": (1, lambda x, y, c: x.cos() * _first_column_of(x.sin())),
    "custom_noisy_scale": (1, lambda x, y, c: x * _NoisyScale.apply(x.cos() + 1.5)),
    # linear algebra whose gradient formulas read factorizations (LU): autograd's own where differentiated
    "linalg_solve": (1, lambda x, y, c: _linalg_solve(x)),
    "slogdet": (1, lambda x, y, c: _slogdet(x)),
    # custom autograd Function flags: an output marked not differentiable, a backward differentiable once
    "custom_sorted_with_ranks": (1, lambda x, y, c: _sorted_with_ranks(x)),
    "custom_square_once_differentiable": (1, lambda x, y, c: _SquareOnce.apply(x.sin())),
    # a region under autocast
    "autocast_matmul": (2, lambda x, y, c: _autocast_matmul(x, y)),
    # a layer with buffers other than batch norm
    "instance_norm_running_stats": (1, lambda x, y, c: _instance_norm_running_stats(x, c)),
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
        "normal_leading_expand_", "rrelu_transposed_then_dropout", "custom_noisy_scale",
    }
)  # fmt: skip

# Catalog ops that write through an `as_strided` view: `torch.func.vmap` has no batching rule for their
# functional form, and remat's derivative under `torch.autograd.forward_ad` is not exact through them
# (remat says so under both; docs/testing.md). `transforms_for` leaves those transforms out.
AS_STRIDED_WRITES = frozenset({"mul_as_strided_of_view_", "mul_interleaved_as_strided_"})

# Catalog ops that compute in bfloat16 within a float64 program. A second derivative reaches a value by
# several paths; eager sums them where they meet (in bfloat16, inside the region), remat some of them at its
# Function's inputs (in float64): second derivatives differ by bfloat16's rounding (docs/torch-func.md,
# "Second derivatives in low precision"). `transforms_for` leaves the second-order transforms out, as the
# checker compares a float64 program tightly.
LOW_PRECISION_OPS = frozenset({"autocast_matmul"})

# Catalog ops that change the function's `CatalogState` (its user generator, its batch norm's buffers), so
# that two calls differ unless that state is put back between them, as `assert_checkpoint_equivalent` does;
# `functions()` leaves them out unless `stateful=True` or asked for by name.
STATEFUL_OPS = frozenset(
    {"rand_from_generator", "branch_on_generator", "batch_norm_momentum_none", "instance_norm_running_stats"}
)
