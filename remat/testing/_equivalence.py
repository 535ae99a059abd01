"""`remat.testing.assert_checkpoint_equivalent`: a function against its checkpoint, every difference
explained.

It runs both through one run's record (`._runs`) and under the transforms (`._transforms`), through
their `__all__` alone; its own interface is what `remat.testing` re-exports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optree
import torch

from .._api._checkpoint import checkpoint as _remat_checkpoint
from ._runs import (
    CallPlan,
    ComparedState,
    OutputMetadata,
    Run,
    UserGenerators,
    buffers_of,
    kind_of,
    record_run,
    state_module_of,
)
from ._transforms import (
    BATCHED,
    DIFFERENTIATED_TANGENTS,
    TRANSFORMS,
    detached,
    is_float,
    tensor_leaves,
    to_device,
    transformed,
)

__all__ = ["CheckpointedRun", "assert_checkpoint_equivalent"]

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


def _diff(what: str, actual: Any, expected: Any, rtol: float | None, atol: float | None) -> str | None:
    """Why `actual` does not match `expected`, or None if it does."""
    if expected is None or actual is None:
        if expected is None and actual is None:
            return None
        return f"{what}: expected {'no gradient' if expected is None else 'a gradient'}, got {'None' if actual is None else 'one'}"
    if isinstance(actual, torch.Tensor) != isinstance(expected, torch.Tensor):
        return f"{what}: expected {kind_of(expected)}, got {kind_of(actual)}"
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
    if not is_float(e):
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
    same = (a64 == e64) | (a64.isnan() & e64.isnan())  # (equal infinities differ by NaN)
    error = (a64 - e64).abs().nan_to_num(nan=float("inf")).masked_fill(same, 0.0)
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
    expected: Run,
    actual: Run,
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
    what: str, actual: OutputMetadata, expected: OutputMetadata, a: torch.Tensor, e: torch.Tensor, same_values: bool
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
    expected: Run,
    actual: Run,
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


def _check_backprop_outputs(backprop: frozenset[int], expected: Run) -> None:
    """Raise if `backprop` names an output of `fn` that cannot be backpropagated through."""
    differentiable = [
        i for i, o in enumerate(expected.outputs) if isinstance(o, torch.Tensor) and is_float(o) and o.requires_grad
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


def _check_gradients_reach_something(expected: Run) -> None:
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
    call: CallPlan,
    state: ComparedState,
    rtol: float | None,
    atol: float | None,
) -> tuple[list[str], Run | None]:
    """Run both, `call.calls` times each; compare what they computed, or, where `fn` raises, that the
    checkpoint raises too.

    The checkpoint starts from the state eager started from: its module's buffers and the user
    generators eager drew from are put back first. Returns the differences and the checkpoint's last
    run (None where `fn` raised). Under a transform (`label`), a program eager refuses is not compared:
    remat may run it where eager cannot (its views are traced as reshapes, which never fail)."""
    start = state.snapshot()
    recorder = UserGenerators()
    expected_runs: list[Run] = []
    refused: Exception | None = None
    for index in range(call.calls):
        try:
            run = record_run(fn, call, state, index, recording=recorder)
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
        actual = record_run(checkpointed, call, state, index)
        actual.generators_after = {key: generator.get_state() for key, generator in generators.items()}
        problems += _compare(_label(label, index, call.calls), expected, actual, rtol, atol, list(generators.values()))
    if refused is None:
        return problems, actual
    at = _label(label, len(expected_runs), call.calls)
    try:
        record_run(checkpointed, call, state, len(expected_runs))
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
        module = state_module_of(fn)
        return [] if module is None else list(module.parameters())
    if isinstance(params, (torch.Tensor, torch.nn.Module, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(
            f"{_API}: expected params to be an iterable of tensors (such as module.parameters() or a list), "
            f"but got {type(params).__name__}. Wrap one tensor in a list; for a module pass module.parameters()."
        )
    params = list(params)
    for i, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{_API}: expected params to hold tensors, but params[{i}] is {kind_of(param)}.")
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


def _eager_is_off_where_remat_is_not(
    name: str, fn: Callable[..., Any], checkpointed: Callable[..., Any], call: CallPlan, state: ComparedState, seed: int
) -> bool:
    """Whether, under a transform that differentiates tangents, the checkpoint's result matches the same
    derivative taken with finite-difference tangents (float64) and eager's does not: eager's tangent
    formulas that read statistics without a derivative (layer and batch norm's) are not differentiated
    exactly, where remat's are (NOTE [tangents that will be differentiated])."""
    leaves = tensor_leaves((call.args, call.kwargs))
    if not leaves or any(is_float(t) and t.dtype != torch.float64 for t in leaves):
        return False
    start = state.snapshot()

    def result(function: Callable[..., Any]) -> list[torch.Tensor]:
        state.restore(start)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            tree = function(*detached(call.args), **detached(call.kwargs))
        return [t.detach() for t in tensor_leaves(tree) if is_float(t)]

    try:
        reference = result(transformed(name, fn, seed, finite_differences=True))
        expected, got = result(transformed(name, fn, seed)), result(transformed(name, checkpointed, seed))
    except Exception:
        return False
    finally:
        state.restore(start)

    def close(values: list[torch.Tensor]) -> bool:
        return len(values) == len(reference) and all(
            v.shape == r.shape and torch.allclose(v, r, rtol=1e-6, atol=1e-6 * (1.0 + r.abs().max().item()))
            for v, r in zip(values, reference, strict=True)
        )

    return close(got) and not close(expected)


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
    type. Under the transforms that differentiate forward-mode tangents
    (`grad_of_jvp`, `grad_of_jvp_of_vmap`, `grad_of_forward_ad`) in
    float64, a result that differs from eager's passes where it matches the
    same derivative taken with finite-difference tangents and eager's does
    not (eager's tangent formulas for layer and batch norm are off there).
    Tolerances depend on the dtype (tight for float64, loose for bfloat16
    and float16) unless given.

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
            gradient: reverse mode twice, as a Hessian-vector product), and
            `"double_backward"` (`torch.autograd.grad` with
            `create_graph=True`, then the gradient of a weighted sum of that
            gradient: plain autograd twice, as a gradient penalty; the first
            gradient is compared as an output, the second by value). They
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
        args = to_device(args, device)
        call_kwargs = to_device(call_kwargs, device)
        for module in (fn, checkpointed):
            if isinstance(module, torch.nn.Module):
                module.to(device)
    tensors = _checked_params(params, fn)
    expected_buffers = buffers_of(fn)
    if checkpointed is None:
        checkpointed = _checkpoint(fn, policy)
        header = f"remat.checkpoint(fn, policy={policy!r}) differs from fn = {fn!r}:"
    else:
        header = f"checkpointed = {checkpointed!r} differs from fn = {fn!r}:"
    # A checkpoint that is not a module itself runs fn's (remat.checkpoint of a function, a lambda).
    actual_buffers = buffers_of(checkpointed)
    state = ComparedState(expected_buffers, expected_buffers if actual_buffers is None else actual_buffers)
    call = CallPlan(args, call_kwargs, tensors, seed, backward=True, backprop=positions, calls=calls)
    problems, run = _run_and_compare("", fn, checkpointed, call, state, rtol, atol)
    for name in transforms:
        # The transforms are compared as pure functions of detached inputs; vmap also backpropagates.
        batched = name in BATCHED
        transformed_call = dataclasses.replace(
            call,
            args=(_stack(args) if name == "vmap" else _stack(detached(args))) if batched else detached(args),
            kwargs=call_kwargs if batched else detached(call_kwargs),
            backward=name == "vmap",
            calls=1,
        )
        found = _run_and_compare(
            f"[{name}] ",
            transformed(name, fn, seed),
            transformed(name, checkpointed, seed),
            transformed_call,
            state,
            rtol,
            atol,
        )[0]
        if (
            found
            and name in DIFFERENTIATED_TANGENTS
            and _eager_is_off_where_remat_is_not(name, fn, checkpointed, transformed_call, state, seed)
        ):
            found = []
        problems += found
    if problems:
        raise AssertionError("\n  ".join([header, *problems]))
    if run is None:
        return None
    return CheckpointedRun(run.tree, tuple(run.input_grads), tuple(run.param_grads))
