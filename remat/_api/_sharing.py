"""One trace for many blocks: structurally identical modules checkpointed together share their traces.

See NOTE [sharing traces between identical blocks].
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import threading
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .._core._cache import LRUCache, tensor_key
from .._eager._capture import ModuleRoots, StateSlot, has_hooks

__all__ = ["AttributeReads", "SharedTraces", "rebase", "recording_attribute_reads", "same_value", "structure_of"]

# NOTE [sharing traces between identical blocks]
# A model's blocks are usually instances of one class with parameters of the same
# shapes: tracing each of them on its own makes start-up grow with depth. So the
# blocks `checkpoint_modules` selects share a `SharedTraces`: the first block of a
# structure traces, and every other block at the same input signature takes that
# trace (its graph, decisions and programs) with its own parameters as inputs.
#
# A trace depends on more than what a cache key sees, so a block takes another's
# trace only when nothing the trace depended on differs between them:
#
# * the structure (`structure_of`): the traced function's code, then, for every
#   module reachable from it, in order, its path, class, the metadata of each
#   parameter and buffer, which of them are one tensor under two names, and
#   whether it has hooks;
# * the plain attributes the trace read (`recording_attribute_reads`): while the
#   first block traces, every attribute read of one of its modules is recorded
#   with the value it had in the module's `__dict__` (or its absence), by patching
#   `__getattribute__` on the modules' classes for the duration. A block whose
#   recorded attributes hold other values (Gemma's sliding and full attention
#   layers, told apart by `self.sliding_window`) traces on its own, and both traces
#   are kept. Values compare by what the trace could read of them (`same_value`):
#   numbers, strings and containers of them by value; a module of the block by
#   its position in it (the new block's `self.attn` stands for the traced block's);
#   a module that holds no tensors (a function made a module per layer, as
#   transformers' kernel wrappers in `self._kernel_funcs`) by its class and
#   attributes; a Python function by its code, globals, defaults and what its
#   closure holds, and a bound method by its function and object (torchtitan's
#   `parallelize` gives each module a `forward` closure over itself, its own
#   `_sharding_config` and objects all modules share); any other object of a
#   Python class by its class and state (`__dict__` and slots), recursively,
#   unless it has none (a sentinel); the rest by identity (tensors, objects of
#   classes defined in C). So equal per-module configurations match; code that
#   told two equal objects apart by identity (`is`, `id`) would be the one way to
#   trace otherwise, and objects without state, the usual markers, compare so.
#   An attribute the trace did not read, such as a Hugging Face layer's
#   `layer_idx` when there is no key/value cache, may differ.
# * the closed-over tensors' metadata and the `training` flags the trace's guard
#   checks, fetched from the new block.
#
# Everything else a trace can read is the same for every block: the globals and
# closure of the one function they run, and objects reached through identical
# attributes. Each block keeps its own cache, so its `cache_info()` and report
# are its own; a shared trace counts in `cache_info().shared`, not `traces`.


def structure_of(fn: Callable[..., Any], roots: ModuleRoots) -> Hashable | None:
    """What must be equal for two blocks to share a trace, before the attributes the trace reads:
    None if `fn` is not a module or a module's method (nothing to share with)."""
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, nn.Module):
        return None
    code = type(fn) if fn is owner else getattr(fn, "__func__", None)
    if code is None:
        return None
    tensors: dict[int, int] = {}  # id -> first position, so that tied weights must be tied alike
    modules = []
    for module in roots.modules:
        states = tuple(
            (name, None if t is None else (type(t), tensor_key(t), tensors.setdefault(id(t), len(tensors))))
            for table in (module._parameters, module._buffers)
            for name, t in table.items()
        )
        hooked = has_hooks(module) and (module is not owner or fn is owner)  # a method runs inside its hooks
        modules.append((roots.paths[id(module)], type(module), states, hooked))
    return code, roots.own_path, tuple(modules)


class _Absent(enum.Enum):
    """An attribute that was not in the module's `__dict__` (a parameter, a submodule, a method)."""

    ABSENT = enum.auto()

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent.ABSENT
_WHOLE_DICT = "__dict__"
# nn.Module's own bookkeeping, read by every call: what it holds is in `structure_of`.
_MODULE_TABLES = frozenset(nn.Module().__dict__) - {"training"}
# nn.Module's own methods read `self.__dict__` to find parameters, buffers and submodules.
_MODULE_CODE = frozenset(f.__code__ for f in vars(nn.Module).values() if isinstance(f, types.FunctionType))


