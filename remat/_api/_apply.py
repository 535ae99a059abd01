"""Checkpoint chosen submodules of a model in place: `checkpoint_modules` and `uncheckpoint_modules`.

The module-level counterpart of `remat.checkpoint`, in the spirit of Hugging
Face's `model.gradient_checkpointing_enable()` and torchtitan's `apply_ac`:
pick the blocks of a model by class or by name, and each call of one of them
runs `remat.checkpoint` of its `forward`. See NOTE [checkpointing a module in place].
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from .._core._kv_caches import without_kv_caches
from .._deciding._policy import PolicyLike
from .._memory import _step
from ..policies import warn_of_unmatched_module_patterns
from ._checkpointed import DEFAULT_CACHE_SIZE, Checkpointed, DelegatesToCheckpointed
from ._sharing import SharedTraces

__all__ = [
    "NOTHING",
    "CheckpointedForward",
    "InstalledForward",
    "Which",
    "checkpoint_modules",
    "checkpoint_selected",
    "uncheckpoint_modules",
]

M = TypeVar("M", bound=nn.Module)

Which = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool]

# NOTE [checkpointing a module in place]
# A matched module gets an instance attribute `forward`: a `CheckpointedForward`
# that calls `remat.checkpoint` of the module's original bound `forward`. The
# module keeps its class, parameters, buffers, submodules and names, and
# `nn.Module.__call__` still runs around the checkpointed forward, so:
#
# * the module's own forward hooks and forward pre-hooks run once per call, on
#   real tensors, with the arguments and outputs of eager execution;
# * its full backward hooks (`register_full_backward_hook`,
#   `register_full_backward_pre_hook`) wrap the checkpointed region from the
#   outside and see the same gradients as without checkpointing;
# * the traced function is a bound method, so remat takes its `__self__` as a
#   root: parameters are fetched from their slots on every call (in-place
#   `load_state_dict` and `load_state_dict(assign=True)` are both seen), and the
#   `training` flags of the module and its submodules are part of the cache key
#   (`train()` and `eval()` retrace when they change what runs).
#
# Modules *inside* a matched module run only while it is traced, on fake
# tensors, as with any `remat.checkpoint`: their hooks run at trace time (once
# per input signature), not on every call, and cannot see real values.
#
# The `CheckpointedForward` is also the record of what was there before: the
# instance attribute `forward` it replaced (usually none), which
# `uncheckpoint_modules` puts back. Nothing else is added to the module.
#
# A Hugging Face transformers layer is checkpointed the same way (its class keeps
# transformers' own gradient-checkpointing wrapper, which stays off); the key/value
# cache transformers hands it is taken out of the call first: see NOTE [key/value
# caches in checkpointed layers]. transformers' own gradient checkpointing must be
# off, or the layer would be checkpointed a second time inside remat's trace.


class InstalledForward:
    """An instance attribute `forward` remat installed on a module, which `uncheckpoint_modules` takes
    away: `replaced` is what was there before (`NOTHING` if none)."""

    replaced: Any


class CheckpointedForward(DelegatesToCheckpointed, InstalledForward):
    """The instance attribute `forward` of a module checkpointed by `checkpoint_modules`."""

    def __init__(self, name: str, module: nn.Module, policy: Any, cache_size: int, compile: Any, shared: SharedTraces):
        self.name = name  # in the model passed to `checkpoint_modules`, for messages
        self.module = module
        self.replaced: Any = module.__dict__.get("forward", NOTHING)  # an instance `forward` set before us
        self.checkpointed: Checkpointed[..., Any] = Checkpointed(module.forward, policy, cache_size, compile, shared)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # remat checkpoints the call (without gradients, it runs as written)
            return self.checkpointed(*args, **kwargs)
        _refuse_transformers_checkpointing(self.name, self.module)
        args, kwargs = without_kv_caches(self.name, self.module, args, kwargs)
        probe = _step.recorder
        if probe is None:
            return self.checkpointed(*args, **kwargs)
        call = probe.forward_started(self.name, self.module)  # See NOTE [a step's timeline].
        outputs = self.checkpointed(*args, **kwargs)
        probe.forward_ended(call)
        return outputs

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointedForward:
        # A deep copy of a checkpointed model is checkpointed too, with the copy's own
        # forward and a fresh trace cache (traces refer to the original's tensors).
        new = CheckpointedForward.__new__(CheckpointedForward)
        memo[id(self)] = new
        new.name = self.name
        new.module = copy.deepcopy(self.module, memo)
        new.replaced = copy.deepcopy(self.replaced, memo)
        original = self.checkpointed.__wrapped__
        new.checkpointed = Checkpointed(
            copy.deepcopy(original, memo),
            self.policy,
            self.checkpointed._cache.maxsize,
            self.checkpointed.compile,
            copy.deepcopy(self.checkpointed._shared, memo),
        )
        return new

    def __repr__(self) -> str:
        return f"<checkpointed forward, policy={self.policy!r}>"


NOTHING = object()  # no instance attribute `forward` was there


def checkpoint_modules(
    model: M, which: Which, *, policy: PolicyLike = None, cache_size: int = DEFAULT_CACHE_SIZE, compile: Any = False
) -> M:
    """Checkpoint, in place, every submodule of `model` that `which` selects.

    Calling a selected module then runs `remat.checkpoint` of its `forward`
    with `policy`: its backward keeps only what the policy saves and replays
    the rest. This is how a model is usually checkpointed, block by block
    (Hugging Face's `gradient_checkpointing_enable()`, torchtitan's
    `apply_ac`), without changing the model's code or its parameter names:
    `state_dict()`, `named_parameters()` and `named_modules()` are exactly as
    before, and optimizers, `load_state_dict` and `train()`/`eval()` work as
    usual. `module.forward.cache_info()` and `module.forward.cache_clear()`
    reach a selected module's trace cache.

    A selected module's own forward hooks, forward pre-hooks and full backward
    hooks run on every call with the values they see without checkpointing.
    Hooks on modules *inside* a selected module run only while it is traced
    (once per input signature, on fake tensors), as under `remat.checkpoint`.
    A selected module's submodules are never selected themselves: the
    outermost match wins. `model` itself is a candidate (its name is `""`).

    For a Hugging Face transformers model, `which=transformers.GradientCheckpointingLayer`
    selects every layer, in one line. While gradients are recorded, a
    selected layer handed the model's key/value cache is called without it
    (with a warning: the returned cache stays empty), as transformers' own
    gradient checkpointing does; a cache that already holds tokens for the
    layer is refused. See docs/modules.md.

    Args:
        model: the `nn.Module` to change in place.
        which: a module class or a tuple of them (selects instances, by
            `isinstance`), or a predicate `which(qualified_name, module) ->
            bool` over `model.named_modules()`, for example
            `lambda name, m: name.startswith("blocks.") and name.count(".") == 1`.
        policy: the policy of every selected module, as for `remat.checkpoint`.
        cache_size: how many input signatures each selected module keeps traced.
        compile: compile each selected module's programs, as for
            `remat.checkpoint`.

    Returns:
        `model` itself.

    Raises:
        TypeError: `model` is not an `nn.Module`, or `which` is not a class,
            a tuple of classes or a predicate.
        ValueError: nothing in `model` matches `which`, `model` already has
            checkpointed submodules (call `uncheckpoint_modules` first: a second
            call is an error rather than a silent no-op, so that a different
            `policy` is never ignored), or a selected module has transformers'
            own gradient checkpointing on (it is also raised by a call that
            finds it on, or finds a key/value cache holding tokens of the layer).

    >>> import torch, remat
    >>> from remat._api._apply import checkpoint_modules, uncheckpoint_modules
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    >>> model = checkpoint_modules(model, torch.nn.Linear, policy=remat.policies.dots_saveable)
    >>> model(torch.ones(3, 2)).sum().backward()
    >>> model[0].weight.grad.shape
    torch.Size([2, 2])
    >>> [name for name, _ in model.named_parameters()]
    ['0.weight', '0.bias', '2.weight', '2.bias']
    >>> model is uncheckpoint_modules(model)
    True
    """
    return checkpoint_selected(model, which, lambda name: policy, cache_size, compile, "remat.checkpoint_modules")


def checkpoint_selected(
    model: M, which: Which, policy_of: Callable[[str], Any], cache_size: int, compile: Any, api: str
) -> M:
    """`checkpoint_modules` with a policy per selected module (by its qualified name); errors name `api`."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{api}: expected an nn.Module as `model`, but got {model!r} of type "
            f"{type(model).__qualname__}. To checkpoint a function, use `remat.checkpoint(fn, policy=...)`."
        )
    matches = _matcher(which, api)
    already = [name or "<model>" for name, _ in _checkpointed(model)]
    if already:
        raise ValueError(
            f"{api}: `model` already has checkpointed modules ({', '.join(already)}). "
            "Call `remat.uncheckpoint_modules(model)` first to checkpoint it differently."
        )
    selected = list(_select(model, "", matches, set()))
    for name, module in selected:
        _refuse_transformers_checkpointing(name, module)
    if not selected:
        raise ValueError(
            f"{api}: no module of {type(model).__name__} matches `which`={which!r}. "
            "Check the class (the type of a block, such as `type(model.layers[0])`) or, for a predicate, the "
            f"qualified names it is given, which are those of `model.named_modules()`, e.g. {_some_names(model)}."
        )
    shared = SharedTraces(cache_size)  # see NOTE [sharing traces between identical blocks]
    paths: dict[int, tuple[Any, set[str]]] = {}  # by policy: the module paths of its blocks
    for name, module in selected:
        policy = policy_of(name)
        paths.setdefault(id(policy), (policy, set()))[1].update(path for path, _ in module.named_modules())
        module.__dict__["forward"] = CheckpointedForward(name, module, policy, cache_size, compile, shared)
    for policy, known in paths.values():
        warn_of_unmatched_module_patterns(policy, known, api, "of any checkpointed block")
    return model


