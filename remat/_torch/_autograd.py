"""Autograd's internals: its graph's nodes, what custom Functions save and how they are applied, the
derivatives torch has, the dtype a leaf's gradient takes, and torch.utils.checkpoint's selective
checkpointing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree

from ._fake import FakeTensor
from ._func import inplace_requires_grad_allowed, temporarily_clear_interpreter_stack
from ._ops import OpOverload, disable_current_modes

__all__ = [
    "SAC_BYPASSES_HOOKS",
    "accumulated_leaf",
    "apply_without_binding",
    "autograd_node_inputs",
    "autograd_node_order",
    "grad_dtype_override",
    "has_no_derivative",
    "is_custom_function_node",
    "is_custom_op_autograd",
    "release_saved_tensors",
    "saved_tensors_hooks_tracing",
    "selective_checkpoint_context",
    "version_counter",
]


# --- autograd ----------------------------------------------------------------------------------------------


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's version counter, bumped by every in-place update."""
    return tensor._version


# NOTE [gradients in another dtype than the tensor's]
# A leaf may ask autograd for its gradient in a dtype of its own (`tensor.grad_dtype = torch.float32`
# on a bfloat16 parameter, or None: any dtype): the engine then casts the gradient it gets to that
# dtype, not to the tensor's, or leaves it as computed. FSDP2's mixed precision sets it on every
# unsharded parameter on torch 2.15 (the reduce dtype), so that a float32 gradient computed from a
# bfloat16 parameter reaches the reduction unrounded. remat's backward is traced, and the cast the
# engine makes at the end is traced with it: the traced inputs take the real ones' `grad_dtype`, and it
# is part of the signature.


def grad_dtype_override(tensor: torch.Tensor) -> tuple[bool, torch.dtype | None]:
    """(whether `tensor` has a `grad_dtype` of its own, which). See NOTE [gradients in another dtype
    than the tensor's]."""
    if not tensor.is_leaf:  # only a leaf has one
        return False, None
    try:
        grad_dtype = tensor.grad_dtype
        # 2.15 says whether it was set; before, an unset `grad_dtype` is the tensor's dtype.
        overridden = getattr(tensor, "_has_grad_dtype_override", grad_dtype != tensor.dtype)
    except (AttributeError, RuntimeError):  # a release without it, or a tensor that cannot say
        return False, None
    return (True, grad_dtype) if overridden else (False, None)


def has_no_derivative(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether autograd has no derivative formula for `op` at all (it records torch's `NotImplemented`
    node, which raises where it is differentiated), found by calling it on `args` and `kwargs`: fake
    tensors of a trace, whose float ones are made to require grad. False where the call raises."""
    fakes = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FakeTensor)]
    if not fakes:
        return False

    def leaf(value: Any) -> Any:
        if isinstance(value, FakeTensor) and (value.is_floating_point() or value.is_complex()):
            return value.detach().requires_grad_()
        return value

    # Outside a torch.func transform's interpreters (the fake tensors are no transform's) and the
    # caller's dispatch modes (a user's op counter must not see the probe).
    with disable_current_modes(), temporarily_clear_interpreter_stack(), inplace_requires_grad_allowed():
        args, kwargs = pytree.tree_map(leaf, (args, kwargs))
        try:
            with fakes[0].fake_mode, torch.enable_grad():
                outputs = op(*args, **kwargs)
        except Exception:
            return False
    return any(
        isinstance(o, torch.Tensor) and type(o.grad_fn).__name__ == "NotImplemented"
        for o in pytree.tree_leaves(outputs)
    )


@contextlib.contextmanager
def saved_tensors_hooks_tracing() -> Iterator[None]:
    """Keep users' `saved_tensors_hooks` from running (autograd's switch for tracing)."""
    previous = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_set_tracing(previous)


def apply_without_binding(function: type[torch.autograd.Function]) -> Any:
    """The C++ `apply` of a custom Function, without the Python argument binding that
    `Function.apply` did until torch 2.13 (a third of the overhead of a small call; since 2.14
    `Function.apply` is this C++ apply already)."""
    return super(torch.autograd.Function, function).apply  # type: ignore[misc]


def release_saved_tensors(ctx: Any) -> None:
    """Drop autograd's references to what a custom Function saved, unless the graph is retained
    (`retain_graph=True`, `create_graph=True`): the references its backward unpacked are then the only ones.
    (What AOTAutograd's runtime does; a ctx of torch.func's own has no such method.)"""
    clear = getattr(ctx, "maybe_clear_saved_tensors", None)
    if clear is not None:
        clear()


def autograd_node_order(node: Any) -> int:
    """The sequence number of an autograd graph node: the engine runs the ready node created last first."""
    return node._sequence_nr()  # type: ignore[no-any-return]


def autograd_node_inputs(node: Any) -> Sequence[Any]:
    """The shape, dtype and device of each gradient an autograd graph node takes."""
    return node._input_metadata  # type: ignore[no-any-return]


def accumulated_leaf(node: Any) -> torch.Tensor | None:
    """The leaf tensor whose `.grad` an autograd graph node accumulates into (its `AccumulateGrad`), if it is one."""
    return node.variable if type(node).__name__ == "AccumulateGrad" else None  # type: ignore[no-any-return]


def is_custom_function_node(node: Any) -> bool:
    """Whether an autograd graph node is a custom Function's (its `backward` runs through `node.apply`)."""
    return hasattr(node, "_forward_cls")


def is_custom_op_autograd(function: type) -> bool:
    """Whether `function` is the autograd Function torch made for a custom op's `register_autograd`."""
    return function.__module__ == "torch._library.autograd"


# --- torch.utils.checkpoint ----------------------------------------------------------------------------------

# Keyword arguments of `torch.utils.checkpoint.checkpoint` that keep a selective-checkpoint region's
# saved tensors out of `saved_tensors_hooks`, as every release did until 2.14. Torch 2.15 warns
# (FutureWarning) unless told, and a later release will route them through the hooks.
SAC_BYPASSES_HOOKS: dict[str, Any] = (
    {"respect_saved_tensors_hooks": False}
    if "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    else {}
)


def selective_checkpoint_context(op_output: Any) -> torch.utils.checkpoint.SelectiveCheckpointContext:
    """The context a SAC policy function receives in forward, with the output of the call it decides on.

    Before 2.12 the context has no `op_output` (its constructor takes only `is_recompute`): it is set after
    construction, so that a policy function written for a newer release reads it on every release."""
    context = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)
    context.op_output = op_output
    return context
