"""The peers remat is measured against, defined once: `torch.utils.checkpoint`, selective activation
checkpointing (SAC) with an op list, and `torch_remat`'s annotated regions.

Each takes a function and returns one that runs it under the peer, called as the function is.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .workloads import ATTENTION_OPS, torch_remat_annotations

__all__ = ["SAC_SAVE_LIST", "checkpointed", "has_torch_remat", "selective", "torch_remat_regions"]

aten = torch.ops.aten

# The op list SAC users save (torchtitan's `_save_list`, minus the collectives): matmuls, attention
# kernels, convolutions.
SAC_SAVE_LIST = frozenset(
    {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default, *ATTENTION_OPS}
)

# Until torch 2.14 a selective-checkpoint region's saved tensors bypassed `saved_tensors_hooks`; torch 2.15
# warns (FutureWarning) unless told which, and a later release routes them through the hooks. The peer runs
# as it always has.
_AS_SAC_ALWAYS_RAN: dict[str, Any] = (
    {"respect_saved_tensors_hooks": False}
    if "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    else {}
)


def checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` under `torch.utils.checkpoint` (non-reentrant): its forward is replayed whole in backward."""
    return functools.partial(torch.utils.checkpoint.checkpoint, fn, use_reentrant=False)


def selective(fn: Callable[..., Any], save: Collection[Any] = SAC_SAVE_LIST) -> Callable[..., Any]:
    """`fn` under SAC: `MUST_SAVE` for the ops in `save`, `PREFER_RECOMPUTE` for the rest."""

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return functools.partial(
        torch.utils.checkpoint.checkpoint, fn, use_reentrant=False, context_fn=context_fn, **_AS_SAC_ALWAYS_RAN
    )


def torch_remat_regions(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` as a `torch_remat` checkpoint, the regions the workloads' blocks annotate kept (the saves of
    `dots_saveable`): the annotations are on inside the function, so that its replay in backward takes the
    same path."""
    import torch_remat

    def annotated(*args: Any) -> Any:
        with torch_remat_annotations():
            return fn(*args)

    return torch_remat.checkpoint(region_name=name)(annotated)


def has_torch_remat() -> bool:
    """Whether `torch_remat` is installed (`pip install torch-remat`)."""
    return importlib.util.find_spec("torch_remat") is not None
