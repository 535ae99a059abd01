"""Tracing: `fn` and example inputs -> a joint forward+backward graph and its `Trace`.

The joint graph is recorded by `make_fx` on fake tensors, functionalized the
way AOTAutograd does it (`FunctionalTensorMode`), so that mutations of inputs
become explicit `copy_` nodes at the end and every other node is pure. The
forward part of it is then described, call by call, as a `remat.Trace`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import optree
import torch
from torch import fx

from . import _quirks, _rng
from ._applications import ApplicationRecorder
from ._cache import requires_grad_at_any_level
from ._calls import Call, TensorMeta, Trace
from ._capture import (
    DetachedViews,
    ModuleRoots,
    StateSlot,
    capture_mode,
    has_hooks,
    redirect_histories,
    variable_slots,
)
from ._contexts import (
    autocast_cache_enabled,
    autocast_disabled,
    cast_once,
    dispatch_keys_put_back,
    outside_functorch,
    without_saved_tensors_hooks,
)
from ._engine import engine_can_run, walked_gradients
from ._error_checks import FunctionalModeKeepingChecks, kept_as_dead_code
from ._errors import TraceError, explain_tracing_errors
from ._facts import (
    add_tag,
    note_differentiable_outputs,
    note_stop_gradient,
    site_of,
    stop_gradient_of,
    tags_of,
)
from ._fake_kernels import EagerLayoutFakeMode
from ._gpu import attention_as_on_the_gpu
from ._in_place import eager_fidelity
from ._measure import estimate_flops, output_nbytes
from ._noting_modes import NodesWithoutGrad
from ._pytree import FlatArgs, flatten_outputs
from ._rng import seeding_refused
from ._specialize import CHECKS, check_coverage, check_value, checks_of, refuse_float_reads, use_remat_checks
from ._specialize import describe as describe_check
from ._torch import (
    FakeTensor,
    FakeTensorMode,
    FunctionalTensor,
    GuardOnDataDependentSymNode,
    OpOverload,
    ShapeEnv,
    carry_real_values,
    fake_kernel_errors_unlogged,
    forget_pending_sizes,
    from_functional,
    function_applications_noted,
    functorch_active,
    get_proxy_mode,
    grad_dtype_override,
    grad_transform_active,
    has_data_mutation,
    insert_value_checks,
    is_functorch_wrapped,
    is_saved_value_modified,
    lazy_graph_modules,
    make_fx,
    op_schema,
    outside_compilers_tracing,
    real_values_traced,
    sync,
    unset_fake_temporarily,
    version_counter,
)

__all__ = ["JointGraph", "is_tracing", "joint_graph_of", "nested_checkpoint", "stops_gradient"]

aten = torch.ops.aten

# Ops whose output is a view of (or a fresh alias of) their first argument:
# keeping one costs nothing beyond its base, so they are not offered to a
# policy and follow their base. See NOTE [free ops follow their base].
_ALIASING_OPS = frozenset({aten._unsafe_view.default, aten.reshape.default, aten.alias.default})


@dataclasses.dataclass(frozen=True)
class JointGraph:
    """The traced joint graph of one signature, with its forward part identified.

    Placeholders are the primals (the tensor leaves of the arguments, then the
    lifted closed-over tensors) followed by one tangent per differentiable
    output. The output node returns the forward outputs, then one gradient per
    primal that requires grad and has one (`grad_of` says which).

    The forward outputs are `fn`'s tensor outputs followed by the new values of
    the differentiable inputs `fn` updates in place (`dirty`): see NOTE [in-place
    updates of differentiable inputs], then the bases of the outputs rebuilt from
    them (`rebuilt`): see NOTE [outputs whose elements may share memory].
    """

    graph: fx.Graph
    constants: dict[str, Any]  # get_attr targets the graph reads
    primals: tuple[fx.Node, ...]
    tangents: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]  # one per tensor leaf of fn's output, one per dirty input, then bases
    n_user_outputs: int
    dirty: tuple[int, ...]  # primal indices of differentiable inputs that fn updates in place
    output_spec: optree.PyTreeSpec
    differentiable_outputs: tuple[int, ...]  # indices into outputs that receive a tangent
    grads: tuple[fx.Node, ...]
    grad_of: tuple[int, ...]  # primal index of each entry in grads
    forward_nodes: frozenset[fx.Node]
    mutations: tuple[fx.Node, ...]  # copy_ of new values back into primals
    call_nodes: tuple[fx.Node, ...]  # the node of each Call, in trace order
    trace: Trace
    lifted: tuple[StateSlot, ...]
    reached_modules: tuple[torch.nn.Module, ...]
    regions: tuple[tuple[Any, tuple[int, ...]], ...]  # (policy, call indices) of nested checkpoints
    under_functorch: bool | None  # traced for calls under a torch.func transform, or not; None: for both
    backward_in_grad_mode: bool  # traced for a backward that runs in grad mode: NOTE [a backward traced as it will run]
    # Where autocast was on: which tensor arguments it casts once per region (NOTE [autocast's cache of casts]).
    cast_once: tuple[bool, ...] | None
    value_checks: tuple[str, ...] = ()  # what the trace assumes of values Python read: NOTE [values Python reads]
    # User outputs taken again from their bases: NOTE [outputs whose elements may share memory].
    rebuilt: tuple[int, ...] = ()
    values: Any = None  # the value graph the rules run on (`_value_graph.with_value_graph`)
    backward_error: str | None = None  # what eager's backward raises: NOTE [a backward eager cannot run]

    @functools.cached_property
    def generators(self) -> tuple[torch.Generator, ...]:
        """The user's `torch.Generator`s the graph draws from (the default ones are not in it)."""
        return tuple(value for value in self.constants.values() if isinstance(value, torch.Generator))


