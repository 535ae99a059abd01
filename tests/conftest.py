"""Shared fixtures, hypothesis profiles, tolerances and measuring helpers of the test suite.

Tests say "the checkpointed function behaves exactly like the original" with
the public `remat.testing.assert_checkpoint_equivalent`, the check users get.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import models
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from torch.utils._python_dispatch import TorchDispatchMode

from remat._torch import import_jvp_decompositions

# Under pytest-xdist (`-n auto`) every worker is a process of its own, and torch would start a thread per
# core in each: one thread apiece keeps the workers from fighting over the cores.
if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(1)

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

# The README's test command gives the same result for the same commit on every clone: the "ci" profile
# draws the same examples every run (`derandomize`, from each test's name) and keeps no database of earlier
# failures to replay. Exploring new examples is the "soak" profile's job (`nox -s soak`), which draws
# afresh each run and keeps its findings in `.hypothesis/`.
settings.register_profile(
    "ci",
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
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


# --- the fast selection ------------------------------------------------------------------------------

# `python -m pytest -n auto -q -m "not slow"` is the edit-test loop: it leaves out what is marked `slow`,
# which is every hypothesis property (marked here: each runs tens of examples) and, marked in their
# files, the tests that start processes, compile with inductor, sweep OpInfo or train model zoos.
# `nox -s coverage` checks that it still covers every module of remat at least half as well as the
# whole suite does.


# --- the release selection ------------------------------------------------------------------------

# `-m "release and not slow"` is what CI runs on the newest torch besides the whole suite on 2.13 (the
# whole suite twice ran past CI's 20 minutes): the files of where remat meets torch, whose behaviour
# moves between releases. The door and its registry of quirks (each entry probed on the running torch),
# tracing, values Python reads, fidelity to eager's ops and layouts, the semantics cases and gradients.
# `nox -s tests` runs the whole suite on every supported release.
RELEASE_FILES = frozenset(
    {
        "test_torch.py",
        "test_quirks.py",
        "test_trace.py",
        "test_values.py",
        "test_fidelity.py",
        "test_semantics.py",
        "test_gradients.py",
        "test_engine.py",  # the backward walked where the engine cannot run: its CUDA test needs a CUDA build
        "test_gpu.py",  # CUDA programs traced and planned without a GPU: on fake CUDA tensors of a CUDA build
    }
)
# A file renamed or removed would leave the selection silently: name it instead.
if missing := sorted(name for name in RELEASE_FILES if not (pathlib.Path(__file__).parent / name).is_file()):
    raise pytest.UsageError(f"tests/conftest.py: RELEASE_FILES names files that do not exist: {missing}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.slow)
        if item.path.name in RELEASE_FILES:
            item.add_marker(pytest.mark.release)


# --- torch's random numbers ---------------------------------------------------------------------------


# Every test starts from a generator state of its own, seeded by its name, before its fixtures run: what
# it draws does not depend on which tests ran before it in its worker (the order is random and xdist
# deals tests out as workers free up). pytest-randomly seeds `random` and numpy, not torch.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    torch.manual_seed(zlib.crc32(item.nodeid.encode()))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if PROFILE != "soak" or not report.failed:
        return
    with open(SOAK_FAILURES, "a") as file:
        file.write(f"===== {report.nodeid} ({report.when}) =====\n{report.longreprtext}\n\n")


# --- tolerances ------------------------------------------------------------------------------------

# float64, for tests that compare tensors themselves: remat runs the same aten kernels as eager,
# in the same order for the forward, so differences are round-off at most (the float64 defaults of
# `remat.testing.assert_checkpoint_equivalent` are these).
RTOL = 1e-10
ATOL = 1e-12


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
