"""Errors raised by remat, and the translation of low-level tracing failures."""

from __future__ import annotations

import os
import traceback
from types import TracebackType

import torch

__all__ = ["TraceError", "user_line"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_REMAT_DIR = os.path.dirname(__file__) + os.sep


class TraceError(RuntimeError):
    """`fn` could not be traced into a graph of op calls.

    Raised by `remat.checkpoint`, `remat.trace` and `remat.report` with an
    explanation of what in `fn` prevented tracing and how to change it.
    """


def user_line(tb: TracebackType | None) -> str | None:
    """The innermost `file:line` of a traceback that is user code (not torch's or remat's)."""
    found = None
    for frame in traceback.extract_tb(tb):
        if not frame.filename.startswith((_TORCH_DIR, _REMAT_DIR)) and not frame.filename.startswith("<frozen"):
            found = f"{frame.filename}:{frame.lineno}" + (f" ({frame.line.strip()})" if frame.line else "")
    return found
