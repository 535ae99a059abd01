"""Objects handed to a checkpointed function, opened into what they hold.

See NOTE [objects handed to a checkpointed function].
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import optree
import torch

__all__ = [
    "OpenedFunction",
    "OpenedObject",
    "close",
    "closed",
    "is_openable",
    "is_opened",
    "open_leaf",
    "opened",
    "register",
    "unchanged",
]

# NOTE [objects handed to a checkpointed function]
# Layers are handed more than tensors: FlexAttention's `BlockMask` (index
# tensors, sizes and a `mask_mod` function whose closure may hold tensors, as
# document masking's does), dataclasses, a model's mask and output objects. One
# mechanism covers them, whatever their class: an object with a plain
# `__dict__` is opened into its attributes, and a Python function into its
# closure's contents and its defaults, recursively. The tensors they hold are
# inputs of the trace like any other argument's, and the rest (the class, the
# attribute names, the function's code and globals, other values) is part of
# the signature's static key. So a `BlockMask` built anew each step with the
# same structure (a new `mask_mod` closure over new document ids, say) takes
# the same trace with its own tensors, and a mask of another structure traces
# again. While tracing, `fn` receives objects rebuilt around the traced tensors
# (made without calling `__init__`, their attributes set directly, functions
# rebuilt from their code with new closure cells).
#
# The objects are read, never written: what `fn` writes into one while tracing
# would happen once, to the rebuilt object, and never to the caller's. So after
# tracing, each rebuilt object is opened again and must hold what it was built
# with (the same attributes, each the same value); otherwise remat refuses,
# naming the argument. Objects whose state does not live in `__dict__` (slots,
# C++ state, the items of a dict or list subclass) are not opened: they are
# refused as before, as non-static arguments.


@dataclasses.dataclass(frozen=True)
class _ByIdentity:
    """A value in a static key that compares by identity (a function's globals)."""

    value: Any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


class OpenedObject:
    """An object opened into its attributes (a pytree node in remat's namespace)."""

    __slots__ = ("cls", "names", "values")

    def __init__(self, cls: type, names: tuple[str, ...], values: tuple[Any, ...]):
        self.cls, self.names, self.values = cls, names, values


class OpenedFunction:
    """A Python function opened into its closure's contents, its defaults and its attributes (a pytree
    node); its code, globals (by identity), qualified name and module are its static part."""

    __slots__ = ("attributes", "cells", "code", "defaults", "globals", "kwdefaults", "names")

    def __init__(self, code: types.CodeType, globals: _ByIdentity, names: tuple[str, str], values: tuple[Any, ...]):
        self.code, self.globals, self.names = code, globals, names
        self.cells, self.defaults, self.kwdefaults, self.attributes = values


def register(namespace: str) -> None:
    """Make opened objects and functions pytree nodes in optree's `namespace`."""
    optree.register_pytree_node(OpenedObject, _flatten_object, _unflatten_object, namespace=namespace)  # type: ignore[arg-type]
    optree.register_pytree_node(OpenedFunction, _flatten_function, _unflatten_function, namespace=namespace)  # type: ignore[arg-type]


def _flatten_object(o: OpenedObject) -> tuple[tuple[Any, ...], tuple[type, tuple[str, ...]], tuple[str, ...]]:
    return o.values, (o.cls, o.names), o.names


def _unflatten_object(data: tuple[type, tuple[str, ...]], values: Any) -> OpenedObject:
    return OpenedObject(data[0], data[1], tuple(values))


_FUNCTION_PARTS = ("closure", "defaults", "kwdefaults", "attributes")


def _flatten_function(f: OpenedFunction) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
    return (f.cells, f.defaults, f.kwdefaults, f.attributes), (f.code, f.globals, f.names), _FUNCTION_PARTS


def _unflatten_function(data: tuple[types.CodeType, _ByIdentity, tuple[str, str]], values: Any) -> OpenedFunction:
    code, globals, names = data
    return OpenedFunction(code, globals, names, tuple(values))


def is_openable(value: Any) -> bool:
    """Whether `value` is an object or function that `open_leaf` opens."""
    if isinstance(value, types.FunctionType):
        return value.__closure__ is None or all(_filled(cell) for cell in value.__closure__)
    cls = type(value)
    return (
        cls.__module__ != "builtins"
        and not isinstance(value, (torch.Tensor, torch.nn.Module, torch.Generator, type, types.ModuleType))
        and cls.__new__ is object.__new__  # made again without arguments
        and not any(vars(klass).get("__slots__") for klass in cls.__mro__[:-1])  # (the ABCs' are empty)
        and not isinstance(value, (dict, list, tuple, set, frozenset))  # items outside `__dict__`
        and isinstance(getattr(value, "__dict__", None), dict)
    )


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def open_leaf(value: Any, namespace: str, _opening: frozenset[int] = frozenset()) -> Any:
    """`value` opened (an `OpenedObject` or `OpenedFunction`, its contents opened too) if it is openable,
    else `value` itself (so also an object that holds itself, which is left as it is)."""
    if not is_openable(value) or id(value) in _opening:
        return value
    opening = _opening | {id(value)}

    def inner(tree: Any) -> Any:
        return optree.tree_map(
            lambda leaf: open_leaf(leaf, namespace, opening), tree, none_is_leaf=False, namespace=namespace
        )

    if isinstance(value, types.FunctionType):
        cells = tuple(cell.cell_contents for cell in value.__closure__ or ())
        values = inner((cells, value.__defaults__, value.__kwdefaults__, dict(vars(value))))
        names = (value.__qualname__, value.__module__)
        return OpenedFunction(value.__code__, _ByIdentity(value.__globals__), names, values)
    names = tuple(vars(value))
    return OpenedObject(type(value), names, tuple(inner(vars(value)[name]) for name in names))


def is_opened(value: Any) -> bool:
    """Whether `value` is an opened object or function."""
    return isinstance(value, (OpenedObject, OpenedFunction))


def close(opened: OpenedObject | OpenedFunction, namespace: str) -> Any:
    """The object or function `opened` made again (what it holds made again too), with what it holds."""

    def make(node: Any) -> Any:
        if isinstance(node, OpenedObject):
            obj: Any = object.__new__(node.cls)
            vars(obj).update(zip(node.names, (closed(v, namespace) for v in node.values), strict=True))
            return obj
        if isinstance(node, OpenedFunction):
            parts = (node.cells, node.defaults, node.kwdefaults, node.attributes)
            cells, defaults, kwdefaults, attributes = closed(parts, namespace)
            function = types.FunctionType(
                node.code, node.globals.value, node.code.co_name, defaults, tuple(types.CellType(c) for c in cells)
            )
            function.__kwdefaults__ = kwdefaults
            function.__qualname__, function.__module__ = node.names
            vars(function).update(attributes)
            return function
        return node

    return make(opened)


def unchanged(made: Any, opened: OpenedObject | OpenedFunction, namespace: str) -> bool:
    """Whether the object or function `made` from `opened` still holds what it was made from: the same
    attributes (closure contents, defaults), each the same value, all the way down."""
    leaves, spec = optree.tree_flatten(open_leaf(made, namespace), none_is_leaf=False, namespace=namespace)
    before: list[Any]
    before, before_spec = optree.tree_flatten(opened, none_is_leaf=False, namespace=namespace)  # type: ignore[arg-type]
    return spec == before_spec and all(a is b for a, b in zip(leaves, before, strict=True))


def opened(tree: Any, namespace: str) -> Any:
    """`tree` with every openable leaf opened."""
    return optree.tree_map(lambda leaf: open_leaf(leaf, namespace), tree, none_is_leaf=False, namespace=namespace)


def closed(tree: Any, namespace: str) -> Any:
    """`tree` with every opened object and function made again."""

    def make(node: Any) -> Any:
        return close(node, namespace) if is_opened(node) else node

    return optree.tree_map(make, tree, is_leaf=is_opened, none_is_leaf=False, namespace=namespace)
