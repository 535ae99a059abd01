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
    with pytest.raises(ValueError, match=r"either `policy` .* or `peak_bytes`"):
        remat.torchtitan.RematAC.Config(policy="save_nothing", peak_bytes=2**30)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="`peak_bytes` must be a positive integer"):
            remat.torchtitan.RematAC.Config(peak_bytes=bad)
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


@pytest.mark.skipif(not HAS_TORCHTITAN, reason="needs torchtitan (nox -s torchtitan)")
def test_remat_ac_with_a_budget_plans_at_the_first_training_call() -> None:
    # tests/test_torchtitan.py trains torchtitan's llama3 so; here, a model on meta when `apply` runs.
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.layers = nn.ModuleDict(
                {str(i): nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)) for i in range(3)}
            )
            self.lm_head = nn.Linear(16, 32)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            for block in self.layers.values():
                h = h + block(h)
            return self.lm_head(h)

    def materialized(model: nn.Module) -> nn.Module:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)
        return model

    with torch.device("meta"):
        model = LM()
    remat.torchtitan.RematAC(remat.torchtitan.RematAC.Config(peak_bytes=2**30)).apply(model)  # on meta: not planned
    model = materialized(model)
    tokens = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        model(tokens)
    planner = vars(model)["forward"].planner
    assert planner.fits.items() == []
    model(tokens).sum().backward()
    [(_, plan)] = planner.fits.items()
    assert [block.name for block in plan.blocks] == ["layers.0", "layers.1", "layers.2"]
    # The probe step's loss was torchtitan's cross entropy against the batch's own tokens.
    with torch.device("meta"):
        same = LM()
    blocks = set(same.layers.children())

    def cross_entropy(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(), reduction="sum")

    expected = remat.fit(materialized(same), lambda n, m: m in blocks, tokens, peak_bytes=2**30, loss=cross_entropy)
    assert plan.report == expected.report
