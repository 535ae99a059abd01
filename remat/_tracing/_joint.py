"""Tracing: `fn` and example inputs -> a joint forward+backward graph and its `Trace`.

The joint graph is recorded by `make_fx` on fake tensors, functionalized the
way AOTAutograd does it (`FunctionalTensorMode`), so that mutations of inputs
become explicit `copy_` nodes at the end and every other node is pure. The
forward part of it is then described, call by call, as a `remat.Trace`.

This module drives the trace and assembles the `JointGraph`; the steps it
runs live beside it: the discovery pass (`_discovery`), the function `make_fx`
traces (`_forward_then_backward`), the clean-up of the traced graph
(`_graph_cleanup`, `_view_fixups`), where derivatives stop (`_gradient_stops`)
and the calls described for policies (`_describe`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import fx

from .._core import _rng
from .._core._calls import Trace
from .._core._contexts import cast_once, dispatch_keys_put_back, outside_functorch, without_saved_tensors_hooks
from .._core._pytree import FlatArgs
from .._core._rng import seeding_refused
from .._eager._capture import ModuleRoots, StateSlot, has_hooks, variable_slots
from .._eager._facts import note_differentiable_outputs
from .._eager._fake_kernels import EagerLayoutFakeMode
from .._eager._nodes import is_call
from .._eager._specialize import check_value, checks_of, refuse_float_reads
from .._eager._specialize import describe as describe_check
from .._memory._gpu import attention_as_on_the_gpu
from .._torch import (
    FakeTensorMode,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    fake_kernel_errors_unlogged,
    forget_pending_sizes,
    functorch_active,
    grad_transform_active,
    insert_value_checks,
    lazy_graph_modules,
    make_fx,
    outside_compilers_tracing,
    put_back_real_values,
    real_values_traced,
    unset_fake_temporarily,
)
from ._describe import describe_all
from ._discovery import Discovery, discover, fake_like
from ._errors import TraceError, explain_tracing_errors
from ._forward_then_backward import ForwardThenBackward
from ._gradient_stops import find_differentiable_outputs, mark_replayed_detaches, may_stop_derivatives
from ._graph_cleanup import clean_up
from ._nesting import nested_regions
from ._view_fixups import put_bases_on_their_views

__all__ = ["JointGraph", "joint_graph_of"]

aten = torch.ops.aten


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
    outer_regions = nested_regions.recorded
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
        nested_regions.recorded = outer_regions


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
    nested_regions.recorded = []
    # Traced with values, `fn` draws real numbers from every generator it uses: each is put back
    # after discovery, so that the trace draws the numbers discovery drew (and the call will), and
    # after the trace. NOTE [values Python reads]
    default_streams = _rng.snapshot()

    def put_streams_back() -> None:
        if with_values:
            default_streams()
            fake_mode.drawn_generators.put_back()

    try:
        discovery = discover(fn, flat_args, roots, fake_mode, forward_mode)
        discovered_generators = fake_mode.drawn_generators.seen()
        forget_pending_sizes(fake_mode)
        put_streams_back()
        nested_regions.recorded = []
        joint = _make_joint_graph(
            fn, flat_args, roots, fake_mode, discovery, under_functorch, backward_in_grad_mode, with_values
        )
        _rng.check_generators_outlive_fn(joint.generators, discovered_generators)
        return joint
    finally:
        put_streams_back()


# make_fx and the global module hooks of a trace are not meant to run on two threads at
# once; tracing is rare (once per signature), so traces simply take turns.
_ONE_TRACE_AT_A_TIME = threading.RLock()


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


def _make_joint_graph(
    fn: Callable[..., Any],
    flat_args: FlatArgs,
    roots: ModuleRoots,
    fake_mode: EagerLayoutFakeMode,
    discovery: Discovery,
    under_functorch: bool,
    backward_in_grad_mode: bool,
    with_values: bool,
) -> JointGraph:
    real_primals = [*flat_args.tensors, *discovery.closed_over]
    fake_primals = [fake_like(fake_mode, t) for t in real_primals]
    if with_values:  # discovery ran `fn` on real data these fakes may share: NOTE [values Python reads]
        put_back_real_values(fake_primals, real_primals)
    joint = ForwardThenBackward(
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
    regions = [(policy, nodes & live) for policy, nodes in nested_regions.recorded or ()]
    clean_up(gm.graph, joint.copies, guarded_ints)
    return _joint_graph(gm, fn, roots, fake_mode, discovery, joint, under_functorch, len(real_primals), regions)


def _joint_graph(
    gm: fx.GraphModule,
    fn: Callable[..., Any],
    roots: ModuleRoots,
    fake_mode: FakeTensorMode,
    discovery: Discovery,
    joint: ForwardThenBackward,
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
    rebuilt = put_bases_on_their_views(output_node, returned, discovery, {*primals, *final_values})
    outputs, grads = tuple(returned[:n_outputs]), tuple(returned[n_outputs:])
    constants = {n.target: getattr(gm, n.target) for n in graph.nodes if n.op == "get_attr"}
    _check_no_unlifted_parameters(constants)

    value_checks = checks_of(graph)
    forward_nodes = _forward_nodes(graph, joint.ran_in_fn, tangents, [*outputs, *mutations], value_checks)
    user_outputs = dict(zip(outputs[: len(discovery.output_fakes)], discovery.output_fakes, strict=True))
    mark_replayed_detaches(forward_nodes, joint.detached, mutations, user_outputs)
    call_nodes = tuple(n for n in graph.nodes if n in forward_nodes and is_call(n) and n not in mutations)
    for node in call_nodes:
        if may_stop_derivatives(node):
            note_differentiable_outputs(node, find_differentiable_outputs(node, fake_mode))
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
        trace=describe_all(call_nodes),
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
