"""One run of a function for `remat.testing.assert_checkpoint_equivalent`: its outputs, gradients and
what it changed (module state, generators), recorded for the comparison.

Its interface (`__all__`), for the equivalence check: how both functions are called (`CallPlan`) and
the state they change that is compared (`ComparedState`, from `state_module_of` and `buffers_of`);
`record_run`, which makes one `Run` (with an `OutputMetadata` per tensor output) under a
`UserGenerators` recorder for eager's run; and `kind_of`, how an error message names a value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from .._torch import version_counter
from ._strategies import RandomFunction
from ._transforms import fresh, is_float, random_like, tensor_leaves

__all__ = [
    "CallPlan",
    "ComparedState",
    "OutputMetadata",
    "Run",
    "UserGenerators",
    "buffers_of",
    "kind_of",
    "record_run",
    "state_module_of",
]


@dataclasses.dataclass
class OutputMetadata:
    """What is compared of one tensor output beyond its value: how it relates to autograd and to the inputs."""

    requires_grad: bool
    grad_fn: str | None  # the name of its grad_fn's type; None for a leaf
    layout: tuple[int, ...] | None  # the strides of its dimensions of size > 1
    aliases: tuple[int, ...]  # the input tensors whose memory it shares
    identity: int | None  # the input tensor it is, if any
    view_of: int | None  # the input tensor it is a view of (its `_base`), if any
    versions: tuple[int, ...] = ()  # the input tensors it shares a version counter with (views, detaches)


@dataclasses.dataclass
class Run:
    """What one call of a function computed and changed, and what its backward gave, recorded for the
    comparison."""

    tree: Any  # the output pytree
    outputs: list[Any]  # its leaves
    spec: Any
    metadata: list[OutputMetadata | None]  # per output (None for a non-tensor)
    inputs_after: list[torch.Tensor]  # the input tensors' values after the call (in-place updates)
    input_grads: list[torch.Tensor | None]
    param_grads: list[torch.Tensor | None]
    backpropagated: tuple[int, ...]  # the outputs given a cotangent
    rng_after: torch.Tensor  # the CPU generator's state after the call and backward
    cuda_rng_after: list[torch.Tensor]  # each CUDA device's default generator state, where CUDA is in use
    buffers_after: list[tuple[str, torch.Tensor]]  # the buffers of the module whose state is compared
    generators_after: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # by id, user generators


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """How both functions are called and backpropagated through."""

    args: Any
    kwargs: dict[str, Any]
    params: Sequence[torch.Tensor]  # closed-over tensors whose `.grad` is compared
    seed: int
    backward: bool
    backprop: frozenset[int] | None  # the outputs to backpropagate through; None: every one
    calls: int = 1  # how many times in a row each function is called


@dataclasses.dataclass(frozen=True)
class ComparedState:
    """The state both functions change that is put back before the checkpoint's run and compared after
    each call: the buffers of the module each side runs (None: no module to compare)."""

    expected_buffers: list[tuple[str, torch.Tensor]] | None
    actual_buffers: list[tuple[str, torch.Tensor]] | None

    def snapshot(self) -> list[torch.Tensor]:
        return [buffer.detach().clone() for _, buffer in self.actual_buffers or ()]

    def restore(self, saved: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for (_, buffer), value in zip(self.actual_buffers or (), saved, strict=True):
                buffer.copy_(value)


def state_module_of(fn: Any) -> torch.nn.Module | None:
    """The module whose parameters and buffers `fn` runs: itself, or a random function's `CatalogState`."""
    if isinstance(fn, torch.nn.Module):
        return fn
    if isinstance(fn, RandomFunction):
        return fn.state
    return None


def buffers_of(fn: Any) -> list[tuple[str, torch.Tensor]] | None:
    """The named buffers of `fn`'s state module (`state_module_of`); None where it has none."""
    module = state_module_of(fn)
    return None if module is None else list(module.named_buffers())


class UserGenerators(TorchFunctionMode):
    """Records the user generators (other than torch's default ones) that torch functions are given
    while active, each with the state it had when first seen: its state before the function drew
    from it. Only those that outlive the call count: a generator made inside the call (the checker's
    own for tangents, a user's seeded afresh at each call) is referenced by nothing else once it
    returns. (Held here, not weakly: a `torch.Generator` takes no weak reference before torch 2.13.)"""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, torch.Generator] = {}
        self.start: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator) and not _is_default(value) and id(value) not in self.seen:
                self.seen[id(value)] = value
                self.start[id(value)] = value.get_state()
        return func(*args, **kwargs)

    @property
    def generators(self) -> dict[int, torch.Generator]:
        """The generators seen that something other than this recorder still holds, by id, in the
        order first seen."""
        probe = {0: torch.Generator()}  # held only here: its count is that of a generator nothing else holds
        alone = _references(probe, 0)
        return {key: self.seen[key] for key in [key for key in self.seen if _references(self.seen, key) > alone]}

    def states(self) -> dict[int, torch.Tensor]:
        """The state of each live generator seen; the state it was first seen in for the others."""
        return {**self.start, **{key: generator.get_state() for key, generator in self.generators.items()}}

    def put_back(self) -> None:
        for key, generator in self.generators.items():
            generator.set_state(self.start[key])


