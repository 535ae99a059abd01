"""PyTorch's own OpInfo database as a client: each op's first float64 sample, checkpointed.

For every op of `op_db` chosen below (see `SELECTED`), the first float64
sample (the first four in the soak) is wrapped as a function of its tensors and checked with
`remat.testing.assert_checkpoint_equivalent` under `save_nothing` and
`save_everything`: outputs with their metadata, gradients, in-place updates
and where the random stream is left, against the unwrapped op. An op either
passes, or is refused with one of remat's own errors, listed below with the
reason; nothing may come out silently different, nor as a raw torch error.

OpInfo runs its random ops inside `wrapper_set_seed`, which calls
`torch.manual_seed(42)` in the op: remat refuses that (see NOTE [seeding
inside a checkpointed function]), which `test_seeding_inside_is_refused`
asserts for each; the sweep then runs them without the wrapper, so that their
kernels are compared too (bit-identical draws, the stream left as eager).
"""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from conftest import PROFILE

import remat
import remat.testing
from remat import _quirks, _torch, policies

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (`pip install -e '.[test]'`)")

from torch.testing._internal import common_methods_invocations
from torch.testing._internal.common_methods_invocations import op_db

# --- what remat refuses, and why -------------------------------------------------------------------

# Python code that reads a tensor's value (`.item()`, `bool(t)`, a number from a tensor): traced for
# the values it reads and checked on each call (NOTE [values Python reads]), or refused with the line
# (a float value; a value read inside a kernel). Either way, never different from eager.
READS_VALUES = {
    "item",  # `.item()` itself
    "allclose",  # returns a Python bool
    "equal",  # returns a Python bool
    "corrcoef",  # checks its input's values in Python
    "cov",  # checks its weights' values in Python
    "nn.functional.gaussian_nll_loss",  # checks `var` for negative values in Python
    "index_reduce.prod",  # the decomposition checks its index values
    "scatter_reduce.prod",  # the decomposition checks its index values
    "tensor_split",  # the first sample gives its split indices as a tensor: pass a list instead
}
if _quirks.QUANTILE_COMPARES_TENSORS.applies(_torch.RELEASE):  # torch 2.11
    READS_VALUES |= {"quantile", "nanquantile"}

# Ops whose output *size* depends on values: symbolic sizes, or refused by a TraceError that says so
# (an op without a rule for symbolic sizes); never different from eager.
SIZE_FROM_VALUES = {
    "argwhere",
    "combinations",
    "masked_select",
    "nonzero",
    "unique",
    "unique_consecutive",
    "nn.functional.ctc_loss",
    "linalg.lstsq",
    "linalg.lstsq.grad_oriented",
}

# Sparse inputs or outputs: remat traces dense (strided) tensors only.
SPARSE = {"to_sparse", "sparse.sampled_addmm", "sparse.mm.reduce"}

# Known difference: eager's backward of `linalg.eig` raises when the loss depends on the phase
# of the eigenvectors (a check of the gradient's values, which torch skips for traced tensors,
# so remat's traced backward returns the formula's gradient). Forward outputs are compared.
FORWARD_ONLY = {"linalg.eig"}

# Ops whose output is uninitialized memory: only its metadata can be compared.
UNINITIALIZED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}

# The ops named in issue 18 (the linalg error checks, tensor indices, seeding inside the op).
ISSUE_OPS = {
    "linalg.inv",
    "linalg.inv_ex",
    "linalg.solve",
    "linalg.solve_ex",
    "linalg.cholesky",
    "linalg.cholesky_ex",
    "linalg.slogdet",
    "logdet",
    "linalg.lu_factor",
    "linalg.ldl_factor",
    "linalg.eigvals",
    "linalg.tensorinv",
    "linalg.tensorsolve",
    "cholesky_inverse",
    "tensor_split",
}


_DATA_DEPENDENT_REFUSALS = (
    r"reads (the|a float) value of a tensor|whose result is a Python value|shape depends on the values of its inputs|reads the values of a tensor "
    r"argument|cannot check on later calls"
)


