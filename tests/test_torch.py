"""The one door to torch's internals (`remat/_torch.py`): every name it provides exists on the running
torch, no other module of remat reaches past it, and an unsupported torch is refused with the range."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import remat
from remat import _torch

PACKAGE = pathlib.Path(remat.__file__).parent

# What counts as reaching into torch's internals from the source of a module.
PRIVATE = re.compile(
    r"torch\._|torch\.fx\.experimental|torch\.utils\._|torch\.distributed\._|sys\._getframe"
    r"|\._version\b|\._schema\b|\._overloadname\b|\._pt_current_level\b|\._current_level\b|\.__func__\b"
)


@pytest.mark.parametrize("name", sorted(_torch.__all__))
def test_every_name_of_the_door_exists_on_this_torch(name: str) -> None:
    assert getattr(_torch, name) is not None


def test_no_other_module_reaches_into_torch() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):  # remat/testing/ included
        if path.name == "_torch.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#")[0]
            if PRIVATE.search(code) and not code.strip().startswith(('"', "'")) and "`" not in code:
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not found, "private torch names outside remat/_torch.py:\n" + "\n".join(found)


def test_the_running_torch_is_supported() -> None:
    assert ".".join(torch.__version__.split(".")[:2]) in _torch.SUPPORTED


@pytest.mark.parametrize("version", ["2.9.1", "2.16.0", "3.0.0+cpu", "1.13.1"])
def test_an_unsupported_torch_is_refused_naming_the_range(version: str) -> None:
    with pytest.raises(ImportError, match=rf"remat supports torch 2\.10 to 2\.15 .* but torch {re.escape(version)}"):
        _torch.check_supported(version)


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"])
def test_supported_releases_pass(version: str) -> None:
    _torch.check_supported(version)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * 2


class _ScaledBySetupContext(torch.autograd.Function):
    @staticmethod
    def forward(x):  # type: ignore[no-untyped-def]
        return _Scaled.apply(x.sin())

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return grad * 2 * x.cos()


class _Inherited(_Scaled):
    pass


def test_function_scopes_come_from_forward_frames_of_either_style() -> None:
    trace = remat.trace(lambda x: _ScaledBySetupContext.apply(x).exp() + _Inherited.apply(x), torch.randn(3))
    scopes = [call.scope for call in trace]
    assert scopes == [
        "_ScaledBySetupContext",
        "_ScaledBySetupContext/_Scaled",
        None,
        "_Inherited",
        None,
    ], [(call.op, call.scope) for call in trace]


def test_the_declared_range_is_the_supported_range() -> None:
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    declared = re.search(r'"torch>=([\d.]+),<([\d.]+)"', pyproject)
    assert declared is not None, "pyproject.toml must bound torch on both sides"
    major, minor = map(int, _torch.SUPPORTED[-1].split("."))
    assert declared.groups() == (_torch.SUPPORTED[0], f"{major}.{minor + 1}")


def test_nox_and_ci_run_the_supported_releases() -> None:
    noxfile = (PACKAGE.parent / "noxfile.py").read_text()
    listed = re.search(r"^TORCH_RELEASES = \[(.*)\]$", noxfile, re.MULTILINE)
    assert listed is not None
    releases = re.findall(r'"([\d.]+)"', listed.group(1))
    assert [_torch.minor_release(r) for r in releases] == list(_torch.SUPPORTED)  # one patch per minor release
    ci = (PACKAGE.parent / ".ci" / "run").read_text()
    assert re.search(r"^NEWEST=([\d.]+)", ci, re.MULTILINE).group(1) == releases[-1]  # type: ignore[union-attr]
    assert re.search(r"^OLDEST=([\d.]+)", ci, re.MULTILINE).group(1) == releases[0]  # type: ignore[union-attr]
    assert re.search(r"^GPU=([\d.]+)", ci, re.MULTILINE).group(1) in releases  # type: ignore[union-attr]
