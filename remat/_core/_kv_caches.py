"""Key/value caches handed to a checkpointed layer: Hugging Face transformers' `Cache` objects.

A decoder layer of a transformers model takes the model's key/value cache as an
argument and writes its keys and values into it. remat cannot trace through
such an object, and a checkpointed layer must not write activations into it;
see NOTE [key/value caches in checkpointed layers].
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from torch import nn

__all__ = ["is_kv_cache", "without_kv_caches"]

# NOTE [key/value caches in checkpointed layers]
# In training, transformers models (5.x) build a fresh `DynamicCache` on every
# forward unless called with `use_cache=False`, and hand it to each decoder layer
# (`cache=...`, positional in GPT-2), whose attention writes the layer's keys and
# values into it (`cache.update(k, v, layer_idx)`) and attends over what it returns.
# A cache is an opaque Python object: remat cannot trace through it, and a
# checkpointed layer must not write into it anyway, since a cache that holds every
# layer's keys and values keeps alive exactly the activations checkpointing drops.
#
# So when a layer checkpointed by `checkpoint_modules` is called with a cache while
# gradients are recorded (that is, when remat checkpoints it), the cache must hold
# nothing yet for this layer, and the layer is called without it (`None` in its
# place, `use_cache=False`), as transformers' own gradient checkpointing does:
#
# * an empty cache contributes nothing to attention, so outputs and gradients are
#   those of the model with the cache (the causal mask, built by the model from the
#   cache's length, is unchanged too);
# * the one thing that differs is the side effect: the model's returned cache stays
#   empty. remat says so with a warning that names the fix (`use_cache=False`,
#   which also spares building the cache), rather than changing it silently;
# * a cache that already holds tokens for this layer (a prefix, or steps of
#   generation run with gradients) would be read by the layer: dropping it would
#   change the result, so remat refuses, naming what to pass instead.
#
# Without gradients (`torch.no_grad()`, generation) remat does not checkpoint and
# the layer runs as written, cache included. transformers is never imported here:
# a cache can only exist once `transformers.cache_utils` is, so it is looked up in
# `sys.modules`.


def is_kv_cache(value: Any) -> bool:
    """Whether `value` is a transformers key/value cache (an instance of `transformers.Cache`)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    return isinstance(cache_type, type) and isinstance(value, cache_type)


def without_kv_caches(
    name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`(args, kwargs)` of a call of the checkpointed `module` with every empty key/value cache replaced by
    None (and `use_cache=False`), warning that the cache is left empty; a ValueError for a cache holding
    tokens of this layer. See NOTE [key/value caches in checkpointed layers]."""
    if "transformers.cache_utils" not in sys.modules:
        return args, kwargs
    where = [(f"args[{i}]", value) for i, value in enumerate(args) if is_kv_cache(value)]
    where += [(f"kwargs[{key!r}]", value) for key, value in kwargs.items() if is_kv_cache(value)]
    if not where:
        return args, kwargs
    layer_index = _layer_index(module)
    for path, cache in where:
        _check_empty(name, module, path, cache, layer_index)
    args = tuple(None if is_kv_cache(value) else value for value in args)
    kwargs = {key: None if is_kv_cache(value) else value for key, value in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    paths = ", ".join(path for path, _ in where)
    warnings.warn(
        f"remat.checkpoint_modules: {type(module).__name__} was called with a key/value cache "
        f"({type(where[0][1]).__name__} at {paths}) while gradients are recorded. A checkpointed layer cannot "
        "write its keys and values into a cache, so remat calls it without one (None, and use_cache=False), "
        "as transformers' own gradient checkpointing does: outputs and gradients are unchanged, but the cache "
        "the model returns stays empty. Call the model with `use_cache=False` in training to silence this.",
        UserWarning,
        stacklevel=2,  # remat's call of the layer: shown once per process, like transformers' warning_once
    )
    return args, kwargs


def _check_empty(name: str, module: nn.Module, path: str, cache: Any, layer_index: int | None) -> None:
    """Raise a ValueError unless `cache` holds nothing for the layer `module` (its `layer_index`)."""
    try:
        tokens = cache.get_seq_length() if layer_index is None else cache.get_seq_length(layer_index)
    except Exception:  # a cache whose length cannot be read (say, a recurrent state): do not guess
        tokens = None
    if tokens == 0:
        return
    held = "state remat cannot measure" if tokens is None else f"{tokens} token(s) for this layer"
    raise ValueError(
        f"remat.checkpoint_modules: {type(module).__name__} at {name or '<model>'!r} was called, while gradients "
        f"are recorded, with a key/value cache ({type(cache).__name__} at {path}) that already holds {held}. "
        "The layer would attend over them, and a checkpointed layer cannot read or update a cache. To train "
        "with checkpointed layers, call the model with `use_cache=False` and no cache (`cache=None`); to "
        "generate, run under `torch.no_grad()`, where remat does not checkpoint and the cache works as usual."
    )


def _layer_index(module: nn.Module) -> int | None:
    """The cache index a transformers layer writes to: the `layer_idx` of it or its first submodule that has one."""
    for submodule in module.modules():
        index = getattr(submodule, "layer_idx", None)
        if isinstance(index, int) and not isinstance(index, bool):
            return index
    return None
