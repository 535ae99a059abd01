"""`remat.fit`'s probe step: one training step measured with every block keeping the least (on fake
tensors of a target device for a model on meta), the ranks of an FSDP2 model agreeing on it, and the
optimizer's step measured on meta copies."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import nn

from .._api._apply import CheckpointedForward
from .._core._objects import closed, opened
from .._core._pytree import NAMESPACE
from .._memory import _step
from .._memory._gpu import attention_as_on_the_gpu
from .._memory._measure import storage_key, storage_nbytes
from .._tracing._engine import SavedTensors, engine_runs_on, walked_backward
from ._fit_choice import Planned

__all__ = ["agreed_across_ranks", "fitted_blocks", "on_this_rank", "plans_for_the_cpu", "probe_step", "target_device"]


def fitted_blocks(model: nn.Module) -> dict[nn.Module, CheckpointedForward]:
    found = {}
    for _, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward) and isinstance(forward.policy, Planned):
            found[module] = forward
    return found


@contextlib.contextmanager
def _put_back(model: nn.Module) -> Iterator[None]:
    """Run the probe step, then put back the parameters' gradients, the buffers and the generators."""
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in parameters if p.device.type == "cuda"})
    for p in parameters:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, grad in zip(parameters, grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


# NOTE [planning on the meta device]
# A model too big for this machine is planned with its parameters on the meta
# device, for a named target (`device=`). The meta device's own kernels are not
# the target's (attention decomposes to the math kernel there, which keeps the
# T x T scores), so the probe step runs on fake tensors of the target device
# instead (a FakeTensorMode: shapes, dtypes and strides, no data): torch's
# composite ops choose the kernels that device would run (CPU's flash attention,
# say), and every block is traced as it will be. Nothing real is allocated; the
# recorder counts the fake storages. Once the model is materialized on the
# target (`to_empty` and `load_state_dict`, or built there again), its batch
# has the planned signature (a meta tensor counts as one on the target), so it
# is not planned again, and each block, tracing itself again on real tensors,
# takes the planned decision of each call by its op, module, occurrence and
# output shapes and dtypes (a call the plan has no match for recomputes).


def plans_for_the_cpu(model: nn.Module, target: torch.device | None) -> bool:
    """Whether the step planned runs on the CPU (the target of a model on meta, or where it is)."""
    if target is not None:
        return target.type == "cpu"
    return any(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers()))


def target_device(model: nn.Module, device: Any) -> torch.device | None:
    """The device a model on meta is planned for (None: plan where the model is)."""
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if device is None:
        if on_meta:
            raise ValueError(
                "remat.fit: the model's parameters are on the meta device, whose kernels are not any real "
                "device's: name the device to plan for (`device='cuda'`, say)."
            )
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise TypeError(f"remat.fit: `device` must name a device ('cpu', 'cuda'), but got {device!r}.") from None
    if target.type == "meta":
        raise ValueError("remat.fit: `device` is the real device to plan for, not 'meta'.")
    if target.type == "cuda" and on_meta and not torch.backends.cuda.is_built():
        # Fake CUDA tensors need torch's CUDA kernels registered, GPU or not (NOTE [planning on the meta device]).
        raise ValueError(
            "remat.fit: planning for `device='cuda'` runs the probe step on fake CUDA tensors, which need a "
            "CUDA build of torch (the default Linux wheel; no GPU needed), but this torch is built for the CPU "
            "only (`torch.backends.cuda.is_built()` is False)."
        )
    where = {t.device for t in (*model.parameters(), *model.buffers())}
    if not on_meta and where != {target} and where:
        raise ValueError(
            f"remat.fit: `device={device!r}` plans a model on the meta device for that device, but this "
            f"model is on {', '.join(sorted(str(d) for d in where))}: leave out `device` to plan it where it is."
        )
    return target if on_meta else None


