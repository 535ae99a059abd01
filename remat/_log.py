"""Logging of traces and retraces, on the `remat` logger.

At DEBUG, every trace logs the signature it traced, how long tracing took and
what the policy decided; at INFO, every retrace of a function says what
changed since its previous trace, as `jax.jit`'s retrace explanations do.

>>> import logging
>>> logging.getLogger("remat").setLevel(logging.INFO)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ._calls import Decision, format_bytes
from ._partition import Programs
from ._pytree import FlatArgs

__all__ = ["describe_signature", "explain_retrace", "log_trace", "logger"]

logger = logging.getLogger("remat")

_TENSOR_FIELDS = ("shape", "stride", "dtype", "device", "requires_grad", "layout")


def _leaf_names(flat: FlatArgs) -> list[str]:
    names = []
    for path in flat.spec.paths():
        where, *rest = path
        names.append(("args" if where == 0 else "kwargs") + "".join(f"[{part!r}]" for part in rest))
    return names


def describe_signature(flat: FlatArgs, tensor_keys: Sequence[tuple[Any, ...]]) -> str:
    """`args[0]: float32[2,3] requires_grad, kwargs['mode']: 'fast'`."""
    names = _leaf_names(flat)
    tensors = dict(zip(flat.tensor_positions, tensor_keys, strict=True))
    statics = iter(flat.statics)
    parts = []
    for position, name in enumerate(names):
        if position in tensors:
            shape, _, dtype, device, requires_grad, _ = tensors[position]
            text = f"{str(dtype).removeprefix('torch.')}[{','.join(map(str, shape))}]"
            text += f" on {device}" if device.type != "cpu" else ""
            text += " requires_grad" if requires_grad else ""
        else:
            text = repr(next(statics))
        parts.append(f"{name}: {text}")
    return ", ".join(parts) or "no arguments"


def explain_retrace(old: Any, new: Any, flat: FlatArgs) -> list[str]:
    """What differs between two signature keys, one line per difference."""
    (old_static, old_tensors, old_ambient, old_forward), (new_static, new_tensors, new_ambient, new_forward) = old, new
    if old_static != new_static:
        old_spec, old_positions, old_leaves = old_static
        new_spec, new_positions, new_leaves = new_static
        if old_spec != new_spec or old_positions != new_positions:
            return [f"the argument structure changed: {old_spec} -> {new_spec}"]
        names = [n for i, n in enumerate(_leaf_names(flat)) if i not in set(new_positions)]
        return [
            f"{name} changed: {old_leaf[1]!r} -> {new_leaf[1]!r}"
            for name, old_leaf, new_leaf in zip(names, old_leaves, new_leaves, strict=True)
            if old_leaf != new_leaf
        ]
    changes = []
    names = _leaf_names(flat)
    for position, old_key, new_key in zip(new_static[1], old_tensors, new_tensors, strict=True):
        for field, before, after in zip(_TENSOR_FIELDS, old_key, new_key, strict=True):
            if before != after:
                changes.append(f"{names[position]}.{field} changed: {_short(before)} -> {_short(after)}")
    if old_ambient != new_ambient:
        (old_autocast, old_cache, old_training), (new_autocast, new_cache, new_training) = old_ambient, new_ambient
        if old_autocast != new_autocast or old_cache != new_cache:
            changes.append(f"the autocast state changed: {old_autocast} -> {new_autocast}")
        if old_training != new_training:
            changes.append("a module's `training` flag changed (train() / eval())")
    if old_forward != new_forward:
        changes.append(f"forward-mode AD (jvp) {'started' if new_forward else 'stopped'}")
    return changes or ["closed-over tensors (parameters, buffers) changed shape, dtype, device or requires_grad"]


def _short(value: Any) -> str:
    if isinstance(value, tuple) or type(value).__name__ == "Size":
        return f"({', '.join(map(str, value))})"
    return str(value).removeprefix("torch.")


def log_trace(name: str, signature: str, seconds: float, programs: Programs) -> None:
    """The DEBUG record of one trace."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    decisions = programs.decisions
    n_saved = sum(decision is Decision.SAVE for decision in decisions)
    logger.debug(
        "traced %s in %.1f ms at (%s): %d calls, policy saves %d; keeps %s from %d calls, replays %d calls in backward",
        name,
        seconds * 1e3,
        signature,
        len(decisions),
        n_saved,
        format_bytes(programs.saved_bytes),
        len(programs.saved_calls),
        len(programs.replayed_calls),
    )
