"""Checkpointed BatchNorm blocks of vision models inside `torch.compile(model)` (issue 18, part 3).

ResNet-18's `BasicBlock`s and EfficientNet's blocks (depthwise conv, BatchNorm, SiLU,
squeeze-excitation), checkpointed and compiled with the model, train as eager does: the same
loss, the same gradient for every parameter and the same running statistics for every BatchNorm.
The replicas in `models` run everywhere; the real torchvision and timm models run where those
packages import (their wheels are built for one torch release each).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import models
import pytest
import torch
from torch import nn

import remat
from remat import policies

pytestmark = [
    pytest.mark.slow,  # compiles vision models
    # Warnings torch's compiler stack raises about itself.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]

POLICIES = {
    "save_nothing": policies.save_nothing,
    "dots_saveable": policies.dots_saveable,
    "budget": policies.budget(fraction=0.5),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _import_or_skip(name: str) -> ModuleType:
    """`name`, or a skip where it cannot be imported: a torchvision wheel built for another torch
    raises `RuntimeError` (`operator torchvision::nms does not exist`), not `ImportError`."""
    try:
        return importlib.import_module(name)
    except Exception as error:
        pytest.skip(f"{name} does not import with torch {torch.__version__}: {error}")


def _checkpoint_blocks(model: nn.Module, blocks: tuple[type[nn.Module], ...], policy: Any, how: str) -> None:
    """Checkpoint every `blocks` instance of `model` in place, by `checkpoint_modules` or by replacing
    each with `remat.checkpoint(block)` (a `CheckpointedModule` with the same parameter names)."""
    if how == "checkpoint_modules":
        remat.checkpoint_modules(model, blocks, policy=policy)
        return
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, blocks):
                setattr(parent, name, remat.checkpoint(child, policy=policy))


def _traces(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> list[int]:
    """How many traces each checkpointed block ran on: made by itself or taken from an identical block."""
    counts = []
    for module in model.modules():
        if isinstance(module, remat.CheckpointedModule):
            counts.append(module.checkpointed.cache_info().traces)
        elif isinstance(module, blocks):
            info = module.forward.cache_info()  # type: ignore[operator]
            counts.append(info.traces + info.shared)
    return counts


def assert_compiled_training_matches_eager(
    build: Callable[[], nn.Module],
    blocks: tuple[type[nn.Module], ...],
    policy: Any,
    *,
    how: str = "checkpoint_modules",
) -> None:
    """Train `build()` eagerly without checkpoints and, from the same state, with its `blocks`
    checkpointed under `policy` inside `torch.compile(model)`: after each step (forward, backward,
    SGD update) the losses, every parameter's gradient and every buffer (BatchNorm's running mean
    and variance, batches tracked) must agree."""
    eager = build().train()
    model = copy.deepcopy(eager)
    _checkpoint_blocks(model, blocks, policy, how)
    compiled = torch.compile(model, backend="aot_eager")  # inductor: see docs/compile.md, BatchNorm blocks
    steps = 2
    for step in range(steps):
        x = models.vision_input(seed=step)
        losses = []
        for net in (compiled, eager):
            loss = net(x).square().mean()
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], msg=f"loss at step {step}")
        named = zip(model.named_parameters(), eager.named_parameters(), strict=True)
        for (name, ours), (eager_name, theirs) in named:
            assert name == eager_name
            assert ours.grad is not None and theirs.grad is not None
            torch.testing.assert_close(ours.grad, theirs.grad, msg=f"{name}.grad at step {step}")
        for (name, ours), (_, theirs) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
            torch.testing.assert_close(ours, theirs, msg=f"{name} at step {step}")
        with torch.no_grad():
            for net in (model, eager):
                for p in net.parameters():
                    p -= 0.1 * p.grad  # type: ignore[operator]
                    p.grad = None
    batches = {int(b) for name, b in model.named_buffers() if name.endswith("num_batches_tracked")}
    assert batches == {steps}  # running statistics updated once a step, not again in the replay
    assert set(_traces(model, blocks)) == {1}  # one trace per block, never again; its decisions went to the compiler


# --- local replicas: run on every torch ----------------------------------------------------------


# Each replica under two of the policies (the wrapped blocks below add a third to ResNet's): every
# policy on every model would compile the same paths again.
@pytest.mark.parametrize("policy", ["save_nothing", "budget"])
def test_resnet18_basic_blocks_train_inside_a_compiled_model(policy: str) -> None:
    assert_compiled_training_matches_eager(models.resnet18_like, (models.BasicBlock,), POLICIES[policy])


@pytest.mark.parametrize("policy", ["dots_saveable", "budget"])
def test_efficientnet_blocks_train_inside_a_compiled_model(policy: str) -> None:
    blocks = (models.DepthwiseSeparable, models.InvertedResidual)
    assert_compiled_training_matches_eager(models.efficientnet_like, blocks, POLICIES[policy])


def test_blocks_wrapped_by_remat_checkpoint_train_inside_a_compiled_model() -> None:
    blocks = (models.BasicBlock,)
    assert_compiled_training_matches_eager(models.resnet18_like, blocks, policies.dots_saveable, how="wrap")


# --- the real torchvision and timm models, where they import -------------------------------------


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_torchvision_resnet18_trains_inside_a_compiled_model(policy: Any) -> None:
    torchvision = _import_or_skip("torchvision")

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return torchvision.models.resnet18(num_classes=10).to(models.DTYPE)

    blocks = (torchvision.models.resnet.BasicBlock,)
    assert_compiled_training_matches_eager(build, blocks, policy)


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_timm_efficientnet_b0_blocks_train_inside_a_compiled_model(policy: Any) -> None:
    timm = _import_or_skip("timm")
    efficientnet_blocks = importlib.import_module("timm.models._efficientnet_blocks")

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)
            # The stem and the first three stages (a depthwise-separable block, then MBConv blocks with
            # stride 2, kernel 5 and residuals): every kind of block B0 has, at a fraction of its compile time.
            head = nn.Linear(40, 10)
        return nn.Sequential(net.conv_stem, net.bn1, *net.blocks[:3], nn.AdaptiveAvgPool2d(1), nn.Flatten(), head).to(
            models.DTYPE
        )

    blocks = (efficientnet_blocks.DepthwiseSeparableConv, efficientnet_blocks.InvertedResidual)
    assert_compiled_training_matches_eager(build, blocks, policy)
