"""Naming calls: `remat.tag`, `Call.occurrence`, `Call.module`, and the policies that select by them.

The issue's must-show is here: in one trace, two calls of the same op, one saved
and one recomputed, chosen by occurrence, by tag and by module path. Each is
shown three ways: the report's decisions, a count of the op's replays in
backward (a `TorchDispatchMode`, against `save_everything` and `save_nothing`
so that the count is sensitive), and gradients equal to the unwrapped function.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from conftest import CountOps
from models import DTYPE, randn
from torch import nn

import remat
from remat import policies
from remat.testing import assert_checkpoint_equivalent

aten = torch.ops.aten


# --- helpers ---------------------------------------------------------------------------------------


def backward_counts(fn: Callable[..., torch.Tensor], args: Sequence[torch.Tensor]) -> collections.Counter[Any]:
    """Run `fn(*args)` on fresh leaves, then count the ops dispatched by its backward only."""
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = fn(*leaves)
    loss = out.sum() if out.dim() else out
    with CountOps() as counter:
        loss.backward()
    return counter.counts


def replays(fn: Callable[..., torch.Tensor], policy: Any, args: Sequence[torch.Tensor], op: Any) -> int:
    """How many more times `op` runs in the backward of `fn` under `policy` than under `save_everything`.

    Gradient formulas may themselves call `op` (a matmul's backward runs `mm`);
    `save_everything` replays nothing, so the difference is the number of replays.
    """
    checkpointed = remat.checkpoint(fn, policy=policy)
    baseline = remat.checkpoint(fn, policy=policies.save_everything)
    return backward_counts(checkpointed, args)[op] - backward_counts(baseline, args)[op]


def decisions_of(report: remat.Report, op: Any) -> list[tuple[remat.Decision, bool]]:
    """(decision, replayed) of each call of `op` in `report`, in trace order."""
    return [(row.decision, row.replayed) for row in report.rows if row.call.op is op]


def _x(*shape: int, device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    return randn(*shape, seed=seed).detach().to(device).requires_grad_()


# --- remat.tag: identity ---------------------------------------------------------------------------


def test_tag_returns_its_argument_in_eager_code():
    x = torch.randn(3, dtype=DTYPE)
    tree = {"a": x, "b": (x.sin(), 3, None, "s")}
    assert remat.tag(x, "x") is x
    assert remat.tag(tree, "tree") is tree
    assert tree["b"][1:] == (3, None, "s"), "non-tensor leaves untouched"


def test_tag_returns_its_argument_inside_a_checkpointed_function():
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        seen.append(remat.tag(h, "h") is h)
        pair = (h.cos(), 2.0)
        seen.append(remat.tag(pair, "pair") is pair)
        return pair[0] * h

    x = _x(4)
    assert_checkpoint_equivalent(fn, x)
    assert seen, "fn ran (while tracing)"
    assert all(seen)


def test_tag_returns_its_argument_under_torch_func_outside_a_checkpoint():
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        seen.append(remat.tag(h, "h") is h)
        return (h * h).sum()

    xs = torch.randn(3, 4, dtype=DTYPE)
    torch.testing.assert_close(torch.func.vmap(fn)(xs), (xs.sin() ** 2).sum(-1))
    torch.testing.assert_close(torch.func.grad(fn)(xs[0]), 2 * xs[0].sin() * xs[0].cos())
    torch.testing.assert_close(
        torch.func.vmap(torch.func.grad(fn))(xs), 2 * xs.sin() * xs.cos(), msg="vmap(grad(fn)) with a tag"
    )
    assert len(seen) == 3 and all(seen)


def test_tag_returns_its_argument_under_torch_func_of_a_checkpointed_function():
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        seen.append(remat.tag(h, "h") is h)
        return (h * h).sum()

    checkpointed = remat.checkpoint(fn, policy=policies.save_tagged("h"))
    xs = torch.randn(3, 4, dtype=DTYPE)
    torch.testing.assert_close(torch.func.vmap(checkpointed)(xs), (xs.sin() ** 2).sum(-1))
    torch.testing.assert_close(torch.func.grad(checkpointed)(xs[0]), 2 * xs[0].sin() * xs[0].cos())
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(checkpointed))(xs), 2 * xs.sin() * xs.cos())
    assert seen, "fn ran (while tracing)"
    assert all(seen)


# --- remat.tag: which calls it names ---------------------------------------------------------------


def test_tag_names_the_producer_of_each_tensor_leaf_of_a_pytree():
    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b, c = x.sin(), x.cos(), x.exp()
        tree = {"a": a, "rest": (b, 3, None, "label")}
        assert remat.tag(tree, "tree") is tree
        return a * b * c

    trace = remat.trace(fn, _x(3))
    assert [(call.name, call.tags) for call in trace] == [
        ("aten.sin.default", frozenset({"tree"})),
        ("aten.cos.default", frozenset({"tree"})),
        ("aten.exp.default", frozenset()),
        ("aten.mul.Tensor", frozenset()),
        ("aten.mul.Tensor", frozenset()),
    ]


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(lambda h: h[0], id="select"),
        pytest.param(lambda h: h.t(), id="transpose"),
        pytest.param(lambda h: h.reshape(-1), id="reshape"),
        pytest.param(lambda h: h.t()[1:], id="view-of-view"),
    ],
)
def test_tag_on_a_view_names_the_call_that_produced_its_base(view: Callable[[torch.Tensor], torch.Tensor]):
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        remat.tag(view(h), "v")
        return h.cos()

    sin, cos = remat.trace(fn, _x(2, 3))
    assert (sin.name, sin.tags) == ("aten.sin.default", frozenset({"v"}))
    assert cos.tags == frozenset()


def test_tag_on_an_input_names_no_call():
    def fn(x: torch.Tensor) -> torch.Tensor:
        remat.tag(x, "input")
        remat.tag(x[0], "input view")
        return x.sin().cos()

    trace = remat.trace(fn, _x(2, 3))
    assert len(trace) == 2
    assert all(call.tags == frozenset() for call in trace)


def test_two_names_on_one_call_give_both():
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = remat.tag(remat.tag(x.sin(), "a"), "b")
        return remat.tag(h[0], "c").cos()

    sin, cos = remat.trace(fn, _x(2, 3))
    assert sin.tags == frozenset({"a", "b", "c"})
    assert cos.tags == frozenset()


@pytest.mark.parametrize("name", [1, None, b"h", "", ("h",)])
def test_tag_with_a_bad_name_raises(name: Any):
    with pytest.raises(TypeError, match=r"remat\.tag: expected a non-empty string as the name, but got"):
        remat.tag(torch.ones(2), name)


def test_tag_with_a_bad_name_raises_while_tracing_too():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return remat.tag(x.sin(), "")

    with pytest.raises(TypeError, match="non-empty string"):
        remat.checkpoint(fn)(_x(3))


def test_tags_cost_nothing_when_the_checkpointed_function_runs():
    def untagged(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = (x @ w).sin()
        return (h @ w).tanh().sum()

    def tagged(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = remat.tag(remat.tag(x @ w, "mm").sin(), "sin")
        remat.tag(h.t(), "view")
        return remat.tag((h @ w).tanh(), "out").sum()

    x, w = _x(3, 4), _x(4, 4, seed=1)
    counts = {}
    for name, fn in [("untagged", untagged), ("tagged", tagged)]:
        checkpointed = remat.checkpoint(fn)  # save_nothing: tags change no decision
        checkpointed(x, w).backward()  # the first call traces
        with CountOps() as counter:
            checkpointed(x, w).backward()
        counts[name] = counter.counts
    assert counts["tagged"] == counts["untagged"]  # no alias or other op left behind by a tag
    assert counts["untagged"][aten.sin.default] == 2, "forward and replay: the counter sees the ops"


# --- the must-show: two calls of one op, one saved and one recomputed ------------------------------


def two_sins(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Two `sin` calls whose outputs the matmuls' backward reads (for the weights' gradients)."""
    return ((x.sin() @ w1).sin() @ w2).sum()


def _two_sins_args(device: torch.device) -> tuple[torch.Tensor, ...]:
    return _x(3, 4, device=device), _x(4, 5, device=device, seed=1), _x(5, 2, device=device, seed=2)


def _assert_one_saved_one_replayed(fn: Callable[..., torch.Tensor], policy: Any, args: Sequence[Any], op: Any):
    report = remat.report(fn, *args, policy=policy)
    assert decisions_of(report, op) == [(remat.SAVE, False), (remat.RECOMPUTE, True)]
    assert replays(fn, policies.save_everything, args, op) == 0
    assert replays(fn, policies.save_nothing, args, op) == 2
    assert replays(fn, policy, args, op) == 1
    assert_checkpoint_equivalent(fn, *args, policy=policy)


def test_must_show_one_of_two_calls_saved_by_occurrence(device: torch.device):
    def first_sin(call: remat.Call) -> bool:
        return call.op is aten.sin.default and call.occurrence == 0

    args = _two_sins_args(device)
    trace = remat.trace(two_sins, *args)
    assert [(call.name, call.occurrence) for call in trace if call.op is aten.sin.default] == [
        ("aten.sin.default", 0),
        ("aten.sin.default", 1),
    ]
    _assert_one_saved_one_replayed(two_sins, first_sin, args, aten.sin.default)


def test_must_show_one_of_two_calls_saved_by_occurrence_of_mm(device: torch.device):
    def second_mm(call: remat.Call) -> bool:
        return call.op is aten.mm.default and call.occurrence == 1

    def fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        # `sin` reads its input in backward: both mm outputs are needed.
        return ((x @ w1).sin() @ w2).sin().sum()

    args = _two_sins_args(device)
    report = remat.report(fn, *args, policy=second_mm)
    assert decisions_of(report, aten.mm.default) == [(remat.RECOMPUTE, True), (remat.SAVE, False)]
    assert replays(fn, policies.save_nothing, args, aten.mm.default) == 2
    assert replays(fn, second_mm, args, aten.mm.default) == 1
    assert_checkpoint_equivalent(fn, *args, policy=second_mm)


def test_must_show_one_of_two_calls_saved_by_tag(device: torch.device):
    def fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.tag(x.sin(), "first")
        return ((h @ w1).sin() @ w2).sum()

    args = _two_sins_args(device)
    _assert_one_saved_one_replayed(fn, policies.save_tagged("first"), args, aten.sin.default)


class TwoLinears(nn.Module):
    """Two submodules doing the same op (`addmm`), with `sin`s (which read their inputs) after each."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 5)
        self.second = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).sin()).sin().sum()


def test_must_show_one_of_two_calls_saved_by_module(device: torch.device):
    model = TwoLinears().to(device=device, dtype=DTYPE)
    x = _x(3, 4, device=device)
    policy = policies.save_modules("first")
    assert [call.module for call in remat.trace(model, x) if call.op is aten.addmm.default] == ["first", "second"]
    _assert_one_saved_one_replayed(model, policy, (x,), aten.addmm.default)
    assert_checkpoint_equivalent(model, x, policy=policy)


# --- module paths ----------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.k_proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) * self.k_proj(x)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x)).tanh()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _layer_paths(prefix: str) -> list[tuple[str, str]]:
    addmm, mul, tanh = "aten.addmm.default", "aten.mul.Tensor", "aten.tanh.default"
    return [
        row
        for i in range(2)
        for row in [
            (addmm, f"{prefix}layers.{i}.attn.q_proj"),
            (addmm, f"{prefix}layers.{i}.attn.k_proj"),
            (mul, f"{prefix}layers.{i}.attn"),
            (addmm, f"{prefix}layers.{i}.mlp"),
            (tanh, f"{prefix}layers.{i}"),
        ]
    ]


def _stack() -> Stack:
    return Stack().to(DTYPE)


def test_module_paths_of_a_model_passed_directly():
    model = _stack()
    trace = remat.trace(model, _x(2, 4))
    assert [(call.name, call.module) for call in trace] == [*_layer_paths(""), ("aten.sum.default", "")]
    # The same paths as `named_modules()` gives.
    named = {name for name, _ in model.named_modules()}
    assert {call.module for call in trace} <= named


def test_module_paths_of_a_closed_over_model_start_with_the_variable_name():
    # As `find_module_roots` names roots (and tests/test_trace.py's closed-over block): the
    # closure variable's name, then the path within it. Calls of the function itself: None.
    model = _stack()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return model(x) * 2

    for closure in (fn, lambda x: model(x) * 2):
        trace = remat.trace(closure, _x(2, 4))
        assert [(call.name, call.module) for call in trace] == [
            *_layer_paths("model."),
            ("aten.sum.default", "model"),
            ("aten.mul.Tensor", None),
        ]


def test_module_paths_of_closed_over_modules_that_are_not_children_of_one_root():
    model = _stack()
    head = nn.Linear(4, 1).to(DTYPE)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return head(model.layers[1](x)).sum()

    trace = remat.trace(fn, _x(2, 4))
    assert [(call.name, call.module) for call in trace] == [
        *_layer_paths("model.")[5:],
        ("aten.addmm.default", "head"),
        ("aten.sum.default", None),
    ]


def test_save_modules_with_an_exact_path():
    model = _stack()
    policy = policies.save_modules("layers.1.attn.k_proj")
    plan = policy.plan(remat.trace(model, _x(2, 4)))
    assert [i for i, decision in enumerate(plan) if decision is remat.SAVE] == [6]


def test_save_modules_with_a_glob_and_submodules():
    model = _stack()
    trace = remat.trace(model, _x(2, 4))
    saved = {
        pattern: [call.module for call in trace if policies.save_modules(pattern)(call) is remat.SAVE]
        for pattern in ["layers.*.attn", "layers.0.attn", "layers.*.attn.q_proj", "*.mlp", "layers.0", "nothing"]
    }
    assert saved == {
        "layers.*.attn": [
            "layers.0.attn.q_proj",
            "layers.0.attn.k_proj",
            "layers.0.attn",
            "layers.1.attn.q_proj",
            "layers.1.attn.k_proj",
            "layers.1.attn",
        ],
        "layers.0.attn": ["layers.0.attn.q_proj", "layers.0.attn.k_proj", "layers.0.attn"],
        "layers.*.attn.q_proj": ["layers.0.attn.q_proj", "layers.1.attn.q_proj"],
        "*.mlp": ["layers.0.mlp", "layers.1.mlp"],
        "layers.0": [path for _, path in _layer_paths("")[:5]],
        "nothing": [],
    }


def test_save_modules_root_pattern_saves_every_call_of_the_root_but_not_calls_outside_modules():
    model = _stack()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return model(x).exp()

    trace = remat.trace(fn, _x(2, 4))
    assert trace[-1].module is None
    for pattern in ["*", "model", "model.*"]:
        plan = policies.save_modules(pattern).plan(trace)
        assert plan[-1] is remat.RECOMPUTE, f"{pattern!r} saves a call outside any module"
    assert all(d is remat.SAVE for d in policies.save_modules("*").plan(trace)[:-1])
    # The root module of a model passed directly is "": the pattern "" saves all its calls.
    assert all(d is remat.SAVE for d in policies.save_modules("").plan(remat.trace(model, _x(2, 4))))


def test_save_modules_gradients_and_report_on_a_closed_over_model():
    model = _stack()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return model(x).exp()

    policy = policies.save_modules("model.layers.*.attn")
    x = _x(2, 4)
    report = remat.report(fn, x, policy=policy)
    saved = [row.call.module for row in report.rows if row.decision is remat.SAVE]
    assert saved == [path for _, path in _layer_paths("model.") if ".attn" in path]
    assert_checkpoint_equivalent(fn, x, policy=policy, params=model.parameters())


@pytest.mark.parametrize("pattern", [1, None, b"layers", ("layers",)])
def test_save_modules_with_a_bad_pattern_raises(pattern: Any):
    with pytest.raises(TypeError, match=r"remat\.policies\.save_modules: expected .* as strings .* but got"):
        policies.save_modules("layers", pattern)


def test_save_modules_repr_hash_and_equality():
    policy = policies.save_modules("layers.*.attn", "head")
    assert repr(policy) == "save_modules('layers.*.attn', 'head')"
    assert policy == policies.save_modules("layers.*.attn", "head")
    assert hash(policy) == hash(policies.save_modules("layers.*.attn", "head"))
    assert policy != policies.save_modules("head")


# --- save_tagged / save_tagged_except -------------------------------------------------------------


def _tagged_trace() -> remat.Trace:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = remat.tag(x.sin(), "a")  # a
        b = remat.tag(remat.tag(a.cos(), "a"), "b")  # a, b
        c = remat.tag(b.exp(), "c")  # c
        return c.tanh()  # untagged

    trace = remat.trace(fn, _x(3))
    assert [call.tags for call in trace] == [
        frozenset({"a"}),
        frozenset({"a", "b"}),
        frozenset({"c"}),
        frozenset(),
    ]
    return trace


S, R = remat.SAVE, remat.RECOMPUTE


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("a",), (S, S, R, R)),
        (("b",), (R, S, R, R)),
        (("c",), (R, R, S, R)),
        (("b", "c"), (R, S, S, R)),
        (("a", "b", "c"), (S, S, S, R)),
        (("missing",), (R, R, R, R)),
        ((), (R, R, R, R)),
    ],
)
def test_save_tagged_saves_calls_with_any_of_the_names(names: tuple[str, ...], expected: tuple[remat.Decision, ...]):
    assert policies.save_tagged(*names).plan(_tagged_trace()) == expected


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("a",), (R, S, S, R)),  # the call tagged a and b keeps b
        (("b",), (S, S, S, R)),
        (("a", "b"), (R, R, S, R)),
        (("a", "b", "c"), (R, R, R, R)),
        (("missing",), (S, S, S, R)),
        ((), (S, S, S, R)),  # every tagged call, never an untagged one
    ],
)
def test_save_tagged_except_saves_tagged_calls_with_another_name(
    names: tuple[str, ...], expected: tuple[remat.Decision, ...]
):
    assert policies.save_tagged_except(*names).plan(_tagged_trace()) == expected


def test_save_tagged_and_save_tagged_except_replays_and_gradients():
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = remat.tag(x.sin(), "a")
        b = remat.tag(a.sin(), "b")
        return b.sin().sum()  # sin's backward reads its input: the outputs of a and b

    x = _x(5)
    cases = [
        (policies.save_tagged("a"), [1]),
        (policies.save_tagged("a", "b"), []),
        (policies.save_tagged_except("a"), [0]),
        (policies.save_tagged_except("a", "b"), [0, 1]),
    ]
    for policy, replayed in cases:
        assert remat.report(fn, x, policy=policy).replayed_calls == tuple(replayed), policy
        assert replays(fn, policy, (x,), aten.sin.default) == len(replayed), policy
        assert_checkpoint_equivalent(fn, x, policy=policy)


def test_tagged_policy_reprs():
    assert repr(policies.save_tagged("b", "a")) == "save_tagged('a', 'b')"
    assert repr(policies.save_tagged_except("x")) == "save_tagged_except('x')"
    assert repr(policies.save_tagged()) == "save_tagged()"


def test_tagged_policies_are_hashable_and_equal_when_built_with_the_same_names():
    assert policies.save_tagged("a", "b") == policies.save_tagged("b", "a", "a")
    assert hash(policies.save_tagged("a", "b")) == hash(policies.save_tagged("b", "a"))
    assert policies.save_tagged_except("a") == policies.save_tagged_except("a")
    assert hash(policies.save_tagged_except("a")) == hash(policies.save_tagged_except("a"))
    assert policies.save_tagged("a") != policies.save_tagged_except("a")
    assert policies.save_tagged("a") != policies.save_tagged("b")
    assert len({policies.save_tagged("a"), policies.save_tagged("a"), policies.save_tagged_except("a")}) == 2


@pytest.mark.parametrize("factory", [policies.save_tagged, policies.save_tagged_except])
@pytest.mark.parametrize("name", [1, None, "", b"a", ("a",)])
def test_tagged_policies_with_a_bad_name_raise(factory: Callable[..., Any], name: Any):
    api = factory.__name__
    with pytest.raises(TypeError, match=rf"remat\.policies\.{api}: expected .* non-empty strings, but got"):
        factory("ok", name)


def test_regression_a_checkpointed_forward_method_gives_the_root_its_empty_path() -> None:
    # Calling `module.forward` directly runs no module hook for the root: its own calls had no path.
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).sin()

    model = Model().to(torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    for fn in (model, model.forward):
        assert [(call.name, call.module) for call in remat.trace(fn, x)] == [
            ("aten.addmm.default", "fc"),
            ("aten.sin.default", ""),
        ]
    plan = remat.policies.save_modules("").plan(remat.trace(model.forward, x))
    assert plan == (remat.SAVE, remat.SAVE)


# --- module patterns that match nothing ----------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).tanh()


class _Block(nn.Module):
    def __init__(self, attention: bool = True) -> None:
        super().__init__()
        self.attn = _Attention() if attention else nn.Identity()
        self.mlp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.attn(x))


class _Stack(nn.Module):
    def __init__(self, *attention: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(a) for a in attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_module_pattern_that_matches_nothing_warns_once_per_trace() -> None:
    model, x = _Stack(True, True), torch.randn(2, 4, requires_grad=True)
    with pytest.warns(UserWarning, match=r"remat\.checkpoint: the save_modules pattern 'blocks\.\*\.attn' matches no"):
        f = remat.checkpoint(model, policy=policies.save_modules("blocks.*.attn") | policies.dots_saveable)
        f(x).sum().backward()
    f(x).sum().backward()  # the same trace: no second warning (warnings are errors in this suite)
    with pytest.warns(UserWarning, match=r"'blocks\.\*\.attn' matches no module .* e\.g\. 'layers', 'layers\.0'"):
        f(torch.randn(3, 4)).sum().backward()  # a new trace
    remat.checkpoint(model, policy=policies.save_modules("layers.*.attn"))(x).sum().backward()  # matches: quiet
    with pytest.warns(UserWarning, match=r"remat\.report: the save_modules pattern 'nope'"):
        remat.report(model, torch.randn(5, 4), policy=policies.save_modules("nope"))


def test_under_checkpoint_modules_a_pattern_warns_only_if_it_matches_in_no_block() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    model = _Stack(True, False)  # the second block has no attention: the pattern matches in the first only
    remat.checkpoint_modules(model, _Block, policy=policies.save_modules("attn"))
    model(x).sum().backward()
    model = _Stack(True, True)
    with pytest.warns(UserWarning, match=r"checkpoint_modules: the save_modules pattern 'layers\.\*\.attn' matches no"):
        remat.checkpoint_modules(model, _Block, policy=policies.save_modules("layers.*.attn"))  # paths are relative
    model(x).sum().backward()  # warned once, when the blocks were checkpointed