def _name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _seeded_by_opinfo(op: Any) -> bool:
    """Whether OpInfo runs `op` inside `wrapper_set_seed` (a lambda that names it)."""
    code = getattr(op.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


# The sweep checks every op named above and every op OpInfo seeds under both policies, and a
# deterministic quarter of the rest (by a hash of the name: the same ops on every run and machine) under
# one of them, alternately, to stay well within a minute on two cores. The soak profile
# (HYPOTHESIS_PROFILE=soak) checks the whole database (about 620 float64 ops on torch 2.13) under both,
# which takes about six times as long.
_FLOAT64_OPS = {_name(op): op for op in op_db if torch.float64 in op.supported_dtypes("cpu")}
_NAMED = READS_VALUES | SIZE_FROM_VALUES | SPARSE | FORWARD_ONLY | ISSUE_OPS
SELECTED = sorted(
    name
    for name, op in _FLOAT64_OPS.items()
    if name in _NAMED or _seeded_by_opinfo(op) or (PROFILE == "soak" or zlib.crc32(name.encode()) % 4 == 0)
)
SEEDED = sorted(name for name, op in _FLOAT64_OPS.items() if _seeded_by_opinfo(op))
_POLICIES = (policies.save_nothing, policies.save_everything)
CASES = [
    pytest.param(name, policy, id=f"{name}-{policy!r}")
    for name in SELECTED
    for k, policy in enumerate(_POLICIES)
    if PROFILE == "soak" or name in _NAMED or name in SEEDED or zlib.crc32(name.encode()) // 4 % 2 == k
]
# The soak checks each op's first four samples, where later samples pass other kinds of arguments (a
# tensor `start` for `narrow`, which the first sample gives as a number).
SAMPLES = 4 if PROFILE == "soak" else 1


def _first_sample(op: Any) -> Any:
    (sample,) = _first_samples(op, 1)
    return sample


def _first_samples(op: Any, n: int) -> list[Any]:
    torch.manual_seed(0)  # samples are drawn from the global generator
    samples = list(itertools.islice(op.sample_inputs("cpu", torch.float64, requires_grad=op.supports_autograd), n))
    if not samples:
        pytest.skip(f"OpInfo gives {op.name} no float64 sample on this torch")
    return samples


def _as_function(op: Any, sample: Any) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """`op` on `sample`, as a function of the sample's tensors (the rest is fixed)."""
    leaves, spec = optree.tree_flatten((sample.input, sample.args, sample.kwargs), none_is_leaf=True)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def fn(*tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, tensor in zip(where, tensors, strict=True):
            filled[i] = tensor
        first, args, kwargs = optree.tree_unflatten(spec, filled)
        return op(first, *args, **kwargs)

    fn.__qualname__ = fn.__name__ = op.name
    return fn, [leaves[i] for i in where]


def _unseeded(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


@pytest.fixture
def without_opinfo_seeding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run OpInfo's random ops without the `torch.manual_seed(42)` of `wrapper_set_seed`."""
    monkeypatch.setattr(common_methods_invocations, "wrapper_set_seed", _unseeded)


@pytest.mark.slow  # about 300 ops and policies (all of the database under both, in the soak)
@pytest.mark.usefixtures("without_opinfo_seeding")
@pytest.mark.filterwarnings("ignore")  # the ops' own deprecation warnings, many only once a process
@pytest.mark.parametrize(("name", "policy"), CASES)
def test_first_float64_sample(name: str, policy: Any) -> None:
    op = _FLOAT64_OPS[name]
    for sample in _first_samples(op, SAMPLES):
        _check(name, policy, *_as_function(op, sample))


def _check(name: str, policy: Any, fn: Callable[..., Any], tensors: list[torch.Tensor]) -> None:
    if name in READS_VALUES | SIZE_FROM_VALUES:
        try:
            remat.testing.assert_checkpoint_equivalent(fn, *tensors, policy=policy)
        except remat.TraceError as error:
            assert re.search(_DATA_DEPENDENT_REFUSALS, str(error)), error
        except TypeError as error:  # `item`, `allclose`, `equal`: a Python number is no output of a checkpoint
            assert re.search(r"the function returned a (float|int|bool) at output", str(error)), error
    elif name in SPARSE:
        with pytest.raises(TypeError, match=re.escape("remat traces dense (`torch.strided`) tensors only")):
            remat.checkpoint(fn, policy=policy)(*tensors)
    elif name in FORWARD_ONLY | UNINITIALIZED:
        with torch.no_grad():
            expected, actual = fn(*tensors), remat.checkpoint(fn, policy=policy)(*tensors)
        for e, a in zip(optree.tree_leaves(expected), optree.tree_leaves(actual), strict=True):
            assert (a.shape, a.dtype, a.stride()) == (e.shape, e.dtype, e.stride())
            if name in FORWARD_ONLY:
                torch.testing.assert_close(a, e, rtol=0, atol=0)
    else:
        remat.testing.assert_checkpoint_equivalent(fn, *tensors, policy=policy)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", SEEDED)
def test_seeding_inside_is_refused(name: str) -> None:
    """OpInfo's random ops, as OpInfo runs them (seeding inside the op), are refused; and the
    refused trace leaves the global generator as it found it."""
    op = _FLOAT64_OPS[name]
    fn, tensors = _as_function(op, _first_sample(op))
    before = torch.get_rng_state()
    with pytest.raises(remat.TraceError, match=r"sets the state of the global random number generator"):
        remat.checkpoint(fn)(*tensors)
    assert torch.equal(torch.get_rng_state(), before)


# --- the sweep under transforms ----------------------------------------------------------------------

# Each op's first float64 sample under each of the checker's transforms (`remat.testing.TRANSFORMS`), two
# policies: in the soak profile, every op OpInfo differentiates twice (about 500 on torch 2.13); in CI,
# the ops whose second derivatives issue 51 found different from eager's, under the transforms that
# differentiate twice. An op passes, or is refused with remat's own error; a difference from eager, or a
# raw torch error where eager runs, fails.
SECOND_ORDER_OPS = {
    "cumprod", "masked.cumprod", "nn.functional.silu", "nn.functional.mish", "logit", "nn.functional.group_norm",
    "nn.functional.rrelu", "linalg.det", "linalg.solve", "linalg.slogdet", "logdet", "linalg.tensorsolve",
    "nn.functional.batch_norm", "nn.functional.layer_norm", "nn.functional.instance_norm",
}  # fmt: skip
_TWICE_DIFFERENTIABLE = {
    name for name, op in _FLOAT64_OPS.items() if op.supports_autograd and op.supports_gradgrad and name not in _NAMED
}
TRANSFORM_CASES = [
    pytest.param(name, policy, id=f"{name}-{policy!r}")
    for name in sorted(_TWICE_DIFFERENTIABLE if PROFILE == "soak" else _TWICE_DIFFERENTIABLE & SECOND_ORDER_OPS)
    for policy in _POLICIES
]
# (op, transform) pairs where eager is wrong and remat right, each shown by a test: skipped by the sweep.
EAGER_WRONG = {
    (
        "select_scatter",
        "vmap",
    ): "test_transforms.py::test_select_scatter_under_vmap_gives_the_per_example_gradient_where_torch_does_not",
    (
        "as_strided_scatter",
        "double_backward",
    ): "test_second_order.py::test_as_strided_scatter_of_an_element_has_the_finite_difference_gradient_under_create_graph",
    (
        "nn.functional.multi_head_attention_forward",
        "grad_of_jvp_of_vmap",
    ): "test_opinfo.py::test_attention_under_grad_of_jvp_of_vmap_is_eager_path_by_path",
}
_SWEPT_TRANSFORMS = (
    remat.testing.TRANSFORMS
    if PROFILE == "soak"
    else ("grad_of_grad", "double_backward", "grad_of_jvp", "grad_of_forward_ad")
)


@pytest.mark.slow
@pytest.mark.usefixtures("without_opinfo_seeding")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("name", "policy"), TRANSFORM_CASES)
def test_first_float64_sample_under_transforms(name: str, policy: Any) -> None:
    op = _FLOAT64_OPS[name]
    for sample in _first_samples(op, SAMPLES):
        fn, tensors = _as_function(op, sample)
        # (Not an empty input either: on torch 2.11 eager's gradient of `det` at a 0x0 matrix is
        # None, and there is no gradient to compare.)
        if not tensors or not tensors[0].requires_grad or tensors[0].numel() == 0:
            continue
        for transform in _SWEPT_TRANSFORMS:
            if (name, transform) in EAGER_WRONG:
                continue
            try:
                remat.testing.assert_checkpoint_equivalent(fn, *tensors, policy=policy, transforms=[transform])
            except (NotImplementedError, remat.TraceError) as error:  # a refusal: remat's own words
                assert str(error).startswith("remat"), f"[{transform}] {type(error).__name__}: {error}"


def test_the_sweep_under_transforms_covers_the_ops_of_issue_51() -> None:
    present = {name for name in SECOND_ORDER_OPS if name in _FLOAT64_OPS}
    assert len(present) >= 12, f"OpInfo lost the ops of issue 51: {sorted(SECOND_ORDER_OPS - present)}"
    assert present & _TWICE_DIFFERENTIABLE == {name for name, _ in (c.values for c in TRANSFORM_CASES)} or (
        PROFILE == "soak"
    )


def test_the_sweep_covers_the_ops_of_the_issue() -> None:
    present = {name for name in ISSUE_OPS if name in _FLOAT64_OPS}
    assert present <= set(SELECTED)
    assert len(present) >= 10, f"OpInfo lost the linalg ops of issue 18: {sorted(present)}"
    assert len(SELECTED) >= len(_FLOAT64_OPS) // 4


def test_known_outcomes_name_real_ops() -> None:
    """A renamed or removed op would silently leave a list: every name listed must exist."""
    unknown = (READS_VALUES | SIZE_FROM_VALUES | SPARSE | FORWARD_ONLY | {n for n, _ in EAGER_WRONG}) - set(
        _FLOAT64_OPS
    )
    assert not unknown, f"not in OpInfo's float64 ops: {sorted(unknown)}"


@pytest.mark.usefixtures("without_opinfo_seeding")
@pytest.mark.filterwarnings("ignore")
def test_attention_under_grad_of_jvp_of_vmap_is_eager_path_by_path() -> None:
    # The sweep's one difference under `grad_of_jvp_of_vmap` (`jacrev` of `jacfwd` of a batch): up to 7e-12
    # (largest element 8e-5) in the input's gradient of a weighted sum of attention's outputs and tangents. The
    # gradient through the outputs alone and the one through the tangents alone are eager's bit for bit,
    # and remat's whole gradient is their sum; eager's whole gradient is off from the sum of its own two
    # by as much (it meets the two cotangents inside the attention, among terms that cancel). So the
    # difference is eager's round-off, and the sweep leaves the pair out (`EAGER_WRONG`).
    op = _FLOAT64_OPS["nn.functional.multi_head_attention_forward"]
    fn, tensors = _as_function(op, _first_sample(op))
    generator = torch.Generator().manual_seed(0)
    batch = [
        torch.stack([t.detach(), t.detach() + 0.1 * torch.randn(t.shape, generator=generator, dtype=t.dtype)])
        for t in tensors
    ]
    tangents = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in batch]
    outputs, output_tangents = torch.func.jvp(
        torch.func.vmap(fn, randomness="different"), tuple(batch), tuple(tangents)
    )
    weights = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in (outputs[0], output_tangents[0])]

    def gradient(function: Callable[..., Any], through: str) -> torch.Tensor:
        def weighted(first: torch.Tensor) -> torch.Tensor:
            batched = torch.func.vmap(function, randomness="different")
            output, tangent = torch.func.jvp(lambda q: batched(q, *batch[1:]), (first,), (tangents[0],))
            return (output[0] * weights[0]).sum() * (through != "tangents") + (tangent[0] * weights[1]).sum() * (
                through != "outputs"
            )

        torch.manual_seed(1)
        return torch.func.grad(weighted)(batch[0])

    checkpointed = remat.checkpoint(fn)
    eager = {through: gradient(fn, through) for through in ("outputs", "tangents", "both")}
    ours = {through: gradient(checkpointed, through) for through in ("outputs", "tangents", "both")}
    assert torch.equal(ours["outputs"], eager["outputs"]) and torch.equal(ours["tangents"], eager["tangents"])
    torch.testing.assert_close(ours["both"], ours["outputs"] + ours["tangents"], rtol=1e-15, atol=1e-20)
    off = (eager["both"] - (eager["outputs"] + eager["tangents"])).abs().max().item()
    assert off > 1e-14, "eager's gradient is the sum of its paths now: drop the pair from EAGER_WRONG"


