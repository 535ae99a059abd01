"""What tracing captures beyond `fn`'s arguments.

Three things, all gathered by one `TorchFunctionMode` while `fn` runs under
the tracer:

* closed-over tensors (module parameters and buffers, global tensors), which
  must become inputs of the traced graph so that they receive gradients;
* the `nn.Module` path that issued each op call (via global module hooks);
* the `file:line` of the user code that issued it.

See NOTE [lifting closed-over tensors].
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import optree
import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from .. import _quirks
from .._torch import (
    FakeTensor,
    FakeTensorMode,
    any_autocast_enabled,
    embedding_renorms_through,
    flex_attention_as_one_call,
    get_proxy_mode,
    innermost,
    node_behind,
    source_and_scope,
    sync,
    tree_map_only,
)
from ._facts import CallSite, StopGradient, note_site, note_stop_gradient, stop_gradient_of
from ._higher_order import with_closures_lifted

__all__ = [
    "SCATTERS",
    "CallSite",
    "DetachedViews",
    "ModuleRoots",
    "StateSlot",
    "capture_mode",
    "find_module_roots",
    "has_hooks",
    "history_of",
    "redirect_histories",
    "variable_slots",
]

# NOTE [lifting closed-over tensors]
# make_fx turns real tensors that `fn` closes over into `get_attr` constants,
# which receive no gradient. So tracing runs twice: a cheap forward on fake
# tensors first records every real tensor that reaches a torch function (in
# order of first use), then the joint trace runs `fn` again with each of those
# replaced, at the torch-function level, by a graph input of the same
# metadata. A lifted tensor that belongs to an `nn.Module` reachable from `fn`
# is remembered by its slot (owner module and attribute name) and fetched anew
# on every call, so a parameter that was swapped since the trace (FSDP's
# unsharded copies, `load_state_dict(assign=True)`) is what the call uses; so is
# a tensor `fn` reads from a closure cell or a global, which the caller may
# rebind. A tensor reached any other way (an element of a list `fn` closes
# over) is used as it was when traced: pass such tensors as arguments.


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """Where a closed-over tensor lives, so that each call can fetch it anew: a module's
    parameter or buffer, a variable of `fn` (a closure cell or a global), or nowhere known."""

    owner: nn.Module | None
    attribute: str
    tensor: torch.Tensor | None  # only for tensors nothing names: used as traced
    variable: Any = None  # a closure cell, or the globals dict holding `attribute`

    def fetch(self) -> torch.Tensor:
        if self.variable is not None:
            return self._fetch_variable()
        if self.owner is None:
            assert self.tensor is not None
            return self.tensor
        slots = self.owner._parameters if self.attribute in self.owner._parameters else self.owner._buffers
        tensor = slots[self.attribute]
        if tensor is None:
            raise RuntimeError(
                f"remat.checkpoint: `{type(self.owner).__name__}.{self.attribute}` was a tensor when the function "
                "was traced and is None now. Call `.cache_clear()` on the checkpointed function after changing "
                "the structure of a module."
            )
        return tensor

    def _fetch_variable(self) -> torch.Tensor:
        if isinstance(self.variable, dict):
            value = self.variable.get(self.attribute)
        else:
            try:
                value = self.variable.cell_contents
            except ValueError:  # the variable was deleted
                value = None
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(
                f"remat.checkpoint: the variable `{self.attribute}` that the function reads was a tensor when it was "
                f"traced and is {type(value).__name__} now. Call `.cache_clear()` on the checkpointed function, or "
                "pass the value as an argument."
            )
        return value


def _variables(fn: Callable[..., Any]) -> Iterator[tuple[str, Any, Any]]:
    """`(name, value, holder)` of each closure variable and global `fn` names; the holder
    (a cell, or the globals dict) is where the value can be read again."""
    code = getattr(fn, "__code__", None)  # a bound method passes its function's through
    if code is None:
        return
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False):
        try:
            yield name, cell.cell_contents, cell
        except ValueError:  # an empty cell
            continue
    module_globals = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in module_globals:
            yield name, module_globals[name], module_globals


def variable_slots(fn: Callable[..., Any]) -> dict[int, StateSlot]:
    """The slot of every tensor `fn` reads directly from a closure cell or a global, by tensor id:
    rebinding such a variable is seen by the next call, as in eager."""
    slots: dict[int, StateSlot] = {}
    for name, value, holder in _variables(fn):
        if isinstance(value, torch.Tensor):
            slots.setdefault(id(value), StateSlot(None, name, None, holder))
    return slots


@dataclasses.dataclass(frozen=True)
class ModuleRoots:
    """The `nn.Module`s reachable from `fn`, with the qualified path of every submodule."""

    paths: dict[int, str]  # id(module) -> qualified path
    slots: dict[int, StateSlot]  # id(tensor) -> slot of a parameter or buffer
    modules: tuple[nn.Module, ...]
    own_path: str | None = None  # "" when `fn` is a method of a root module: its calls are the root's

    def slot_of(
        self, tensor: torch.Tensor, reached: Iterable[nn.Module] = (), variables: dict[int, StateSlot] | None = None
    ) -> StateSlot:
        """The slot of `tensor` in a root's module tree, or in a module whose forward ran, or in
        one of `fn`'s `variables`, or itself."""
        slot = self.slots.get(id(tensor)) or state_slots(reached).get(id(tensor))
        if slot is None:
            slot = (variables or {}).get(id(tensor), StateSlot(None, "", tensor))
        return slot


