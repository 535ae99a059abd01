"""remat as torchtitan's activation checkpointing, configured through torchtitan's own configuration.

    from remat.torchtitan import RematAC

    config = llama3_debugmodel()  # or any config torchtitan builds its trainer from
    config.activation_checkpoint = RematAC.Config(policy="dots_saveable")

torchtitan is an optional dependency (`pip install 'remat[torchtitan]'`, which needs torch 2.14 or newer):
it is imported when `RematAC` is first read, not with this module. See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import nn

from . import policies as _policies
from ._apply import checkpoint_modules
from ._policy import Policy

__all__ = ["RematAC"]  # noqa: F822  # made on first read (`__getattr__`), when torchtitan is imported


def __getattr__(name: str) -> Any:
    if name == "RematAC":
        return _remat_ac()
    raise AttributeError(f"module 'remat.torchtitan' has no attribute {name!r}")


def _policy_named(name: Any) -> Policy:
    """The built-in policy `remat.policies.<name>` (one without arguments), or a clear error."""
    found = getattr(_policies, name, None) if isinstance(name, str) else None
    if not isinstance(found, Policy):
        names = sorted(n for n in _policies.__all__ if isinstance(getattr(_policies, n), Policy))
        raise ValueError(
            f"remat.torchtitan.RematAC: `policy` names a built-in policy of remat.policies without arguments "
            f"({', '.join(names)}), but got {name!r}."
        )
    return found


@functools.cache
def _remat_ac() -> type:
    try:
        from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing  # type: ignore[import-not-found]
    except ImportError as error:
        raise ImportError(
            "remat.torchtitan.RematAC needs torchtitan: `pip install 'remat[torchtitan]'` (torch 2.14 or newer)."
        ) from error

    class RematAC(ActivationCheckpointing):  # type: ignore[misc]
        """torchtitan's activation checkpointing by remat: every block of the model's `layers` checkpointed
        with the policy the config names (`remat.policies.<policy>`), identical blocks sharing one trace."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(ActivationCheckpointing.Config):  # type: ignore[misc]
            policy: str = "dots_saveable"  # a built-in policy of remat.policies without arguments

            def __post_init__(self) -> None:
                _policy_named(self.policy)

        def apply(self, model: nn.Module) -> None:
            # One call for all the blocks (not one per block, as torchtitan's `_wrap_block` makes), so that
            # identical blocks share one trace.
            layers = model.get_submodule("layers")
            blocks = {id(block) for block in layers.children()}
            policy = _policy_named(self.config.policy)
            checkpoint_modules(layers, lambda name, module: id(module) in blocks, policy=policy)

    RematAC.__module__ = __name__
    return RematAC
