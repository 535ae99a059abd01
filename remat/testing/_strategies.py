"""The hypothesis strategies of `remat.testing`: random functions from the catalog (`functions`), inputs
for them (`inputs`) and per-call policies for a trace (`policies`).

Its interface (`__all__`) is what `remat.testing` re-exports; one run's record reads `RandomFunction`
(whose `CatalogState` is the module whose state a run compares).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from .. import policies as _policies
from .._core._calls import Call, Decision, Trace
from .._storing._storage import exact
from ._catalog import (
    AS_STRIDED_WRITES,
    CATALOG,
    LOW_PRECISION_OPS,
    RANDOM_OPS,
    REFUSABLE_OPS,
    STATEFUL_OPS,
    CatalogState,
    Constants,
)
from ._transforms import BATCHED, TRANSFORMS, UNDER_FUNC_JVP, tensor_leaves

__all__ = ["RandomFunction", "Step", "functions", "inputs", "policies", "transforms_for"]


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
        values = tensor_leaves(args)
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
    objects: bool = False,
    all_require_grad: bool = False,
    special_values: bool = False,
) -> tuple[Any, ...]:
    """Draw positional arguments for a random function: float tensors, optionally nested in a pytree.

    Each input requires grad unless hypothesis decides otherwise (at least
    one always does). With `pytree=True` the tensors come nested in a random
    structure of tuples, lists and dicts, which `RandomFunction` accepts; with
    `objects=True` also in plain objects (as attributes) and in functions (as
    what their closures hold), which remat opens (docs/modules.md, "Objects
    handed to a layer").

    Args:
        fn: the function the inputs are for.
        dtype: a floating dtype.
        device: where to put the tensors.
        pytree: whether to nest them in tuples, lists and dicts.
        objects: whether to nest them in objects and closures too (implies `pytree`).
        all_require_grad: make every input require grad (by default each may not).
        special_values: also put the values where floating point has its corners into some elements:
            NaN, infinities of both signs, -0.0 and denormals (the smallest subnormal, and the largest).
            Off by default, so that a property test keeps the inputs it was written for; with it,
            `assert_checkpoint_equivalent` checks that the checkpoint gives NaN, infinity and zero
            where eager does (see docs/testing.md, "What exactly eager means").

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
    drawn = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in fn.input_shapes]
    if special_values:
        drawn = [_with_special_values(draw, values, dtype) for values in drawn]
    tensors = [
        values.to(dtype=dtype, device=device).requires_grad_(rg)
        for values, rg in zip(drawn, requires_grad, strict=True)
    ]
    if not (pytree or objects):
        return tuple(tensors)
    kinds = ["leaf", "tuple", "list", "dict", *(["object", "closure"] if objects else [])]
    groups: list[Any] = []
    remaining = list(tensors)
    while remaining:
        size = draw(st.integers(1, len(remaining)))
        group, remaining = remaining[:size], remaining[size:]
        kind = draw(st.sampled_from(kinds))
        if kind == "leaf" and len(group) == 1:
            groups.append(group[0])
        elif kind == "list":
            groups.append(list(group))
        elif kind == "dict":
            groups.append({f"t{i}": t for i, t in enumerate(group)})
        elif kind == "object":
            groups.append(Holder(*group))
        elif kind == "closure":
            groups.append(_closing_over(group))
        else:
            groups.append(tuple(group))
    return tuple(groups)


def _special_values(dtype: torch.dtype) -> list[float]:
    """NaN, the infinities, a negative zero and the extreme denormals of `dtype`."""
    info = torch.finfo(dtype)
    return [math.nan, math.inf, -math.inf, -0.0, info.smallest_normal * info.eps, info.smallest_normal * (1 - info.eps)]


def _with_special_values(draw: st.DrawFn, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` with a few elements (none to a quarter, drawn) set to special values of `dtype`."""
    flat = values.flatten().clone()
    if flat.numel() == 0:
        return values
    count = draw(st.integers(0, max(1, flat.numel() // 4)))
    for _ in range(count):
        where = draw(st.integers(0, flat.numel() - 1))
        flat[where] = draw(st.sampled_from(_special_values(dtype)))
    return flat.reshape(values.shape)


class Holder:
    """A plain object handed to a function: its tensors are attributes (`t0`, `t1`, ...), in order."""

    def __init__(self, *tensors: torch.Tensor):
        for i, tensor in enumerate(tensors):
            setattr(self, f"t{i}", tensor)

    def __repr__(self) -> str:
        return f"Holder({', '.join(f'{k}={type(v).__name__}{tuple(v.shape)}' for k, v in vars(self).items())})"


def _closing_over(tensors: Sequence[torch.Tensor]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A function handed to a function: the tensors are what its closure holds, in order."""
    held = tuple(tensors)

    def closure() -> tuple[torch.Tensor, ...]:
        return held

    closure.__qualname__ = f"closure over {len(held)} tensor(s)"
    return closure


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
    where highspy is installed, the planner `remat.policies.budget`, and
    `remat.policies.pack_everything`. With `offload`, also per-call tables of
    every decision (SAVE, PACK, OFFLOAD and RECOMPUTE: every split is
    reachable) and `remat.policies.offload_dots`.

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
        st.sampled_from([None, _policies.save_nothing, _policies.save_everything, _policies.pack_everything]),
        st.builds(_PerCallPolicy, st.lists(st.booleans(), min_size=n, max_size=n).map(tuple), st.booleans()),
    ]
    if save_calls:
        choices.append(subsets.map(lambda indices: _policies.save_calls(*sorted(indices))))
    if importlib.util.find_spec("highspy") is not None:  # the planner's solver
        choices.append(st.just(_policies.budget(fraction=1.0)))  # a smaller budget may be infeasible
    if offload:
        three_way = st.lists(st.sampled_from([d for d in Decision if exact(d)]), min_size=n, max_size=n).map(tuple)
        choices += [st.builds(_PerCallDecisions, three_way), st.just(_policies.offload_dots)]
    return st.one_of(*choices)


def transforms_for(fn: RandomFunction) -> tuple[str, ...]:
    """The transforms (of `TRANSFORMS`) that `assert_checkpoint_equivalent` can compare for `fn`.

    Left out: `torch.func.jvp` where a catalog op may update an input in place (`REFUSABLE_OPS`: torch.func
    does not let a Function update the input's tangent in place, which remat says; nor, under
    `"grad_of_forward_ad"`, update a dual tensor, a view of a tensor that requires grad), the batched
    transforms and `forward_ad` for writes through `as_strided` (`AS_STRIDED_WRITES`: remat says it does
    not support them there), and second derivatives of regions that compute in bfloat16
    (`LOW_PRECISION_OPS`: remat sums some paths' contributions in another precision than eager).

    >>> import remat.testing
    >>> fn = remat.testing.RandomFunction((2, 3), 1, (remat.testing.Step("sin", 0, 0),), (1,))
    >>> remat.testing.transforms_for(fn) == remat.testing.TRANSFORMS
    True
    """
    ops = set(fn.ops)
    left_out: set[str] = set()
    if REFUSABLE_OPS & ops:
        left_out |= UNDER_FUNC_JVP | {"grad_of_forward_ad"}
    if AS_STRIDED_WRITES & ops:
        left_out |= BATCHED | {"forward_ad", "grad_of_forward_ad"}
    if LOW_PRECISION_OPS & ops:
        left_out |= {"grad_of_grad", "double_backward", "grad_of_jvp", "grad_of_jvp_of_vmap", "grad_of_forward_ad"}
    return tuple(t for t in TRANSFORMS if t not in left_out)