def state_slots(modules: Iterable[nn.Module]) -> dict[int, StateSlot]:
    """The slot of every parameter and buffer the given modules own directly, by tensor id."""
    slots: dict[int, StateSlot] = {}
    for module in modules:
        for table in (module._parameters, module._buffers):
            for attribute, tensor in table.items():
                if tensor is not None:
                    slots.setdefault(id(tensor), StateSlot(module, attribute, None))
    return slots


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def has_hooks(module: nn.Module) -> bool:
    """Whether `module` has forward or backward hooks of its own."""
    return any(getattr(module, table, None) for table in _HOOK_TABLES)


def find_module_roots(fn: Callable[..., Any]) -> ModuleRoots:
    """Find the modules `fn` can reach: itself, its `self`, closure cells and globals it names."""
    roots: list[tuple[str, nn.Module]] = []
    if isinstance(fn, nn.Module):
        roots.append(("", fn))
    owner = getattr(fn, "__self__", None)
    is_method = isinstance(owner, nn.Module)
    if isinstance(owner, nn.Module):
        roots.append(("", owner))
    roots += [(name, value) for name, value, _ in _variables(fn) if isinstance(value, nn.Module)]

    paths: dict[int, str] = {}
    modules: list[nn.Module] = []
    for prefix, root in roots:
        for name, module in root.named_modules(remove_duplicate=False):
            if id(module) not in paths:
                paths[id(module)] = ".".join(part for part in (prefix, name) if part)
                modules.append(module)
    # A module's forward called directly (not through `__call__`) runs no module hook for its own calls.
    return ModuleRoots(paths, state_slots(modules), tuple(modules), "" if is_method else None)


class DataPointerRead(Exception):
    """`fn` read a tensor's memory address (`data_ptr()`), which a trace of tensor ops cannot hold."""


