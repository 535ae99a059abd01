"""Identical blocks share one trace: NOTE [sharing traces between identical blocks].

Every gradient check compares a model after `checkpoint_modules` with an
unwrapped copy of it, in float64, parameter gradients included, so a block
that ran another block's parameters (or another block's trace where it
should not have) fails it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any

import hypothesis.strategies as st
import models
import pytest
import torch
from conftest import examples
from hypothesis import given
from torch import nn

import remat
from remat import checkpoint_modules
from remat._api._sharing import same_value

DTYPE = torch.float64
POLICIES = {
    "save_nothing": remat.policies.save_nothing,
    "dots_saveable": remat.policies.dots_saveable,
    "budget": remat.policies.budget(fraction=0.5),
}


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Block(nn.Module):
    """A residual MLP block with attributes like a real one's: `window` (read by forward) and
    `layer_idx` (not read)."""

    def __init__(self, d: int = 8, hidden: int = 8, *, window: int | None = None, seed: int = 0):
        super().__init__()
        generator = models.make_generator(seed)
        self.up = nn.Linear(d, hidden, dtype=DTYPE)
        self.down = nn.Linear(hidden, d, dtype=DTYPE)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=DTYPE) / math.sqrt(d))
        self.window = window
        self.layer_idx = seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.up(x))
        if self.window is not None:
            h = h[..., : self.window].sum(-1, keepdim=True) * h
        return x + self.down(h)


class TiedBlock(nn.Module):
    """Two square layers that are one weight (`tied`) or two."""

    def __init__(self, d: int = 8, *, tied: bool, seed: int = 0):
        super().__init__()
        generator = models.make_generator(seed)
        self.first = nn.Linear(d, d, bias=False, dtype=DTYPE)
        self.second = nn.Linear(d, d, bias=False, dtype=DTYPE)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=DTYPE) / math.sqrt(d))
        if tied:
            self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(torch.tanh(self.first(x)))


def counts(model: Stack) -> list[tuple[int, int]]:
    """(traces, shared) of each block of `model`."""
    return [(block.forward.cache_info().traces, block.forward.cache_info().shared) for block in model.blocks]


def checkpointed_copy(model: nn.Module, block_type: Any, policy: Any = None) -> nn.Module:
    return checkpoint_modules(copy.deepcopy(model), block_type, policy=policy)


def x_input(d: int = 8, seed: int = 1) -> torch.Tensor:
    return models.randn(3, d, seed=seed).to(DTYPE).detach().requires_grad_()


# --- sharing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_identical_blocks_share_one_trace_and_keep_their_own_gradients(policy: str) -> None:
    reference = Stack([models.GPT2Block(seed=i) for i in range(4)])
    model = checkpointed_copy(reference, models.GPT2Block, POLICIES[policy])
    models.compare(reference, model, models.gpt2_input())
    assert counts(model) == [(1, 0), (0, 1), (0, 1), (0, 1)]
    models.compare(reference, model, models.gpt2_input(seed=2))  # later steps hit each block's own cache
    assert [m.forward.cache_info().hits for m in model.blocks] == [1, 1, 1, 1]


def test_attributes_the_trace_reads_must_match_and_unread_ones_may_differ() -> None:
    # `window` is read by forward: blocks 1 and 3 (window 2) trace apart from 0 and 2 (no window).
    # `layer_idx` differs in every block but is never read, so it does not keep blocks apart.
    reference = Stack([Block(window=None if i % 2 == 0 else 2, seed=i) for i in range(4)])
    model = checkpointed_copy(reference, Block, remat.policies.dots_saveable)
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (1, 0), (0, 1), (0, 1)]


def test_an_attribute_read_through_the_instance_dict_compares_them_all() -> None:
    class ReadsItsDict(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * vars(self).get("scale", 1.0)

    reference = Stack([ReadsItsDict(seed=i) for i in range(3)])  # `layer_idx` differs in each
    model = checkpointed_copy(reference, ReadsItsDict)
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (1, 0), (1, 0)]

    same = Stack([ReadsItsDict(seed=0) for _ in range(3)])
    for i, block in enumerate(same.blocks):
        block.up.weight.data.mul_(i + 1)  # other values, the same attributes
    model = checkpointed_copy(same, ReadsItsDict)
    models.compare(same, model, x_input())
    assert counts(model) == [(1, 0), (0, 1), (0, 1)]


class Scaled(nn.Module):
    """A function made a module, holding no tensors: `scale` decides what it computes."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.scale


