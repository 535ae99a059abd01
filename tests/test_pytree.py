"""Arguments and outputs as pytrees: tensors are traced, everything else is static and keys the cache."""

from __future__ import annotations

import collections
import enum
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import optree.dataclasses
import pytest
import torch

import remat

DTYPE = torch.float64
NAMESPACE = "remat"


def _randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, dtype=DTYPE, generator=generator).requires_grad_()


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(leaf, torch.Tensor)]


def _fresh(tree: Any) -> Any:
    def copy(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        return leaf

    return optree.tree_map(copy, tree, namespace=NAMESPACE)


def _same_structure(actual: Any, expected: Any) -> None:
    assert optree.tree_structure(actual, namespace=NAMESPACE) == optree.tree_structure(expected, namespace=NAMESPACE)


def _assert_like_unwrapped(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """Outputs (structure and values) and input gradients of `remat.checkpoint(fn)` equal those of `fn`."""
    kwargs = kwargs or {}
    results = []
    for wrapped in (fn, remat.checkpoint(fn)):
        call_args, call_kwargs = _fresh((args, kwargs))
        out = wrapped(*call_args, **call_kwargs)
        outputs = _tensor_leaves(out)
        inputs = [t for t in _tensor_leaves((call_args, call_kwargs)) if t.requires_grad]
        generator = torch.Generator().manual_seed(7)
        cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outputs]
        grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
        results.append((out, outputs, grads))
    (expected_out, expected_outputs, expected_grads), (out, outputs, grads) = results
    _same_structure(out, expected_out)
    assert len(outputs) == len(expected_outputs)
    for actual, expected in zip(outputs, expected_outputs, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)
    assert len(grads) == len(expected_grads)
    for actual, expected in zip(grads, expected_grads, strict=True):
        assert (actual is None) == (expected is None)
        if expected is not None:
            torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)
    return out


# --- containers -----------------------------------------------------------------------------------


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


Triple = collections.namedtuple("Triple", ["a", "b", "c"])


@optree.dataclasses.dataclass(namespace=NAMESPACE)
class LSTMState:
    hidden: torch.Tensor
    cell: torch.Tensor


class Box:
    """A custom container registered with optree by hand; `label` is metadata, not a leaf."""

    def __init__(self, value: torch.Tensor, label: str):
        self.value = value
        self.label = label


optree.register_pytree_node(
    Box,
    lambda box: ((box.value,), box.label, None),
    lambda label, children: Box(children[0], label),
    namespace=NAMESPACE,
)


def test_nested_tuples_lists_and_dicts():
    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        (x, (y, z)), [w] = inputs["tuple"], inputs["list"]
        return {"sum": [x.sin() + y, (z * w).exp()], "nested": ((x * y).tanh(),)}

    g = torch.Generator().manual_seed(0)
    inputs = {
        "tuple": (_randn(3, generator=g), (_randn(3, generator=g), _randn(2, generator=g))),
        "list": [_randn(2, generator=g)],
    }
    out = _assert_like_unwrapped(fn, (inputs,))
    assert isinstance(out, dict) and list(out) == ["sum", "nested"]
    assert isinstance(out["sum"], list) and len(out["sum"]) == 2
    assert isinstance(out["nested"], tuple)


def test_namedtuples_in_and_out():
    def fn(pair: Pair, triple: Triple) -> Triple:
        return Triple(pair.left * triple.a, Pair(pair.right.cos(), triple.b.sin()), triple.c.sum())

    g = torch.Generator().manual_seed(1)
    out = _assert_like_unwrapped(
        fn,
        (
            Pair(_randn(3, generator=g), _randn(2, generator=g)),
            Triple(_randn(3, generator=g), _randn(4, generator=g), _randn(5, generator=g)),
        ),
    )
    assert type(out) is Triple
    assert type(out.b) is Pair