def uncheckpoint_modules(model: M) -> M:
    """Undo `checkpoint_modules`: restore the original `forward` of every checkpointed submodule.

    Each module is left exactly as it was before `checkpoint_modules` (with
    whatever instance attribute `forward` it had then, usually none), and its
    traces are dropped. A model with no checkpointed module is returned
    unchanged.

    Args:
        model: the `nn.Module` to change in place.

    Returns:
        `model` itself.

    >>> import torch
    >>> from remat._api._apply import checkpoint_modules, uncheckpoint_modules
    >>> model = checkpoint_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear)
    >>> "forward" in vars(model[0])
    True
    >>> "forward" in vars(uncheckpoint_modules(model)[0])
    False
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"remat.uncheckpoint_modules: expected an nn.Module as `model`, but got {model!r} of type "
            f"{type(model).__qualname__}."
        )
    for _, module in list(model.named_modules()):
        while isinstance(wrapper := module.__dict__.get("forward"), InstalledForward):
            if wrapper.replaced is NOTHING:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = wrapper.replaced
    return model


def _matcher(which: Any, api: str) -> Callable[[str, nn.Module], bool]:
    """The predicate `which` stands for, or a TypeError that says what is accepted."""
    accepted = (
        "a subclass of nn.Module (such as `type(model.layers[0])`), a non-empty tuple of them, or a predicate "
        "`which(qualified_name, module) -> bool`"
    )
    if isinstance(which, type) and issubclass(which, nn.Module):
        return lambda name, module: isinstance(module, which)
    if isinstance(which, tuple) and which and all(isinstance(c, type) and issubclass(c, nn.Module) for c in which):
        return lambda name, module: isinstance(module, which)
    if isinstance(which, nn.Module):
        raise TypeError(
            f"{api}: `which` must be {accepted}, but got the module instance "
            f"{type(which).__name__}. To select this very module, pass `lambda name, m: m is module`."
        )
    if callable(which) and not isinstance(which, type):
        return which  # type: ignore[no-any-return]
    raise TypeError(f"{api}: `which` must be {accepted}, but got {which!r}.")


def _select(
    module: nn.Module, name: str, matches: Callable[[str, nn.Module], bool], seen: set[int]
) -> Iterator[tuple[str, nn.Module]]:
    """The modules `matches` selects, with their names, in `named_modules()` order, not looking inside a
    selected one."""
    if id(module) in seen:
        return
    seen.add(id(module))
    if matches(name, module):
        yield name, module
        return
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _select(child, f"{name}.{child_name}" if name else child_name, matches, seen)


def _refuse_transformers_checkpointing(name: str, module: nn.Module) -> None:
    """A ValueError if transformers' own gradient checkpointing is on in `module` (a transformers layer) or
    in one of its submodules."""
    on = [inner for inner in module.modules() if inner.__dict__.get("gradient_checkpointing") is True]
    if on:
        raise ValueError(
            f"remat.checkpoint_modules: {type(module).__name__} at {name or '<model>'!r} has transformers' own "
            f"gradient checkpointing on (`gradient_checkpointing=True` on {type(on[0]).__name__}), which would "
            "checkpoint it a second time, with torch.utils.checkpoint, inside remat's trace. Turn it off on the model first with "
            "`model.gradient_checkpointing_disable()` (`activation_checkpointing_disable()` in newer "
            "transformers): remat.checkpoint_modules replaces it."
        )


def _checkpointed(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module.__dict__.get("forward"), CheckpointedForward):
            yield name, module


def _some_names(model: nn.Module, limit: int = 4) -> str:
    names = [repr(name) for name, _ in model.named_modules()][:limit]
    return ", ".join(names) + (", ..." if len(names) == limit else "")
