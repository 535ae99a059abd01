"""Ops and how they dispatch: overloads and their schemas, custom, collective and higher-order ops,
torch's decompositions, the dispatch modes and keys in force (autocast's among them), and which kernel
attention dispatches to.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._ops
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = [
    "COLLECTIVE_NAMESPACES",
    "HigherOrderOperator",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "TorchFunctionMode",
    "any_autocast_enabled",
    "decomposition_of",
    "disable_current_modes",
    "embedding_renorms_through",
    "flex_attention_as_one_call",
    "inherit_higher_order_rules",
    "is_custom_op",
    "op_schema",
    "overload_name",
    "preserved_dispatch_keys",
    "sdp_priority_order",
    "tree_leaves",
    "tree_map_only",
]


# --- ops -------------------------------------------------------------------------------------------

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
HigherOrderOperator = torch._ops.HigherOrderOperator


def op_schema(op: Any) -> Any:
    """The `torch._C.FunctionSchema` of an op overload (None for other callables)."""
    return getattr(op, "_schema", None)


def overload_name(op: Any) -> str:
    return op._overloadname  # type: ignore[no-any-return]


def is_custom_op(op: Any) -> bool:
    """Whether `op` is a `torch.library` custom op (one call, differentiated by its own rule): an op of a
    namespace other than aten's and prims'."""
    return getattr(op, "namespace", None) not in (None, "aten", "prims")


# The namespaces of torch's functional collectives and their waits.
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


# --- dispatch modes and keys ---------------------------------------------------------------------------


def any_autocast_enabled() -> bool:
    """Whether autocast is on for any device: one call where asking each device is two per device."""
    return bool(torch._C._is_any_autocast_enabled())


def preserved_dispatch_keys() -> Any:
    """A guard that puts this thread's included and excluded dispatch keys back as they were when it was
    made, when it exits."""
    return torch._C._PreserveDispatchKeyGuard()


def decomposition_of(op: OpOverload) -> Callable[..., Any] | None:
    """torch's decomposition of `op` into other ops (its Python reference formula), if it has one."""
    from torch._decomp import decomposition_table

    return decomposition_table.get(op)


_SDP_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}  # torch's `SDPBackend` values


def sdp_priority_order() -> list[str]:
    """The order in which SDPA tries its backends on CUDA (`torch._C._set_sdp_priority_order` changes it)."""
    return [_SDP_BACKENDS.get(int(b), "unknown") for b in torch._C._get_sdp_priority_order()]


# --- higher-order ops -----------------------------------------------------------------------------------


# NOTE [higher-order ops under remat's modes]
# A higher-order op (FlexAttention's `flex_attention` and its backward) finds
# its rule for a dispatch mode by the mode's exact class, so torch's rules for
# `FakeTensorMode` and `FunctionalTensorMode` do not reach remat's subclasses of
# them: each subclass takes its bases' rules as it is entered (the ops made
# since it was last entered included). remat's other dispatch modes look at aten
# calls only and let higher-order ops pass through.


def inherit_higher_order_rules(mode_class: type) -> None:
    """Give `mode_class` the rules every higher-order op has for its nearest base class that has one."""
    for op in list(torch._ops._higher_order_ops.values()):
        if mode_class in op.python_key_table:
            continue
        rule = next((op.python_key_table[c] for c in mode_class.__mro__[1:] if c in op.python_key_table), None)
        if rule is not None:
            op.py_impl(mode_class)(rule)


@contextlib.contextmanager
def flex_attention_as_one_call() -> Iterator[None]:
    """While tracing: `flex_attention` calls its higher-order op directly, which traces as one call, as
    under torch.compile; eagerly it compiles the op with Dynamo, which cannot run inside a trace. See
    NOTE [flex attention inside a trace]."""
    module = sys.modules.get("torch.nn.attention.flex_attention")
    flag = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"
    if module is None or not hasattr(module, flag):
        yield
        return
    before = getattr(module, flag)
    setattr(module, flag, True)
    try:
        yield
    finally:
        setattr(module, flag, before)


@contextlib.contextmanager
def embedding_renorms_through(renorm: Callable[[torch.Tensor, torch.Tensor, float, float], Any]) -> Iterator[None]:
    """While tracing on this thread: `F.embedding` and `F.embedding_bag` with `max_norm=` renormalize their
    weight by calling `renorm(weight, input, max_norm, norm_type)` (other threads, torch's own helper). See
    NOTE [functions that hide an update] in `remat/_eager/_capture.py`."""
    functional = torch.nn.functional
    name = "_no_grad_embedding_renorm_"
    original = getattr(functional, name, None)
    if original is None:
        yield
        return
    tracing_thread = threading.get_ident()

    def renormalized(weight: torch.Tensor, input: torch.Tensor, max_norm: float, norm_type: float) -> Any:
        if threading.get_ident() != tracing_thread:
            return original(weight, input, max_norm, norm_type)
        return renorm(weight, input, max_norm, norm_type)

    setattr(functional, name, renormalized)
    try:
        yield
    finally:
        setattr(functional, name, original)


# NOTE [flex attention inside a trace]
# Called eagerly, `flex_attention` wraps its higher-order op in `torch.compile`
# (Dynamo, with the eager backend), which fails on the fake and functional
# tensors of remat's trace. Its module flag `_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`
# makes it call the op directly instead, which make_fx records as one call with
# its `score_mod` and `mask_mod` as subgraphs, and whose autograd rule traces
# the backward op: so the flag is set while remat traces (traces take turns).
# A thread running flex attention eagerly meanwhile runs the op uncompiled,
# with the same results. The programs run the traced op, without Dynamo.
