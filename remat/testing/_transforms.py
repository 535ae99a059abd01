"""The torch.func transforms `remat.testing.assert_checkpoint_equivalent` compares a function under
(`TRANSFORMS`), and the copies of arguments each comparison runs on.

Its interface (`__all__`), for the strategies, one run's record and the equivalence check: the
transforms by name and the sets of them that take stacked arguments (`BATCHED`) or run under
`torch.func.jvp` (`UNDER_FUNC_JVP`); `transformed`, a function under one of them; and the helpers over
argument and output trees every comparison shares (`fresh`, `detached`, `to_device`, `tensor_leaves`,
`random_like`, `is_float`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from .._core import _objects
from .._core._pytree import NAMESPACE
from .._torch import import_jvp_decompositions

__all__ = [
    "BATCHED",
    "DIFFERENTIATED_TANGENTS",
    "TRANSFORMS",
    "UNDER_FUNC_JVP",
    "detached",
    "fresh",
    "is_float",
    "random_like",
    "tensor_leaves",
    "to_device",
    "transformed",
]

TRANSFORMS = (
    "grad",
    "vmap",
    "jvp",
    "vjp",
    "jvp_of_vmap",
    "vmap_of_jvp",
    "forward_ad",
    "grad_of_jvp",
    "grad_of_jvp_of_vmap",
    "grad_of_forward_ad",
    "grad_of_grad",
    "double_backward",
)
BATCHED = frozenset({"vmap", "jvp_of_vmap", "vmap_of_jvp", "grad_of_jvp_of_vmap"})  # of stacked arguments
UNDER_FUNC_JVP = frozenset(
    {"jvp", "jvp_of_vmap", "vmap_of_jvp", "grad_of_jvp", "grad_of_jvp_of_vmap"}
)  # torch.func.jvp
_FORWARD_MODE = UNDER_FUNC_JVP | {"forward_ad", "grad_of_forward_ad"}


def _through_objects(function: Callable[[Any], Any], tree: Any) -> Any:
    """`function` of every leaf of `tree`, the leaves inside the objects a checkpointed function is handed
    included (made again around the new leaves): see NOTE [objects handed to a checkpointed function]."""
    mapped = optree.tree_map(function, _objects.opened(tree, NAMESPACE), none_is_leaf=False, namespace=NAMESPACE)
    return _objects.closed(mapped, NAMESPACE)


def to_device(tree: Any, device: str | torch.device | None) -> Any:
    """`tree` with each tensor leaf detached and moved to `device` (its `requires_grad` kept); the leaves
    as they are where `device` is None."""

    def move(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and device is not None:
            return leaf.detach().to(device).requires_grad_(leaf.requires_grad)
        return leaf

    return _through_objects(move, tree)


def fresh(tree: Any) -> Any:
    """`tree` with each tensor leaf a detached clone (its `requires_grad` kept): a copy a run may change."""

    def copy(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        return leaf

    return _through_objects(copy, tree)


def _detach(leaf: Any) -> Any:
    return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf


def detached(tree: Any) -> Any:
    """`tree` with each tensor leaf detached (sharing its memory); the leaves inside objects untouched."""
    return optree.tree_map(_detach, tree, none_is_leaf=False)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of `tree`, in `optree` order, those inside the objects a checkpointed function is
    handed included."""
    leaves = optree.tree_leaves(_objects.opened(tree, NAMESPACE), none_is_leaf=False, namespace=NAMESPACE)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def random_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Standard normal values of `tensor`'s shape, dtype and device, drawn in float64 from `generator`."""
    return torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.dtype).to(tensor.device)


