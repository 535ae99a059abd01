"""The discovery pass: `fn` run once on fake tensors, to find the tensors it closes over, its outputs, the
differentiable inputs it updates in place, and the bases of outputs whose elements may share memory.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch

from .._core._cache import requires_grad_at_any_level
from .._core._contexts import outside_functorch
from .._core._pytree import FlatArgs, flatten_outputs
from .._eager._capture import ModuleRoots, capture_mode
from .._torch import FakeTensor, FakeTensorMode, is_functorch_wrapped, unset_fake_temporarily, version_counter

__all__ = ["Discovery", "all_floats", "bases_to_return", "discover", "fake_like", "is_differentiated"]


@dataclasses.dataclass(frozen=True)
class Discovery:
    closed_over: tuple[torch.Tensor, ...]
    output_spec: optree.PyTreeSpec
    output_fakes: tuple[torch.Tensor, ...]
    reached_modules: tuple[torch.nn.Module, ...]
    dirty: tuple[int, ...]  # differentiable arguments updated in place
    # Output -> the position of its base in `bases`: NOTE [outputs whose elements may share memory].
    rebuilt: Mapping[int, int]
    bases: tuple[torch.Tensor, ...]
    forward_mode: bool  # traced for forward mode: the only traces that return bases (see the NOTE)

    def differentiated(self, differentiated_inputs: Sequence[bool]) -> tuple[int, ...]:
        """The indices of the forward outputs that get a tangent: `fn`'s outputs with a history that the
        Function returns, the new values of differentiable inputs `fn` updates in place, the bases
        with a history."""
        n_outputs, n_dirty = len(self.output_fakes), len(self.dirty)
        return (
            *(i for i, o in enumerate(self.output_fakes) if _has_history(o) and i not in self.rebuilt),
            *(n_outputs + j for j, i in enumerate(self.dirty) if differentiated_inputs[i]),  # others: jvp only
            *(n_outputs + n_dirty + j for j, base in enumerate(self.bases) if _has_history(base)),
        )


# NOTE [outputs whose elements may share memory]
# Traced for forward mode, the Function never returns an output some of whose
# elements may share memory (an `expand`, an `unfold` with overlapping
# windows): that output is a view, and the Function returns its base (as an
# extra output) instead, from which the epilogue takes the view again.
# Autograd gives each output of a Function the tangent of its jvp rule, copied
# into the output's layout where the two differ, and under torch.func transforms the rule's tangents cannot have the
# layout (vmap chooses where their batch lies): the copy into memory that
# elements share fails. Taken outside the Function, the view gets its tangent
# from the view op's own rule, in its layout, as in eager (and its gradient
# reaches the base through the view op's backward, also as in eager). An output
# that is a view of an input or of another output is rebuilt by the epilogue
# anyway. Traced for reverse mode alone, the Function returns the view itself,
# whose gradient's layout is then eager's under torch.func too (through the
# base, a gradient under `torch.func.vjp` came out in another layout).
def bases_to_return(
    outputs: Sequence[torch.Tensor], owners: Sequence[torch.Tensor]
) -> tuple[dict[int, int], list[torch.Tensor]]:
    """The outputs to take again from their bases (-> the position of the base) and the bases, for the
    `outputs` of `fn`: views whose elements may share memory, of a tensor that is not one of the
    `owners` (the inputs) nor one of the outputs."""
    rebuilt_elsewhere = {id(t) for t in (*owners, *outputs)}
    rebuilt: dict[int, int] = {}
    bases: list[torch.Tensor] = []
    for i, output in enumerate(outputs):
        if not output._is_view() or not _elements_may_share_memory(output):
            continue
        base = output._base
        if base is None or id(base) in rebuilt_elsewhere:
            continue
        position = next((j for j, b in enumerate(bases) if b is base), len(bases))
        if position == len(bases):
            bases.append(base)
        rebuilt[i] = position
    return rebuilt, bases


def _elements_may_share_memory(tensor: torch.Tensor) -> bool:
    """Whether two elements of `tensor` may be one place in memory: unless each stride, in increasing
    order, steps past every place the smaller ones reach. (A size that depends on data is not looked
    at: an output of such a size is returned as it is.)"""
    shape, strides = tensor.shape, tensor.stride()
    if not all(isinstance(n, int) for n in (*shape, *strides)):
        return False
    reach = 0  # the farthest place, from the first element, that the smaller strides reach
    for stride, size in sorted((stride, size) for size, stride in zip(shape, strides, strict=True) if size > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


# NOTE [in-place updates of differentiable inputs]
# Eager lets `fn` update in place an input that requires grad when that input
# is not a leaf (`x += self.mlp(x)` in a residual block). Tracing would see a
# leaf, so the argument is passed to `fn` as a fresh non-leaf copy; the copy is
# removed from the graph afterwards (the graph is functional, so reads of the
# copy are reads of the input). The input's new value becomes an extra output
# with its own tangent, is written back into the input by the forward program,
# and the Function returns the input itself marked dirty, so that autograd
# gives it the Function as its new history, as eager does.
#
# An update autograd does not record (under `no_grad`, or through `.detach()`)
# is allowed on leaves too and changes no history: it is written back like any
# input's. Forward-mode AD sees through `no_grad`, so such an update changes
# the input's tangent: traced for forward mode, every float input updated in
# place is dirty, and the jvp rule updates its tangent in place, as autograd
# asks of a Function that updates an input. (Through `.detach()`, the input
# keeps its old tangent beside the new value, as in eager: see NOTE [updates
# under no_grad keep their tensors' histories].)


def fake_like(fake_mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake tensor with `tensor`'s logical metadata (its per-example view under `vmap`)."""
    if is_functorch_wrapped(tensor) or (isinstance(tensor, FakeTensor) and tensor.fake_mode is not fake_mode):
        with fake_mode:
            return torch.empty_strided(tuple(tensor.shape), tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    with unset_fake_temporarily():  # a real tensor detached under the fake mode (discovery's) has no real data
        detached = tensor.detach()
    return fake_mode.from_tensor(detached)


def discover(
    fn: Callable[..., Any],
    flat_args: FlatArgs,
    roots: ModuleRoots,
    fake_mode: FakeTensorMode,
    forward_mode: bool,
) -> Discovery:
    """Run `fn` once on fake tensors to find closed-over tensors and the output structure."""
    fakes = []
    for tensor in flat_args.tensors:
        fake = fake_like(fake_mode, tensor)
        if is_differentiated(tensor):
            with fake_mode, torch.enable_grad():
                fake = fake.requires_grad_().clone()  # see NOTE [in-place updates of differentiable inputs]
        fakes.append(fake)
    versions = [version_counter(fake) for fake in fakes]
    histories = [fake.grad_fn for fake in fakes]
    reached: dict[int, torch.nn.Module] = {}

    def fakeify(tensor: torch.Tensor) -> torch.Tensor:
        # Called while `fn` runs, maybe inside a torch.func transform of its own.
        with outside_functorch():
            return fake_like(fake_mode, tensor).requires_grad_(is_differentiated(tensor))

    tracing_thread = threading.get_ident()

    def note_module(module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == tracing_thread:  # module hooks are global: only this thread's
            reached.setdefault(id(module), module)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(note_module)
    try:
        with fake_mode, torch.enable_grad(), capture_mode(roots, None, fakeify, fake_mode=fake_mode) as mode:
            rebuilt_args = flat_args.rebuild_objects(fakes)
            args, kwargs = rebuilt_args.arguments
            out = fn(*args, **kwargs)
    finally:
        hook.remove()
    rebuilt_args.check_unwritten("remat.checkpoint")
    outputs, output_spec = flatten_outputs(out)
    outputs = [mode.record_closed_over(o) for o in outputs]  # a closed-over tensor returned as is
    closed_over = tuple(mode.closed_over.values())
    rebuilt, bases = bases_to_return(outputs, [*fakes, *closed_over]) if forward_mode else ({}, [])
    # An update autograd does not see (under no_grad, or through `.detach()`) leaves the input's
    # history alone, as in eager: it is written back like an update of an input without grad.
    dirty = tuple(
        i
        for i, (fake, version, history) in enumerate(zip(fakes, versions, histories, strict=True))
        if version_counter(fake) != version
        and ((fake.requires_grad and fake.grad_fn is not history) or (forward_mode and all_floats(fake)))
    )
    return Discovery(
        closed_over, output_spec, tuple(outputs), tuple(reached.values()), dirty, rebuilt, tuple(bases), forward_mode
    )


def _has_history(output: torch.Tensor) -> bool:
    """Whether autograd can differentiate `output` back into `fn`'s inputs. A view `fn` took under
    `no_grad` of a tensor that requires grad requires grad too, but as a leaf of its own: as in eager,
    no gradient reaches its base through it."""
    return output.requires_grad and not (output.is_leaf and output._is_view())


def all_floats(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def is_differentiated(tensor: torch.Tensor) -> bool:
    """Whether the trace differentiates `tensor`. Under a torch.func transform the levels below
    this one run the same Function, so a float input that requires grad at any of them is."""
    return all_floats(tensor) and requires_grad_at_any_level(tensor)