@dataclasses.dataclass(frozen=True)
class AttributeReads:
    """The attributes a trace read of each module (by position in `ModuleRoots.modules`),
    with their values in the module's `__dict__` then."""

    reads: tuple[tuple[int, str, Any], ...]

    def hold_for(self, modules: Sequence[nn.Module], recorded: Sequence[nn.Module]) -> bool:
        """Whether every attribute read has the same value in `modules` as it had in `recorded` (the
        modules of the block that traced, at the same positions)."""
        pairs = {id(m): r for m, r in zip(modules, recorded, strict=True)}
        for index, name, value in self.reads:
            attributes = modules[index].__dict__
            if name == _WHOLE_DICT:
                if not _same_attributes(attributes, value, pairs):
                    return False
            elif not same_value(attributes.get(name, ABSENT), value, pairs):
                return False
        return True


def _plain_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    # A checkpointed block's instance `forward` is remat's wrapper, one per block; a read of
    # `self.forward` itself is recorded by name.
    return {name: value for name, value in attributes.items() if name not in _MODULE_TABLES and name != "forward"}


def _same_attributes(attributes: dict[str, Any], recorded: dict[str, Any], pairs: dict[int, nn.Module]) -> bool:
    plain = _plain_attributes(attributes)
    return plain.keys() == recorded.keys() and all(same_value(plain[k], v, pairs) for k, v in recorded.items())


_COMPARED_BY_VALUE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)


def same_value(a: Any, b: Any, pairs: dict[int, nn.Module] | None = None) -> bool:
    """Whether a trace that read `b` holds for `a`: numbers, strings and enums (and tuples, lists,
    sets, dicts and `functools.partial`s of them) by value; a module of the block (`pairs` maps the new
    block's modules, by id, to the traced block's at the same position) by position; other modules that
    hold no tensors by their class and attributes; Python functions by their code, globals, defaults,
    attributes and what their closures hold; bound methods by function and object; other objects of
    Python classes that have state by their class and state; anything else by identity."""
    try:
        return _same_value(a, b, frozenset(), pairs or {})
    except RecursionError:  # objects nested deeper than Python recurses: not shown the same
        return False


def _same_value(a: Any, b: Any, comparing: frozenset[tuple[int, int]], pairs: dict[int, nn.Module]) -> bool:
    if isinstance(a, nn.Module) and id(a) in pairs:
        return pairs[id(a)] is b
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (*_COMPARED_BY_VALUE, enum.Enum)):
        return bool(a == b) or (a != a and b != b)  # NaN reads as NaN
    if isinstance(a, (set, frozenset)):
        return all(isinstance(x, _COMPARED_BY_VALUE) for x in a) and a == b
    if (id(a), id(b)) in comparing:  # a cycle of containers or objects: equal so far
        return True
    comparing |= {(id(a), id(b))}

    def same(x: Any, y: Any) -> bool:
        return _same_value(x, y, comparing, pairs)

    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, functools.partial):  # an activation made per layer: `partial(gelu, approximate="tanh")`
        return a.func is b.func and same(a.args, b.args) and same(a.keywords, b.keywords)
    if isinstance(a, nn.Module):  # a function made a module per layer: transformers' kernel wrappers
        return not _holds_tensors(a) and not _holds_tensors(b) and same(vars(a), vars(b))
    if isinstance(a, types.FunctionType):  # a forward made per module (torchtitan's `parallelize`)
        return (
            a.__code__ is b.__code__
            and a.__globals__ is b.__globals__
            and same((a.__defaults__, a.__kwdefaults__, a.__dict__), (b.__defaults__, b.__kwdefaults__, b.__dict__))
            and same(_cells(a), _cells(b))
        )
    if isinstance(a, types.MethodType):
        function = getattr(a, "__func__")  # noqa: B009 (the torch-door test reserves `.__func__`)
        return same(function, getattr(b, "__func__")) and same(a.__self__, b.__self__)  # noqa: B009
    state_a, state_b = _state(a), _state(b)  # a configuration object per module, say
    return bool(state_a) and same(state_a, state_b)


_EMPTY_CELL = object()


def _cells(fn: types.FunctionType) -> tuple[Any, ...]:
    cells = fn.__closure__ or ()
    contents = []
    for cell in cells:
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            contents.append(_EMPTY_CELL)
    return tuple(contents)