def _references(held: dict[int, torch.Generator], key: int) -> int:
    """How many references the generator `held[key]` has, counted the same way for every one."""
    return sys.getrefcount(held[key])


def _is_default(generator: torch.Generator) -> bool:
    defaults = [torch.default_generator]
    if torch.cuda.is_available():
        defaults += list(torch.cuda.default_generators)
    return any(generator is default for default in defaults)


def _cuda_rng_states() -> list[torch.Tensor]:
    """The default CUDA generators' states, where CUDA is in use (asking would start it otherwise)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(torch.cuda.get_rng_state_all())


def record_run(
    fn: Callable[..., Any],
    call: CallPlan,
    state: ComparedState,
    index: int,
    recording: contextlib.AbstractContextManager[Any] | None = None,
) -> Run:
    """Call `fn` (for the `index`-th time in a row) on fresh copies of the arguments and backpropagate,
    under `recording` (eager's run, whose user generators are found so) or as the checkpoint."""
    params, backward, backprop = call.params, call.backward, call.backprop
    seed = call.seed + index
    for param in params:
        param.grad = None
    args, kwargs = fresh((call.args, call.kwargs))
    leaves = tensor_leaves((args, kwargs))
    torch.manual_seed(seed)
    with recording or contextlib.nullcontext():
        tree = fn(*args, **kwargs)
    outputs, spec = optree.tree_flatten(tree, none_is_leaf=False)
    generator = torch.Generator().manual_seed(seed)
    # One cotangent per float output, drawn in order, so that an output gets the same one in both runs.
    cotangents = {
        i: random_like(o, generator) for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and is_float(o)
    }
    backpropagated = tuple(i for i in cotangents if outputs[i].requires_grad and (backprop is None or i in backprop))
    if backward and backpropagated:
        with recording or contextlib.nullcontext():
            torch.autograd.backward([outputs[i] for i in backpropagated], [cotangents[i] for i in backpropagated])
    buffers = state.actual_buffers if recording is None else state.expected_buffers
    run = Run(
        tree=tree,
        outputs=outputs,
        spec=spec,
        metadata=[_output(o, leaves) for o in outputs],
        inputs_after=[t.detach().clone() for t in leaves],
        input_grads=[t.grad for t in leaves],
        param_grads=[None if p.grad is None else p.grad.clone() for p in params],
        backpropagated=backpropagated if backward else (),
        rng_after=torch.get_rng_state(),
        cuda_rng_after=_cuda_rng_states(),
        buffers_after=[(name, b.detach().clone()) for name, b in buffers or ()],
    )
    _find_shared_versions(run.metadata, outputs, leaves)  # last: it bumps the inputs' version counters
    return run


def _output(value: Any, leaves: Sequence[torch.Tensor]) -> OutputMetadata | None:
    if not isinstance(value, torch.Tensor):
        return None
    base = value._base if value._is_view() else None
    return OutputMetadata(
        requires_grad=value.requires_grad,
        grad_fn=None if value.grad_fn is None else type(value.grad_fn).__name__,
        layout=_layout(value),
        aliases=_aliased_inputs(value, leaves),
        identity=next((i for i, t in enumerate(leaves) if value is t), None),
        view_of=next((i for i, t in enumerate(leaves) if base is t), None),
    )


def _find_shared_versions(
    metadata: list[OutputMetadata | None], outputs: Sequence[Any], leaves: Sequence[torch.Tensor]
) -> None:
    """Which inputs each output shares a version counter with (a view or a `detach()` of one does):
    bump each input's counter and see which outputs' counters move."""
    # Inference tensors have no version counter.
    tensors = [(m, o) for m, o in zip(metadata, outputs, strict=True) if m is not None and not o.is_inference()]
    shared: list[list[int]] = [[] for _ in tensors]
    for i, leaf in enumerate(leaves):
        before = [version_counter(o) for _, o in tensors]
        torch.autograd.graph.increment_version(leaf)
        for k, ((_, output), version) in enumerate(zip(tensors, before, strict=True)):
            if version_counter(output) != version:
                shared[k].append(i)
    for (meta, _), inputs in zip(tensors, shared, strict=True):
        if meta is not None:
            meta.versions = tuple(inputs)


def _layout(value: Any) -> tuple[int, ...] | None:
    """The strides of a tensor's dimensions of size > 1 (the others' strides mean nothing)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    return tuple(stride for stride, size in zip(value.stride(), value.shape, strict=True) if size > 1)


def _aliased_inputs(value: Any, leaves: Sequence[torch.Tensor]) -> tuple[int, ...]:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or not value.numel():
        return ()
    storage = value.untyped_storage().data_ptr()
    return tuple(
        i
        for i, t in enumerate(leaves)
        if t.layout == torch.strided and t.numel() and t.untyped_storage().data_ptr() == storage
    )


def kind_of(value: Any) -> str:
    """How an error message names `value`: "a tensor", or its repr and type."""
    return "a tensor" if isinstance(value, torch.Tensor) else f"{value!r} ({type(value).__name__})"