def joint_graph_of(
    fn: Callable[..., Any], flat_args: FlatArgs, roots: ModuleRoots, *, forward_mode: bool = False
) -> JointGraph:
    """Trace `fn` at the signature of `flat_args` into a `JointGraph` (for forward-mode AD too,
    with `forward_mode`: see NOTE [in-place updates of differentiable inputs])."""
    under_functorch = functorch_active()  # see NOTE [dropout under torch.func]
    backward_in_grad_mode = grad_transform_active()  # see NOTE [a backward traced as it will run]
    outer_regions = _regions.recorded
    try:
        with (
            _ONE_TRACE_AT_A_TIME,
            explain_tracing_errors(fn),
            dispatch_keys_put_back(),  # NOTE [a failed trace leaves the thread's dispatch keys as it found them]
            without_saved_tensors_hooks(),
            outside_functorch(),
            seeding_refused(),  # NOTE [seeding inside a checkpointed function]
            unset_fake_temporarily(),  # a fake mode of the caller's: the trace has its own
            fake_kernel_errors_unlogged(),
            attention_as_on_the_gpu(flat_args.tensors),  # NOTE [kernels of a GPU this machine lacks]
        ):
            try:
                joint = _joint_graph_attempt(
                    fn, flat_args, roots, forward_mode, under_functorch, backward_in_grad_mode, with_values=False
                )
            except GuardOnDataDependentSymNode:
                if under_functorch:  # the inputs' values are not reachable under a transform
                    raise
                with real_values_traced():  # See NOTE [values Python reads].
                    joint = _joint_graph_attempt(
                        fn, flat_args, roots, forward_mode, under_functorch, backward_in_grad_mode, with_values=True
                    )
        _warn_about_hooks(joint.reached_modules, roots)
        return joint
    finally:
        _regions.recorded = outer_regions


def _joint_graph_attempt(
    fn: Callable[..., Any],
    flat_args: FlatArgs,
    roots: ModuleRoots,
    forward_mode: bool,
    under_functorch: bool,
    backward_in_grad_mode: bool,
    with_values: bool,
) -> JointGraph:
    # Sizes that depend on data are symbols; every other size is the int it is. See NOTE [kernels
    # that choose their output layout] and NOTE [data-dependent sizes count at their bound].
    fake_mode = EagerLayoutFakeMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    _regions.recorded = []
    # Traced with values, `fn` draws real numbers from every generator it uses: each is put back
    # after discovery, so that the trace draws the numbers discovery drew (and the call will), and
    # after the trace. NOTE [values Python reads]
    default_streams = _rng.snapshot()

    def put_streams_back() -> None:
        if with_values:
            default_streams()
            fake_mode.drawn_generators.put_back()

    try:
        discovery = _discover(fn, flat_args, roots, fake_mode, forward_mode)
        discovered_generators = fake_mode.drawn_generators.seen()
        forget_pending_sizes(fake_mode)
        put_streams_back()
        _regions.recorded = []
        joint = _make_joint_graph(
            fn, flat_args, roots, fake_mode, discovery, under_functorch, backward_in_grad_mode, with_values
        )
        _rng.check_generators_outlive_fn(joint.generators, discovered_generators)
        return joint
    finally:
        put_streams_back()


# NOTE [nested checkpoints]
# A checkpointed function called while another one is being traced does not
# trace itself: it runs inline, so its calls become part of the outer graph,
# and the calls it made are remembered with its policy. The outer partition
# then takes their decisions from that policy (asked about them as a trace of
# their own, indexed from 0), and the outer policy decides the rest, as
# `jax.checkpoint` inside `jax.checkpoint` does.
class _Regions(threading.local):
    recorded: list[tuple[Any, frozenset[fx.Node]]] | None = None


_regions = _Regions()

# make_fx and the global module hooks of a trace are not meant to run on two threads at
# once; tracing is rare (once per signature), so traces simply take turns.
_ONE_TRACE_AT_A_TIME = threading.RLock()


def is_tracing() -> bool:
    """Whether a remat trace is running `fn` on this thread right now."""
    return _regions.recorded is not None


@contextmanager
def nested_checkpoint(policy: Any) -> Iterator[None]:
    """Run a nested checkpointed function inline, noting the graph nodes it creates."""
    proxy_mode = get_proxy_mode()
    if proxy_mode is None or _regions.recorded is None:  # the discovery pass records no graph
        yield
        return
    graph = proxy_mode.tracer.graph
    before = next(iter(reversed(graph.nodes)))
    yield
    # The nodes made since, noted now: make_fx may yet remove some (sizes it no longer needs).
    created, node = [], before.next
    while node.op != "root":
        created.append(node)
        node = node.next
    _regions.recorded.append((policy, frozenset(created)))


def name_producer(tensor: torch.Tensor, name: str) -> None:
    """Give `name` to the call of the graph being traced that produced `tensor` (see `remat.tag`).

    The traced graph names `tensor` only through what it is computed from, so an
    alias of it is traced, its argument read off, and the alias removed again.
    """
    proxy_mode = get_proxy_mode()
    if proxy_mode is None:  # the discovery pass records no graph
        return
    graph = proxy_mode.tracer.graph
    last = next(iter(reversed(graph.nodes)))
    torch.ops.aten.alias.default(tensor)
    new_nodes = []
    for node in reversed(graph.nodes):
        if node is last:
            break
        new_nodes.append(node)
    for node in new_nodes:  # newest first: nothing reads them
        if node.target is aten.alias.default and isinstance(node.args[0], fx.Node):
            producer = node.args[0]
            while is_free(producer) and producer.op == "call_function" and isinstance(producer.args[0], fx.Node):
                producer = producer.args[0]
            add_tag(producer, name)
        graph.erase_node(node)


