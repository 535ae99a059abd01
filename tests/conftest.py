"""Shared fixtures, hypothesis profiles and the one comparison helper of the test suite.

`assert_same_outputs_and_grads(fn, checkpointed, args, ...)` is how tests say
"the checkpointed function behaves exactly like the original": it runs both
on fresh copies of the same inputs, backpropagates the same random cotangents
through every output that requires grad, and compares outputs, input
gradients and the `.grad` of module parameters.
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import models
import optree
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from torch.utils._python_dispatch import TorchDispatchMode

from remat._torch import import_jvp_decompositions

# --- hypothesis profiles ---------------------------------------------------------------------------

# When a property fails, hypothesis's pytest plugin imports `hypothesis.extra._patching`
# (and with it libcst, whose import emits a DeprecationWarning from mypy_extensions).
# Under `filterwarnings = error` that turns every falsified property into a pytest
# INTERNALERROR that hides the real failure; importing it once here, with that
# warning ignored, keeps failure reports readable.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with contextlib.suppress(ImportError):  # without libcst, the plugin skips patch generation
        import hypothesis.extra._patching  # noqa: F401

# The first forward-mode AD call in a process imports torch's jvp decompositions, which warn
# (an error under `filterwarnings = error`): import them once here, quietly.
import_jvp_decompositions()

settings.register_profile(
    "ci",
    max_examples=20,
    deadline=None,
    # No "explain" phase: its line tracing makes every shrink step of a failure several times slower.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "soak",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def examples(ci: int, soak: int) -> settings:
    """Settings for a property whose example count is chosen per profile.

    An explicit `max_examples` on a test overrides the loaded profile, so a
    property that runs a set number of examples in CI names its soak count here.
    """
    return settings(max_examples=soak if PROFILE == "soak" else ci)


# --- soak failures ---------------------------------------------------------------------------------

# The soak run records every failing test, with hypothesis's falsifying example and its
# `@reproduce_failure` blob, in this file (one entry per failure, appended), so a
# long run's findings survive the terminal. The hypothesis database keeps them too.
SOAK_FAILURES = os.environ.get("REMAT_SOAK_FAILURES", "soak-failures.txt")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if PROFILE != "soak" or not report.failed:
        return
    with open(SOAK_FAILURES, "a") as file:
        file.write(f"===== {report.nodeid} ({report.when}) =====\n{report.longreprtext}\n\n")


# torch warns once at import when numpy is missing (a fresh `nox` venv); `-W` filter for subprocesses.
NO_NUMPY_IS_FINE = "ignore:Failed to initialize NumPy:UserWarning"

# --- tolerances ------------------------------------------------------------------------------------

# float64: remat runs the same aten kernels as eager, in the same order for the
# forward, so differences are round-off at most.
RTOL = 1e-10
ATOL = 1e-12

COTANGENT_SEED = 1234


def _leaves(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    return optree.tree_flatten(tree, none_is_leaf=False)


def _fresh(tree: Any) -> Any:
    """A copy of `tree` whose tensors are new leaves with the same values and requires_grad."""

    def copy(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        return leaf

    return optree.tree_map(copy, tree, none_is_leaf=False)


def _cotangents(outputs: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device)
        if o.is_floating_point() or o.is_complex()
        else torch.zeros(())  # placeholder, never used: integer outputs have no gradient
        for o in outputs
    ]


def run_and_backprop(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    params: Iterable[torch.Tensor] = (),
    backprop: Sequence[int] | None = None,
    seed: int = COTANGENT_SEED,
) -> dict[str, Any]:
    """Run `fn` on fresh copies of the inputs and backpropagate seeded cotangents.

    Returns the output pytree, its flat tensor leaves, the input leaves' grads
    and the params' grads (each `.grad` is cleared before the run).
    `backprop` chooses which flat outputs get a cotangent (default: all that
    require grad).
    """
    params = list(params)
    for p in params:
        p.grad = None
    args_copy, kwargs_copy = _fresh((tuple(args), dict(kwargs or {})))
    out = fn(*args_copy, **kwargs_copy)
    flat_out, spec = _leaves(out)
    input_leaves = [leaf for leaf in _leaves((args_copy, kwargs_copy))[0] if isinstance(leaf, torch.Tensor)]
    cotangents = _cotangents(flat_out, seed)
    chosen = range(len(flat_out)) if backprop is None else backprop
    pairs = [(flat_out[i], cotangents[i]) for i in chosen if flat_out[i].requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
    return {
        "out": out,
        "flat_out": flat_out,
        "spec": spec,
        "input_grads": [leaf.grad for leaf in input_leaves],
        "param_grads": [None if p.grad is None else p.grad.clone() for p in params],
        "n_backprop": len(pairs),
    }


def _assert_close_or_both_none(actual: Any, expected: Any, what: str) -> None:
    if expected is None:
        assert actual is None, f"{what}: expected no gradient (None), got {actual}"
        return
    assert actual is not None, f"{what}: expected a gradient, got None"
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def assert_same_outputs_and_grads(
    fn: Callable[..., Any],
    checkpointed: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    params: Iterable[torch.Tensor] = (),
    backprop: Sequence[int] | None = None,
    seed: int = COTANGENT_SEED,
) -> dict[str, Any]:
    """Assert that `checkpointed` computes the same outputs and gradients as `fn`.

    Both run on fresh copies of `args`/`kwargs` (pytrees of tensors and static
    values). The same seeded random cotangents are backpropagated through every
    output that requires grad (or only those at the flat indices `backprop`).
    Compared, in float64 with tight tolerances: the output structure and every
    output tensor (values, dtype, requires_grad), the `.grad` of every input
    tensor, and the `.grad` of every tensor in `params` (module parameters that
    both functions close over). Returns the checkpointed run.
    """
    params = list(params)
    expected = run_and_backprop(fn, args, kwargs, params=params, backprop=backprop, seed=seed)
    actual = run_and_backprop(checkpointed, args, kwargs, params=params, backprop=backprop, seed=seed)

    assert actual["spec"] == expected["spec"], f"output structure differs: {actual['spec']} != {expected['spec']}"
    for i, (a, e) in enumerate(zip(actual["flat_out"], expected["flat_out"], strict=True)):
        assert isinstance(a, torch.Tensor), f"output {i}: expected a tensor, got {type(a)}"
        assert a.requires_grad == e.requires_grad, f"output {i}: requires_grad {a.requires_grad} != {e.requires_grad}"
        torch.testing.assert_close(a.detach(), e.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"output {i}: {m}")
    assert actual["n_backprop"] == expected["n_backprop"]
    for i, (a, e) in enumerate(zip(actual["input_grads"], expected["input_grads"], strict=True)):
        _assert_close_or_both_none(a, e, f"grad of input leaf {i}")
    for i, (a, e) in enumerate(zip(actual["param_grads"], expected["param_grads"], strict=True)):
        _assert_close_or_both_none(a, e, f"grad of parameter {i}")
    if expected["n_backprop"]:
        # Guard against a vacuous comparison: backward must have reached some input or parameter.
        assert any(g is not None for g in [*expected["input_grads"], *expected["param_grads"]]), "no gradients"
    return actual


# --- bytes kept for backward -----------------------------------------------------------------------


def bytes_seen_by_saved_tensors_hooks(fn: Callable[..., Any], x: torch.Tensor, exclude: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves during `fn(x)`, other than those of `exclude`
    (inputs, parameters): what a user's `saved_tensors_hooks` sees kept for backward."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(x)
    out.sum().backward()  # the saved tensors were alive until here: their addresses were distinct
    return sum(storages.values())


# --- counting dispatched ops ---------------------------------------------------------------------


class CountOps(TorchDispatchMode):
    """Counts the aten (and custom) op overloads dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[Any] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture
def mlp_model() -> torch.nn.Sequential:
    return models.mlp()


@pytest.fixture(params=["sdpa", "softmax"])
def gpt2_block(request: pytest.FixtureRequest) -> models.GPT2Block:
    return models.GPT2Block(attention=request.param)


@pytest.fixture
def conv_model() -> torch.nn.Sequential:
    return models.conv_net()


# --- devices -----------------------------------------------------------------------------------------

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each test that takes `device` runs on the CPU, and on CUDA where a GPU exists."""
    return torch.device(request.param)