class HelperBlock(Block):
    """A block that keeps a module of its own outside its submodules, in a plain dict attribute, as
    transformers' layers keep their kernel wrappers (`self._kernel_funcs`, one per layer)."""

    def __init__(self, helper: nn.Module, *, seed: int = 0):
        super().__init__(seed=seed)
        self.__dict__["_helpers"] = {"act": helper}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self._helpers["act"](x))


def test_modules_of_their_own_that_hold_no_tensors_compare_by_their_attributes() -> None:
    # With transformers 5.25 and `kernels`, every MoE and dense decoder layer read such a dict, and no two
    # layers shared a trace: start-up grew with depth again.
    reference = Stack([HelperBlock(Scaled(0.5 if i < 3 else 2.0), seed=i) for i in range(4)])
    model = checkpointed_copy(reference, HelperBlock)
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (0, 1), (0, 1), (1, 0)]


def test_modules_of_their_own_that_hold_tensors_compare_by_identity() -> None:
    reference = Stack([HelperBlock(nn.Linear(8, 8, dtype=DTYPE), seed=i) for i in range(3)])
    model = checkpointed_copy(reference, HelperBlock)
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (1, 0), (1, 0)]


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """A configuration object each module gets its own copy of (torchtitan's `_sharding_config`)."""

    scale: float
    names: tuple[str, ...] = ("x",)


class Parallelized(nn.Module):
    """A linear layer whose instance `forward` is a closure made for it, over itself, its own
    configuration object and a shared object, as torchtitan's `Module.parallelize` makes one."""

    def __init__(self, d: int, layout: Layout, shared: Any, *, seed: int):
        super().__init__()
        self.linear = nn.Linear(d, d, dtype=DTYPE)
        with torch.no_grad():
            self.linear.weight.copy_(models.randn(d, d, seed=seed).to(DTYPE) / math.sqrt(d))
        self._layout = layout
        forward = self.forward

        def forward_with_layout(x: torch.Tensor) -> torch.Tensor:
            return forward(x * self._layout.scale) + shared["offset"]

        self.forward = forward_with_layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class ParallelizedBlock(nn.Module):
    def __init__(self, layout: Layout, shared: Any, *, seed: int):
        super().__init__()
        self.inner = Parallelized(8, layout, shared, seed=seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def test_objects_made_per_module_compare_by_what_they_hold() -> None:
    # torchtitan gives every module its own `forward` closure and configuration object: compared by
    # identity, no two blocks shared a trace. Equal closures and configurations share; a configuration
    # of another value the trace reads does not.
    shared = {"offset": 0.25}

    def build() -> Stack:  # not a deep copy: the closures would still run the copied-from modules
        layouts = [Layout(0.5), Layout(0.5), Layout(2.0), Layout(0.5)]
        return Stack([ParallelizedBlock(layout, shared, seed=i) for i, layout in enumerate(layouts)])

    reference, model = build(), checkpoint_modules(build(), ParallelizedBlock)
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (0, 1), (1, 0), (0, 1)]


def test_a_closure_over_another_value_or_object_traces_apart() -> None:
    def build() -> Stack:
        offsets = [0.25, 0.5]
        return Stack([ParallelizedBlock(Layout(0.5), {"offset": offset}, seed=i) for i, offset in enumerate(offsets)])

    reference, model = build(), checkpoint_modules(build(), ParallelizedBlock)
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (1, 0)]


def test_tied_weights_must_be_tied_alike() -> None:
    reference = Stack([TiedBlock(tied=tied, seed=i) for i, tied in enumerate([True, False, True, False])])
    model = checkpointed_copy(reference, TiedBlock, remat.policies.save_nothing)
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (1, 0), (0, 1), (0, 1)]


def test_parameters_of_other_shapes_or_requires_grad_trace_apart() -> None:
    blocks = [Block(hidden=8, seed=0), Block(hidden=16, seed=1), Block(hidden=8, seed=2), Block(hidden=8, seed=3)]
    blocks[3].up.bias.requires_grad_(False)  # frozen
    reference = Stack(blocks)
    model = checkpointed_copy(reference, Block)
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (1, 0), (0, 1), (1, 0)]


def test_a_block_with_a_hook_inside_traces_on_its_own() -> None:
    reference = Stack([Block(seed=i) for i in range(3)])
    model = checkpointed_copy(reference, Block)
    calls: list[str] = []
    model.blocks[1].up.register_forward_hook(lambda *_: calls.append("hooked"))
    with pytest.warns(UserWarning, match="hooks"):
        models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (1, 0), (0, 1)]
    assert calls == ["hooked", "hooked"]  # both while tracing (on fake tensors, then traced), none on the call