class _CaptureMode(TorchFunctionMode):
    def __init__(
        self,
        roots: ModuleRoots,
        substitutes: dict[int, torch.Tensor] | None,
        fakeify: Callable[[torch.Tensor], torch.Tensor] | None,
        detached_views: DetachedViews | None,
        fake_mode: FakeTensorMode | None,
    ):
        super().__init__()
        self.detached_views = detached_views
        self.fake_mode = fake_mode  # discovery's: its fakes are `fn`'s own, any other tensor is closed over
        self.roots = roots
        self.substitutes = substitutes
        self.fakeify = fakeify
        self.closed_over: dict[int, torch.Tensor] = {}
        self.fakes: dict[int, torch.Tensor] = {}
        self.module_stack: list[nn.Module] = []
        self.detached: set[Any] = set()  # graph nodes `fn` detached (see `stops_gradient`)
        self.autocast_seen = False  # whether autocast was on as any torch function ran

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.data_ptr:  # (a fake tensor has no address: it warns, or raises, and goes on)
            raise DataPointerRead
        args, kwargs = with_closures_lifted(func, args, kwargs or {})
        return self._call(func, args, kwargs)

    def renorm(self, weight: torch.Tensor, input: torch.Tensor, max_norm: float, norm_type: float) -> None:
        """An embedding's renormalization of its weight, as the calls it makes: NOTE [functions that hide an
        update]."""
        detached = self._call(torch.Tensor.detach, (weight,), {})
        self._call(torch.embedding_renorm_, (detached, input, max_norm, norm_type), {})

    def _call(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run the torch function `func` (its closures lifted), noting what it adds to the graph."""
        if self.substitutes is None:
            # Discovery: record real tensors and run on fake copies of them, so
            # that nothing real is read or written (buffers updated in place).
            args, kwargs = tree_map_only(torch.Tensor, self.record_closed_over, (args, kwargs))
            return func(*args, **kwargs)
        if self.substitutes:
            args, kwargs = tree_map_only(torch.Tensor, self.substitute, (args, kwargs))
        self.autocast_seen = self.autocast_seen or any_autocast_enabled()
        proxy_mode = get_proxy_mode()
        if proxy_mode is None:
            return func(*args, **kwargs)
        graph = proxy_mode.tracer.graph
        nodes_before = len(graph.nodes)
        # What autograd must not see through when the graph is differentiated
        # again: see NOTE [differentiating the forward again].
        stops_gradient: StopGradient | None = (
            "detach" if func in _DETACHES else None if torch.is_grad_enabled() else _no_grad_kind(func)
        )
        kept = _histories_to_keep(func, args, stops_gradient, self.detached_views)
        result = _keeping_histories(graph, func, args, kwargs, kept) if kept else func(*args, **kwargs)
        new_nodes = len(graph.nodes) - nodes_before
        if new_nodes > 0:
            site = CallSite(self._module_path(), *source_and_scope(1))
            for node, _ in zip(reversed(graph.nodes), range(new_nodes), strict=False):
                note_site(node, site)
                # (`_keeping_histories` may have said None: a view passing a history on.) A detach is its
                # alias alone: the views functionalization replays to bring the tensor up to date first
                # are the tensor's own, with their derivatives.
                if stops_gradient and (stops_gradient != "detach" or node.target in _ALIASES):
                    note_stop_gradient(node, stops_gradient, unless_noted=True)
                if stops_gradient == "detach" and node.target in _ALIASES:
                    self.detached.add(node.args[0])
            if self.detached_views is not None:
                self.detached_views.called((args, kwargs), result, detach=stops_gradient == "detach")
        return result

    def record_closed_over(self, tensor: torch.Tensor) -> torch.Tensor:
        """Note `tensor` if it is real (closed over), and return the fake tensor standing for it."""
        inner = innermost(tensor)  # fake (not a caller's fake), or a transform of `fn`'s own wrapping it
        if isinstance(inner, FakeTensor) and inner.fake_mode is self.fake_mode:
            return tensor
        assert self.fakeify is not None
        if id(tensor) not in self.fakes:
            self.closed_over[id(tensor)] = tensor
            self.fakes[id(tensor)] = self.fakeify(tensor)
        return self.fakes[id(tensor)]

    def substitute(self, tensor: torch.Tensor) -> torch.Tensor:
        """The graph input standing for `tensor` if it is closed over, else `tensor`."""
        assert self.substitutes is not None
        return self.substitutes.get(id(tensor), tensor)

    def _module_path(self) -> str | None:
        if not self.module_stack:
            return self.roots.own_path
        return self.roots.paths.get(id(self.module_stack[-1]))


# NOTE [updates under no_grad keep their tensors' histories]
# In eager, an in-place update under `torch.no_grad()` of a tensor that
# requires grad is invisible to autograd: the tensor keeps its history, and a
# derivative taken later flows through its new value as if it were the old one.
# An update through a detached alias (`x.detach().mul_(s)`, in any grad mode)
# is invisible to both modes of autograd: `x` keeps its history and its tangent.
# Functionalization records the update as new values (the op's result, and its
# base's scattered from it); differentiated again as they are (a second
# derivative, through the pure forward or the backward program; a tangent), they
# would stop the derivative at the update. So after such an update, the node of
# each tensor that keeps its history (the updated tensor itself under no_grad,
# the detached tensor through an alias; and its base where it is a view) notes
# the node of the value it replaced (`remat_history_of`, with whether forward
# mode sees the update: under no_grad it does), and the programs that autograd
# differentiates give the new value the old one's history
# (`_eager_copies.with_history_of`). An update through a view of the base is
# rebuilt from several nodes (`x.t()[1:].mul_(s)`: a scatter into `x.t()` taken
# again, then the transpose of the scatter), any of which a policy may keep:
# each scatter notes the view it writes into as its history, and the views
# functionalization takes again, of the old base or of such a scatter, pass the
# history on as views do (they do not stop the gradient).


@dataclasses.dataclass(frozen=True)
class History:
    """What the new value of a tensor updated where autograd does not see keeps: the history of the
    node it replaced, and the tangent too where forward mode does not see the update either."""

    of: fx.Node
    seen_by_forward_mode: bool


def history_of(node: fx.Node, *, forward_mode: bool = False) -> fx.Node | None:
    """The node whose history the value of `node` keeps (in forward mode: and whose tangent), if any.
    See NOTE [updates under no_grad keep their tensors' histories]."""
    history: History | None = node.meta.get("remat_history_of")
    if history is None or (forward_mode and history.seen_by_forward_mode):
        return None
    return history.of


def redirect_histories(graph: fx.Graph, replaced: dict[fx.Node, fx.Node]) -> None:
    """Point the histories noted of nodes in `replaced` to their replacements."""
    for node in graph.nodes:
        history: History | None = node.meta.get("remat_history_of")
        if history is not None and history.of in replaced:
            node.meta["remat_history_of"] = History(replaced[history.of], history.seen_by_forward_mode)


def _histories_to_keep(
    func: Any, args: Any, stops_gradient: str | None, detached_views: DetachedViews | None
) -> list[tuple[torch.Tensor, bool]]:
    """The tensors an in-place call of `func` updates without autograd seeing it, each with whether
    forward mode sees the update."""
    if not args or not isinstance(args[0], torch.Tensor) or not _is_in_place(func):
        return []
    updated = args[0]
    kept = [(t, False) for t in ([] if detached_views is None else detached_views.sources_of(updated))]
    if stops_gradient == "no_grad_update":
        kept += [(t, True) for t in _with_bases([updated]) if t.requires_grad and all(t is not k for k, _ in kept)]
    return kept


def _with_bases(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for tensor in tensors:
        for t in (tensor, tensor._base):
            if isinstance(t, torch.Tensor) and all(t is not f for f in found):
                found.append(t)
    return found


def _keeping_histories(
    graph: fx.Graph, func: Any, args: Any, kwargs: dict[str, Any], kept: list[tuple[torch.Tensor, bool]]
) -> Any:
    """`func(*args, **kwargs)`, an in-place update autograd does not see of the `kept` tensors,
    noting the histories it leaves."""
    before = []
    for tensor, _ in kept:
        sync(tensor)
        before.append(node_behind(tensor))
    nodes_before = len(graph.nodes)
    result = func(*args, **kwargs)
    seen_by_forward_mode = all(seen for _, seen in kept)
    for (tensor, seen), old in zip(kept, before, strict=True):
        sync(tensor)
        new = node_behind(tensor)
        if new is not None and old is not None and new is not old:
            new.meta["remat_history_of"] = History(old, seen)
    _pass_histories_through_rebuilt_views(list(graph.nodes)[nodes_before:], seen_by_forward_mode)
    return result


# The functional forms of writes through views: each returns its first argument with the write done.
SCATTERS = frozenset(
    {
        torch.ops.aten.slice_scatter.default,
        torch.ops.aten.select_scatter.default,
        torch.ops.aten.diagonal_scatter.default,
        torch.ops.aten.as_strided_scatter.default,
    }
)


def _pass_histories_through_rebuilt_views(new_nodes: list[fx.Node], seen_by_forward_mode: bool) -> None:
    """Note the histories in an update's rebuilding of its base: see NOTE [updates under no_grad keep
    their tensors' histories]."""
    made = set(new_nodes)
    with_history: set[fx.Node] = set()
    for node in new_nodes:
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if first is None:
            continue
        passes_on = first not in made or first in with_history
        if getattr(node.target, "is_view", False) and passes_on:
            note_stop_gradient(node, None)
            with_history.add(node)
        elif node.target in SCATTERS and passes_on:
            node.meta.setdefault("remat_history_of", History(first, seen_by_forward_mode))
            with_history.add(node)


@dataclasses.dataclass(frozen=True)
class _Tracked:
    tensor: weakref.ref[torch.Tensor]
    depths: frozenset[int]  # where its detaches lie in its chain of views (0: its own node; k: k views above)
    sources: tuple[weakref.ref[torch.Tensor], ...]  # the tensors detached, which share its memory


class DetachedViews:
    """The tensors `fn` detached and the views it took of them, each with where its detaches lie in its
    chain of views, to mark the detaches functionalization replays (see NOTE [detaches functionalization
    replays]), and with the tensors it was detached from, which an update through it leaves their histories
    (see NOTE [updates under no_grad keep their tensors' histories])."""

    def __init__(self) -> None:
        self._tracked: dict[int, _Tracked] = {}

    def called(self, inputs: Any, result: Any, *, detach: bool) -> None:
        """After a call of `fn` that recorded nodes: track what it detached or viewed, then mark."""
        if not detach and not self._tracked:  # nothing detached yet: the common case, at every call
            return
        outputs = [t for t in optree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        if detach:
            detached = optree.tree_leaves(inputs)[0]
            # (`detach_` detaches the tensor itself, whose history is gone; a view's base outlives it)
            sources = (
                [] if any(o is detached for o in outputs) else [*_with_bases([detached]), *self.sources_of(detached)]
            )
            for output in outputs:
                self._track(output, frozenset({0}), sources)
        else:
            for tensor in optree.tree_leaves(inputs):
                found = self._tracked_as(tensor)
                below = node_behind(tensor) if found is not None else None
                for output in outputs if below is not None else ():
                    steps = _views_between(node_behind(output), below)
                    if steps is not None:
                        self._track(output, frozenset(d + steps for d in found.depths), self.sources_of(tensor))  # type: ignore[union-attr]
        self.mark_replayed()

    def sources_of(self, tensor: Any) -> list[torch.Tensor]:
        """The tensors `tensor` is a detached alias of (a view of), still alive."""
        found = self._tracked_as(tensor)
        sources = () if found is None else found.sources
        return [t for t in (ref() for ref in sources) if t is not None]

    def mark_replayed(self) -> None:
        """Mark as `fn`'s detaches the detach nodes in the chains behind the tracked tensors' current values
        (functionalization's replays among them)."""
        for key, tracked in list(self._tracked.items()):
            tensor = tracked.tensor()
            if tensor is None:
                del self._tracked[key]
                continue
            for depth in tracked.depths:
                node = _views_below(node_behind(tensor), depth)
                # (An update through the tensor rebuilds its chain, under the update's grad mode, with views
                # that pass a history on: not this one, which is `fn`'s detach.)
                if node is not None and node.target in _ALIASES and stop_gradient_of(node) != "detach":
                    note_stop_gradient(node, "detach")

    def _tracked_as(self, tensor: Any) -> _Tracked | None:
        found = self._tracked.get(id(tensor))
        return found if found is not None and found.tensor() is tensor else None

    def _track(self, tensor: torch.Tensor, depths: frozenset[int], sources: list[torch.Tensor]) -> None:
        known = self._tracked_as(tensor)
        if known is not None:
            depths |= known.depths
            sources = [*sources, *(t for t in (ref() for ref in known.sources) if t is not None)]
        unique = [t for i, t in enumerate(sources) if all(t is not u for u in sources[:i])]
        self._tracked[id(tensor)] = _Tracked(weakref.ref(tensor), depths, tuple(weakref.ref(t) for t in unique))


def _is_view_node(node: Any) -> bool:
    return node.op == "call_function" and (node.target is operator.getitem or getattr(node.target, "is_view", False))


def _views_below(node: Any, steps: int) -> Any:
    """The node `steps` views below `node` (following each view's first argument), or None."""
    for _ in range(steps):
        if node is None or not _is_view_node(node):
            return None
        node = node.args[0]
    return node


def _views_between(node: Any, below: Any, most: int = 64) -> int | None:
    """How many views lead down from `node` to `below` (None if none do, within `most`)."""
    for steps in range(most):
        if node is below:
            return steps
        if node is None or not _is_view_node(node):
            return None
        node = node.args[0]
    return None


# NOTE [detaches functionalization replays]
# A view of a tensor updated in place is recorded again from the tensor's new
# value when it is next read: functionalization replays the view's chain (a
# detach included) during whichever call reads it, even after `fn` returned
# (in backward). The replayed detach is a new node, which `fn`'s call did not
# record; unmarked, it would look like one of autograd's own detaches, which
# the pure forward sees through, and forward mode and double backward would
# differentiate through what `fn` detached. So the tensors `fn` detached, and
# the views taken of them, are followed, and after every call (and after the
# trace) the detaches in the chains behind their current values are marked.


# NOTE [functions that hide an update]
# A torch function this mode sees as one call may update a tensor inside, where
# the mode does not see it: `F.embedding` and `F.embedding_bag` with `max_norm=`
# renormalize rows of the weight in place through `weight.detach()`, which
# autograd does not see (the weight keeps its history). Seen as part of one
# call, the update is an op of the graph with the weight's derivative running
# through it, which a second derivative then asks of `embedding_renorm` (torch
# has none). While `fn` is traced, torch's helper for that update calls
# `_CaptureMode.renorm` instead (`embedding_renorms_through`), which makes the
# detach and the update as calls this mode sees: the detach is noted, and the
# update through it keeps the weight's history (NOTE [updates under no_grad
# keep their tensors' histories]).
_DETACHES = (torch.Tensor.detach, torch.detach, torch.Tensor.detach_)
_ALIASES = _quirks.DETACH_TRACES_AS_ALIAS.table  # what a detach traces as


def _no_grad_kind(func: Any) -> StopGradient:
    """How a call under no_grad stops gradients: an in-place method ("no_grad_update") leaves the
    tensor it updates its history, as in eager; any other call ("no_grad") makes a value without one."""
    return "no_grad_update" if _is_in_place(func) else "no_grad"


def _is_in_place(func: Any) -> bool:
    """Whether the torch function `func` updates its first argument (`mul_`, `__imul__`, `__setitem__`)."""
    name = getattr(func, "__name__", "")
    return (
        (name.endswith("_") and not name.startswith("_"))
        or (name.startswith("__i") and name.endswith("__"))
        or name == "__setitem__"
    )


@contextmanager
def capture_mode(
    roots: ModuleRoots,
    substitutes: dict[int, torch.Tensor] | None,
    fakeify: Callable[[torch.Tensor], torch.Tensor] | None = None,
    detached_views: DetachedViews | None = None,
    fake_mode: FakeTensorMode | None = None,
) -> Iterator[_CaptureMode]:
    """Run `fn` under a mode that records closed-over tensors, running on fake
    copies made by `fakeify` in `fake_mode` (when `substitutes` is None), or that replaces them
    by `substitutes` and labels every new graph node with its `CallSite`."""
    mode = _CaptureMode(roots, substitutes, fakeify, detached_views, fake_mode)

    tracing_thread = threading.get_ident()  # module hooks are global: ignore other threads' modules

    def enter(module: nn.Module, args: Any) -> None:
        if threading.get_ident() != tracing_thread:
            return
        mode.module_stack.append(module)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != tracing_thread:
            return
        if mode.module_stack and mode.module_stack[-1] is module:
            mode.module_stack.pop()

    pre_hook = nn.modules.module.register_module_forward_pre_hook(enter)
    post_hook = nn.modules.module.register_module_forward_hook(leave, always_call=True)
    try:
        renorms = embedding_renorms_through(mode.renorm) if substitutes is not None else nullcontext()
        with mode, flex_attention_as_one_call(), renorms:
            yield mode
    finally:
        pre_hook.remove()
        post_hook.remove()
