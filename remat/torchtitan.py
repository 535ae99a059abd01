"""remat as torchtitan's activation checkpointing, configured through torchtitan's own configuration.

    from remat.torchtitan import RematAC

    config = llama3_debugmodel()  # or any config torchtitan builds its trainer from
    config.activation_checkpoint = RematAC.Config(policy="dots_saveable")
    # or: plans for the whole step within a byte budget per rank, made at the first training step
    config.activation_checkpoint = RematAC.Config(peak_bytes=60 * 2**30)

torchtitan is an optional dependency (`pip install 'remat[torchtitan]'`, which needs torch 2.14 or newer):
it is imported when `RematAC` is first read, not with this module. See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import nn

from . import policies as _policies
from ._api._apply import checkpoint_modules
from ._deciding._policy import Policy
from ._planning._fit import fit_when_called
from ._planning._fit_results import Fit

__all__ = ["RematAC"]  # noqa: F822  # made on first read (`__getattr__`), when torchtitan is imported

DEFAULT_POLICY = "dots_saveable"


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
            policy: str | None = None
            """A built-in policy of remat.policies without arguments, for every block (by default
            "dots_saveable"); not with `peak_bytes`."""

            peak_bytes: int | None = None
            """A byte budget for each rank's training step (forward, loss, backward), planned by
            `remat.fit` at the first training step, on its batch, after the model is sharded."""

            cost: str = "flops"
            """What `peak_bytes`' plans replay least of: "flops" or "roofline:<device>"."""

            offload: bool = False
            """Whether `peak_bytes`' plans may keep values in host memory (needs a roofline `cost`)."""

            loss_chunks: int = 8
            """The `num_chunks` of the trainer's `ChunkedLossWrapper` (torchtitan's default loss), which
            the step planned for `peak_bytes` computes its loss with."""

            def __post_init__(self) -> None:
                if self.policy is not None and self.peak_bytes is not None:
                    raise ValueError(
                        "remat.torchtitan.RematAC: give either `policy` (one policy for every block) or "
                        f"`peak_bytes` (plans for the step within a budget), not both; got policy={self.policy!r} "
                        f"and peak_bytes={self.peak_bytes!r}."
                    )
                if self.peak_bytes is None:
                    _policy_named(self.policy or DEFAULT_POLICY)
                elif isinstance(self.peak_bytes, bool) or not isinstance(self.peak_bytes, int) or self.peak_bytes <= 0:
                    raise ValueError(
                        f"remat.torchtitan.RematAC: `peak_bytes` must be a positive integer (bytes per rank), but "
                        f"got {self.peak_bytes!r}."
                    )

        def apply(self, model: nn.Module) -> None:
            # One call for all the blocks (not one per block, as torchtitan's `_wrap_block` makes), so that
            # identical blocks share one trace.
            layers = model.get_submodule("layers")
            blocks = {id(block) for block in layers.children()}
            which = lambda name, module: id(module) in blocks  # noqa: E731
            config = self.config
            if config.peak_bytes is None:
                checkpoint_modules(layers, which, policy=_policy_named(config.policy or DEFAULT_POLICY))
                return
            fit_when_called(
                model,
                which,
                peak_bytes=config.peak_bytes,
                loss_for=functools.partial(_loss_for, model, config.loss_chunks),
                cost=config.cost,
                offload=config.offload,
                planned=_log,
            )

    RematAC.__module__ = __name__
    return RematAC


# NOTE [a torchtitan step planned]
# torchtitan applies activation checkpointing to the model before any batch
# exists, before FSDP2 shards it and before it is materialized on its device. A
# plan made then would be a single process's, on meta. With `peak_bytes`, the
# blocks are checkpointed with plans to be made, and the step is planned when
# the model is first called for training: on every rank, with that batch
# (torchtitan's `local_batch_size` x `seq_len` tokens and the attention masks it
# passes), on the sharded, materialized model, before FSDP2's hooks of that call
# run (`fit_when_called`). The probe step's loss is the trainer's, which `apply`
# cannot see, made again from what the trainer leaves on the model: where it
# skips the model's head (`_skip_lm_head`), torchtitan's default loss, a
# `ChunkedLossWrapper` of cross entropy over the head's logits chunk by chunk
# (`loss_chunks`: its `num_chunks`); otherwise cross entropy of the logits. The
# batch's own tokens stand for its labels: the same shape and dtype, and only
# memory is measured. A new batch shape is planned again.


def _loss_for(model: nn.Module, chunks: int, args: Any, kwargs: dict[str, Any]) -> Any:
    """torchtitan's loss of a batch of tokens (NOTE [a torchtitan step planned])."""
    from torchtitan.components.loss import ChunkedLossWrapper, cross_entropy_loss  # type: ignore[import-not-found]

    tokens = args[0] if args else kwargs["tokens"]
    if not getattr(model, "_skip_lm_head", False):
        return lambda logits: cross_entropy_loss(logits, tokens)
    chunked = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=chunks))
    chunked.set_lm_head(model.get_submodule("lm_head"))
    return lambda hidden: chunked(hidden, tokens)[0]


def _log(plan: Fit) -> None:
    from torchtitan.tools.logging import logger  # type: ignore[import-not-found]

    logger.info(f"remat planned the step:\n{plan}")
