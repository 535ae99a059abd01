"""What the functional trace must keep of eager execution that functionalization alone loses.

Tracing rewrites every in-place op as its out-of-place form and predicts
output layouts with fake tensors. Four eager behaviours depend on details
that this changes, and are kept here:

* the numbers an in-place random fill draws depend on the memory layout of
  the tensor it fills (see NOTE [random fills draw in eager's layout]);
* some CPU kernels choose their output layout themselves, unlike their fake
  kernels (see NOTE [kernels that choose their output layout]);
* an in-place write through a view is written back through the view's
  inverse, which is exact for every view but `expand`, and undefined where
  the view's elements share memory (see NOTE [writes through views]);
* linalg ops check their results and raise (a singular matrix), through an
  op that functionalization would thread effect tokens through (see
  NOTE [error checks of linalg ops]).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _quirks
from ._facts import fill_of, note_computed_without_grad, note_fill, note_stacked_under_vmap
from ._measure import storage_key
from ._rng import DrawnGenerators
from ._torch import (
    FAKE_DTYPE_ERRATA,
    STRICT_FAKE_KERNELS,
    FunctionalTensor,
    FunctionalTensorMode,
    HigherOrderOperator,
    TorchDispatchMode,
    UncheckedRealValuesFakeMode,
    drawn_per_example_but_unbatched,
    elementwise_output_strides,
    empty_in_memory_layout,
    forward_ad_level,
    from_functional,
    inherit_higher_order_rules,
    memory_layout,
    node_behind,
    op_schema,
    random_calls_traced,
    run_real_kernel_on_zeros,
    runs_per_example_under_vmap,
    sync,
    trace_call,
    tree_leaves,
    tree_map_only,
    under_torch_func,
)

__all__ = [
    "EagerFidelity",
    "EagerLayoutFakeMode",
    "FakeKernelRefused",
    "FillInEagerLayout",
    "FunctionalModeKeepingChecks",
    "OverlappingWrite",
    "ReadsWhatItWrites",
    "eager_fidelity",
    "fill_in_eager_layout",
    "with_a_fills_derivative",
    "is_dense",
    "kept_as_dead_code",
    "runnable",
]

aten = torch.ops.aten


# NOTE [random fills draw in eager's layout]
# `t.bernoulli_(p)`, `t.normal_()` and the fill inside CPU dropout write
# random numbers into `t` in its memory order, and some kernels take another
# path (and draw another count) when `t` is not contiguous. Functionalization
# traces them as their out-of-place forms (`bernoulli.p`, `normal_functional`),
# which fill a fresh tensor of their own layout: other numbers, and the
# stream left elsewhere, whenever `t` is transposed, permuted or strided. So
# the trace notes the strides `t` had (a FunctionalTensor keeps eager's view
# metadata), and the programs run such a call as the in-place op itself on a
# fresh tensor of those strides (`FillInEagerLayout`). Under `vmap` the fresh
# tensor is made from the batched input, so the batching rule of the in-place
# op fills the whole batch as eager's does, in the memory order eager's
# batched tensor has: its batch dimension need not lead (an embedding's
# output keeps it in the middle), so the fresh tensor takes the layout of the
# value it replaces, batch dimension included, and is made at each torch.func
# level that value is at (a tangent's replay adds a gradient level of its
# own, which lets a fill write only into a tensor of its level). The traced
# call's value is given those strides too (the tracing fake mode's
# `fill_strides`): what reads the filled tensor (a view, attention choosing
# its kernel) is traced for the layout it will have, not for the contiguous
# one of `bernoulli.p`.
class FillInEagerLayout(NamedTuple):
    """How eager ran an in-place random fill: its op and the strides of the tensor it filled.

    Plain data (the op by name), so that FX programs can carry it as an argument; calling it
    runs the fill (`fill_in_eager_layout`).
    """

    op: str  # the in-place op, e.g. "aten::bernoulli_.float"
    strides: tuple[int, ...]
    dense: bool  # whether those strides cover their storage exactly (a strided slice does not)
    of_fns_tensor: bool  # whether it filled a tensor of `fn`'s (not one a dropout function made for its mask)

    def __call__(self, like: torch.Tensor, /, *args: Any, **kwargs: Any) -> torch.Tensor:
        return fill_in_eager_layout(self, like, *args, **kwargs)


def fill_in_eager_layout(fill: FillInEagerLayout, like: torch.Tensor, /, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Run the in-place random fill `fill.op` on a fresh tensor shaped like `like` with eager's strides."""
    out = _empty_as_batched(fill, like) if under_torch_func(like) else None
    if out is None:
        out = like.new_empty_strided(like.shape, fill.strides)
    if fill.op == _BERNOULLI_FILL and drawn_per_example_but_unbatched(out):
        # (a dropout of a tensor the vmap does not batch: eager draws the batch's masks out of place)
        out = aten.bernoulli.p(out, *args, **kwargs)
    else:
        _op_named(fill.op)(out, *args, **kwargs)
        # A non-dense layout (a strided view in eager) is only written back into its base:
        # hand on a compact copy, the size the trace accounted for.
        out = out if fill.dense else out.contiguous()
    return with_a_fills_derivative(out, like)