def is_float(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is floating point or complex: whether it has gradients and tangents to compare."""
    return tensor.is_floating_point() or tensor.is_complex()


def _scalar(fn: Callable[..., Any], seed: int) -> Callable[..., torch.Tensor]:
    """A scalar reduction of `fn`: the sum of each float output times a fixed random weight."""

    def scalar(*args: Any, **kwargs: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed + 1)
        outputs = [o for o in tensor_leaves(fn(*args, **kwargs)) if is_float(o)]
        return sum(((o * random_like(o, generator)).sum() for o in outputs), torch.zeros(()))

    return scalar


# The transforms that differentiate forward-mode tangents: where eager's tangent formulas are not
# differentiated exactly, the checker compares with finite-difference tangents (`finite_differences`).
DIFFERENTIATED_TANGENTS = frozenset({"grad_of_jvp", "grad_of_jvp_of_vmap", "grad_of_forward_ad"})


def transformed(
    name: str, fn: Callable[..., Any], seed: int, *, finite_differences: bool = False
) -> Callable[..., Any]:
    """`fn` under the torch.func transform `name`, as a function of the same arguments (or stacked
    positional ones); keyword arguments are passed through, neither differentiated nor batched. With
    `finite_differences`, tangents are central differences of `fn` (float64), not forward mode's."""
    if finite_differences:
        jvp, forward_ad = _finite_difference_jvp, _finite_difference_forward_ad
    else:
        jvp, forward_ad = _jvp, _forward_ad
    if name == "grad":
        return torch.func.grad(_scalar(fn, seed))
    if name == "grad_of_grad":  # reverse mode over reverse mode, as `hessian` by `jacrev(jacrev(fn))`
        # Compared by value: a second derivative's layout is that of how its paths meet, not of the program.
        # Where the first backward both replays a call from an input and reads a value kept from it, the
        # input's second derivative arrives by two paths, summed (into a fresh tensor) at the input; eager's
        # meets before the call's derivative, whose view of the sum (a `stack`'s `select`) it returns.
        return _valued(torch.func.grad(_scalar(torch.func.grad(_scalar(fn, seed)), seed + 4)))
    if name == "double_backward":
        return _double_backward(fn, seed)
    if name == "vmap":
        return torch.func.vmap(fn, randomness="different")
    if name in _FORWARD_MODE:
        # The first forward-mode AD call in a process imports torch's jvp decompositions, which
        # warn (an error where warnings are errors): import them here, quietly.
        import_jvp_decompositions()
    if name == "jvp_of_vmap":
        return jvp(torch.func.vmap(fn, randomness="different"), seed)
    # The derivatives of forward mode's results are compared by value, as tangents are: see `_by_value`.
    if name == "grad_of_jvp":  # reverse mode over forward mode
        return _valued(torch.func.grad(_scalar(jvp(fn, seed), seed)))
    if name == "grad_of_jvp_of_vmap":  # and over a batch, as `jacrev(jacfwd(fn))`
        return _valued(torch.func.grad(_scalar(jvp(torch.func.vmap(fn, randomness="different"), seed), seed)))
    if name == "grad_of_forward_ad":
        return _valued(_backward_of(forward_ad(fn, seed), seed))
    if name == "vmap_of_jvp":

        def jvp_per_example(*primals_and_tangents: Any, **kwargs: Any) -> Any:
            half = len(primals_and_tangents) // 2
            primals, tangents = primals_and_tangents[:half], primals_and_tangents[half:]
            return torch.func.jvp(_bound(fn, kwargs), primals, tangents)

        def vmap_of_jvp(*primals: Any, **kwargs: Any) -> Any:
            tangents = _tangents(primals, seed)
            outputs, output_tangents = torch.func.vmap(
                functools.partial(jvp_per_example, **kwargs), randomness="different"
            )(*primals, *tangents)
            return outputs, _by_value(output_tangents)

        return vmap_of_jvp
    if name == "jvp":
        return jvp(fn, seed)
    if name == "forward_ad":
        return forward_ad(fn, seed)

    def vjp(*primals: Any, **kwargs: Any) -> Any:
        outputs, pullback = torch.func.vjp(_bound(fn, kwargs), *primals)[:2]
        generator = torch.Generator().manual_seed(seed + 3)
        cotangents = optree.tree_map(lambda t: random_like(t, generator) if is_float(t) else None, outputs)
        return outputs, pullback(cotangents)

    return vjp


def _valued(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: _by_value(fn(*args, **kwargs))


def _backward_of(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    """The gradient, by `torch.autograd.grad`, of a fixed random weighted sum of `fn`'s outputs with respect
    to its first argument (zeros where they do not depend on it)."""

    def backward(first: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
        first = first.detach().requires_grad_()
        with torch.enable_grad():
            loss = _scalar(fn, seed)(first, *rest, **kwargs)
            if not loss.requires_grad:
                return torch.zeros_like(first)
            (grad,) = torch.autograd.grad(loss, first, allow_unused=True)
        return torch.zeros_like(first) if grad is None else grad

    return backward


def _double_backward(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    """A gradient penalty's two passes under plain autograd: the gradient, by `torch.autograd.grad` with
    `create_graph=True`, of a fixed random weighted sum of `fn`'s outputs with respect to its first
    argument, then the gradient of a weighted sum of that gradient. The first is compared as an output
    (layout, and whether it requires grad, included); the second by value, None where unused."""

    def double_backward(first: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        first = first.detach().requires_grad_()
        with torch.enable_grad():
            loss = _scalar(fn, seed)(first, *rest, **kwargs)
            if not loss.requires_grad:
                return None
            (grad,) = torch.autograd.grad(loss, first, allow_unused=True, create_graph=True)
            if grad is None or not grad.requires_grad:
                return grad, None
            (second,) = torch.autograd.grad(_scalar(lambda g: g, seed + 4)(grad), first, allow_unused=True)
        return grad, None if second is None else _by_value(second)

    return double_backward


def _bound(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """`fn` with the keyword arguments a transform passes through, neither differentiated nor batched."""
    return functools.partial(fn, **kwargs) if kwargs else fn


def _tangents(primals: Sequence[Any], seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed + 2)
    return tuple(random_like(t, generator) for t in primals)


def _by_value(tangents: Any) -> Any:
    """Tangents (and their derivatives) to compare by value alone. Their layouts are those of torch's
    derivative formulas (a zero tangent of an op without a derivative may be a broadcast, under vmap
    unbatched), not of the program."""
    return optree.tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, tangents, none_is_leaf=False)


def _jvp(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    def jvp(*primals: Any, **kwargs: Any) -> Any:
        outputs, tangents = torch.func.jvp(_bound(fn, kwargs), primals, _tangents(primals, seed))[:2]
        return outputs, _by_value(tangents)

    return jvp


class _DetachesAsAtTheStart(TorchFunctionMode):
    """Each `detach` gives the value it gave in the first evaluation (which records them), as forward mode
    treats a detached value: a constant. Finite differences would otherwise see through it."""

    def __init__(self, recorded: list[torch.Tensor]):
        super().__init__()
        self.recorded, self.replaying, self.next = recorded, bool(recorded), 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in _DETACHES and isinstance(result, torch.Tensor):
            if not self.replaying:
                self.recorded.append(result)
            elif self.next < len(self.recorded) and self.recorded[self.next].shape == result.shape:
                result, self.next = self.recorded[self.next], self.next + 1
        return result


_DETACHES = (torch.Tensor.detach, torch.detach)
_STEP = 1e-6  # of central differences in float64: truncation and round-off both near 1e-10 relative


def _central_difference(fn: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
    """(outputs, d outputs along `tangents`) by central differences, every evaluation drawing the same
    random numbers (the default generators forked and seeded alike)."""

    recorded_detaches: list[torch.Tensor] = []

    def evaluate(step: float) -> Any:
        with torch.random.fork_rng(devices=[]), _DetachesAsAtTheStart(recorded_detaches):
            torch.manual_seed(0)
            moved = [
                p + step * t if isinstance(p, torch.Tensor) and is_float(p) else p
                for p, t in zip(primals, tangents, strict=True)
            ]
            return fn(*moved)

    outputs, ahead, behind = evaluate(0.0), evaluate(_STEP), evaluate(-_STEP)
    difference = optree.tree_map(
        lambda a, b: (a - b) / (2 * _STEP) if isinstance(a, torch.Tensor) and is_float(a) else a,
        ahead,
        behind,
        none_is_leaf=False,
    )
    return outputs, difference


def _finite_difference_jvp(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    def jvp(*primals: Any, **kwargs: Any) -> Any:
        outputs, tangents = _central_difference(_bound(fn, kwargs), primals, _tangents(primals, seed))
        return outputs, _by_value(tangents)

    return jvp


def _finite_difference_forward_ad(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    def forward_ad(*primals: Any, **kwargs: Any) -> Any:
        outputs, tangents = _central_difference(_bound(fn, kwargs), primals, _tangents(primals, seed))
        return optree.tree_map(
            lambda o, t: (o, _by_value(t)) if isinstance(o, torch.Tensor) else o, outputs, tangents, none_is_leaf=False
        )

    return forward_ad


def _forward_ad(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
    """`fn` on dual tensors of `torch.autograd.forward_ad`: each output becomes (primal, tangent), a
    tangent autograd did not attach given as zeros (eager attaches zeros where an op has a derivative of
    zero, a random draw from a dual mean, where remat attaches none)."""

    def forward_ad(*primals: Any, **kwargs: Any) -> Any:
        with torch.autograd.forward_ad.dual_level():
            duals = [
                torch.autograd.forward_ad.make_dual(p, t) if isinstance(p, torch.Tensor) and is_float(p) else p
                for p, t in zip(primals, _tangents(primals, seed), strict=True)
            ]
            outputs = fn(*duals, **kwargs)

            def unpacked(leaf: Any) -> Any:
                if not isinstance(leaf, torch.Tensor):
                    return leaf
                primal, tangent = torch.autograd.forward_ad.unpack_dual(leaf)
                return primal, _by_value(torch.zeros_like(primal) if tangent is None else tangent)

            return optree.tree_map(unpacked, outputs, none_is_leaf=False)

    return forward_ad
