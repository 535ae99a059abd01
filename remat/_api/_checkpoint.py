"""`remat.checkpoint`: a function becomes a `Checkpointed`, an `nn.Module` a `CheckpointedModule`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import torch

from .._deciding._policy import PolicyLike
from ._checkpointed import DEFAULT_CACHE_SIZE, BindsAsMethod, Checkpointed
from ._module import CheckpointedModule

__all__ = ["checkpoint"]

P = ParamSpec("P")
T = TypeVar("T")


@overload
def checkpoint(
    fn: Callable[P, T], /, *, policy: PolicyLike = None, cache_size: int = ..., compile: Any = ...
) -> Checkpointed[P, T]: ...
@overload
def checkpoint(
    fn: None = None, /, *, policy: PolicyLike = None, cache_size: int = ..., compile: Any = ...
) -> Callable[[Callable[P, T]], Checkpointed[P, T]]: ...
def checkpoint(
    fn: Callable[P, T] | None = None,
    /,
    *,
    policy: PolicyLike = None,
    cache_size: int = DEFAULT_CACHE_SIZE,
    compile: Any = False,
) -> Any:
    """Wrap `fn` so that its backward keeps only what `policy` saves.

    `fn` is traced (once per input signature) into a list of op calls; the
    policy answers SAVE or RECOMPUTE for each. The returned function computes
    the same outputs and gradients as `fn`, but between forward and backward it
    keeps only the outputs of saved calls that backward reads; discarded calls
    that backward needs are replayed in backward, each just before first use.

    Args:
        fn: a function of tensors (and pytrees of them, and static values), or
            an `nn.Module`. Tensors it closes over, such as module parameters,
            receive gradients as usual.
        policy: `None` (recompute everything), a callable
            `policy(call) -> remat.Decision | bool`, or a planner with
            `plan(trace)`; see `remat.policies`.
        cache_size: how many signatures to keep traced (least recently used
            are dropped).
        compile: compile the forward and backward programs with
            `torch.compile`: `True` (inductor), a backend (`"aot_eager"`, or
            a callable), or a dict of `torch.compile` arguments (`backend`,
            `mode`, `options`, `fullgraph`, `dynamic`). What is kept between
            forward and backward stays exactly what `policy` saves. Under a
            `torch.func` transform, and when backward is differentiated again,
            the programs run uncompiled. Inside a model that is itself
            compiled, the model's compilation takes over (see
            docs/compile.md).

    Returns:
        A function with the same signature as `fn` (for an `nn.Module`, a
        `CheckpointedModule` sharing its parameters under the same names).
        Usable as a decorator, bare or with options.

    >>> import torch, remat
    >>> f = remat.checkpoint(lambda x: x.sin().sin().sum())
    >>> x = torch.ones(3, requires_grad=True)
    >>> f(x).backward()
    >>> torch.allclose(x.grad, torch.cos(torch.sin(x)) * torch.cos(x))
    True
    """
    if fn is None:
        return functools.partial(checkpoint, policy=policy, cache_size=cache_size, compile=compile)
    if not callable(fn):
        raise TypeError(
            f"remat.checkpoint: expected a function or nn.Module to wrap, but got {fn!r} of type "
            f"{type(fn).__qualname__}. Use `remat.checkpoint(fn, policy=...)` or `@remat.checkpoint(policy=...)`."
        )
    if isinstance(fn, torch.nn.Module):
        return CheckpointedModule(fn, policy, cache_size, compile)
    if inspect.isfunction(fn):  # possibly a method, bound when read from an instance
        return BindsAsMethod(fn, policy, cache_size, compile)
    return Checkpointed(fn, policy, cache_size, compile)