@contextlib.contextmanager
def _stepping(
    model: nn.Module, device: torch.device | None, args: Sequence[Any], kwargs: dict[str, Any]
) -> Iterator[tuple[Callable[[], Any], list[torch.Tensor], Any]]:
    """(a call of the model on the batch, the parameters it trains, the fake mode the tensors are of, if
    any): on the model as it is, or, for a
    `device` to plan a model on meta for, on fake tensors of that device (NOTE [planning on the meta
    device]). The blocks' traces made on fakes are dropped after."""
    if device is None:
        args, kwargs = _copies_of_the_batch(args, kwargs)
        yield (lambda: model(*args, **kwargs)), [p for p in model.parameters() if p.requires_grad], None
        return
    from .._torch import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_meta:
            return mode.from_tensor(tensor)
        with mode:
            made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
        return made.requires_grad_(tensor.requires_grad)

    state = {name: fake(t) for name, t in (*model.named_parameters(), *model.named_buffers())}
    names = {id(p): name for name, p in model.named_parameters()}
    batch: Any = (tuple(args), kwargs)
    fake_args, fake_kwargs = optree.tree_map(  # type: ignore[misc]
        lambda leaf: fake(leaf) if isinstance(leaf, torch.Tensor) else leaf, batch, none_is_leaf=True
    )
    trained = [state[names[id(p)]] for p in model.parameters() if p.requires_grad]
    try:
        with mode, attention_as_on_the_gpu(list(state.values())):
            yield (lambda: torch.func.functional_call(model, state, fake_args, fake_kwargs)), trained, mode  # type: ignore[arg-type]
    finally:
        for forward in fitted_blocks(model).values():
            forward.cache_clear()


