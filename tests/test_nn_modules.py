"""torch's nn layers under `remat.checkpoint` and `remat.checkpoint_modules`, checked against eager.

Layers a user meets first: each runs under the policies that keep least, keep the matmuls and keep
everything, at first and second order, and must give eager's outputs, gradients and buffers.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import policies
from remat.testing import assert_checkpoint_equivalent

POLICIES = pytest.mark.parametrize(
    "policy",
    [policies.save_nothing, policies.dots_saveable, policies.save_everything],
    ids=["save_nothing", "dots_saveable", "save_everything"],
)

_BAGS = [
    (mode, weighted, padding, offsets)
    for mode, weighted, padding, offsets in itertools.product(
        ["sum", "mean", "max"], [False, True], [None, 2], [False, True]
    )
    if not weighted or mode == "sum"  # torch takes per-sample weights in "sum" mode only
]


@POLICIES
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize(("mode", "weighted", "padding", "offsets"), _BAGS, ids=str)
def test_regression_embedding_bag(mode: str, weighted: bool, padding: int | None, offsets: bool, policy: Any) -> None:
    # The bag's value is a getitem of `_embedding_bag`'s, which vmap runs example by example; the program
    # printed that getitem as an argument, and its code did not compile under any policy (issue 69).
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 8, mode=mode, padding_idx=padding).double()
    linear = nn.Linear(8, 4).double()
    if offsets:
        indices, starts = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    else:
        indices, starts = torch.randint(0, 10, (3, 4)), None
    weights = torch.randn(indices.shape, dtype=torch.float64, requires_grad=True)

    def fn(weights: torch.Tensor) -> torch.Tensor:
        return linear(bag(indices, starts, per_sample_weights=weights if weighted else None)).tanh()

    assert_checkpoint_equivalent(
        fn,
        weights,
        policy=policy,
        params=[*bag.parameters(), *linear.parameters()],
        transforms=["grad", "vmap", "grad_of_grad", "double_backward"],
    )


@POLICIES
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_regression_an_embedding_with_max_norm_at_second_order(bag: bool, policy: Any) -> None:
    # The renormalization updates the weight in place through `weight.detach()`, inside `F.embedding`, where
    # remat did not see the detach: a second derivative ran into `embedding_renorm`, which has none, with
    # torch's raw NotImplementedError (issue 69). NOTE [functions that hide an update]
    def make() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.EmbeddingBag(10, 4, max_norm=1.0, mode="sum") if bag else nn.Embedding(10, 4, max_norm=1.0)
        return layer.double()

    indices = torch.tensor([[1, 2, 3], [4, 5, 1]])
    x = torch.randn(2, 4, dtype=torch.float64) if bag else torch.randn(2, 3, 4, dtype=torch.float64)

    def fn(layer: nn.Module) -> Any:
        return lambda x: (layer(indices) * x).tanh()

    # One call each way renormalizes the weight once, alike.
    eager_layer, layer = make(), make()
    fn(eager_layer)(x)
    remat.checkpoint(fn(layer), policy=policy)(x.clone().requires_grad_())
    assert torch.equal(layer.weight, eager_layer.weight)
    layer = make()
    transforms = ["double_backward", "grad_of_grad", "vmap"]
    assert_checkpoint_equivalent(
        fn(layer), x.requires_grad_(), policy=policy, params=list(layer.parameters()), transforms=transforms
    )


@POLICIES
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize(
    ("layer", "shape"),
    [
        (nn.CircularPad1d((1, 2)), (2, 3, 5)),
        (nn.CircularPad2d((1, 2, 2, 1)), (2, 3, 4, 5)),
        (nn.CircularPad3d(1), (1, 2, 3, 4, 5)),
    ],
    ids=["1d", "2d", "3d"],
)
def test_regression_circular_padding(layer: nn.Module, shape: tuple[int, ...], policy: Any) -> None:
    # Circular padding copies slices of the padded tensor into others; their stretches of storage overlap
    # though they share no element, and remat refused it as an op that reads what it writes (found by the
    # sweep of torch's module tests, issue 69). NOTE [in-place ops that read what they write]
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    assert_checkpoint_equivalent(
        lambda x: layer(x).sin(), x, policy=policy, transforms=["grad", "vmap", "double_backward"]
    )
