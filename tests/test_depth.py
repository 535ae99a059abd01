"""Functions far deeper than Python's recursion limit trace and run: nothing in remat recurses per call.

The tests lower the limit to `LIMIT` frames, well under Python's default of 1,000 and well over what a
short function needs, and trace functions of more calls than that: a recursion of even one frame per
call anywhere in remat would raise, at a fraction of the cost of chains longer than the default limit."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import models
import pytest
import torch

import remat
from remat import policies
from remat.testing import assert_checkpoint_equivalent

pytestmark = pytest.mark.slow  # chains of hundreds of calls


LIMIT = 200  # frames
DEPTH = 240  # calls in a chain


@pytest.fixture(autouse=True)
def low_recursion_limit() -> Iterator[None]:
    """`LIMIT`, whatever an earlier test or library set (inductor raises it)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(LIMIT)
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(DEPTH):
        x = x.sin()
    return x


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything])
def test_a_chain_of_calls_deeper_than_the_recursion_limit(policy: remat.Policy) -> None:
    assert sys.getrecursionlimit() < DEPTH
    x = models.randn(4, seed=1)
    assert len(remat.trace(chain, x)) == DEPTH
    assert_checkpoint_equivalent(chain, x, policy=policy)


def test_an_unrolled_rnn_deeper_than_the_recursion_limit() -> None:
    w = models.randn(8, 8, seed=2, requires_grad=False) / 3

    def rnn(h: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        for step in range(xs.shape[0]):
            h = torch.tanh(h @ w + xs[step])
        return h

    h, xs = models.randn(2, 8, seed=3), models.randn(DEPTH // 3, 2, 8, seed=4)  # 3 calls a step
    assert len(remat.trace(rnn, h, xs)) == DEPTH
    assert_checkpoint_equivalent(rnn, h, xs, policy=policies.save_nothing)