def _warn_about_hooks(modules: Sequence[torch.nn.Module], roots: ModuleRoots) -> None:
    """Hooks on modules that run inside the traced function run while tracing, on fake tensors,
    and never again: say so rather than skip them silently."""
    hooked = [m for m in modules if has_hooks(m)]
    if hooked:
        names = ", ".join(f"`{roots.paths.get(id(m), type(m).__name__) or type(m).__name__}`" for m in hooked[:5]) + (
            " and others" if len(hooked) > 5 else ""
        )
        warnings.warn(
            f"remat.checkpoint: {names} ha{'ve' if len(hooked) > 1 else 's'} forward or backward hooks, but runs "
            "inside the checkpointed function, where hooks run once while tracing (on fake tensors) and not on "
            "later calls or in backward. Register the hooks on a module outside the checkpoint, or checkpoint "
            "the module's forward instead (`remat.checkpoint_modules(model, ...)` keeps its hooks running).",
            UserWarning,
            stacklevel=5,
        )


@dataclasses.dataclass(frozen=True)
class _Discovery:
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
def _bases_to_return(
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


def _put_bases_on_their_views(
    output_node: fx.Node, returned: list[Any], discovery: _Discovery, inputs: set[fx.Node]
) -> tuple[int, ...]:
    """Make each base returned for a view the node its view's chain of views starts from, which the
    epilogue takes the view from again (in place, in `returned` and the graph's output); the outputs
    rebuilt from them. The tensor autograd calls the view's base may have been traced as another node of
    the same value (a second `detach` of one tensor), and a view of a detach of an input (a new tensor to
    autograd) is a view of the input's memory, which the epilogue rebuilds from the input (`inputs`:
    the primals and the final values of those `fn` updates; its base stays an output nothing reads)."""
    first_base = len(discovery.output_fakes) + len(discovery.dirty)
    rebuilt = []
    for output, position in discovery.rebuilt.items():
        base = returned[first_base + position]
        chain = [returned[output]]
        while (
            chain[-1] is not base and chain[-1] not in inputs and chain[-1].op == "call_function" and is_free(chain[-1])
        ):
            chain.append(chain[-1].args[0])
        if chain[-1] in inputs:
            continue  # a view of an input: rebuilt from it, as any
        rebuilt.append(output)
        if chain[-1] is base:
            continue
        same = [n for n in chain if _same_view(n, base)]
        if not same:
            raise TraceError(
                f"remat.checkpoint: output {output} of fn is a view whose elements share memory, and remat "
                "could not find the tensor it views among the views it was taken through; please report this."
            )
        returned[first_base + position] = same[0]
        output_node.args = (returned,)
    return tuple(rebuilt)


def _same_view(a: fx.Node, b: fx.Node) -> bool:
    """Whether `a` and `b` are the same chain of views (`detach`es, say) of one node."""
    while a is not b:
        if not (a.op == b.op == "call_function" and is_free(a) and (a.target, a.kwargs) == (b.target, b.kwargs)):
            return False
        if len(a.args) != len(b.args) or a.args[1:] != b.args[1:]:
            return False
        a, b = a.args[0], b.args[0]  # type: ignore[assignment]
    return True


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


def _fake_like(fake_mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake tensor with `tensor`'s logical metadata (its per-example view under `vmap`)."""
    if is_functorch_wrapped(tensor) or (isinstance(tensor, FakeTensor) and tensor.fake_mode is not fake_mode):
        with fake_mode:
            return torch.empty_strided(tuple(tensor.shape), tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    with unset_fake_temporarily():  # a real tensor detached under the fake mode (discovery's) has no real data
        detached = tensor.detach()
    return fake_mode.from_tensor(detached)


def _discover(
    fn: Callable[..., Any],
    flat_args: FlatArgs,
    roots: ModuleRoots,
    fake_mode: FakeTensorMode,
    forward_mode: bool,
) -> _Discovery:
    """Run `fn` once on fake tensors to find closed-over tensors and the output structure."""
    fakes = []
    for tensor in flat_args.tensors:
        fake = _fake_like(fake_mode, tensor)
        if _requires_grad(tensor):
            with fake_mode, torch.enable_grad():
                fake = fake.requires_grad_().clone()  # see NOTE [in-place updates of differentiable inputs]
        fakes.append(fake)
    versions = [version_counter(fake) for fake in fakes]
    histories = [fake.grad_fn for fake in fakes]
    reached: dict[int, torch.nn.Module] = {}

    def fakeify(tensor: torch.Tensor) -> torch.Tensor:
        # Called while `fn` runs, maybe inside a torch.func transform of its own.
        with outside_functorch():
            return _fake_like(fake_mode, tensor).requires_grad_(_requires_grad(tensor))

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
    rebuilt, bases = _bases_to_return(outputs, [*fakes, *closed_over]) if forward_mode else ({}, [])
    # An update autograd does not see (under no_grad, or through `.detach()`) leaves the input's
    # history alone, as in eager: it is written back like an update of an input without grad.
    dirty = tuple(
        i
        for i, (fake, version, history) in enumerate(zip(fakes, versions, histories, strict=True))
        if version_counter(fake) != version
        and ((fake.requires_grad and fake.grad_fn is not history) or (forward_mode and _all_floats(fake)))
    )
    return _Discovery(
        closed_over, output_spec, tuple(outputs), tuple(reached.values()), dirty, rebuilt, tuple(bases), forward_mode
    )


def _tangent_like(fake_mode: FakeTensorMode, output: torch.Tensor, *, contiguous: bool = False) -> torch.Tensor:
    """The fake gradient of an output (`contiguous`, or in the output's layout). Traced with values, an
    output whose size depends on data gets a gradient of the size it has in this call: torch cannot carry
    real data beside a fake whose size is a symbol, so the trace specializes on that size (and checks
    it). NOTE [values Python reads]"""
    layout = torch.contiguous_format if contiguous else torch.preserve_format
    real = getattr(output, "real_tensor", None)
    if real is not None and any(isinstance(size, torch.SymInt) for size in output.shape):
        return fake_mode.from_tensor(torch.empty_like(real, memory_format=layout))
    return torch.empty_like(output, memory_format=layout)


def _is_detached(output: torch.Tensor) -> bool:
    """Whether `output` is what a detach makes: no view, and no history."""
    return not output.requires_grad and not output._is_view()


def _has_history(output: torch.Tensor) -> bool:
    """Whether autograd can differentiate `output` back into `fn`'s inputs. A view `fn` took under
    `no_grad` of a tensor that requires grad requires grad too, but as a leaf of its own: as in eager,
    no gradient reaches its base through it."""
    return output.requires_grad and not (output.is_leaf and output._is_view())


def _all_floats(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _requires_grad(tensor: torch.Tensor) -> bool:
    """Whether the trace differentiates `tensor`. Under a torch.func transform the levels below
    this one run the same Function, so a float input that requires grad at any of them is."""
    return _all_floats(tensor) and requires_grad_at_any_level(tensor)


def _make_joint_graph(
    fn: Callable[..., Any],
    flat_args: FlatArgs,
    roots: ModuleRoots,
    fake_mode: EagerLayoutFakeMode,
    discovery: _Discovery,
    under_functorch: bool,
    backward_in_grad_mode: bool,
    with_values: bool,
) -> JointGraph:
    real_primals = [*flat_args.tensors, *discovery.closed_over]
    fake_primals = [_fake_like(fake_mode, t) for t in real_primals]
    joint = _ForwardThenBackward(
        fn, flat_args, roots, discovery, fake_primals, fake_mode, under_functorch, backward_in_grad_mode, with_values
    )
    outputs = [*discovery.output_fakes, *(fake_primals[i] for i in discovery.dirty), *discovery.bases]
    first_base = len(outputs) - len(discovery.bases)
    with fake_mode:
        # A base's gradient comes from the backward of the views taken of it (a sum, for an `expand`),
        # contiguous, whatever the base's layout: the backward is traced for the layout it will get.
        fake_tangents = [_tangent_like(fake_mode, outputs[i], contiguous=i >= first_base) for i in joint.differentiable]
    with lazy_graph_modules(), outside_compilers_tracing():  # never called: only its graph is read
        gm = make_fx(joint, tracing_mode="fake", _allow_non_fake_inputs=True)(fake_primals, fake_tangents)
    guarded_ints: set[str] = set()
    if with_values:  # See NOTE [values Python reads].
        assert fake_mode.shape_env is not None
        guarded_ints, guarded_floats = insert_value_checks(gm, fake_mode.shape_env)
        refuse_float_reads(guarded_floats)
    live = set(gm.graph.nodes)  # nested checkpoints' regions, before clean-up
    regions = [(policy, nodes & live) for policy, nodes in _regions.recorded or ()]
    _clean_up(gm.graph, joint.copies, guarded_ints)
    return _joint_graph(gm, fn, roots, fake_mode, discovery, joint, under_functorch, len(real_primals), regions)


class _ForwardThenBackward:
    """`fn` and its gradients, as one function of (primals, tangents) for `make_fx` to trace.

    Tracing it also records what the graph alone does not say: the nodes `fn` itself ran
    (`ran_in_fn`) and detached (`detached`), which primals have a gradient (`grad_of`), the
    copies of dirty inputs to remove afterwards (`copies`), and whether dropout's layout
    matters (NOTE [dropout under torch.func]).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        flat_args: FlatArgs,
        roots: ModuleRoots,
        discovery: _Discovery,
        fake_primals: list[torch.Tensor],
        fake_mode: EagerLayoutFakeMode,
        under_functorch: bool,
        backward_in_grad_mode: bool,
        with_values: bool,
    ):
        self.fn, self.flat_args, self.roots, self.discovery = fn, flat_args, roots, discovery
        self.fake_mode = fake_mode
        self.fake_primals, self.under_functorch, self.with_values = fake_primals, under_functorch, with_values
        self.backward_in_grad_mode = backward_in_grad_mode
        self.autocast_cache_enabled = torch.is_autocast_cache_enabled()  # make_fx turns it off
        self.autocast_seen = False
        self.backward_error: str | None = None  # NOTE [a backward eager cannot run]
        self.n_args = len(flat_args.tensors)
        self.differentiated = [_requires_grad(t) for t in [*flat_args.tensors, *discovery.closed_over]]
        # See NOTE [gradients in another dtype than the tensor's].
        self.grad_dtypes = {
            i: dtype
            for i, t in enumerate([*flat_args.tensors, *discovery.closed_over])
            for overridden, dtype in [grad_dtype_override(t)]
            if overridden
        }
        self.differentiable = discovery.differentiated(self.differentiated)
        self.ran_in_fn: set[fx.Node] = set()  # the graph's nodes when fn returned (some may be dead code later)
        self.detached: set[fx.Node] = set()
        self.detached_views = DetachedViews()  # NOTE [detaches functionalization replays]
        self.grad_of: list[int] = []
        self.copies: list[fx.Node] = []  # the non-leaf copies of dirty inputs
        self.dropout_layout_matters = False

    def __call__(self, primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> tuple[list[Any], list[Any]]:
        if self.with_values:
            carry_real_values(primals, self.fake_primals)
        dirty = self.discovery.dirty
        with FunctionalModeKeepingChecks():
            functional = [FunctionalTensor.to_functional(p) for p in primals]
            inputs = [
                f.requires_grad_() if grad else f for f, grad in zip(functional, self.differentiated, strict=True)
            ]
            for i, dtype in self.grad_dtypes.items():
                inputs[i].grad_dtype = dtype
            with torch.enable_grad():
                arguments, outputs = self._run_fn(inputs)
                wrt = [i for i, grad in enumerate(self.differentiated) if grad]
                try:
                    grads = self._gradients(
                        [outputs[i] for i in self.differentiable],
                        [inputs[i] for i in wrt],
                        tangents,
                        create_graph=self.backward_in_grad_mode,
                    )
                except RuntimeError as error:  # See NOTE [a backward eager cannot run].
                    if not is_saved_value_modified(error):
                        raise
                    self.backward_error = str(error)
                    grads = [None] * len(wrt)
            for primal, value in zip(primals, functional, strict=True):
                sync(value)
                if has_data_mutation(value):
                    primal.copy_(_unwrap(value))
            for i in dirty:
                primals[i].copy_(_unwrap(arguments[i]))
            unwrapped = [_unwrap(o) for o in outputs], [_unwrap(g) for g in grads if g is not None]
            self.detached_views.mark_replayed()  # replays in backward, and of the outputs
            self.grad_of.extend(i for i, g in zip(wrt, grads, strict=True) if g is not None)
            return unwrapped

    def _run_fn(self, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """Run `fn` on the functional inputs (dirty ones copied, so that autograd sees the update);
        its arguments and outputs, then the new values of the dirty inputs."""
        proxy_mode = get_proxy_mode()
        assert proxy_mode is not None
        graph = proxy_mode.tracer.graph
        arguments = list(inputs[: self.n_args])
        for i in self.discovery.dirty:
            arguments[i] = inputs[i].clone()
            self.copies.append(next(iter(reversed(graph.nodes))))
        substitutes = {id(real): inputs[self.n_args + i] for i, real in enumerate(self.discovery.closed_over)}
        with (
            capture_mode(self.roots, substitutes, detached_views=self.detached_views) as mode,
            eager_fidelity(self.under_functorch, self.fake_mode) as fidelity,
            autocast_cache_enabled(self.autocast_cache_enabled),  # NOTE [autocast's cache of casts]
        ):
            args, kwargs = self.flat_args.rebuild(arguments)
            # See NOTE [custom Functions applied again].
            with function_applications_noted(ApplicationRecorder(graph, mode.substitute)):
                outputs, _ = flatten_outputs(self.fn(*args, **kwargs))
        self.ran_in_fn.update(graph.nodes)
        self.detached.update(mode.detached)
        self.autocast_seen = mode.autocast_seen
        self.dropout_layout_matters = fidelity.dropout_layout_matters
        outputs = [mode.substitute(o) for o in outputs]
        rebuilt, bases = _bases_to_return(outputs, [*inputs, *arguments]) if self.discovery.forward_mode else ({}, [])
        if rebuilt != self.discovery.rebuilt:
            raise TraceError(
                "remat.checkpoint: fn returned views that share memory with different tensors when traced "
                f"({rebuilt}) than when run on fake tensors ({dict(self.discovery.rebuilt)}); please report this."
            )
        return arguments, [*outputs, *(arguments[i] for i in self.discovery.dirty), *bases]

    # NOTE [a backward eager cannot run]
    # A function that updates in place a value its own backward needs (`v =
    # u.exp(); v.mul_(2)`: exp's gradient reads its output) runs forward in eager
    # and raises in backward, when the gradient formula finds the value changed.
    # Tracing runs that backward too, and met the error at the first call. The
    # trace keeps it instead: the forward runs, and the Function's backward
    # raises eager's error, where eager's would.

    # NOTE [a backward traced as it will run]
    # torch.func's reverse mode (`grad`, `vjp`, `jacrev`, `hessian`) runs backward
    # with `create_graph=True`, in grad mode, where many of eager's gradient
    # formulas take another form than under `.backward()`: group norm's and
    # SiLU's run differentiable ops instead of a fused kernel, cumprod's and
    # linalg.solve's another formula. The forms give other layouts (group norm's
    # gradient follows the incoming one's) and other round-off. A trace made while
    # such a transform runs traces backward in grad mode too, and is kept apart in
    # the cache from one made for `.backward()` (`JointGraph.backward_in_grad_mode`,
    # checked by the cache entry), so that each runs eager's formulas for where it
    # runs. Plain autograd's `create_graph=True` is not known when tracing: its
    # backward is the first form, made differentiable (NOTE [a backward that will
    # be differentiated]).
    @staticmethod
    def _gradients(
        outputs: list[Any], wrt: list[torch.Tensor], tangents: list[torch.Tensor], create_graph: bool
    ) -> Sequence[torch.Tensor | None]:
        if not outputs or not wrt:
            return [None] * len(wrt)
        nodes_without_grad = NodesWithoutGrad(_traced_graph()) if create_graph else nullcontext()
        functional_tangents = [FunctionalTensor.to_functional(t) for t in tangents]
        with autocast_disabled(), nodes_without_grad:  # NOTE [autocast is traced, not re-applied]
            if not engine_can_run([*outputs, *wrt]):  # See NOTE [a backward walked without the engine].
                return walked_gradients(outputs, wrt, functional_tangents, create_graph)
            return torch.autograd.grad(
                outputs,
                wrt,
                functional_tangents,
                allow_unused=True,
                # As eager's backward will run: see NOTE [a backward traced as it will run].
                create_graph=create_graph,
            )


def _traced_graph() -> fx.Graph:
    proxy_mode = get_proxy_mode()
    assert proxy_mode is not None
    return proxy_mode.tracer.graph  # type: ignore[no-any-return]


def _clean_up(graph: fx.Graph, copies: list[fx.Node], guarded_ints: set[str]) -> None:
    """Remove the copies of dirty inputs, rewrite views to run as eager ran them, drop dead code."""
    originals = {copy: copy.args[0] for copy in copies}
    for copy, original in originals.items():
        copy.replace_all_uses_with(original)  # type: ignore[arg-type]
        graph.erase_node(copy)
    redirect_histories(graph, originals)  # type: ignore[arg-type]
    _use_reshape_for_view(graph)
    _end_slices_at_the_size(graph)
    _drop_unread_batch_norm_arguments(graph)
    graph.eliminate_dead_code(is_impure_node=kept_as_dead_code)
    use_remat_checks(graph)  # after removing dead code: FX knows torch's assertions, not remat's, to be live
    check_coverage(graph, guarded_ints)


def _joint_graph(
    gm: fx.GraphModule,
    fn: Callable[..., Any],
    roots: ModuleRoots,
    fake_mode: FakeTensorMode,
    discovery: _Discovery,
    joint: _ForwardThenBackward,
    under_functorch: bool,
    n_primals: int,
    regions: list[tuple[Any, frozenset[fx.Node]]],
) -> JointGraph:
    """The `JointGraph` of a traced and cleaned-up graph: its parts named, its calls described."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primals, tangents = tuple(placeholders[:n_primals]), tuple(placeholders[n_primals:])
    output_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    returned = list(output_node.args[0])
    n_outputs = len(discovery.output_fakes) + len(discovery.dirty) + len(discovery.bases)
    mutations = tuple(
        n for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in primals
    )
    final_values = {mutation.args[1] for mutation in mutations}
    rebuilt = _put_bases_on_their_views(output_node, returned, discovery, {*primals, *final_values})
    outputs, grads = tuple(returned[:n_outputs]), tuple(returned[n_outputs:])
    constants = {n.target: getattr(gm, n.target) for n in graph.nodes if n.op == "get_attr"}
    _check_no_unlifted_parameters(constants)

    value_checks = checks_of(graph)
    forward_nodes = _forward_nodes(graph, joint.ran_in_fn, tangents, [*outputs, *mutations], value_checks)
    user_outputs = dict(zip(outputs[: len(discovery.output_fakes)], discovery.output_fakes, strict=True))
    _mark_replayed_detaches(forward_nodes, joint.detached, mutations, user_outputs)
    call_nodes = tuple(n for n in graph.nodes if n in forward_nodes and is_call(n) and n not in mutations)
    for node in call_nodes:
        if _may_stop_derivatives(node):
            note_differentiable_outputs(node, _differentiable_outputs(node, fake_mode))
    variables = variable_slots(fn)
    return JointGraph(
        graph=graph,
        constants=constants,
        primals=primals,
        tangents=tangents,
        outputs=outputs,
        n_user_outputs=len(discovery.output_fakes),
        dirty=discovery.dirty,
        output_spec=discovery.output_spec,
        differentiable_outputs=joint.differentiable,
        grads=grads,
        grad_of=tuple(joint.grad_of),
        forward_nodes=forward_nodes,
        mutations=mutations,
        call_nodes=call_nodes,
        trace=_describe_all(call_nodes),
        regions=tuple(
            (policy, tuple(i for i, node in enumerate(call_nodes) if node in region)) for policy, region in regions
        ),
        lifted=tuple(roots.slot_of(t, discovery.reached_modules, variables) for t in discovery.closed_over),
        reached_modules=discovery.reached_modules,
        under_functorch=under_functorch if joint.dropout_layout_matters else None,
        backward_in_grad_mode=joint.backward_in_grad_mode,
        cast_once=tuple(map(cast_once, joint.flat_args.tensors)) if joint.autocast_seen else None,
        backward_error=joint.backward_error,
        value_checks=tuple(str(describe_check(check)) for check in value_checks if check.target is check_value),
        rebuilt=rebuilt,
    )


def _mark_replayed_detaches(
    forward_nodes: frozenset[fx.Node],
    detached: set[fx.Node],
    mutations: Sequence[fx.Node],
    returned: Mapping[fx.Node, Any],
) -> None:
    """Mark as `fn`'s own detaches the aliases functionalization recreated of what `fn` detached,
    and make each of `fn`'s detaches an `aten.detach`. See NOTE [a detach runs as a detach].

    `capture_mode` marks the node `x.detach()` creates (an `aten.detach`, or an `aten.alias` since
    torch 2.15); but functionalization recreates the detached alias of a tensor updated in place
    when it is next read, during another call: of its new value (for an input, the value written
    back into it). Only those aliases of new values are recreations: another alias of what `fn`
    detached, itself not updated, is no detach of `fn`'s (make_fx may record one during `v.detach()`
    that stands for `v` where backward reads a value autograd saved, `exp`'s result, with its
    derivative). An alias `fn` returns (`returned`: output node -> what `fn` returned, as eager made
    it) that is no view and has no history is a detach too, however many updates of the memory it
    shares came between (a detach of an input updated in place before and after)."""
    updated = {m.args[1] for m in mutations if m.args[0] in detached}
    for node in forward_nodes:
        if node.target in _quirks.DETACH_TRACES_AS_ALIAS.table and node.args[0] in updated:
            note_stop_gradient(node, "detach")
        value = returned.get(node)
        if node.target is aten.alias.default and isinstance(value, torch.Tensor) and _is_detached(value):
            note_stop_gradient(node, "detach")
        if node.target is aten.alias.default and stop_gradient_of(node) == "detach":
            node.target = aten.detach.default


# NOTE [a detach runs as a detach]
# Since torch 2.15 make_fx records `x.detach()` as `aten.alias`. Run as traced, an alias is a view
# that autograd differentiates: an output `x.detach()` rebuilt outside the Function (the epilogue
# rebuilds views of inputs and of returned outputs) would require grad, and send gradient back
# into `x`. Eager's detach makes a tensor that shares `x`'s memory and version counter but is no
# view and has no history, which is what `aten.detach` makes: `fn`'s own detaches run as that.


def _may_stop_derivatives(node: fx.Node) -> bool:
    """Whether autograd may leave some float output of the call `node` without a derivative from its
    float inputs: a multi-output call (the mean and rstd of `native_layer_norm`), or one output
    computed from a float tensor (`empty_like`, `zeros_like`: a buffer that dropout then fills)."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return True
    return (
        isinstance(value, torch.Tensor)
        and _all_floats(value)
        and any(isinstance(v := arg.meta.get("val"), torch.Tensor) and _all_floats(v) for arg in node.all_input_nodes)
    )


def _differentiable_outputs(node: fx.Node, fake_mode: FakeTensorMode) -> tuple[bool, ...]:
    """Which outputs of a call autograd differentiates (not, say, the mean and rstd of
    `native_layer_norm`, nor the output of `empty_like`), found by calling it on fake tensors
    that require grad: all its float inputs at once or, where the op refuses one (batch norm's
    running statistics), each of them alone."""
    values = [v for n in node.all_input_nodes if isinstance(v := n.meta.get("val"), torch.Tensor) and _all_floats(v)]
    found = _outputs_requiring_grad(node, fake_mode, {id(v) for v in values})
    if found is None:
        alone = [_outputs_requiring_grad(node, fake_mode, {id(v)}) for v in values]
        flags = [f for f in alone if f is not None]
        if not flags:  # an op that cannot run again on its own: assume every float output is
            return tuple(isinstance(v, torch.Tensor) and _all_floats(v) for v in _as_tuple(node.meta["val"]))
        found = tuple(any(column) for column in zip(*flags, strict=True))
    return found


def _outputs_requiring_grad(node: fx.Node, fake_mode: FakeTensorMode, leaves: set[int]) -> tuple[bool, ...] | None:
    """Which outputs of `node`, run again on its inputs' fake values, require grad when the inputs in
    `leaves` (ids of values) do; None where the op raises."""

    def value(n: fx.Node) -> Any:
        v = n.meta.get("val")
        return v.detach().requires_grad_() if isinstance(v, torch.Tensor) and id(v) in leaves else v

    args = fx.node.map_arg(node.args, value)
    kwargs = fx.node.map_arg(node.kwargs, value)
    try:
        with fake_mode, torch.enable_grad():
            outputs = node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:
        return None
    return tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in _as_tuple(outputs))


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _unwrap(functional: Any) -> torch.Tensor:
    """The traced tensor behind a `FunctionalTensor`, with pending updates applied."""
    sync(functional)
    return from_functional(functional)


# NOTE [views are traced as reshapes]
# `aten.view` is chosen by the tracer from the fake tensors' strides; at run
# time the same graph can meet tensors with other strides (an incoming
# gradient that is an expanded scalar, a batched tensor under vmap), where
# `view` fails. `reshape` is a view whenever `view` would succeed, and copies
# otherwise, so it is always safe.
def _use_reshape_for_view(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default


# NOTE [slices end at the size]
# `t[:, ::2]` traces as `slice(t, 1, 0, 9223372036854775807, 2)`, and an in-place
# update of it as a `slice_scatter` with the same end, which functorch's batching
# rule for `slice_scatter` refuses ("invalid size, possible overflow?") under
# `vmap`. An end past the size means the size: the graph says so.
_SLICE_DIMENSION = {aten.slice.Tensor: 1, aten.slice_scatter.default: 2}


def _end_slices_at_the_size(graph: fx.Graph) -> None:
    for node in graph.nodes:
        position = _SLICE_DIMENSION.get(node.target)  # type: ignore[arg-type]
        if position is None or len(node.args) <= position + 2:
            continue
        base = node.args[0].meta.get("val")  # type: ignore[union-attr]
        dim, end = node.args[position], node.args[position + 2]
        if isinstance(base, torch.Tensor) and isinstance(dim, int) and isinstance(end, int):
            size = base.shape[dim]
            if isinstance(size, int) and end > size:
                node.args = (*node.args[: position + 2], size, *node.args[position + 3 :])


def _drop_unread_batch_norm_arguments(graph: fx.Graph) -> None:
    """A training-mode batch norm's backward takes the running statistics but does not read
    them (it uses the batch statistics): pass None, so that backward does not keep them."""
    unread_by = _quirks.BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS.table["backward"]
    for node in graph.nodes:
        unread = unread_by.get(node.target)
        if unread is not None and (unread[0] is None or node.args[unread[0]] is True):
            node.args = tuple(None if i in unread[1] else a for i, a in enumerate(node.args))


def _check_no_unlifted_parameters(constants: dict[str, Any]) -> None:
    for name, value in constants.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise TraceError(
                f"remat.checkpoint: a tensor that requires grad ({tuple(value.shape)}, {value.dtype}) reached the "
                f"traced graph as the constant `{name}` without passing through a torch function, so it would "
                "receive no gradient. Pass it to the function as an argument."
            )


def _forward_nodes(
    graph: fx.Graph,
    ran_in_fn: set[fx.Node],
    tangents: Sequence[fx.Node],
    roots: Sequence[Any],
    checks: Sequence[fx.Node],
) -> frozenset[fx.Node]:
    """Nodes of the forward program: everything `fn` itself ran (`ran_in_fn`) plus the
    tangent-free ancestors of the outputs and mutations (views regenerated by
    functionalization after the backward was traced), and the checks of values and sizes
    that read no tangent (a check of a size backward made, as of the gradient a boolean mask
    picks, is backward's)."""
    depends_on_tangent: set[fx.Node] = set(tangents)
    for node in graph.nodes:
        if any(arg in depends_on_tangent for arg in node.all_input_nodes):
            depends_on_tangent.add(node)
    forward = {node for node in graph.nodes if node in ran_in_fn and node.op in ("call_function", "get_attr")}
    stack = [r for r in roots if isinstance(r, fx.Node)] + [c for c in checks if c not in depends_on_tangent]
    while stack:
        node = stack.pop()
        if node in forward or node.op == "placeholder":
            continue
        assert node not in depends_on_tangent
        forward.add(node)
        stack.extend(node.all_input_nodes)
    alive = set(graph.nodes)  # some nodes of `fn` may have been removed as dead code
    return frozenset(n for n in forward if n in alive and n.op != "placeholder")


def stops_gradient(node: fx.Node, *, forward_mode: bool = False) -> bool:
    """Whether `fn` computed `node` where autograd does not see: through a `detach()`, or under
    `no_grad`, which forward-mode AD sees through (as it does in eager). `capture_mode` notes
    which (`_facts.stop_gradient_of`): "detach", "no_grad" or "no_grad_update"."""
    why = stop_gradient_of(node)
    return why == "detach" if forward_mode else why is not None


# NOTE [free ops follow their base]
# A view (or alias, or getitem of a multi-output call) shares memory with its
# base, so keeping it costs nothing more than keeping the base, and replaying it
# costs nothing. Such nodes are not calls of the Trace; a policy decides about
# the call that produced their base.
def is_free(node: fx.Node) -> bool:
    """Whether `node` only names (part of) the memory of another node."""
    if node.op == "get_attr":
        return True
    return node.op == "call_function" and is_free_op(node.target)


def is_free_op(target: Any) -> bool:
    """Whether calls of `target` only name (part of) the memory of their first argument."""
    return target is operator.getitem or target in _ALIASING_OPS or bool(getattr(target, "is_view", False))


def is_call(node: fx.Node) -> bool:
    """Whether `node` is an op call a policy decides about (not a view, nor a number such as a
    data-dependent size, which is computed again wherever backward needs it)."""
    return node.op == "call_function" and not is_free(node) and not _is_number(node) and node.target not in CHECKS


def _is_number(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _describe_all(call_nodes: Sequence[fx.Node]) -> Trace:
    occurrences: collections.Counter[Any] = collections.Counter()
    calls = []
    for index, node in enumerate(call_nodes):
        calls.append(_describe(index, node, occurrences[node.target]))
        occurrences[node.target] += 1
    return Trace(calls)


def _describe(index: int, node: fx.Node, occurrence: int) -> Call:
    def meta(value: Any) -> Any:
        if isinstance(value, fx.Node):
            val = value.meta.get("val")
            return TensorMeta.of(val) if isinstance(val, torch.Tensor) else val
        return value

    args = fx.node.map_aggregate(node.args, meta)
    kwargs = fx.node.map_aggregate(node.kwargs, meta)
    out = node.meta.get("val")
    fake_args = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    fake_kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    site = site_of(node)
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    return Call(
        index=index,
        op=node.target,
        occurrence=occurrence,
        inputs=tuple(args),
        kwargs=tuple(kwargs.items()),
        outputs=tuple(TensorMeta.of(o) for o in outputs if isinstance(o, torch.Tensor)),
        tags=tags_of(node),
        module=site.module,
        source=site.source,
        scope=_custom_op_name(node.target) or site.scope,
        flops=estimate_flops(node.target, tuple(fake_args), dict(fake_kwargs), out),
        nbytes=output_nbytes(out),
        is_random=draws_random_numbers(node),
    )


def _custom_op_name(op: Any) -> str | None:
    """`mylib::attention` for a custom op (one that is not from aten or prims)."""
    if isinstance(op, OpOverload) and op.namespace not in ("aten", "prims"):
        return op_schema(op).name  # type: ignore[no-any-return]
    return None


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether the call really draws from an RNG: attention with `dropout_p=0` does not."""
    op = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    for position, argument in enumerate(op_schema(op).arguments):
        if argument.name == "dropout_p":
            if position < len(node.args):
                probability = node.args[position]
            else:
                probability = node.kwargs.get(argument.name, argument.default_value)
            return bool(probability != 0)
    return True
