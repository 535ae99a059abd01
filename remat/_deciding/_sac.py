"""`from_sac`: use a PyTorch selective-activation-checkpointing policy function as a remat policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .._core._calls import Call, Decision, TensorMeta, Trace
from .._torch import op_schema, selective_checkpoint_context
from ._policy import Policy

__all__ = ["from_sac"]

_DECISIONS = {
    CheckpointPolicy.MUST_SAVE: Decision.SAVE,
    CheckpointPolicy.PREFER_SAVE: Decision.SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: Decision.RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: Decision.RECOMPUTE,
    **{
        getattr(CheckpointPolicy, name): Decision.OFFLOAD
        for name in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD")
        if hasattr(CheckpointPolicy, name)
    },
}

# NOTE [what a SAC policy function sees under remat]
# `torch.utils.checkpoint` calls a SAC policy function from a TorchDispatchMode
# while the real forward runs: it is asked about every aten op that reaches the
# dispatcher (views and `aten.t` included, `aten.detach` excepted), with real
# tensors as arguments and the real output as `ctx.op_output`.
# `from_sac` asks it about the calls of a remat trace instead, before anything
# runs. Those are functionalized aten calls: an in-place op (`add_`) shows up as
# its functional form (`add`), and views (`view`, `transpose`, `t`, `split`, ...)
# are not calls at all, so the function is never asked about them. A function
# that keys off op identity for compute ops (`mm`, `addmm`, attention, ...), as
# torchtitan's does, sees the same compute calls in the same order.
# Tensors arrive as tensors on the `meta` device with the traced shape and dtype
# (contiguous strides), so `args[1].shape` works but values cannot be read.
# Positional and keyword arguments arrive as the traced call received them
# (`Call.inputs`, `Call.kwargs`).


@dataclasses.dataclass(frozen=True, repr=False)
class _FromSAC(Policy):
    policy_fn: Callable[..., Any]

    def plan(self, trace: Trace) -> tuple[Decision, ...]:
        # One call per call of the trace, in trace order: stateful functions
        # (torchtitan's every-second-mm counter) see what they see in one SAC forward.
        return tuple(self._decide(call) for call in trace)

    def _decide(self, call: Call) -> Decision:
        context = selective_checkpoint_context(_op_output(call))
        # See NOTE [what a SAC policy function sees under remat]
        args = tuple(_as_meta(value) for value in call.inputs)
        kwargs = {name: _as_meta(value) for name, value in call.kwargs}
        returned = self.policy_fn(context, call.op, *args, **kwargs)
        if isinstance(returned, bool):
            return Decision.SAVE if returned else Decision.RECOMPUTE
        if isinstance(returned, CheckpointPolicy) and returned in _DECISIONS:
            return _DECISIONS[returned]
        raise TypeError(
            f"remat.policies.from_sac: the SAC policy function {_name(self.policy_fn)} returned {returned!r} "
            f"(of type {type(returned).__qualname__}) for call {call}; it must return a "
            f"torch.utils.checkpoint.CheckpointPolicy ({', '.join(p.name for p in _DECISIONS)}) "
            "or a bool (True saves, False recomputes)."
        )

    def __repr__(self) -> str:
        return f"from_sac({_name(self.policy_fn)})"


def _name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else repr(fn)


def _as_meta(value: Any) -> Any:
    """A `TensorMeta` (also inside lists and tuples) as an empty tensor on the meta device."""
    if isinstance(value, TensorMeta):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)) and any(isinstance(item, (TensorMeta, list, tuple)) for item in value):
        return type(value)(_as_meta(item) for item in value)
    return value


def _op_output(call: Call) -> Any:
    """`ctx.op_output` as SAC gives it, as meta tensors: one tensor, or a tuple for several outputs."""
    outputs = tuple(_as_meta(output) for output in call.outputs)
    schema = op_schema(call.op)
    if len(outputs) == 1 and schema is not None and len(schema.returns) == 1:
        return outputs[0]
    return outputs


def from_sac(policy_fn: Callable[..., Any]) -> Policy:
    """Use a selective activation checkpointing (SAC) policy function of `torch.utils.checkpoint` as a policy.

    Code written for `torch.utils.checkpoint.create_selective_checkpoint_contexts`
    (torchtitan's op-list policy with its every-second-mm counter, for one)
    keeps working under remat without a rewrite. Planning a trace calls
    `policy_fn(ctx, op, *args)` once per call, in trace order, so a function
    that counts calls sees them as in one SAC forward. `ctx` is a
    `torch.utils.checkpoint.SelectiveCheckpointContext` with `is_recompute`
    False (SAC asks only in forward too) and `op_output` the call's outputs as
    meta tensors; `op` is the `OpOverload`; tensor arguments are meta tensors
    of the traced shape and dtype, so `args[1].shape` works but values do not.

    Decisions: `MUST_SAVE`, `PREFER_SAVE` and `True` save the call;
    `MUST_CPU_OFFLOAD` and `PREFER_CPU_OFFLOAD` (torch 2.11 on) offload it (`remat.OFFLOAD`:
    kept in host memory, which eager SAC does not implement);
    `MUST_RECOMPUTE`, `PREFER_RECOMPUTE` and `False` recompute it. `PREFER_*`
    leaves the choice to a compiler in torch; remat has no compiler to leave it
    to, so `PREFER_*` act as `MUST_*`. Anything else raises `TypeError`.

    The function sees functionalized aten calls, not what eager dispatch sees:
    an in-place op appears as its functional form, and view ops (`view`,
    `transpose`, `t`, `split`, ...) are not calls and are never asked about;
    keyword arguments of an op arrive positionally after the positional ones.
    See NOTE [what a SAC policy function sees under remat]. State kept in a
    closure carries over from one trace to the next (remat plans once per new
    input signature), where SAC's `context_fn` usually builds it afresh per
    forward. A single call (`policy(call)`, as the combinators of
    `remat.policies` may ask) calls `policy_fn` for that call alone.

    Args:
        policy_fn: `policy_fn(ctx, op, *args, **kwargs)` returning a
            `torch.utils.checkpoint.CheckpointPolicy` or a bool.

    Returns:
        A policy; equal (and hashing equal) to another `from_sac` of the same function.

    >>> import torch, remat
    >>> from torch.utils.checkpoint import CheckpointPolicy
    >>> from remat._deciding._sac import from_sac
    >>> def save_matmuls(ctx, op, *args, **kwargs):
    ...     if op is torch.ops.aten.mm.default:
    ...         return CheckpointPolicy.MUST_SAVE
    ...     return CheckpointPolicy.PREFER_RECOMPUTE
    >>> policy = from_sac(save_matmuls)
    >>> policy
    from_sac(save_matmuls)
    >>> w = torch.ones(4, 4, requires_grad=True)
    >>> trace = remat.trace(lambda x: (x @ w).sin(), torch.ones(2, 4))
    >>> [call.name for call in trace]
    ['aten.mm.default', 'aten.sin.default']
    >>> policy.plan(trace)
    (remat.SAVE, remat.RECOMPUTE)
    """
    if not callable(policy_fn):
        raise TypeError(
            f"remat.policies.from_sac: expected a SAC policy function `policy_fn(ctx, op, *args, **kwargs)` "
            f"returning a torch.utils.checkpoint.CheckpointPolicy or a bool, but got {policy_fn!r} of type "
            f"{type(policy_fn).__qualname__}. To save a list of ops, use `remat.policies.save_ops(*ops)`."
        )
    return _FromSAC(policy_fn)
