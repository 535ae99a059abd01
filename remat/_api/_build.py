"""A trace's programs under a policy, built into the `Executable` a checkpointed function runs: decided,
partitioned, checked, compiled where asked; shared between identical blocks."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from .._core._calls import TensorMeta, Trace
from .._deciding._decide import decide_nested
from .._partitioning._partition import Programs, partition
from .._running._active_transforms import unsupported_under
from .._running._compiled import compile_programs
from .._running._executable import Executable
from .._torch import HigherOrderOperator
from .._tracing._errors import TraceError
from .._tracing._joint import JointGraph
from ..policies import warn_of_unmatched_module_patterns
from ._sharing import SharedTraces

__all__ = ["build_executable", "check_module_patterns"]


# The traces checked for module patterns that match nothing (NOTE [module patterns that match nothing]).
_checked_patterns: weakref.WeakSet[Trace] = weakref.WeakSet()


def check_module_patterns(policy: Any, trace: Trace, api: str) -> None:
    """Warn, once per trace with calls, of `save_modules` patterns of `policy` its calls' modules miss."""
    if len(trace) and trace not in _checked_patterns:
        _checked_patterns.add(trace)
        paths = (call.module for call in trace)
        warn_of_unmatched_module_patterns(policy, paths, api, "that issued a call in this trace")


def build_executable(
    joint: JointGraph,
    policy: Any,
    forward_mode: bool,
    compile_options: dict[str, Any] | None,
    shared: SharedTraces | None = None,
) -> Executable:
    """The programs of `joint` under `policy`; blocks sharing traces share them per decisions."""
    decisions = decide_nested(policy, joint.trace, joint.regions)
    if shared is None:  # blocks of `checkpoint_modules` were checked as they were checkpointed
        check_module_patterns(policy, joint.trace, "remat.checkpoint")
    if shared is None:
        return _executable_of(joint, decisions, forward_mode, compile_options)
    return shared.executable(  # type: ignore[no-any-return]
        (joint.trace, decisions, forward_mode),
        lambda: _executable_of(joint, decisions, forward_mode, compile_options),
    )


def _executable_of(
    joint: JointGraph, decisions: tuple[Any, ...], forward_mode: bool, compile_options: dict[str, Any] | None
) -> Executable:
    if compile_options is not None and joint.value_checks:
        raise TraceError(
            "remat.checkpoint(..., compile=...): the function reads the value of a tensor in Python, so its "
            "trace holds for the values it read and checks them as it runs, which compiled programs cannot "
            "do. Checkpoint it without `compile=`, or use `torch.compile` around the checkpointed model."
        )
    programs = partition(joint, decisions, forward_mode=forward_mode)
    output_metas = tuple(TensorMeta.of(o.meta["val"]) for o in joint.outputs)
    _check_sizes_backward_can_tell(joint, programs, output_metas)
    return Executable(
        programs=programs,
        differentiable_outputs=joint.differentiable_outputs,
        grad_of=joint.grad_of,
        n_primals=len(joint.primals),
        n_user_outputs=joint.n_user_outputs,
        dirty=joint.dirty,
        output_metas=output_metas,
        compiled=None if compile_options is None else compile_programs(programs, compile_options),
        unbatchable=unsupported_under("torch.func.vmap", joint.graph.nodes),
        higher_order_ops=frozenset(n.target for n in joint.graph.nodes if isinstance(n.target, HigherOrderOperator)),
        not_under_forward_ad=unsupported_under(
            "torch.autograd.forward_ad", joint.graph.nodes, works_under="torch.func.jvp (or jacfwd)"
        )
        if forward_mode
        else None,
        sized_by_values=tuple(
            i for i in joint.differentiable_outputs if output_metas[i].data_dependent and i in programs.returned
        ),
        backward_error=joint.backward_error,
    )


def _check_sizes_backward_can_tell(joint: JointGraph, programs: Programs, metas: Sequence[TensorMeta]) -> None:
    """Refuse an output rebuilt after the Function (a view of an input) whose size depends on values,
    where the backward program reads its gradient: the Function never sees the view, so the zeros it
    hands the backward for it could not take its size."""
    if not any(i in programs.returned for i in joint.differentiable_outputs):
        return  # the backward program never runs: only the views' own gradients flow
    placeholders = [n for n in programs.backward.graph.nodes if n.op == "placeholder"]
    tangents = placeholders[len(programs.kept) :]
    for i, tangent in zip(joint.differentiable_outputs, tangents, strict=False):
        if metas[i].data_dependent and i not in programs.returned and tangent.users:
            raise TraceError(
                f"remat: output {i} of the checkpointed function is a view of an input whose size depends on "
                f"values the function read ({metas[i]}), returned beside outputs it computes: remat rebuilds such "
                "a view after running the function, and its backward could not tell the view's size. Take the "
                "view outside the checkpointed function."
            )
