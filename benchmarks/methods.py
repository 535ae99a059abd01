"""The checkpointing methods compared: eager, torch.utils.checkpoint, SAC, torch_remat and remat's policies.

A method turns one checkpoint unit (an `nn.Module` of a workload) into the callable that runs it.
Methods that do not apply to a workload, or whose package is missing, give a reason instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

import remat
from remat import policies

from . import peers
from .workloads import Workload

Unit = Callable[[torch.Tensor], torch.Tensor]


def _eager(unit: nn.Module, workload: Workload) -> Unit:
    return unit


def _checkpoint(unit: nn.Module, workload: Workload) -> Unit:
    return peers.checkpointed(unit)


def _sac(unit: nn.Module, workload: Workload) -> Unit:
    return peers.selective(unit)


def _torch_remat(unit: nn.Module, workload: Workload) -> Unit:
    return peers.torch_remat_regions(unit, type(unit).__name__)


def _torch_remat_skip(workload: Workload) -> str | None:
    if not peers.has_torch_remat():
        return "torch_remat is not installed: pip install torch-remat"
    if not all(getattr(unit, "supports_torch_remat", False) for unit in workload.units):
        return "not applicable: only the GPT-2 block carries torch_remat.region annotations"
    return None


def _remat(policy: Callable[[Workload], remat.policies.PolicyLike]) -> Callable[[nn.Module, Workload], Unit]:
    def wrap(unit: nn.Module, workload: Workload) -> Unit:
        return remat.checkpoint(unit, policy=policy(workload))

    return wrap


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of running a checkpoint unit."""

    name: str
    wrap: Callable[[nn.Module, Workload], Unit]
    describe: Callable[[Workload], str]
    skip: Callable[[Workload], str | None] = lambda workload: None
    is_remat: bool = False


# The registry, in table order. Every method runs on every workload, unless `skip` gives a reason.
METHODS: list[Method] = [
    Method("eager", _eager, lambda w: "no checkpoint"),
    Method("checkpoint", _checkpoint, lambda w: "torch.utils.checkpoint(use_reentrant=False) per unit"),
    Method("sac", _sac, lambda w: "SAC: MUST_SAVE mm/addmm/bmm/attention/convolution, PREFER_RECOMPUTE the rest"),
    Method(
        "torch_remat",
        _torch_remat,
        lambda w: "torch_remat.checkpoint per unit, region(recompute=False) around the linears and attention",
        skip=_torch_remat_skip,
    ),
    Method(
        "remat save_nothing",
        _remat(lambda w: policies.save_nothing),
        lambda w: "remat.checkpoint(policy=save_nothing)",
        is_remat=True,
    ),
    Method(
        "remat dots_saveable",
        _remat(lambda w: policies.dots_saveable),
        lambda w: "remat.checkpoint(policy=dots_saveable)",
        is_remat=True,
    ),
    Method(
        "remat per-call",
        _remat(lambda w: w.custom_policy),
        lambda w: f"remat.checkpoint with a per-call policy: save {w.custom_policy_text}",
        is_remat=True,
    ),
    Method(
        "remat save_everything",
        _remat(lambda w: policies.save_everything),
        lambda w: "remat.checkpoint(policy=save_everything)",
        is_remat=True,
    ),
    *(
        Method(
            f"remat budget({fraction})",
            _remat(lambda w, fraction=fraction: policies.budget(fraction=fraction)),
            lambda w, fraction=fraction: f"remat.checkpoint(policy=budget(fraction={fraction})): the planner",
            is_remat=True,
        )
        for fraction in (0.25, 0.5)
    ),
]
