"""The `remat` logger: DEBUG records each trace, INFO explains each retrace."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import remat
from remat import policies

DTYPE = torch.float64


@pytest.fixture
def remat_records(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="remat")
    return caplog


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "remat" and r.levelno == level]


def test_each_trace_logs_signature_time_and_decisions_at_debug(remat_records: pytest.LogCaptureFixture) -> None:
    f = remat.checkpoint(lambda x, w, *, scale: (x @ w).tanh() * scale, policy=policies.save_ops(torch.ops.aten.mm))
    x = torch.randn(2, 3, dtype=DTYPE)
    w = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
    f(x, w, scale=2.0)
    f(x, w, scale=2.0)  # a cache hit: no record
    (message,) = _messages(remat_records, logging.DEBUG)
    assert "args[0]: float64[2,3]," in message  # no requires_grad on x
    assert "args[1]: float64[3,4] requires_grad" in message
    assert "kwargs['scale']: 2.0" in message
    assert " ms " in message
    assert "3 calls, policy saves 1 and offloads 0" in message
    assert "keeps 64 B on the device and 0 B in host memory from 1 calls" in message  # the mm's output


def test_the_first_trace_is_not_a_retrace(remat_records: pytest.LogCaptureFixture) -> None:
    f = remat.checkpoint(lambda x: x.sin())
    f(torch.randn(2, requires_grad=True))
    assert _messages(remat_records, logging.INFO) == []


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ((2, 3), (4, 3), "args[0].shape changed: (2, 3) -> (4, 3)"),
        ((2, 3), (3, 2), "args[0].shape changed: (2, 3) -> (3, 2)"),
    ],
)
def test_a_retrace_says_which_shape_changed(
    remat_records: pytest.LogCaptureFixture, first: tuple[int, ...], second: tuple[int, ...], expected: str
) -> None:
    f = remat.checkpoint(lambda x: x.sin())
    f(torch.randn(first, dtype=DTYPE, requires_grad=True))
    f(torch.randn(second, dtype=DTYPE, requires_grad=True))
    (message,) = _messages(remat_records, logging.INFO)
    assert message.startswith("retracing remat.checkpoint(")
    assert expected in message


def test_a_retrace_says_what_else_changed(remat_records: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).to(DTYPE)
    f = remat.checkpoint(lambda x, scale: model(x) * scale)
    x = torch.randn(2, 3, dtype=DTYPE)
    f(x, 1.0)
    f(x.requires_grad_(), 1.0)
    f(x, 2.0)
    model.eval()
    f(x, 2.0)
    f(x.detach().t().contiguous().t().requires_grad_(), 2.0)  # the same values, column-major
    assert _messages(remat_records, logging.INFO) == [
        f"retracing {f!r}: args[0].requires_grad changed: False -> True",
        f"retracing {f!r}: args[1] changed: 1.0 -> 2.0",
        f"retracing {f!r}: a module's `training` flag changed (train() / eval())",
        f"retracing {f!r}: args[0].stride changed: (3, 1) -> (1, 2)",
    ]


def test_autocasts_cache_retraces_only_under_autocast(remat_records: pytest.LogCaptureFixture) -> None:
    # The cache holds only autocast's casts: with autocast off its flag changes no trace (AOTAutograd on
    # torch 2.10 turns it off for one of its two traces of a compiled region).
    f = remat.checkpoint(lambda x: x.sin())
    x = torch.randn(3, dtype=DTYPE, requires_grad=True)
    before = torch.is_autocast_cache_enabled()
    try:
        f(x)
        torch.set_autocast_cache_enabled(False)
        f(x)
        assert f.cache_info().traces == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            f(x)
            torch.set_autocast_cache_enabled(True)
            f(x)
    finally:
        torch.set_autocast_cache_enabled(before)
    assert f.cache_info().traces == 3
    assert _messages(remat_records, logging.INFO)[-1] == f"retracing {f!r}: autocast's cache was enabled"


def test_a_retrace_for_a_changed_closed_over_tensor_says_so(remat_records: pytest.LogCaptureFixture) -> None:
    w = torch.randn(3, dtype=DTYPE, requires_grad=True)
    f = remat.checkpoint(lambda x: x * w)
    x = torch.randn(3, dtype=DTYPE)
    f(x)
    w = torch.randn(4, dtype=DTYPE, requires_grad=True)  # the closure now reads another shape
    f(torch.randn(4, dtype=DTYPE))
    w = torch.randn(4, dtype=DTYPE)  # same signature, but the closed-over tensor needs no grad now
    f(torch.randn(4, dtype=DTYPE))
    infos = _messages(remat_records, logging.INFO)
    assert infos[0].endswith("args[0].shape changed: (3) -> (4)")
    assert infos[1].endswith("closed-over tensors (parameters, buffers) changed shape, dtype, device or requires_grad")


def test_nothing_is_formatted_when_the_logger_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    logging.getLogger("remat").setLevel(logging.WARNING)
    formatted = []
    monkeypatch.setattr(remat._partitioning._log, "describe_signature", lambda *a: formatted.append(a) or "")
    f = remat.checkpoint(lambda x: x.sin())
    f(torch.randn(2, requires_grad=True))
    f(torch.randn(3, requires_grad=True))
    assert formatted == []