def with_a_fills_derivative(value: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """`value`, a random fill of `filled`, with autograd's zero derivative with respect to `filled` where it is
    differentiated: NOTE [a fill's derivative]."""
    if torch.is_grad_enabled() and filled.requires_grad:
        return _ZeroDerivative.apply(value, filled)  # type: ignore[no-any-return]
    return value


# NOTE [a fill's derivative]
# Autograd gives an in-place random fill a derivative of zero with respect to
# the tensor filled (its draws do not depend on its values), so eager's gradients
# stay connected, through zeros, to that tensor's history: a gradient taken with
# `create_graph=True` requires grad, and its derivative is zeros, not None. The
# fill on a fresh tensor, where it is differentiated, is connected so too, and
# so is a fill's kept value that a recomputed forward reads as it is.
class _ZeroDerivative(torch.autograd.Function):
    """`value`, with a derivative of zero with respect to `filled`: NOTE [a fill's derivative]."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return value.view_as(value)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        return None, torch.zeros_like(grad)

    @staticmethod
    def jvp(ctx: Any, value_tangent: Any, filled_tangent: Any) -> Any:
        return value_tangent


_BERNOULLI_FILL = "aten::bernoulli_.float"


def _empty_as_batched(fill: FillInEagerLayout, like: torch.Tensor) -> torch.Tensor | None:
    """The tensor to fill under vmap, laid out as eager's batched tensor, if `like` shows that layout.

    Eager fills `fn`'s tensor with its whole batch in its memory order, and the batch dimension may
    lie anywhere in memory (after an embedding, in the middle): `like`, the value the fill replaces,
    is laid out as that tensor. (A dropout function's mask under vmap is contiguous: NOTE [dropout
    under torch.func])"""
    if not fill.of_fns_tensor or not _ordered_as(like, fill.strides):
        return None
    if not fill.dense:
        return empty_in_memory_layout(like)  # a strided view of it: its strides, gaps and all
    return torch.empty_like(like) if is_dense(*memory_layout(like)[1:]) else None


def _ordered_as(tensor: torch.Tensor, strides: Sequence[int]) -> bool:
    """Whether `tensor` orders its dimensions in memory as `strides` do."""
    sizes = tensor.shape

    def order(of: Sequence[Any]) -> list[int]:
        return sorted((d for d in range(len(sizes)) if sizes[d] != 1), key=lambda d: -of[d])

    return order(tensor.stride()) == order(strides)


def _op_named(name: str) -> Any:
    namespace, _, rest = name.partition("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def runnable(node: Any) -> Callable[..., Any]:
    """What the programs call for a traced node: its op, or how eager ran it."""
    if node.target in RRELU:
        return rrelu_as_eager  # type: ignore[return-value]  # (a callable NamedTuple)
    return fill_of(node) or node.target  # type: ignore[no-any-return]


# NOTE [rrelu runs as eager's]
# `F.rrelu` traces to the functional `rrelu_with_noise`, which differs from the
# in-place one eager runs (`_quirks.RRELU_FUNCTIONAL_DERIVATIVE`): its
# derivative reads the `noise` it is given (uninitialized) instead of the noise
# it draws, it has no forward-mode formula, and on the CPU it lays its output
# out as the input, where eager's is contiguous (a dropout after it then draws
# its mask in another order). remat's programs run it on a detached input for
# the noise, and compute the output as eager's kernel does, from ops autograd
# and forward-mode AD differentiate as eager's formulas do: in training, the
# input times the noise drawn (exactly the kernel's product); otherwise a leaky
# ReLU with the mean slope.
RRELU = _quirks.RRELU_FUNCTIONAL_DERIVATIVE.table
(_FUNCTIONAL_RRELU,) = RRELU


class _RreluOfNoise(torch.autograd.Function):
    """`x` times the `noise` rrelu drew for it (exactly the kernel's output), differentiated by eager's
    formulas for the in-place `rrelu_with_noise` in training."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, noise: torch.Tensor, lower: float, upper: float) -> torch.Tensor:  # type: ignore[override]
        return x * noise

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, noise, ctx.lower, ctx.upper = inputs
        ctx.save_for_backward(x, noise)
        ctx.save_for_forward(noise)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        x, noise = ctx.saved_tensors
        return (
            aten.rrelu_with_noise_backward.default(grad, x, noise, ctx.lower, ctx.upper, True, False),
            None,
            None,
            None,
        )

    @staticmethod
    def jvp(ctx: Any, x_tangent: torch.Tensor | None, *_: Any) -> torch.Tensor | None:
        (noise,) = ctx.saved_tensors
        return None if x_tangent is None else x_tangent * noise


class _RreluAsEager(NamedTuple):
    """The functional `rrelu_with_noise`, as eager's in-place one computes it: see NOTE [rrelu runs as
    eager's]. (A NamedTuple, so that a program's code can name it where it is an argument.)"""

    def __call__(
        self,
        x: torch.Tensor,
        noise: torch.Tensor,
        lower: float = 0.125,
        upper: float = 1.0 / 3.0,
        training: bool = False,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, drawn = _FUNCTIONAL_RRELU(x.detach(), noise, lower, upper, training, generator=generator)
        if training:
            output = _RreluOfNoise.apply(x, drawn, lower, upper)
        else:
            output = aten.leaky_relu.default(x, (float(lower) + float(upper)) / 2)
        if output.device.type == "cpu":
            output = output.contiguous()
        return output, drawn


rrelu_as_eager = _RreluAsEager()


def run_rrelu_as_eager(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`rrelu_as_eager` as a program's call (a target needs a plain function)."""
    return rrelu_as_eager(*args, **kwargs)


class OverlappingWrite(RuntimeError):
    """An in-place update of a tensor whose elements share memory (raised while tracing)."""

    def __init__(self, op: Any, shape: Sequence[int], strides: Sequence[int]):
        super().__init__(f"{op} writes into a tensor of shape {tuple(shape)} with strides {tuple(strides)}")
        self.op, self.shape, self.strides = op, tuple(shape), tuple(strides)


# NOTE [in-place ops that read what they write]
# An in-place op whose source shares memory with the tensor it writes, in part
# (`t.scatter_(1, idx, t[:, :2])`), reads in eager some elements it has already
# overwritten, in the order its kernel happens to run; elementwise ops and
# `copy_` refuse such overlap in eager, and scatters do not. A traced graph is
# functional: it reads every source element before any write, so its result
# would differ from eager's without a word. remat refuses it at the trace.
class ReadsWhatItWrites(RuntimeError):
    """An in-place op reads memory it writes, in part (raised while tracing)."""

    def __init__(self, op: Any):
        super().__init__(f"{op} reads memory it writes")
        self.op = op


def _reads_what_it_writes(written: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a tensor argument other than `written` overlaps its memory without being it."""
    if not all(isinstance(n, int) for n in (*written.shape, *written.stride())):
        return False
    storage, span = _memory_span(written)
    for value in tree_leaves((args, kwargs)):
        if value is written or not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        if not all(isinstance(n, int) for n in (*value.shape, *value.stride(), value.storage_offset())):
            continue
        other_storage, other_span = _memory_span(value)
        same_view = (value.storage_offset(), value.shape, value.stride()) == (
            written.storage_offset(),
            written.shape,
            written.stride(),
        )
        if other_storage == storage and not same_view and other_span[0] < span[1] and span[0] < other_span[1]:
            return True
    return False


def _memory_span(tensor: torch.Tensor) -> tuple[Any, tuple[Any, Any]]:
    """The storage `tensor` views, and the range of element offsets it spans there."""
    start = tensor.storage_offset()
    end = start + 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True) if n > 0)
    return storage_key(tensor), (start, end)


# In-place random ops that only write their `self` (`rrelu_with_noise_` reads it, so it is not one).
_RANDOM_FILLS = frozenset(
    {
        aten.bernoulli_, aten.normal_, aten.uniform_, aten.exponential_, aten.geometric_, aten.cauchy_,
        aten.log_normal_, aten.random_,
    }
)  # fmt: skip


# NOTE [dropout under torch.func]
# Eager dropout fills `empty_like(input)` in place, in the input's layout; but
# on a tensor wrapped by a torch.func transform (`grad`, `vmap`), torch's
# dropout functions draw their mask out of place, into a contiguous tensor.
# The two draw the same numbers when the input is contiguous, and then one
# trace serves calls with and without transforms. When it is not, a function
# traced to run under a transform keeps the functional form of the fills made
# inside a dropout function, and its trace serves only calls under a transform
# (and the other trace only calls without): `JointGraph.under_functorch`.
_DROPOUTS = frozenset(
    {
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
        torch.dropout, torch.dropout_, torch.feature_dropout, torch.feature_dropout_, torch.alpha_dropout,
        torch.alpha_dropout_, torch.feature_alpha_dropout, torch.feature_alpha_dropout_,
    }
)  # fmt: skip


class _InsideDropout(TorchFunctionMode):
    """Notes, for `EagerFidelity`, when a dropout function is running."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        inside = func in _DROPOUTS
        self.depth += inside
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= inside


# NOTE [ops vmap runs example by example]
# Under vmap, torch runs a composite op that has neither a batching rule nor a
# decomposition registered for vmap (`stft`, `istft`, `fft.ihfft2`, `fft.ihfftn`,
# `linalg.tensorsolve`: found by asking the dispatcher, not from a list) example
# by example, and stacks the results into a contiguous tensor, whatever layout
# one example's result has. remat's trace holds the ops such an op is made of,
# which vmap batches one by one, each in its own rule's layout (`stft`'s
# transposed). While tracing, the node of the value such an op returns is
# noted (not an input it returns as it is: `conj` of a real tensor); where vmap
# was the innermost level of the call, the programs make that value contiguous,
# as the stack is.
class _StackedUnderVmap(TorchFunctionMode):
    """Notes the nodes of the values of the ops vmap runs example by example: NOTE [ops vmap runs example
    by example]."""

    def __init__(self) -> None:
        super().__init__()
        self.noted = 0  # values noted so far

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        noted_before = self.noted
        result = func(*args, **(kwargs or {}))
        # The innermost call of the op is noted: a Python wrapper of the same name (`torch.stft` around
        # `_VF.stft`) may take a view of its value after.
        if self.noted > noted_before or not runs_per_example_under_vmap(getattr(func, "__name__", "")):
            return result
        for value in tree_leaves(result):
            node = node_behind(value) if isinstance(value, torch.Tensor) else None
            if node is not None and node.op == "call_function":
                note_stacked_under_vmap(node)
                self.noted += 1
        return result


class _ViewsWrittenThroughExactly(TorchFunctionMode):
    """Traces the views functionalization cannot write back through exactly as views it can
    (NOTE [writes through views]), above autograd, so that its view replays take them too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.unfold:
            unfold = _Unfold(*args, **kwargs)
            if unfold.has_one_window():
                return unfold.as_slice()
            if unfold.has_gaps():
                return unfold.with_gaps()
        if func in _AS_STRIDED and isinstance(args[0], torch.Tensor):
            return _as_strided(*args, **kwargs)
        return func(*args, **kwargs)


_AS_STRIDED = (torch.Tensor.as_strided, torch.as_strided)


def _as_strided(
    tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> torch.Tensor:
    """`tensor.as_strided(...)`, of the tensor it views if it is a view: functionalization writes through
    an `as_strided` of a tensor, but refuses one at the end of a chain of views."""
    offset = tensor.storage_offset() if storage_offset is None else storage_offset
    base = tensor if tensor._base is None else tensor._base
    return torch.Tensor.as_strided(base, size, stride, offset)


@dataclasses.dataclass(frozen=True)
class _Unfold:
    """A call `tensor.unfold(dimension, size, step)`."""

    tensor: torch.Tensor
    dimension: int
    size: int
    step: int

    @property
    def length(self) -> Any:
        """The size of the unfolded dimension (a symbol where it depends on data)."""
        return self.tensor.shape[self.dimension] if self.tensor.dim() else 1

    @property
    def windows(self) -> Any:
        return (self.length - self.size) // self.step + 1

    def has_one_window(self) -> bool:
        """Whether it has one window, longer than its step: functionalization refuses writes through
        such an `unfold`, though none of its elements overlap."""
        return isinstance(self.length, int) and self.windows == 1 and self.size > self.step

    def has_gaps(self) -> bool:
        """Whether its windows share nothing but leave elements out (`unfold(0, 1, 2)`, or a last element
        no window reaches): functionalization writes back through it as the sum of the windows, which
        sets those elements to zero."""
        if not isinstance(self.length, int) or self.size > self.step:
            return False
        return self.size < self.step or self.windows * self.step != self.length

    def with_gaps(self) -> torch.Tensor:
        """It as views functionalization writes through exactly: where its windows fit in whole steps,
        the steps as a dimension of their own and the first `size` elements of each; otherwise (a last
        window shorter than a step) the `as_strided` it is. Both have its shape and strides."""
        dim = self.dimension % self.tensor.dim()
        if self.windows * self.step <= self.length:
            steps = self.tensor.narrow(dim, 0, self.windows * self.step).unflatten(dim, (self.windows, self.step))
            return steps.narrow(dim + 1, 0, self.size).movedim(dim + 1, -1)
        shape, strides = list(self.tensor.shape), list(self.tensor.stride())
        shape[dim] = self.windows
        strides[dim] *= self.step
        return _as_strided(self.tensor, (*shape, self.size), (*strides, self.tensor.stride(dim)))

    def as_slice(self) -> torch.Tensor:
        """Its one window as a slice, its elements moved last, a dimension of 1 in their place: the
        unfold's shape and strides, through views that functionalization writes through exactly."""
        if self.tensor.dim() == 0:
            return self.tensor.unsqueeze(0)
        dim = self.dimension % self.tensor.dim()
        return self.tensor.narrow(dim, 0, self.size).movedim(dim, -1).unsqueeze(dim)


# NOTE [error checks of linalg ops]
# `torch.linalg.inv`, `solve`, `cholesky`, `slogdet`, `lu_factor` and friends
# run their `_ex` form and then `aten._linalg_check_errors(info, ...)`, which
# raises (a singular matrix, a matrix that is not positive-definite) and
# returns nothing. Since torch 2.13 functionalization marks that op effectful
# and wants an effect token threaded through the graph, which only
# AOTAutograd sets up ("Could not find a token for effect"). The check is a
# pure read of `info`: it is traced as it is, unfunctionalized, so
# the forward program runs it where eager does and raises what eager raises.
# Its node has no output, so no policy keeps anything for it and backward
# never replays it (a replayed `_ex` call is not checked again: its forward
# already was). Dead-code elimination must keep the node (`kept_as_dead_code`):
# on a release that does not mark the op effectful, fx would remove it, and
# with it the check.
_ERROR_CHECKS = _quirks.LINALG_CHECKS_ARE_EFFECTFUL.table


def kept_as_dead_code(node: Any) -> bool:
    """Whether dead-code elimination must keep the traced node `node`: it has side effects."""
    return bool(node.is_impure()) or node.target in _ERROR_CHECKS


class FunctionalModeKeepingChecks(FunctionalTensorMode):
    """The `FunctionalTensorMode` of a trace, which traces error checks as they are."""

    def __enter__(self) -> Any:
        inherit_higher_order_rules(type(self))  # See NOTE [higher-order ops under remat's modes].
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _ERROR_CHECKS:  # NOTE [error checks of linalg ops]
            args, kwargs = tree_map_only(FunctionalTensor, _unwrap, (args, kwargs or {}))
            return func(*args, **kwargs)  # this mode is off while it dispatches: make_fx records the op
        out_of_place = _out_of_place_under_forward_ad(func)
        if out_of_place is not None:  # See NOTE [in-place ops whose meta kernels fail under forward AD].
            result = self.__torch_dispatch__(out_of_place, types, args, kwargs)
            _check_in_place_result(func, args[0], result)
            target = args[0]  # updated as functionalization updates a tensor in place
            target.replace_(from_functional(result))
            target.commit_update()
            target.sync()
            return target
        return super().__torch_dispatch__(func, types, args, kwargs)


# NOTE [in-place ops whose meta kernels fail under forward AD]
# The meta kernel of `lerp_` with a tensor weight calls `lerp` by its overload
# packet, and resolving the overload prints the weight as it tries it against
# `lerp.Scalar`; while a forward-mode AD level is active, printing a tensor
# inside a kernel raises torch's internal assert about `_fw_primal`
# (`_quirks.IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD`). `quantile` calls
# `lerp_`, so it could not be traced under `jvp` or `forward_ad`. While a level
# is active, remat's fake and functional modes run such an op as its out-of-place
# overload (the same kernel), after the check the in-place op adds (the result's
# shape is the updated tensor's); the functional mode then gives the updated
# tensor that result as its new value, as functionalization does for an in-place
# op.


def _out_of_place_under_forward_ad(func: Any) -> Any:
    """The out-of-place overload to run instead of `func` (in place), if its meta kernel would fail here."""
    table = _quirks.IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD.table
    if func not in table or forward_ad_level() < 0:
        return None
    return table[func]


def _check_in_place_result(func: Any, target: torch.Tensor, result: torch.Tensor) -> None:
    """The check `func` (in place into `target`) makes of its `result` beyond the out-of-place op's (which
    already asks for one dtype), as eager's message says it."""
    if result.shape != target.shape:
        raise RuntimeError(
            f"{func}: output with shape {list(target.shape)} doesn't match the broadcast shape {list(result.shape)}"
        )


def _unwrap(functional: FunctionalTensor) -> torch.Tensor:
    sync(functional)
    return from_functional(functional)


# NOTE [writes through views]
# Functionalization writes an in-place update of a view back into its base
# through the view's inverse. For `expand` the inverse is `base + sum(new -
# base)` over the expanded dimensions: one rounding off eager when nothing is
# expanded (`x.expand(*x.shape)`, a plain alias), and plainly wrong when
# something is (eager's `fill_` on a broadcast view writes each element once;
# the sum writes it as many times as it is repeated). So an `expand` to the
# same shape is traced as the alias it is (one that only adds leading dimensions
# of size one as the view it is), and an in-place op into a tensor
# whose elements may share memory (a broadcast, an overlapping `unfold`) is
# refused: which of the writes wins is not something a functional graph says.
# Functionalization itself refuses a write through any `unfold` whose window is
# longer than its step, even where there is only one window and nothing
# overlaps; such an `unfold` is traced as the slice and reordering it is. It
# also refuses a write through an `as_strided` of a view (as_strided reads the
# storage, not the view): that is traced as the same `as_strided` of the base.
# And it writes back through an `unfold` whose windows leave gaps as the sum of
# the windows, which sets the gaps to zero: such an unfold is traced as a
# slice of whole steps, or, where its last window is shorter than a step, as
# the `as_strided` it is (which `vmap` cannot batch and forward mode does not
# yet differentiate exactly through remat: a known limitation).
class EagerFidelity(TorchDispatchMode):
    """Sits above FunctionalTensorMode while the joint graph is traced, seeing eager's tensors."""

    def __init__(self, dropouts: _InsideDropout, under_functorch: bool, fake_mode: EagerLayoutFakeMode):
        super().__init__()
        self.dropouts = dropouts
        self.under_functorch = under_functorch
        self.fake_mode = fake_mode
        self.dropout_layout_matters = False  # a dropout filled a non-contiguous mask

    supports_higher_order_operators = True  # See NOTE [higher-order ops under remat's modes].

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if func is aten.expand.default and _expands_nothing(args[0], args[1]):
            return aten.alias.default(args[0])
        if func is aten.expand.default and _only_adds_dims_of_one(args[0], args[1]):
            return aten.view.default(args[0], [1] * (len(args[1]) - args[0].dim()) + list(args[0].shape))
        written = _written_tensors(func, args, kwargs)
        for tensor in written:
            if _may_overlap(tensor.shape, tensor.stride()):
                raise OverlappingWrite(func, tensor.shape, tensor.stride())
            if _reads_what_it_writes(tensor, args, kwargs):  # NOTE [in-place ops that read what they write]
                raise ReadsWhatItWrites(func)
        if not written or func.overloadpacket not in _RANDOM_FILLS:
            return trace_call(func, args, kwargs)
        target = written[0]
        if self.dropouts.depth and not target.is_contiguous():  # NOTE [dropout under torch.func]
            self.dropout_layout_matters = True
            if self.under_functorch:
                return trace_call(func, args, kwargs)
        strides = tuple(target.stride())
        fill = FillInEagerLayout(func.name(), strides, is_dense(target.shape, strides), not self.dropouts.depth)
        if fill.dense:  # the fill's value has eager's layout, for every op that reads it
            self.fake_mode.fill_strides = fill.strides
        try:
            result, random_nodes = random_calls_traced(lambda: trace_call(func, args, kwargs))
        finally:
            self.fake_mode.fill_strides = None
        if random_nodes:
            note_fill(random_nodes[0], fill)
        return result


# NOTE [regions of a backward without grad]
# A backward traced in grad mode (NOTE [a backward traced as it will run]) may
# run parts with grad mode off: a custom Function's `once_differentiable`
# backward computes under `no_grad`, so eager never differentiates it (torch.func
# takes its derivative as zero; plain autograd raises where one is asked for).
# A traced graph does not say which ops ran so. While the backward is traced,
# the nodes made with grad mode off are noted, and where the backward program
# runs to be differentiated, their values are detached.
class NodesWithoutGrad(TorchDispatchMode):
    """Notes each graph node made while grad mode is off, as a backward is traced in grad mode."""

    def __init__(self, graph: Any):
        super().__init__()
        self.graph = graph

    supports_higher_order_operators = True  # See NOTE [higher-order ops under remat's modes].

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if torch.is_grad_enabled() or isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        last = next(iter(reversed(self.graph.nodes)), None)  # (before 2.12 `reversed` gives no iterator)
        result = func(*args, **(kwargs or {}))
        for node in reversed(self.graph.nodes):
            if node is last:
                break
            note_computed_without_grad(node)
        return result


@contextlib.contextmanager
def eager_fidelity(under_functorch: bool, fake_mode: EagerLayoutFakeMode) -> Iterator[EagerFidelity]:
    """The modes to run `fn` under, inside `FunctionalTensorMode`, while tracing the joint graph
    (for a function that runs under a torch.func transform, with `under_functorch`)."""
    with (
        _ViewsWrittenThroughExactly(),
        _InsideDropout() as dropouts,
        _StackedUnderVmap(),
        EagerFidelity(dropouts, under_functorch, fake_mode) as fidelity,
    ):
        yield fidelity


def _written_tensors(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments an op writes into (`self` of an in-place op, `out=`)."""
    written = []
    for position, argument in enumerate(op_schema(func).arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


def _expands_nothing(tensor: torch.Tensor, sizes: Sequence[Any]) -> bool:
    if len(sizes) != tensor.dim():
        return False
    return all(isinstance(s, int) and s in (-1, n) for s, n in zip(sizes, tensor.shape, strict=True))


def _only_adds_dims_of_one(tensor: torch.Tensor, sizes: Sequence[Any]) -> bool:
    """Whether `tensor.expand(sizes)` only puts dimensions of size one in front: a view, not a broadcast."""
    added = len(sizes) - tensor.dim()
    return (
        added > 0
        and all(isinstance(s, int) and s == 1 for s in sizes[:added])
        and _expands_nothing(tensor, sizes[added:])
    )


def _known(shape: Sequence[Any], strides: Sequence[Any]) -> list[tuple[int, int]] | None:
    """(stride, size) of each dimension with more than one element, by stride; None if symbolic."""
    if not all(isinstance(v, int) for v in (*shape, *strides)):
        return None
    if 0 in shape:
        return []
    return sorted((stride, size) for size, stride in zip(shape, strides, strict=True) if size > 1)


def _may_overlap(shape: Sequence[Any], strides: Sequence[Any]) -> bool:
    """Whether two elements of a tensor may share memory. Where every stride steps past the whole
    extent of the smaller-strided dimensions, none do; where one is zero, some do; in between
    (`as_strided((3, 2), (2, 3))` interleaves distinct elements), the offsets are counted, up to
    `_OFFSETS_COUNTED` elements (past that, the write is taken to overlap)."""
    dims = _known(shape, strides)
    extent = 0
    for stride, size in dims or ():
        if stride == 0:
            return True
        if stride <= extent:
            return _offsets_repeat(dims or [])
        extent += stride * (size - 1)
    return False


_OFFSETS_COUNTED = 1 << 20


def _offsets_repeat(dims: Sequence[tuple[int, int]]) -> bool:
    """Whether two indices of a tensor with these (stride, size) dimensions reach one offset."""
    count = 1
    for _, size in dims:
        count *= size
    if count > _OFFSETS_COUNTED:
        return True
    offsets = {0}  # plain integers: no tensor op while a trace's modes are active
    for stride, size in dims:
        offsets = {offset + stride * i for offset in offsets for i in range(size)}
    return len(offsets) < count


def is_dense(shape: Sequence[Any], strides: Sequence[Any]) -> bool:
    """Whether a tensor's elements fill its memory with no gaps (contiguous in some order)."""
    dims = _known(shape, strides)
    if dims is None:
        return True
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


# NOTE [kernels that choose their output layout]
# Fake tensors predict output strides from each op's meta kernel or
# decomposition, which mostly follows the input's layout. Some CPU kernels
# choose another: batch norm's return a tensor contiguous in the input's
# suggested memory format, log-sigmoid's and several backward kernels' a
# contiguous one whatever their inputs, and some elementwise ops whose
# decomposition reorders their operands (`floor_divide`, `copysign`, `xlogy`)
# take the layout TensorIterator gives, led by the first operand. Eager's
# `bn(x.transpose(1, 2)).view(-1)` works, while the fake predicts transposed
# strides and refuses the view. The tracing fake mode corrects those outputs,
# so that the trace (views, random fills, the kernels attention chooses, output
# metadata) sees the layouts eager sees. The table is PyTorch's OpInfo database
# swept on torch 2.13 and 2.15 for real CPU strides that differ from the fake
# ones (docs/debugging.md).
# The table is `_quirks.CPU_KERNELS_CHOOSE_LAYOUTS`.
_CPU_LAYOUT = _quirks.CPU_KERNELS_CHOOSE_LAYOUTS.table


# NOTE [fake results from the cache lose their storage offset]
# FakeTensorMode caches the metadata of an op's outputs, and on a hit makes a
# new output with `empty_strided`: an output that is no view but sits at an
# offset in its storage, as `aten.copy`'s does when its destination does (a
# slice assignment, functionalized), comes back at offset 0, with a smaller
# storage than eager's. The first trace in a process then counted other bytes
# than the next one. These ops are dispatched past the cache.
_CACHE_LOSES_OFFSETS = frozenset({aten.copy.default})


class EagerLayoutFakeMode(UncheckedRealValuesFakeMode):
    """A fake tensor mode whose outputs have the strides (and dtypes, `FAKE_DTYPE_ERRATA`) eager's kernels give them,
    and that notes the user's generators it draws from (`drawn_generators`), to be put back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drawn_generators = DrawnGenerators()
        self.fill_strides: tuple[int, ...] | None = None  # eager's layout for the random fill traced next

    def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):  # See NOTE [higher-order ops under remat's modes].
            return super().dispatch(func, types, args, kwargs)
        try:
            if func in STRICT_FAKE_KERNELS and not _on_cuda(args):
                return run_real_kernel_on_zeros(self, func, args, kwargs)
            out_of_place = _out_of_place_under_forward_ad(func)
            if out_of_place is not None:  # See NOTE [in-place ops whose meta kernels fail under forward AD].
                _check_in_place_result(func, args[0], self.dispatch(out_of_place, types, args, kwargs))
                return args[0]
            self.drawn_generators.note(kwargs.get("generator"))  # tracing with real values draws for real
            if func in _CACHE_LOSES_OFFSETS and self.cache_enabled:
                result: Any = self._uncached(func, types, args, kwargs)
            else:
                result = super().dispatch(func, types, args, kwargs)
        except RuntimeError as error:
            if type(error) is RuntimeError:  # not one of the subclasses that say why tracing cannot go on
                raise FakeKernelRefused(func, error) from error
            raise
        if self.fill_strides is not None and torch.Tag.nondeterministic_seeded in func.tags:
            strides, self.fill_strides = self.fill_strides, None  # NOTE [random fills draw in eager's layout]
            if isinstance(result, torch.Tensor) and tuple(result.stride()) != strides:
                return self._restrided(types, result, strides)
        erratum = FAKE_DTYPE_ERRATA.get(func)
        if erratum is not None:
            index, eager_dtype = erratum
            dtype = eager_dtype(*args, **kwargs)
            if result[index].dtype != dtype:
                fixed = super().dispatch(aten._to_copy.default, types, (result[index],), {"dtype": dtype})
                result = (*result[:index], fixed, *result[index + 1 :])
        layout = _CPU_LAYOUT.get(func)
        if layout is None:
            return result
        outputs = list(result) if isinstance(result, tuple) else [result]
        for i in layout.outputs:
            output = outputs[i]
            if not isinstance(output, torch.Tensor) or output.device.type != "cpu" or output.dim() == 0:
                continue
            eager = _eager_strides(layout, output, args)
            if eager is not None and tuple(output.stride()) != eager:
                outputs[i] = self._restrided(types, output, eager)
        return tuple(outputs) if isinstance(result, tuple) else outputs[0]

    def _uncached(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """`func` dispatched past the fake tensor cache: NOTE [fake results from the cache lose their storage offset]."""
        self.cache_enabled = False
        try:
            return super().dispatch(func, types, args, kwargs)
        finally:
            self.cache_enabled = True

    def _restrided(self, types: Any, fake: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
        """`fake` with `strides` (and, traced with values, the same values)."""
        fixed = super().dispatch(
            aten.empty_strided.default,
            types,
            (fake.shape, tuple(strides)),
            {"dtype": fake.dtype, "device": fake.device},
        )
        return super().dispatch(aten.copy_.default, types, (fixed, fake), {})  # type: ignore[no-any-return]


class FakeKernelRefused(RuntimeError):
    """An op's fake kernel (its rule for output shapes and dtypes) refused its inputs while tracing:
    the inputs are wrong for the op, or the rule is stricter than the real kernel."""

    def __init__(self, op: Any, error: RuntimeError):
        super().__init__(f"{op}: {error}")
        self.op, self.reason = op, str(error)


def _on_cuda(args: Sequence[Any]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args)


def _eager_strides(layout: _quirks.CpuLayout, output: torch.Tensor, args: Sequence[Any]) -> tuple[int, ...] | None:
    """The strides the CPU kernel gives `output`, by `layout`; None where the fake's can stand (and
    where sizes depend on values, which meta tensors cannot take: the fake's stand there too)."""
    tensors = [output, *(a for a in args if isinstance(a, torch.Tensor))]
    if any(not isinstance(n, int) for t in tensors for n in (*t.shape, *t.stride())):
        return None
    if layout.position == _quirks.ELEMENTWISE:
        chosen = args if layout.operands is None else [args[i] for i in layout.operands]
        operands = [a for a in chosen if isinstance(a, torch.Tensor) and a.dim() > 0]  # 0-d ones lead nothing
        if not operands or torch.broadcast_shapes(*(o.shape for o in operands)) != output.shape:
            return None
        return elementwise_output_strides(operands)
    memory_format = (
        torch.contiguous_format
        if layout.position == _quirks.CONTIGUOUS
        else _suggested_memory_format(args[layout.position])
    )
    return tuple(torch.empty(output.shape, device="meta", memory_format=memory_format).stride())


def _suggested_memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """The layout CPU kernels give the output for `tensor`: channels-last if it is, else contiguous."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if tensor.dim() == 5 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format
