"""torch.func (functorch): whether a transform runs and which, the wrappers its levels put around tensors,
vmap's batching and the ops it runs example by example, and forward-mode AD, under vmap too.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._C._functorch import TransformType
from torch._functorch.autograd_function import CtxCustomSave, CtxWithSavedTensors
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters, temporarily_clear_interpreter_stack
from torch._functorch.vmap import unwrap_batched

__all__ = [
    "CtxCustomSave",
    "CtxWithSavedTensors",
    "TransformType",
    "batched_at",
    "batched_level",
    "drawn_per_example_but_unbatched",
    "empty_in_memory_layout",
    "forward_ad_level",
    "forward_grad_enabled",
    "functorch_active",
    "functorch_interpreters",
    "functorch_level",
    "grad_transform_active",
    "import_jvp_decompositions",
    "innermost",
    "inplace_requires_grad_allowed",
    "is_functorch_wrapped",
    "make_dual",
    "memory_layout",
    "runs_per_example_under_vmap",
    "tangent_of",
    "temporarily_clear_interpreter_stack",
    "unbatched_at",
    "under_torch_func",
    "unwrap_batched",
    "unwrap_dead_wrappers",
    "unwrap_level",
    "vmap_levels",
]


# --- torch.func (functorch) -----------------------------------------------------------------------------


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, ...) is running."""
    return bool(torch._C._are_functorch_transforms_active())


def grad_transform_active() -> bool:
    """Whether a torch.func reverse-mode transform (`grad`, `vjp`, `jacrev`, `hessian`) is running: its
    backward runs in grad mode (`create_graph=True`)."""
    return functorch_active() and any(i.key() == TransformType.Grad for i in functorch_interpreters())


def functorch_interpreters() -> list[Any]:
    return list(retrieve_all_functorch_interpreters())


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(tensor))


