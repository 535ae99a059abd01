"""make_fx and functionalization: recording ops into a graph through the proxy mode, random calls and the
generators they draw from, the graph modules make_fx builds, and the functional tensors of a trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx

from ._releases import RELEASE_NUMBERS

__all__ = [
    "BoxedCodeGen",
    "FunctionalTensor",
    "FunctionalTensorMode",
    "LazyGraphModule",
    "default_generator",
    "from_functional",
    "get_proxy_mode",
    "has_data_mutation",
    "lazy_graph_modules",
    "make_fx",
    "node_behind",
    "outside_compilers_tracing",
    "calls_traced",
    "random_calls_traced",
    "sync",
    "trace_call",
]


# --- make_fx -------------------------------------------------------------------------------------------

# A GraphModule generates and compiles its Python code as it is built; a lazy one, when first called
# (or its code read). remat never calls the joint graph make_fx records, and calls a pure forward only
# for higher-order derivatives and forward mode: building their code took a tenth of a small trace.


def lazy_graph_modules() -> contextlib.AbstractContextManager[None]:
    """Inside this context make_fx builds `LazyGraphModule`s."""
    return _use_lazy_graph_module(True)


# Inside a compile, torch's tracing context names the compiler's fake mode. make_fx there takes that mode
# (since torch 2.11), or checks that the inputs' mode is it and fails (2.10): remat's trace, in its own
# mode, is made outside the context.
def outside_compilers_tracing() -> contextlib.AbstractContextManager[Any]:
    """A context in which make_fx traces in the fake mode of its inputs, even inside a compile."""
    return torch._guards.tracing(None)


# Since torch 2.13 make_fx records a `torch.Generator` argument as a `get_attr` constant of the
# graph (an "opaque reference"); before, it raises NotImplementedError. On those releases the call
# is traced with `generator=None`, and its generator is then put back on the node as such a constant, so that
# every later step sees one graph on every release. Traced with values, the real kernel then draws
# from the device's default generator, which is first set to the user's generator's state, so that it
# draws the user's numbers and advances the user's generator as eager does.
_TRACES_GENERATORS = RELEASE_NUMBERS >= (2, 13)


def trace_call(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run the op `func` under make_fx's proxy mode, recording its `generator=` argument if any."""
    generator = kwargs.get("generator")
    if generator is None or _TRACES_GENERATORS:
        return func(*args, **kwargs)
    with _default_standing_in_for(generator):
        result, random_nodes = random_calls_traced(lambda: func(*args, **{**kwargs, "generator": None}))
    tracer: Any = get_proxy_mode().tracer  # type: ignore[union-attr]
    name = tracer.get_fresh_qualname("_generator")
    setattr(tracer.root, name, generator)
    for node in random_nodes:
        with tracer.graph.inserting_before(node):
            node.kwargs = {**node.kwargs, "generator": tracer.graph.get_attr(name)}
    return result


def default_generator(device: torch.device) -> torch.Generator:
    """The generator a random call on `device` draws from when given none."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        if not torch.cuda.is_available():  # fake CUDA tensors, on a machine without a GPU
            return _CUDA_GENERATOR_STAND_INS.setdefault(device.index or 0, _CudaGeneratorStandIn())  # type: ignore[return-value]
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise NotImplementedError(
        f"remat.checkpoint: replaying a random call on a {device.type!r} device is not supported; save it with a "
        "policy (e.g. `policy | (lambda call: call.is_random)`)."
    )


class _CudaGeneratorStandIn:
    """A CUDA generator's state where torch has no CUDA generator (a CUDA build on a machine without a GPU):
    random calls on fake CUDA tensors draw nothing, but remat keeps and restores their generator's state as
    on a GPU, a 16-byte Philox state (seed and offset). The state is made as the generator makes it, outside
    the dispatcher, so that a probe step does not count it as device memory."""

    def __init__(self) -> None:
        self._state = torch.frombuffer(bytearray(16), dtype=torch.uint8)

    def get_state(self) -> torch.Tensor:
        return self._state

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state


_CUDA_GENERATOR_STAND_INS: dict[int, _CudaGeneratorStandIn] = {}


@contextlib.contextmanager
def _default_standing_in_for(generator: torch.Generator) -> Iterator[None]:
    """While active, the default generator of `generator`'s device draws `generator`'s numbers; after,
    `generator` is where those draws left it, and the default generator is as before."""
    default = default_generator(generator.device)
    own = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(default.get_state())
        default.set_state(own)


def calls_traced(run: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """`run()`'s result, and the nodes it added to the graph make_fx is tracing, in order."""
    graph = get_proxy_mode().tracer.graph  # type: ignore[union-attr]
    last = next(iter(reversed(graph.nodes)))
    result = run()
    added = []
    for node in reversed(graph.nodes):
        if node is last:
            break
        added.append(node)
    return result, added[::-1]


def random_calls_traced(run: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """`run()`'s result, and the nodes of random calls it added to the graph make_fx is tracing."""
    result, added = calls_traced(run)
    return result, [n for n in added if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]


# The boxed calling convention: a program takes one list of its inputs and empties it once it has
# read them, so that each input can be freed at its last use inside the program.
BoxedCodeGen = torch.fx.graph._BoxedCodeGen


# --- functionalization -----------------------------------------------------------------------------------


def sync(functional: torch.Tensor) -> None:
    """Apply the updates pending on a FunctionalTensor (of its views' bases)."""
    torch._sync(functional)


def has_data_mutation(functional: Any) -> bool:
    """Whether the data of a FunctionalTensor was updated in place since it was wrapped."""
    return bool(torch._functionalize_has_data_mutation(functional.elem))  # type: ignore[attr-defined]


def node_behind(functional: Any) -> Any:
    """The graph node make_fx recorded for the current value of a FunctionalTensor (before its pending
    updates are applied: no sync), or None where it recorded none."""
    mode = get_proxy_mode()
    if mode is None or not isinstance(functional, FunctionalTensor):
        return None
    proxy = get_proxy_slot(torch._from_functional_tensor(functional.elem), mode.tracer, None)
    return None if proxy is None else proxy.proxy.node


def from_functional(functional: Any) -> torch.Tensor:
    """The traced tensor behind a FunctionalTensor (its updates applied first: `sync`)."""
    return torch._from_functional_tensor(functional.elem)