def test_optree_dataclass_in_and_out():
    def fn(state: LSTMState, x: torch.Tensor) -> LSTMState:
        cell = state.cell * torch.sigmoid(x) + torch.tanh(x)
        return LSTMState(hidden=torch.tanh(cell) * state.hidden, cell=cell)

    g = torch.Generator().manual_seed(2)
    out = _assert_like_unwrapped(
        fn, (LSTMState(_randn(4, generator=g), _randn(4, generator=g)), _randn(4, generator=g))
    )
    assert type(out) is LSTMState


def test_registered_custom_node_in_and_out():
    labels: list[str] = []

    def fn(box: Box) -> Box:
        labels.append(box.label)
        return Box(box.value.sin() * 2, box.label + "!")

    g = torch.Generator().manual_seed(3)
    out = _assert_like_unwrapped(fn, (Box(_randn(3, generator=g), "first"),))
    assert type(out) is Box
    assert out.label == "first!"
    assert set(labels) == {"first"}


def test_none_in_arguments_and_outputs():
    def fn(x: torch.Tensor, maybe: torch.Tensor | None, options: dict[str, Any]) -> tuple[Any, ...]:
        assert maybe is None
        assert options["mask"] is None
        return None, x.sin(), {"aux": None, "y": x.cos()}, [None]

    g = torch.Generator().manual_seed(4)
    out = _assert_like_unwrapped(fn, (_randn(3, generator=g), None, {"mask": None}))
    assert out[0] is None
    assert out[2]["aux"] is None
    assert out[3] == [None]