# --- in-place ops keep the layout of the tensor they write -------------------------------------------------
# NOTE [in-place ops keep their tensor's layout]: every in-place variant OpInfo knows, and the in-place ops
# it has no variant for, applied to a transposed tensor; a `randn_like` after each draws in its layout.

_IN_PLACE_OPS = {f"{op.name}.{op.variant_test_name}".rstrip("."): op for op in op_db if op.inplace_variant is not None}
# In-place ops that OpInfo has no in-place variant for (activations' `inplace=True`), each on a tensor.
_IN_PLACE_WITHOUT_OPINFO = {
    name: getattr(torch.ops.aten, name)
    for name in [
        "relu_",
        "hardtanh_",
        "leaky_relu_",
        "elu_",
        "celu_",
        "selu_",
        "silu_",
        "mish_",
        "hardsigmoid_",
        "hardswish_",
        "rrelu_",
        "random_",
        "bernoulli_",
    ]
}


def _transposed(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values in a transposed layout: dense, not contiguous."""
    return tensor.detach().mT.contiguous().mT.detach()


def _in_place_then_drawn(apply: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.mul(1.0)  # x's layout, and not a leaf: in place is allowed
        apply(t)
        return t, torch.randn_like(t)

    return fn


@pytest.mark.slow
@pytest.mark.usefixtures("without_opinfo_seeding")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(_IN_PLACE_OPS))
def test_an_in_place_variant_keeps_a_transposed_layout(name: str) -> None:
    op = _IN_PLACE_OPS[name]
    torch.manual_seed(0)
    samples = op.sample_inputs("cpu", torch.float64, requires_grad=False)
    sample = next(
        (
            s
            for s in samples
            if isinstance(s.input, torch.Tensor) and s.input.dim() >= 2 and min(s.input.shape[-2:]) > 1
        ),
        None,
    )
    if sample is None:
        return  # (no sample of two dimensions: a layout is no matter of one)
    fn = _in_place_then_drawn(lambda t: op.inplace_variant(t, *sample.args, **sample.kwargs))
    x = _transposed(sample.input)
    try:
        fn(x.clone())
    except RuntimeError:
        return  # eager refuses the sample in place (an in-place op that would change the dtype, say)
    remat.testing.assert_checkpoint_equivalent(fn, x.requires_grad_(), policy=policies.save_nothing)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(_IN_PLACE_WITHOUT_OPINFO))
def test_an_in_place_op_without_an_opinfo_variant_keeps_a_transposed_layout(name: str) -> None:
    op = _IN_PLACE_WITHOUT_OPINFO[name]
    fn = _in_place_then_drawn(lambda t: op(t))
    x = _transposed(torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    remat.testing.assert_checkpoint_equivalent(fn, x.requires_grad_(), policy=policies.save_nothing)


@pytest.mark.parametrize(
    "write",
    [
        lambda t: t.masked_fill_(t > 0, 1.5),
        lambda t: t.scatter_(0, torch.zeros_like(t, dtype=torch.long), t.clone()),
        lambda t: t.scatter_add_(0, torch.zeros_like(t, dtype=torch.long), t.clone()),
        lambda t: t.scatter_reduce_(0, torch.zeros_like(t, dtype=torch.long), t.clone(), "amax"),
        lambda t: t.index_add_(0, torch.tensor([0, 1]), t[:2].clone()),
        lambda t: t.index_copy_(0, torch.tensor([1, 0]), t[:2].clone()),
        lambda t: t.masked_scatter_(t > 0, torch.ones(t.numel(), dtype=t.dtype)),
    ],
    ids=["masked_fill_", "scatter_", "scatter_add_", "scatter_reduce_", "index_add_", "index_copy_", "masked_scatter_"],
)
def test_regression_in_place_index_ops_keep_a_permuted_layout(write: Callable[[torch.Tensor], Any]) -> None:
    # Their functional forms return contiguous tensors: the written tensor came out contiguous, and a
    # `randn_like` of it drew in another order, values off by up to 2.75 (issue 69).
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.permute(2, 1, 0).sin()
        write(t)
        return t, torch.randn_like(t)

    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    for policy in (policies.save_nothing, policies.save_everything):
        remat.testing.assert_checkpoint_equivalent(fn, x, policy=policy, transforms=["grad", "vmap"])