def unwrap_level(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor one torch.func level below a wrapped one."""
    return torch._C._functorch.get_unwrapped(tensor)


def innermost(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor under every torch.func wrapper."""
    while is_functorch_wrapped(tensor):
        tensor = unwrap_level(tensor)
    return tensor


def under_torch_func(tensor: torch.Tensor) -> bool:
    """Whether a program meets `tensor` wrapped by a torch.func transform. Never inside a graph Dynamo
    compiles (`compile=`), which cannot trace the question, and in which no tensor is wrapped."""
    return not torch.compiler.is_compiling() and is_functorch_wrapped(tensor)


def memory_layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Where each `vmap` level keeps its batch dimension, and the shape and strides of the tensor under
    every torch.func wrapper: what decides its layout in memory."""
    batch_dims = []
    while under_torch_func(tensor):
        if torch._C._functorch.is_batchedtensor(tensor):
            batch_dims.append(torch._C._functorch.maybe_get_bdim(tensor))
        tensor = unwrap_level(tensor)
    return tuple(batch_dims), tuple(tensor.shape), tensor.stride()


def empty_in_memory_layout(tensor: torch.Tensor) -> torch.Tensor | None:
    """An uninitialized tensor with the strides of `tensor`, batched as it is under each `vmap` (every
    batch dimension where `tensor` keeps it in memory) and at the gradient levels it is at, so that an
    in-place op may write into it there; None for a tensor under other torch.func wrappers."""
    functorch = torch._C._functorch
    if not is_functorch_wrapped(tensor):
        with torch._C._DisableFuncTorch():  # a plain tensor: under a gradient level, a factory's is wrapped
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    empty = empty_in_memory_layout(unwrap_level(tensor))
    if empty is None:
        return None
    level = functorch.maybe_get_level(tensor)
    if functorch.is_batchedtensor(tensor):
        return functorch._add_batch_dim(empty, functorch.maybe_get_bdim(tensor), level)
    if functorch.is_gradtrackingtensor(tensor):
        return functorch._wrap_for_grad(empty, level)
    return None


def batched_level(ctx: Any) -> int:
    """The vmap level of the ctx `setup_context` gets under vmap (a `CtxCustomSave`)."""
    return ctx._pt_current_level  # type: ignore[no-any-return]


@contextlib.contextmanager
def inplace_requires_grad_allowed() -> Iterator[None]:
    """Let `requires_grad_()` be called under torch.func transforms, which forbid it by default."""
    allowed = torch._C._functorch.get_inplace_requires_grad_allowed()
    torch._C._functorch.set_inplace_requires_grad_allowed(True)
    try:
        yield
    finally:
        torch._C._functorch.set_inplace_requires_grad_allowed(allowed)


@functools.cache
def runs_per_example_under_vmap(name: str) -> bool:
    """Whether vmap runs the aten op `name` example by example (its boxed fallback): a composite op with
    neither a batching rule nor a decomposition or randomness rule registered for vmap. See NOTE [ops vmap
    runs example by example] in `remat/_eager/_noting_modes.py`."""
    qualified = f"aten::{name}"
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        return has_kernel(qualified, "CompositeImplicitAutograd") and not any(
            has_kernel(qualified, key)
            for key in ("FuncTorchBatched", "FuncTorchBatchedDecomposition", "FuncTorchVmapMode")
        )
    except RuntimeError:  # no such op
        return False


# --- forward-mode AD -------------------------------------------------------------------------------------


@contextlib.contextmanager
def forward_grad_enabled() -> Iterator[None]:
    """Compute forward-mode tangents (at the current `forward_ad` level) where autograd turned that off:
    inside a custom Function's jvp rule."""
    enabled = torch._C._is_fwd_grad_enabled()
    torch._C._set_fwd_grad_enabled(True)
    try:
        yield
    finally:
        torch._C._set_fwd_grad_enabled(enabled)


# NOTE [forward-mode tangents under vmap]
# torch.autograd.forward_ad keeps tangents on the tensors under vmap's batch
# wrappers (vmap's rules run the ops on those), and `make_dual`/`unpack_dual`
# have no batching rule. Under vmap they are applied to the tensors under every
# batch wrapper, and the result is batched again as its primal is.
def tangent_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The forward-mode tangent of `tensor` at the current `forward_ad` level, under vmap too."""
    wrapper = _batch_wrapper(tensor)
    if wrapper is None:
        return torch.autograd.forward_ad.unpack_dual(tensor).tangent
    tangent = tangent_of(unwrap_level(tensor))
    return None if tangent is None else torch._C._functorch._add_batch_dim(tangent, wrapper[1], wrapper[0])


def make_dual(primal: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    """`primal` with `tangent` at the current `forward_ad` level, under vmap too."""
    if _batch_wrapper(primal) is None and _batch_wrapper(tangent) is None:
        return torch.autograd.forward_ad.make_dual(primal, tangent)
    # Both batched alike (the same op on the same kinds of batching), so their wrappers match.
    primal, tangent = primal + torch.zeros_like(tangent), tangent + torch.zeros_like(primal)
    wrappers = []
    while (wrapper := _batch_wrapper(primal)) is not None:
        if _batch_wrapper(tangent) != wrapper:
            raise AssertionError(f"remat: a primal and its tangent batched differently under vmap: {wrapper}")
        wrappers.append(wrapper)
        primal, tangent = unwrap_level(primal), unwrap_level(tangent)
    dual = torch.autograd.forward_ad.make_dual(primal, tangent)
    for level, bdim in reversed(wrappers):
        dual = torch._C._functorch._add_batch_dim(dual, bdim, level)
    return dual


def unwrap_dead_wrappers(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors`, each unwrapped from the torch.func wrappers of levels that have ended (as
    `Function.apply` unwraps its arguments)."""
    return list(torch._functorch.utils.unwrap_dead_wrappers(tuple(tensors)))


def drawn_per_example_but_unbatched(tensor: torch.Tensor) -> bool:
    """Whether the innermost `vmap` running draws different random numbers for each example
    (`randomness="different"`) while `tensor` is not batched by it: there an in-place random fill of
    `tensor` raises, where an out-of-place draw gives the whole batch its numbers. Never inside a graph
    Dynamo compiles (`compile=`), which runs under no transform."""
    if torch.compiler.is_compiling():
        return False
    for interpreter in reversed(functorch_interpreters()):
        if interpreter.key() == TransformType.Vmap:
            return interpreter.randomness() == "different" and interpreter.level() not in vmap_levels(tensor)
    return False


def unbatched_at(tensor: torch.Tensor, level: int) -> tuple[torch.Tensor, int | None]:
    """`tensor` without its batching at the vmap `level`, and the dimension that batched it (None where
    `level` does not batch it)."""
    if torch._C._functorch.is_batchedtensor(tensor) and torch._C._functorch.maybe_get_level(tensor) == level:
        return torch._C._functorch._unwrap_batched(tensor, level)  # type: ignore[no-any-return]
    return tensor, None


def functorch_level(tensor: torch.Tensor) -> int:
    """The torch.func level of the outermost wrapper of `tensor` (a wrapped one)."""
    return int(torch._C._functorch.maybe_get_level(tensor))


def batched_at(tensor: torch.Tensor, dim: int, level: int) -> torch.Tensor:
    """`tensor` batched at the vmap `level` along `dim` (the converse of `unbatched_at`)."""
    return torch._C._functorch._add_batch_dim(tensor, dim, level)  # type: ignore[no-any-return]


def vmap_levels(tensor: torch.Tensor) -> frozenset[int]:
    """The levels of the `vmap`s `tensor` is batched by, through every torch.func wrapper around it."""
    levels = set()
    while is_functorch_wrapped(tensor):
        if torch._C._functorch.is_batchedtensor(tensor):
            levels.add(torch._C._functorch.maybe_get_level(tensor))
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return frozenset(levels)


def _batch_wrapper(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The (level, batch dimension) of the vmap wrapper around `tensor`, or None if it has none."""
    if not torch._C._functorch.is_batchedtensor(tensor):
        return None
    return torch._C._functorch.maybe_get_level(tensor), torch._C._functorch.maybe_get_bdim(tensor)


def import_jvp_decompositions() -> None:
    """Import the decompositions forward-mode AD loads on first use, ahead of time: they call
    `torch.jit.script`, which torch itself deprecates (a DeprecationWarning before 2.15, a
    FutureWarning since), an error where warnings are errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        import torch._decomp.decompositions_for_jvp  # noqa: F401


def forward_ad_level() -> int:
    """The level of `torch.autograd.forward_ad` in use, or -1 (torch.func.jvp also enters one)."""
    return torch.autograd.forward_ad._current_level
