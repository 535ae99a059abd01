"""Reading a function without running it for training: `remat.trace` (its op calls) and `remat.report`
(what a policy keeps and replays)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from .._core import _rng
from .._core._calls import Trace
from .._core._pytree import flatten_args
from .._deciding._decide import decide_nested
from .._deciding._policy import PolicyLike
from .._eager._capture import find_module_roots
from .._partitioning._accounting import account_for
from .._partitioning._partition import partition
from .._partitioning._peak import predict_peak
from .._partitioning._value_graph import with_value_graph
from .._report import Report, ReportRow
from .._running._executable import Executable
from .._storing import _lossy
from .._torch import FakeTensor, is_functorch_wrapped
from .._tracing._joint import JointGraph, joint_graph_of
from ..policies import save_nothing
from ._build import check_module_patterns
from ._checkpointed import Checkpointed, traced

__all__ = ["report", "trace"]


def _joint_of(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], api: str
) -> tuple[JointGraph, Any, Executable | None]:
    """The joint graph of `fn` at these arguments, and, for a checkpointed function, its policy and the
    programs its cache holds for them (the policy's decisions, partitioned)."""
    flat = flatten_args(api, args, kwargs)
    fn = getattr(fn, "checkpointed", fn)  # a CheckpointedModule
    if isinstance(fn, Checkpointed):
        joint, executable = traced(fn, flat)
        return joint, fn.policy, executable
    if not callable(fn):
        raise TypeError(f"{api}: expected a function or nn.Module, but got {fn!r} of type {type(fn).__qualname__}.")
    return with_value_graph(joint_graph_of(fn, flat, find_module_roots(fn))), None, None


def _compression_errors(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], policy: Any, joint: JointGraph
) -> dict[int, float]:
    """The largest error the kept values of each compressed call come back with (NOTE [values kept lossy]),
    by call index: the function's forward, checkpointed with `policy`, run once on the arguments, putting
    back the generators and the buffers of the modules it reaches; none where the arguments are not real
    tensors."""
    leaves: list[Any] = optree.tree_leaves((args, kwargs), none_is_leaf=True)  # type: ignore[arg-type]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if any(t.is_meta or isinstance(t, FakeTensor) or is_functorch_wrapped(t) for t in tensors):
        return {}
    target = getattr(fn, "checkpointed", fn)
    target = target.__wrapped__ if isinstance(target, Checkpointed) else target
    buffers = list({id(b): b for module in find_module_roots(target).modules for b in module.buffers()}.values())
    before = [b.clone() for b in buffers]
    put_back = _rng.snapshot()
    try:
        with _lossy.recording_errors() as errors, torch.enable_grad():
            Checkpointed(target, policy, 1)(*args, **kwargs)
    finally:
        put_back()
        with torch.no_grad():
            for buffer, value in zip(buffers, before, strict=True):
                buffer.copy_(value)
    call_of = {node.name: value[0] for value, node in joint.values.nodes.items() if value[0] >= 0}
    by_call: dict[int, float] = {}
    for name, error in errors.items():
        call = call_of[name]
        by_call[call] = max(by_call.get(call, 0.0), error)
    return by_call


def trace(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Trace:
    """Trace `fn` at these arguments and return its forward op calls.

    Args:
        fn: a function or `nn.Module` (or a `remat.checkpoint` of one).
        *args: example arguments; only their shapes, dtypes and devices matter.
        **kwargs: example keyword arguments.

    Returns:
        The `remat.Trace`: one `remat.Call` per op call a policy decides about.

    >>> import torch, remat
    >>> trace = remat.trace(lambda a, b: (a @ b).relu(), torch.ones(2, 3), torch.ones(3, 4))
    >>> [(call.index, call.name) for call in trace]
    [(0, 'aten.mm.default'), (1, 'aten.relu.default')]
    """
    joint, _, _ = _joint_of(fn, args, kwargs, "remat.trace")
    return joint.trace


def report(fn: Callable[..., Any], /, *args: Any, policy: PolicyLike = None, **kwargs: Any) -> Report:
    """Report what `remat.checkpoint(fn, policy=policy)` keeps and replays at these arguments.

    Args:
        fn: a function or `nn.Module`, or a `remat.checkpoint` of one (whose
            policy is used when `policy` is None).
        *args: example arguments.
        policy: the policy to report on; None means the checkpointed
            function's own policy, or recompute everything.
        **kwargs: example keyword arguments.

    Returns:
        A `remat.Report`; `print(report)` shows a table.

    >>> import torch, remat
    >>> w = torch.randn(8, 8, requires_grad=True)
    >>> r = remat.report(lambda x: (x @ w).tanh().sum(), torch.randn(4, 8), policy=remat.policies.save_everything)
    >>> r.saved_bytes  # the tanh output (4 x 8 floats); the input and w cost nothing
    128
    """
    joint, own_policy, cached = _joint_of(fn, args, kwargs, "remat.report")
    if policy is None and cached is not None:  # the checkpoint's own policy: its cached decisions and programs
        policy, decisions, programs = own_policy, cached.programs.decisions, cached.programs
    else:
        policy = policy if policy is not None else own_policy
        decisions = decide_nested(policy, joint.trace, joint.regions)
        check_module_patterns(policy, joint.trace, "remat.report")
        programs = partition(joint, decisions)
    accounting = account_for(joint.trace, decisions)
    compressed = any(not kept.storage.exact and kept.stored_nbytes for kept in accounting.kept_by_call.values())
    errors = _compression_errors(fn, args, kwargs, policy, joint) if compressed else {}
    rows = []
    for call in joint.trace:
        kept = accounting.kept_by_call.get(call.index)
        rows.append(
            ReportRow(
                call,
                decisions[call.index],
                saved=kept is not None,
                replayed=call.index in accounting.replayed_calls,
                rng_state_kept=call.index in accounting.rng_state_calls,
                saved_bytes=kept.nbytes if kept else 0,
                read_by=kept.read_by if kept else frozenset(),
                offloaded=kept is not None and kept.offloaded,
                storage="" if kept is None else kept.storage.name if kept.stored_nbytes else "device",
                error=errors.get(call.index),
            )
        )
    return Report(
        saved_bytes=accounting.saved_bytes,
        rng_state_bytes=accounting.rng_state_bytes,
        recompute_flops=accounting.recompute_flops,
        replayed_calls=accounting.replayed_calls,
        rows=tuple(rows),
        trace=joint.trace,
        policy=policy if policy is not None else save_nothing,
        nested_policies=tuple({id(p): p if p is not None else save_nothing for p, _ in joint.regions}.values()),
        peak=predict_peak(joint, programs),
        value_checks=joint.value_checks,
        offloaded_bytes=accounting.offloaded_bytes,
    )