# NOTE [the probe step runs on copies of the batch]
# A fitted model plans a new signature when it is called, on the caller's own
# batch, before that call runs. The probe step is a whole training step: run on
# the caller's tensors, its backward would leave a gradient in a leaf input
# (which the real step then doubles) and backpropagate through a non-leaf one
# into the caller's graph; a forward that writes into its input would write
# twice. It runs on copies instead: each tensor of the batch cut from its graph
# and copied in its own layout (so the signature planned is the caller's), with
# its `requires_grad`. A tensor with gaps or overlapping elements, whose
# layout a copy does not keep, is only cut from its graph (such a tensor cannot
# be written in place). The copies were live before the step, as the batch is,
# so the step's peak above that is the same.
def _copies_of_the_batch(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Sequence[Any], dict[str, Any]]:
    """`args` and `kwargs` with every tensor a copy the probe step may use freely: NOTE [the probe step runs
    on copies of the batch]."""

    def copy(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        copied = leaf.detach().clone()
        if copied.stride() != leaf.stride():
            copied = leaf.detach()
        return copied.requires_grad_(leaf.requires_grad)

    tree = optree.tree_map(copy, opened((tuple(args), kwargs), NAMESPACE), namespace=NAMESPACE)
    return closed(tree, NAMESPACE)  # type: ignore[no-any-return]


def probe_step(
    model: nn.Module,
    loss: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    device: torch.device | None,
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> tuple[_step.Timeline, int]:
    """The probe step's timeline (`model(*args, **kwargs)`, `loss` of its output, its backward; on fake
    tensors of `device` for a model on meta), with `optimizer`'s step after it, and the bytes of new
    optimizer state."""
    with _put_back(model), _stepping(model, device, args, kwargs) as (call, parameters, fakes):
        # Without a GPU, the backward of fake CUDA tensors is walked, releasing saved tensors as the engine
        # does (NOTE [a backward walked without the engine]).
        saved = None if device is None or engine_runs_on(device) else SavedTensors()

        def step() -> None:
            with saved.packing() if saved is not None else contextlib.nullcontext():
                value = loss(call())
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
                raise ValueError(
                    "remat.fit: `loss` must give a scalar tensor that requires grad (the value the step "
                    f"backpropagates), but gave {value!r}."
                )
            if saved is None:
                value.backward()
            else:
                walked_backward([value], [torch.ones_like(value)], saved)

        recorder = _step.run_step(step, fakes, _step.kernel_workspaces(parameters))
        # Distinct storages: FSDP2's gradient shards of a block are views of one reduce-scatter output.
        grads = [on_this_rank(p.grad) for p in parameters if p.grad is not None]
        gradients = sum({storage_key(g): storage_nbytes(g) for g in grads}.values())
        timeline = _step.timeline_of(recorder, gradients)
    if optimizer is None:
        return timeline, 0
    step_peak, state = _optimizer_step(optimizer, device)
    last = timeline.segments[-1]
    after = _step.Segment(_step.Phase.OUTSIDE, None, last.alive, timeline.end + step_peak, "optimizer.step")
    return dataclasses.replace(timeline, segments=(*timeline.segments, after)), state


# NOTE [planning on every rank]
# Under FSDP2 each rank runs the same step on its own shard of the batch and
# of the parameters, and plans it with its own probe step, whose collectives
# (the all-gathers and reduce-scatters of the step itself) every rank issues
# in the same order, as in training: `fit` is called on every rank. The ranks
# then agree on what they measured, each segment of the step at its largest
# over the ranks, and solve the same program from it: every rank checkpoints
# alike, and the plan holds on the rank whose memory is tightest.


def agreed_across_ranks(model: nn.Module, timeline: _step.Timeline, state: int) -> tuple[_step.Timeline, int]:
    """The probe step's timeline and optimizer state at their largest over the ranks of a model sharded with
    FSDP2 (NOTE [planning on every rank]); as they are otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return timeline, state
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return timeline, state
    mine = [len(timeline.segments), timeline.peak, timeline.gradients, timeline.end, state]
    mine += [segment.peak for segment in timeline.segments]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len({len(theirs) for theirs in everyone}) != 1:
        raise ValueError(
            "remat.fit: the ranks' probe steps ran different block calls; every rank must run the same step "
            "(the same model and batch shapes) and call `remat.fit` together."
        )
    largest = [max(values) for values in zip(*everyone, strict=True)]
    _, peak, gradients, end, state, *peaks = largest
    segments = tuple(dataclasses.replace(s, peak=p) for s, p in zip(timeline.segments, peaks, strict=True))
    return dataclasses.replace(timeline, segments=segments, peak=peak, gradients=gradients, end=end), state


def on_this_rank(tensor: torch.Tensor) -> torch.Tensor:
    """What `tensor` holds on this rank: a DTensor's shard (FSDP2's parameters, gradients and optimizer
    state), any other tensor itself."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.to_local()
    return tensor


def _optimizer_step(optimizer: torch.optim.Optimizer, device: torch.device | None) -> tuple[int, int]:
    """(peak bytes, bytes of new state) of one `optimizer.step()`, measured on meta copies of its
    parameters and gradients (nothing real is touched). State it already holds was live before the step
    and is not counted; a first step allocates its state."""
    copies: dict[int, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            meta = nn.Parameter(torch.empty_like(on_this_rank(p), device="meta"), requires_grad=p.requires_grad)
            if p.requires_grad:
                meta.grad = torch.empty_like(meta)
            copies[id(p)] = meta
            params.append(meta)
        options = {k: v for k, v in group.items() if k != "params"}
        on_cuda = device.type == "cuda" if device is not None else any(p.is_cuda for p in group["params"])
        if options.get("foreach") is None and on_cuda:
            options["foreach"] = True  # what torch chooses on CUDA; on meta it would loop over the tensors
        groups.append({**options, "params": params})
    kind: Any = type(optimizer)
    try:
        replica = kind(groups)
    except TypeError as error:
        raise TypeError(
            f"remat.fit: cannot make a copy of the optimizer {type(optimizer).__name__} on the meta device to "
            f"measure its step ({error}); plan without `optimizer=` and leave room for its state."
        ) from None
    for p, state in optimizer.state.items():
        if id(p) in copies:
            replica.state[copies[id(p)]] = {
                k: torch.empty_like(on_this_rank(v), device="meta") if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in state.items()
            }
    recorder = _step.run_step(replica.step)
    return recorder.peak, recorder.total
