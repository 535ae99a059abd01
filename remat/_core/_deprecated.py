"""Old public names, kept for one release: each warns that it is deprecated and names the new one."""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["moved_module", "renamed", "warn_renamed"]

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{old} is deprecated and goes in the next release: use {new} (the same thing, under a name that says "
        "what it does). See the migration table in CHANGELOG.md.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed(old: str, new: str, function: F) -> F:
    """`function` under its old public name `old`: it warns, then does what `new` does."""

    @functools.wraps(function)
    def under_the_old_name(*args: Any, **kwargs: Any) -> Any:
        warn_renamed(old, new)
        return function(*args, **kwargs)

    under_the_old_name.__name__ = under_the_old_name.__qualname__ = old.rsplit(".", 1)[-1]
    under_the_old_name.__doc__ = f"Deprecated: use `{new}`, which this calls after a DeprecationWarning."
    return under_the_old_name  # type: ignore[return-value]


def moved_module(old: str, new: str, module: types.ModuleType, names: tuple[str, ...]) -> None:
    """Make `from <old> import name` give `module`'s `name` for each of `names`, after a warning that it is
    `<new>.name` now. The stand-in is put in `sys.modules` directly: imported from a file, a submodule
    would be set as its package's attribute of the same name (`remat.report`, the function)."""

    class Moved(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name not in names:
                raise AttributeError(f"module {old!r} has no attribute {name!r}")
            warn_renamed(f"{old}.{name}", f"{new}.{name}")
            return getattr(module, name)

    sys.modules[old] = Moved(old, f"Deprecated: the names {', '.join(names)} are in `{new}`.")
