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

from .._core._cache import SignatureKey
from .._core._calls import Decision, Trace, format_bytes
from .._core._pytree import FlatArgs, describe_path
from ._accounting import account_for

__all__ = ["describe_signature", "explain_retrace", "log_trace", "logger"]

logger = logging.getLogger("remat")

_TENSOR_FIELDS = ("shape", "stride", "dtype", "device", "requires_grad", "layout", "grad_dtype")


def _leaf_names(flat: FlatArgs) -> list[str]:
    return [describe_path(path) for path in flat.spec.paths()]


def describe_signature(flat: FlatArgs, tensor_keys: Sequence[tuple[Any, ...]]) -> str:
    """`args[0]: float32[2,3] requires_grad, kwargs['mode']: 'fast'`."""
    names = _leaf_names(flat)
    tensors = dict(zip(flat.tensor_positions, tensor_keys, strict=True))
    statics = iter(flat.statics)
    parts = []
    for position, name in enumerate(names):
        if position in tensors:
            shape, _, dtype, device, requires_grad, *_ = tensors[position]
            text = f"{str(dtype).removeprefix('torch.')}[{','.join(map(str, shape))}]"
            text += f" on {device}" if device.type != "cpu" else ""
            text += " requires_grad" if requires_grad else ""
        else:
            text = repr(next(statics))
        parts.append(f"{name}: {text}")
    return ", ".join(parts) or "no arguments"


def explain_retrace(old: SignatureKey, new: SignatureKey, flat: FlatArgs) -> list[str]:
    """What differs between two signature keys, one line per difference."""
    if old.static != new.static:
        if old.static.spec != new.static.spec or old.static.tensor_positions != new.static.tensor_positions:
            return [f"the argument structure changed: {old.static.spec} -> {new.static.spec}"]
        names = [n for i, n in enumerate(_leaf_names(flat)) if i not in set(new.static.tensor_positions)]
        return [
            f"{name} changed: {old_leaf[1]!r} -> {new_leaf[1]!r}"
            for name, old_leaf, new_leaf in zip(names, old.static.statics, new.static.statics, strict=True)
            if old_leaf != new_leaf
        ]
    changes = []
    names = _leaf_names(flat)
    for position, old_key, new_key in zip(new.static.tensor_positions, old.tensors, new.tensors, strict=True):
        for field, before, after in zip(_TENSOR_FIELDS, old_key, new_key, strict=True):
            if before != after:
                changes.append(f"{names[position]}.{field} changed: {_short(before)} -> {_short(after)}")
    if old.ambient != new.ambient:
        if old.ambient.autocast != new.ambient.autocast:
            changes.append(f"the autocast state changed: {old.ambient.autocast} -> {new.ambient.autocast}")
        if old.ambient.autocast_cache != new.ambient.autocast_cache:
            changes.append(f"autocast's cache was {'enabled' if new.ambient.autocast_cache else 'disabled'}")
        if old.ambient.training != new.ambient.training:
            changes.append("a module's `training` flag changed (train() / eval())")
    if old.forward_mode != new.forward_mode:
        changes.append(f"forward-mode AD (jvp) {'started' if new.forward_mode else 'stopped'}")
    return changes or ["closed-over tensors (parameters, buffers) changed shape, dtype, device or requires_grad"]


def _short(value: Any) -> str:
    if isinstance(value, tuple) or type(value).__name__ == "Size":
        return f"({', '.join(map(str, value))})"
    return str(value).removeprefix("torch.")


def log_trace(name: str, signature: str, seconds: float, trace: Trace, decisions: Sequence[Decision]) -> None:
    """The DEBUG record of one trace."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    accounting = account_for(trace, decisions)
    logger.debug(
        "traced %s in %.1f ms at (%s): %d calls, policy saves %d and offloads %d; keeps %s on the device and %s in "
        "host memory from %d calls, replays %d calls in backward",
        name,
        seconds * 1e3,
        signature,
        len(decisions),
        sum(decision is Decision.SAVE for decision in decisions),
        sum(decision is Decision.OFFLOAD for decision in decisions),
        format_bytes(accounting.saved_bytes),
        format_bytes(accounting.offloaded_bytes),
        len(accounting.saved_calls),
        len(accounting.replayed_calls),
    )
