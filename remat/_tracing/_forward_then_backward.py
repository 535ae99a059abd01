"""The function `make_fx` traces: `fn` on functional inputs, then its gradients, recording on the way
what the graph alone does not say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import fx

from .._core._contexts import autocast_cache_enabled, autocast_disabled
from .._core._pytree import FlatArgs, flatten_outputs
from .._eager._applications import ApplicationRecorder
from .._eager._capture import DetachedViews, ModuleRoots, capture_mode
from .._eager._error_checks import FunctionalModeKeepingChecks
from .._eager._fake_kernels import EagerLayoutFakeMode
from .._eager._in_place import ExpandsAsViews, eager_fidelity
from .._eager._noting_modes import NodesWithoutGrad
from .._torch import (
    FunctionalTensor,
    carry_real_values,
    from_functional,
    function_applications_noted,
    get_proxy_mode,
    grad_dtype_override,
    has_data_mutation,
    is_saved_value_modified,
    sync,
)
from ._discovery import Discovery, bases_to_return, is_differentiated
from ._engine import engine_can_run, walked_gradients
from ._errors import TraceError

__all__ = ["ForwardThenBackward"]


class ForwardThenBackward:
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
        discovery: Discovery,
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
        self.differentiated = [is_differentiated(t) for t in [*flat_args.tensors, *discovery.closed_over]]
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
        rebuilt, bases = bases_to_return(outputs, [*inputs, *arguments]) if self.discovery.forward_mode else ({}, [])
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
        # (ExpandsAsViews: NOTE [writes through views], for the backward's writes)
        with autocast_disabled(), nodes_without_grad, ExpandsAsViews():  # NOTE [autocast is traced, not re-applied]
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


def _unwrap(functional: Any) -> torch.Tensor:
    """The traced tensor behind a `FunctionalTensor`, with pending updates applied."""
    sync(functional)
    return from_functional(functional)