def _state(value: Any) -> dict[str, Any] | None:
    """The attributes of an object of a Python class (its `__dict__` and slots); None for objects of
    classes defined in C, whose state Python does not see, and for objects without state (sentinels,
    which compare by identity)."""
    cls = type(value)
    if not _is_python_class(cls):
        return None
    state = dict(getattr(value, "__dict__", {}))
    for klass in cls.__mro__:
        for name in klass.__dict__.get("__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                state[name] = getattr(value, name)
    return state or None


def _is_python_class(cls: type) -> bool:
    return all(getattr(klass, "__flags__", 0) & _HEAPTYPE for klass in cls.__mro__[:-1])


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a `class` statement, not one defined in C


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


class _Recording(threading.local):
    reads: dict[int, dict[str, Any]] | None = None  # id(module) -> name -> value, on the tracing thread


_recording = _Recording()
_PATCHING = threading.RLock()


@contextmanager
def recording_attribute_reads(modules: Sequence[nn.Module]) -> Iterator[Callable[[], AttributeReads | None]]:
    """Record the attributes of `modules` read while the block runs; yields a function that
    returns them afterwards (None if they could not be recorded: another recording on this thread)."""
    if _recording.reads is not None:
        yield lambda: None
        return
    reads: dict[int, dict[str, Any]] = {id(module): {} for module in modules}
    with _PATCHING, _reads_recorded({type(module) for module in modules}):
        _recording.reads = reads
        try:
            yield lambda: AttributeReads(
                tuple((i, name, value) for i, m in enumerate(modules) for name, value in reads[id(m)].items())
            )
        finally:
            _recording.reads = None


@contextmanager
def _reads_recorded(classes: set[type]) -> Iterator[None]:
    """Patch `__getattribute__` of `classes` to note reads of the modules being recorded."""
    originals: dict[type, Any] = {cls: cls.__getattribute__ for cls in classes}  # all before patching any
    own = {cls: cls.__dict__.get("__getattribute__") for cls in classes}
    try:
        for cls, original in originals.items():
            setattr(cls, "__getattribute__", _recorder(original))  # noqa: B010
        yield
    finally:
        for cls, previous in own.items():
            if previous is None:
                del cls.__getattribute__
            else:
                setattr(cls, "__getattribute__", previous)  # noqa: B010


def _recorder(original: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    def __getattribute__(self: Any, name: str) -> Any:
        reads = _recording.reads
        noted = None if reads is None else reads.get(id(self))
        if noted is not None and name not in noted and name not in _MODULE_TABLES:
            attributes = object.__getattribute__(self, "__dict__")
            if name == _WHOLE_DICT:
                if _caller_code() not in _MODULE_CODE:  # not nn.Module finding a parameter
                    noted[name] = dict(_plain_attributes(attributes))
            elif not name.startswith("__"):
                noted[name] = attributes.get(name, ABSENT)
        return original(self, name)

    return __getattribute__


def _caller_code() -> types.CodeType | None:
    """The code that called the `__getattribute__` calling this."""
    frame = inspect.currentframe()
    caller = frame and frame.f_back and frame.f_back.f_back
    return caller.f_code if caller else None


@dataclasses.dataclass(frozen=True)
class _Shared:
    """A trace one block made, for others to take."""

    entry: Any  # the tracing block's `_Entry`
    modules: tuple[nn.Module, ...]  # the tracing block's `ModuleRoots.modules`
    reads: AttributeReads
    policy: Any  # the tracing block's (its entry's programs are those of its decisions)


_VARIANTS = 8  # traces kept per structure and signature (Gemma's sliding and full layers make two)


class SharedTraces:
    """The traces of the blocks `checkpoint_modules` selected in one call, for identical blocks to share.

    A deep copy is a new, empty one (a copied model's blocks trace their own tensors)."""

    def __init__(self, maxsize: int):
        self._traces: LRUCache[list[_Shared]] = LRUCache(maxsize)
        # Programs by (trace, decisions, forward mode), for blocks that share a trace under policies of
        # their own (`remat.fit` plans each block); bounded like the traces.
        self._executables: LRUCache[Any] = LRUCache(maxsize * _VARIANTS)

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedTraces:
        return SharedTraces(self._traces.maxsize)

    def clear(self) -> None:
        self._traces.clear()
        self._executables.clear()

    def executable(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The programs at `key`, built once."""
        found = self._executables.get(key)
        if found is None:
            found = build()
            self._executables.put(key, found)
        return found

    def publish(self, key: Hashable, entry: Any, roots: ModuleRoots, reads: AttributeReads, policy: Any) -> None:
        shared = _Shared(entry, roots.modules, reads, policy)
        self._traces.put(key, [shared, *(self._traces.get(key) or [])][:_VARIANTS])

    def find(self, key: Hashable, modules: Sequence[nn.Module], skip: Callable[[Any], bool]) -> Iterator[_Shared]:
        """The traces made at `key` whose recorded reads hold for `modules`, but for those `skip` refuses."""
        for shared in self._traces.get(key) or []:
            if (
                len(shared.modules) == len(modules)
                and not skip(shared.entry)
                and shared.reads.hold_for(modules, shared.modules)
            ):
                yield shared


def rebase(slot: StateSlot, moved: dict[int, nn.Module]) -> StateSlot:
    """`slot` in the block whose modules `moved` maps the tracing block's to (by id)."""
    if slot.owner is None or id(slot.owner) not in moved:
        return slot  # a variable of the shared function, or state outside the block: the same for both
    return dataclasses.replace(slot, owner=moved[id(slot.owner)])