def test_a_hook_on_a_block_itself_runs_on_every_call_and_keeps_it_sharing() -> None:
    reference = Stack([Block(seed=i) for i in range(3)])
    model = checkpointed_copy(reference, Block)
    calls: list[int] = []
    model.blocks[1].register_forward_hook(lambda module, args, output: calls.append(output.shape[0]))
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (0, 1), (0, 1)]
    assert calls == [3]  # around the checkpointed forward, with the real output


def test_a_block_in_eval_mode_traces_apart_from_blocks_in_train_mode() -> None:
    class DropoutBlock(Block):
        def __init__(self, seed: int):
            super().__init__(seed=seed)
            self.dropout = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dropout(super().forward(x))

    reference = Stack([DropoutBlock(seed=i) for i in range(3)])
    reference.blocks[1].dropout.eval()
    model = checkpointed_copy(reference, DropoutBlock)
    models.compare(reference, model, x_input())  # the same seed: the same dropout masks
    assert counts(model) == [(1, 0), (1, 0), (0, 1)]


def test_new_parameters_of_a_block_that_took_a_shared_trace_are_used() -> None:
    reference = Stack([Block(seed=i) for i in range(3)])
    model = checkpointed_copy(reference, Block)
    models.compare(reference, model, x_input())
    fresh = Block(seed=7)
    model.blocks[2].load_state_dict(fresh.state_dict(), assign=True)
    reference.blocks[2].load_state_dict(fresh.state_dict(), assign=True)
    models.compare(reference, model, x_input())


def test_a_deep_copy_of_the_model_shares_among_its_own_blocks() -> None:
    reference = Stack([Block(seed=i) for i in range(3)])
    model = checkpointed_copy(reference, Block)
    models.compare(reference, model, x_input())
    copied = copy.deepcopy(model)
    models.compare(reference, copied, x_input())
    assert counts(copied) == [(1, 0), (0, 1), (0, 1)]  # its own trace, of its own tensors


def test_each_block_reports_on_its_own_calls() -> None:
    reference = Stack([Block(window=2, seed=i) for i in range(3)])
    model = checkpointed_copy(reference, Block, remat.policies.dots_saveable)
    x = x_input()
    model(x).sum().backward()
    alone = remat.report(remat.checkpoint(copy.deepcopy(reference.blocks[2]), policy=remat.policies.dots_saveable), x)
    shared = remat.report(model.blocks[2].forward, x)
    assert model.blocks[2].forward.cache_info().shared == 1
    assert (shared.saved_bytes, [row.decision for row in shared.rows]) == (
        alone.saved_bytes,
        [row.decision for row in alone.rows],
    )
    assert [call.module for call in shared.trace] == [call.module for call in alone.trace]


