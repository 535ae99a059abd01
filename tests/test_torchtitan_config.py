"""`remat.torchtitan`: remat as torchtitan's activation checkpointing, its configuration checked with and
without torchtitan installed (tests/test_torchtitan.py trains with it where torchtitan is)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import remat
import remat.torchtitan
from remat import policies
from remat.torchtitan import _policy_named

HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None


def test_the_config_names_a_built_in_policy() -> None:
    assert _policy_named("dots_saveable") is policies.dots_saveable
    assert _policy_named("pack_everything") is policies.pack_everything
    for bad in ("budget", "nope", 3):  # a factory needs arguments; the rest are no policies
        with pytest.raises(ValueError, match=r"`policy` names a built-in policy .*dots_saveable.*save_nothing"):
            _policy_named(bad)


def test_the_module_imports_without_torchtitan_and_names_what_it_lacks() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        remat.torchtitan.Nope  # noqa: B018
    if HAS_TORCHTITAN:
        assert remat.torchtitan.RematAC.__module__ == "remat.torchtitan"
    else:
        with pytest.raises(ImportError, match=r"pip install 'remat\[torchtitan\]'"):
            remat.torchtitan.RematAC  # noqa: B018


@pytest.mark.skipif(not HAS_TORCHTITAN, reason="needs torchtitan (nox -s torchtitan)")
def test_remat_ac_checkpoints_every_block_of_the_layers_with_one_trace() -> None:
    with pytest.raises(ValueError, match="got 'nope'"):
        remat.torchtitan.RematAC.Config(policy="nope")
    config = remat.torchtitan.RematAC.Config(policy="save_nothing")
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for i in range(3)})
    remat.torchtitan.RematAC(config).apply(model)
    x = torch.randn(4, 8, requires_grad=True)
    for block in model.layers.values():
        x = block(x)
    x.sum().backward()
    infos = [block.forward.cache_info() for block in model.layers.values()]
    assert sum(info.traces for info in infos) == 1 and sum(info.shared for info in infos) == 2  # one trace
