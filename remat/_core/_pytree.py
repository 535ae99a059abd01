"""Arguments and outputs as optree pytrees: tensor leaves are dynamic, the rest static."""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any, NamedTuple

import optree
import torch

from . import _objects
from ._kv_caches import is_kv_cache

__all__ = ["NAMESPACE", "FlatArgs", "Rebuilt", "describe_path", "flatten_args", "flatten_outputs"]

NAMESPACE = "remat"
"""optree namespace remat flattens with: register custom containers here or globally."""
_objects.register(NAMESPACE)

_STATIC_TYPES = (
    types.BuiltinFunctionType,  # `torch.tanh` handed as an activation: by identity
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    type(...),
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


_TENSOR_OR_STATIC = (torch.Tensor, *_STATIC_TYPES)


class StaticKey(NamedTuple):
    """The part of a signature key that the arguments' structure and non-tensor leaves make."""

    spec: optree.PyTreeSpec
    tensor_positions: tuple[int, ...]  # which leaves are tensors
    statics: tuple[tuple[type, Any], ...]  # (type, value) of each other leaf


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """Arguments rebuilt around traced tensors, with the objects among them made again (see NOTE [objects
    handed to a checkpointed function]): each with its path and what it was made from."""

    arguments: tuple[tuple[Any, ...], dict[str, Any]]
    objects: tuple[tuple[tuple[Any, ...], Any, Any], ...]

    def check_unwritten(self, api: str) -> None:
        """Raise if `fn` wrote into an object it was handed."""
        for path, obj, opened in self.objects:
            if not _objects.unchanged(obj, opened, NAMESPACE):
                raise TypeError(
                    f"{api}: the function writes into the argument at {describe_path(path)}, a "
                    f"{type(obj).__qualname__}: an object handed to a checkpointed function is traced as a read-only "
                    "input (its tensors are inputs), so a write into it would happen once, while tracing, to a copy, "
                    "and never to your object. Return what the function computes instead of storing it in the "
                    "object, or keep the object out of the checkpointed function's arguments."
                )


@dataclasses.dataclass(frozen=True)
class FlatArgs:
    """`(args, kwargs)` split into tensor leaves and a static remainder."""

    spec: optree.PyTreeSpec
    tensors: tuple[torch.Tensor, ...]
    tensor_positions: tuple[int, ...]
    statics: tuple[Any, ...]  # the leaf at every non-tensor position, in order
    has_objects: bool = False  # whether objects were opened: see NOTE [objects handed to a checkpointed function]

    def rebuild(self, tensors: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """`(args, kwargs)` with the tensor leaves replaced by `tensors` (objects made again around them)."""
        args, kwargs = self.rebuild_objects(tensors).arguments
        return args, kwargs

    def rebuild_objects(self, tensors: Any) -> Rebuilt:
        """`rebuild`, keeping what each object handed to `fn` was made from, to check it after `fn` ran."""
        leaves: list[Any] = []
        tensor_iter, static_iter = iter(tensors), iter(self.statics)
        positions = set(self.tensor_positions)
        for position in range(len(self.tensor_positions) + len(self.statics)):
            leaves.append(next(tensor_iter) if position in positions else next(static_iter))
        tree = optree.tree_unflatten(self.spec, leaves)
        if not self.has_objects:
            return Rebuilt((tuple(tree[0]), dict(tree[1])), ())
        made: list[tuple[tuple[Any, ...], Any, Any]] = []

        def close(path: tuple[Any, ...], node: Any) -> Any:
            if not _objects.is_opened(node):
                return node
            obj = _objects.close(node, NAMESPACE)
            made.append((path, obj, node))
            return obj

        args, kwargs = optree.tree_map_with_path(
            close, tree, is_leaf=_objects.is_opened, none_is_leaf=False, namespace=NAMESPACE
        )
        return Rebuilt((tuple(args), dict(kwargs)), tuple(made))

    def static_key(self) -> StaticKey:
        """Everything but the tensors' values that tracing depends on."""
        return StaticKey(self.spec, self.tensor_positions, tuple((type(s), s) for s in self.statics))


def flatten_args(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FlatArgs:
    """Flatten `(args, kwargs)`, checking that every non-tensor leaf is a static value."""
    tree: Any = (args, kwargs)
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
    has_objects = any(not isinstance(leaf, _TENSOR_OR_STATIC) and _openable(leaf) for leaf in leaves)
    if has_objects:  # See NOTE [objects handed to a checkpointed function].
        tree = optree.tree_map(
            lambda leaf: _objects.open_leaf(leaf, NAMESPACE) if _openable(leaf) else leaf,
            tree,
            none_is_leaf=False,
            namespace=NAMESPACE,
        )
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
    tensors: list[torch.Tensor] = []
    positions: list[int] = []
    statics: list[Any] = []
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided:
                path = optree.tree_paths(tree, none_is_leaf=False, namespace=NAMESPACE)[position]
                raise TypeError(f"{api}: the argument at {describe_path(path)} {_NOT_STRIDED.format(leaf.layout)}")
            tensors.append(leaf)
            positions.append(position)
        elif _is_static(leaf):
            statics.append(leaf)
        else:
            path = optree.tree_paths(tree, none_is_leaf=False, namespace=NAMESPACE)[position]
            if is_kv_cache(leaf):  # see NOTE [key/value caches in checkpointed layers]
                raise TypeError(
                    f"{api}: the argument at {describe_path(path)} is a {type(leaf).__qualname__}, a transformers "
                    "key/value cache, which remat cannot trace through: the layer would write its keys and values "
                    "into it (or read past ones from it) as a side effect. In training, call the model with "
                    "`use_cache=False` so that no cache is passed, or checkpoint the model's layers with "
                    "`remat.checkpoint_modules(model, transformers.GradientCheckpointingLayer, policy=...)`, which "
                    "leaves an empty cache out of each layer's call, with a warning."
                )
            raise TypeError(
                f"{api}: the argument at {describe_path(path)} is a {type(leaf).__qualname__}, which is neither a "
                "tensor nor a static value (bool, int, float, str, enum, dtype, device, or a tuple of them), nor an "
                "object remat opens into what it holds (one whose state is its `__dict__`, or a Python function). "
                "Pass tensors as tensors and configuration as static values; a custom container must be "
                f"registered as a pytree node with optree (namespace={NAMESPACE!r} or global)."
            )
    return FlatArgs(spec, tuple(tensors), tuple(positions), tuple(statics), has_objects)


def _openable(value: Any) -> bool:
    return _objects.is_openable(value) and not is_kv_cache(value)  # a cache has its own error, below


def _is_static(value: Any) -> bool:
    if isinstance(value, tuple):  # e.g. a torch.Size, or a tuple registered as a leaf
        return all(_is_static(v) for v in value)
    return isinstance(value, _STATIC_TYPES)


# While tracing, a Python number made from a tensor (`t.item()`) is a symbolic one.
_SYMBOLIC_NUMBERS = {torch.SymInt: "int", torch.SymFloat: "float", torch.SymBool: "bool"}


def flatten_outputs(out: Any) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """Flatten `fn`'s output, which must be a pytree of tensors (`None` allowed)."""
    paths, leaves, spec = optree.tree_flatten_with_path(out, none_is_leaf=False, namespace=NAMESPACE)
    for path, leaf in zip(paths, leaves, strict=False):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"remat.checkpoint: the function returned a {_SYMBOLIC_NUMBERS.get(type(leaf), type(leaf).__qualname__)} at "
                f"{describe_path(path, root='output')}, but a checkpointed function must return a tensor or a "
                "pytree (tuples, lists, dicts, namedtuples, registered dataclasses) of tensors and None. Return "
                "non-tensor values from a function outside the checkpoint."
            )
        if leaf.layout != torch.strided:
            raise TypeError(
                f"remat.checkpoint: the function's output at {describe_path(path, root='output')} "
                + _NOT_STRIDED.format(leaf.layout)
            )
    return leaves, spec


# Sparse (and other non-strided) tensors have no strides, and their fake tensors trace
# gradient formulas that fail on dense gradients: refused at the boundary of the function.
_NOT_STRIDED = (
    "is a tensor of layout {}, but remat traces dense (`torch.strided`) tensors only. Convert it with "
    "`.to_dense()` outside the checkpointed function, or keep the sparse computation outside it."
)


def describe_path(path: tuple[Any, ...], root: str | None = None) -> str:
    """`args[0]['w']` for the leaf at `path` of `(args, kwargs)`, or `root[...]` for one of another tree."""
    if root is None:  # argument paths start with 0 (positional) or 1 (keyword)
        kind, *rest = path
        if kind == 0:
            root, path = f"args[{rest[0]}]", tuple(rest[1:])
        else:
            root, path = f"kwargs[{rest[0]!r}]", tuple(rest[1:])
    return root + "".join(f"[{entry!r}]" for entry in path)