def test_keyword_arguments():
    def fn(x: torch.Tensor, *, weight: torch.Tensor, extras: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        out = x @ weight
        for extra in extras:
            out = out + extra
        return out.relu()

    g = torch.Generator().manual_seed(5)
    x, weight, bias = _randn(2, 3, generator=g), _randn(3, 4, generator=g), _randn(4, generator=g)
    _assert_like_unwrapped(fn, (x,), {"weight": weight})
    _assert_like_unwrapped(fn, (x,), {"weight": weight, "extras": (bias, bias * 2)})


def test_keyword_order_does_not_matter_for_values():
    def fn(*, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * 2 + b.sin()

    g = torch.Generator().manual_seed(6)
    a, b = _randn(3, generator=g), _randn(3, generator=g)
    f = remat.checkpoint(fn)
    torch.testing.assert_close(f(a=a, b=b), fn(a=a, b=b))
    torch.testing.assert_close(f(b=b, a=a), fn(a=a, b=b))


def test_tensor_that_does_not_require_grad_gets_no_gradient():
    def fn(x: torch.Tensor, constant: torch.Tensor) -> torch.Tensor:
        return (x * constant).sum()

    g = torch.Generator().manual_seed(8)
    x = _randn(3, generator=g)
    constant = torch.randn(3, dtype=DTYPE, generator=g)
    remat.checkpoint(fn)(x, constant).backward()
    torch.testing.assert_close(x.grad, constant)
    assert constant.grad is None


# --- static leaves --------------------------------------------------------------------------------


class Activation(enum.Enum):
    SIN = "sin"
    TANH = "tanh"


def test_static_leaves_are_passed_through_unchanged():
    seen: list[tuple[Any, ...]] = []

    def fn(
        x: torch.Tensor,
        count: int,
        scale: float,
        name: str,
        activation: Activation,
        flag: bool,
        *,
        dtype: torch.dtype,
        shape: torch.Size,
    ) -> torch.Tensor:
        seen.append((count, scale, name, activation, flag, dtype, shape))
        y = getattr(torch, activation.value)(x.to(dtype)) * scale
        for _ in range(count):
            y = y * 2
        return y.reshape(shape) if flag else y

    g = torch.Generator().manual_seed(9)
    x = _randn(2, 3, generator=g)
    args = (x, 3, 0.5, "label", Activation.TANH, True)
    kwargs = {"dtype": torch.float64, "shape": torch.Size([3, 2])}
    out = _assert_like_unwrapped(fn, args, kwargs)
    assert out.shape == (3, 2)
    assert seen, "fn was never called"
    for count, scale, name, activation, flag, dtype, shape in seen:
        assert type(count) is int and count == 3
        assert type(scale) is float and scale == 0.5
        assert type(name) is str and name == "label"
        assert activation is Activation.TANH
        assert flag is True
        assert dtype is torch.float64
        assert shape == torch.Size([3, 2]) and isinstance(shape, tuple)


def _scaled(x: torch.Tensor, power: Any, activation: Activation = Activation.SIN, name: str = "a") -> torch.Tensor:
    y = getattr(torch, activation.value)(x)
    return (y**power).sum() * len(name)


def test_same_static_values_do_not_retrace():
    f = remat.checkpoint(_scaled)
    g = torch.Generator().manual_seed(10)
    x = _randn(4, generator=g)
    for _ in range(3):
        f(x, 2, Activation.TANH, name="abc")
    assert f.cache_info().traces == 1
    f(_randn(4, generator=g), 2, Activation.TANH, name="abc")  # new values, same signature
    assert f.cache_info().traces == 1


def test_different_static_values_retrace_and_compute_the_new_function():
    f = remat.checkpoint(_scaled)
    g = torch.Generator().manual_seed(11)
    x = _randn(4, generator=g)
    variants: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((x, 2), {}),
        ((x, 3), {}),  # another int
        ((x, 3.0), {}),  # same value, another type: a Python float power traces differently
        ((x, 3, Activation.TANH), {}),  # another enum member
        ((x, 3, Activation.TANH), {"name": "abcd"}),  # another string
    ]
    for expected_traces, (args, kwargs) in enumerate(variants, start=1):
        out = f(*args, **kwargs)
        torch.testing.assert_close(out, _scaled(*args, **kwargs), rtol=1e-10, atol=1e-12)
        (grad,) = torch.autograd.grad(out, x)
        (expected,) = torch.autograd.grad(_scaled(*args, **kwargs), x)
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
        assert f.cache_info().traces == expected_traces, (args, kwargs)
    # Every one of them is still cached: calling them again does not trace.
    for args, kwargs in variants:
        f(*args, **kwargs)
    assert f.cache_info().traces == len(variants)


def test_static_metadata_of_a_custom_node_keys_the_cache():
    def fn(box: Box) -> torch.Tensor:
        return box.value.sin() * len(box.label)

    f = remat.checkpoint(fn)
    g = torch.Generator().manual_seed(12)
    value = _randn(3, generator=g)
    torch.testing.assert_close(f(Box(value, "ab")), fn(Box(value, "ab")))
    torch.testing.assert_close(f(Box(value, "ab")), fn(Box(value, "ab")))
    assert f.cache_info().traces == 1
    torch.testing.assert_close(f(Box(value, "abcde")), fn(Box(value, "abcde")))
    assert f.cache_info().traces == 2


def test_pytree_structure_keys_the_cache():
    def fn(xs: Any) -> torch.Tensor:
        return sum(leaf.sin().sum() for leaf in optree.tree_leaves(xs))  # type: ignore[return-value]

    f = remat.checkpoint(fn)
    g = torch.Generator().manual_seed(13)
    a, b = _randn(3, generator=g), _randn(3, generator=g)
    f((a, b))
    f([a, b])
    f({"a": a, "b": b})
    f(Pair(a, b))
    assert f.cache_info().traces == 4
    f((b, a))
    assert f.cache_info().traces == 4


# --- importing remat ------------------------------------------------------------------------------


@pytest.mark.slow
def test_import_is_quiet_and_pulls_in_no_optional_dependency():
    script = textwrap.dedent(
        """
        import sys
        import remat
        optional = ["hypothesis", "highspy", "scipy", "matplotlib", "pytest", "pandas", "IPython"]
        loaded = sorted(name for name in optional if name in sys.modules)
        if loaded:
            raise SystemExit(f"import remat pulled in {loaded}")
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert result.stderr == ""