def test_recording_leaves_no_class_patched_even_when_tracing_fails() -> None:
    class Fails(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("broken block")

    model = checkpoint_modules(Stack([Fails(seed=i) for i in range(2)]), Fails)
    with pytest.raises(ValueError, match="broken block"):
        model(x_input())
    for cls in (Fails, Block, nn.Linear):
        assert "__getattribute__" not in vars(cls)


# --- random stacks -------------------------------------------------------------------------------

_KINDS = st.tuples(st.sampled_from([8, 16]), st.sampled_from([None, 2]), st.integers(0, 3))  # hidden, window, unread


@examples(ci=5, soak=200)
@given(kinds=st.lists(_KINDS, min_size=2, max_size=5), policy=st.sampled_from(sorted(POLICIES)))
def test_random_stacks_share_exactly_between_identical_blocks(
    kinds: list[tuple[int, int | None, int]], policy: str
) -> None:
    blocks = []
    for i, (hidden, window, unread) in enumerate(kinds):
        blocks.append(Block(hidden=hidden, window=window, seed=i))
        blocks[-1].layer_idx = unread
    reference = Stack(blocks)
    model = checkpointed_copy(reference, Block, POLICIES[policy])
    models.compare(reference, model, x_input())
    first_of_kind: dict[tuple[int, int | None], int] = {}
    for i, (hidden, window, _) in enumerate(kinds):
        first_of_kind.setdefault((hidden, window), i)
    expected = [
        (1, 0) if first_of_kind[(hidden, window)] == i else (0, 1) for i, (hidden, window, _) in enumerate(kinds)
    ]
    assert counts(model) == expected


@examples(ci=5, soak=200)
@given(
    kinds=st.lists(st.tuples(st.sampled_from([0.5, 2.0]), st.sampled_from([0.0, 0.25])), min_size=2, max_size=5),
    policy=st.sampled_from(sorted(POLICIES)),
)
def test_random_stacks_of_blocks_with_objects_of_their_own_share_exactly_between_equal_ones(
    kinds: list[tuple[float, float]], policy: str
) -> None:
    # Each block's module has its own forward closure, configuration object and dict: equal ones share.
    def build() -> Stack:
        return Stack(
            [ParallelizedBlock(Layout(scale), {"offset": offset}, seed=i) for i, (scale, offset) in enumerate(kinds)]
        )

    reference, model = build(), checkpoint_modules(build(), ParallelizedBlock, policy=POLICIES[policy])
    models.compare(reference, model, x_input())
    first_of_kind: dict[tuple[float, float], int] = {}
    for i, kind in enumerate(kinds):
        first_of_kind.setdefault(kind, i)
    assert counts(model) == [(1, 0) if first_of_kind[kind] == i else (0, 1) for i, kind in enumerate(kinds)]


# --- comparing attribute values ------------------------------------------------------------------


class Sentinel:
    """A marker class whose instances have no state: code tells them apart with `is`."""


def _closure(scale: float, *, default: int = 1) -> Any:
    def scaled(x: Any, power: int = default) -> Any:
        return x * scale**power

    return scaled


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (4, 4, True),
        (4, 4.0, False),  # another type can take another branch
        (None, 8, False),
        ("sliding", "full", False),
        (float("nan"), float("nan"), True),
        ((1, [2, "x"]), (1, [2, "x"]), True),
        ({"a": (1, 2)}, {"a": (1, 3)}, False),
        (torch.float32, torch.float32, True),
        (functools.partial(torch.tanh), functools.partial(torch.tanh), True),
        (functools.partial(max, 1), functools.partial(max, 2), False),
        ({"a", "b"}, {"b", "a"}, True),
        (frozenset({"a", (1,)}), frozenset({"a", (1,)}), False),  # of more than plain values: by identity
        (Scaled(0.5), Scaled(0.5), True),
        (Scaled(0.5), Scaled(2.0), False),
        (nn.Identity(), Scaled(0.5), False),
        (nn.Sequential(Scaled(0.5)), nn.Sequential(Scaled(0.5)), True),
        (nn.Sequential(Scaled(0.5)), nn.Sequential(Scaled(1.0)), False),
        (nn.Linear(2, 2), nn.Linear(2, 2), False),  # a module that holds tensors: by identity
        (object(), object(), False),  # objects of classes defined in C only when they are one object
        (Layout(0.5), Layout(0.5), True),  # objects of Python classes by their state, slots included
        (Layout(0.5), Layout(0.5, ("y",)), False),
        (Sentinel(), Sentinel(), False),  # without state: by identity
        (_closure(1.0), _closure(1.0), True),  # functions by code, globals, defaults and closure
        (_closure(1.0), _closure(2.0), False),
        (_closure(1.0, default=2), _closure(1.0), False),
        (_closure(1.0), lambda x: x, False),
        (Scaled(0.5).forward, Scaled(0.5).forward, True),  # bound methods by function and object
        (Scaled(0.5).forward, Scaled(0.5).extra_repr, False),
    ],
)
def test_same_value(a: Any, b: Any, same: bool) -> None:
    assert same_value(a, b) is same


def test_objects_nested_deeper_than_python_recurses_are_not_the_same() -> None:
    def chain(length: int) -> Any:
        head: Any = Layout(0.0)
        for _ in range(length):
            head = Layout(0.0, (head,))  # type: ignore[arg-type]
        return head

    assert same_value(chain(3), chain(3))
    assert not same_value(chain(5_000), chain(5_000))


def test_the_modules_of_the_block_compare_by_position() -> None:
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    pairs = {id(second): first}  # `second` is at the position `first` had in the block that traced
    assert same_value(second.forward, first.forward, pairs)
    assert same_value([second], [first], pairs)
    assert not same_value(first.forward, second.forward, pairs)  # `first` is no module of the new block
    assert not same_value(second, nn.Linear(2, 2), pairs)


def test_cache_clear_on_a_block_makes_the_next_block_trace_again() -> None:
    reference = Stack([Block(seed=i) for i in range(3)])
    model = checkpointed_copy(reference, Block)
    models.compare(reference, model, x_input())
    for block in model.blocks:
        block.forward.cache_clear()
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (0, 1), (0, 1)]  # counted anew: block 0 traced again, the others took it
    model.blocks[2].forward.cache_clear()
    models.compare(reference, model, x_input())
    assert counts(model) == [(1, 0), (0, 1), (1, 0)]  # nothing left to take
