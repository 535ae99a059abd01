"""Compiled programs: `remat.checkpoint(..., compile=...)` runs its forward and backward through `torch.compile`.

See NOTE [compiling remat's programs].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from .._core import _rng
from .._partitioning._partition import Programs
from .._storing._storage import program_functions

__all__ = ["CompiledPrograms", "compile_options", "compile_programs"]

# NOTE [compiling remat's programs]
# The forward program (primals -> outputs and kept values) and the backward
# program (kept values and tangents -> gradients, replays included) are plain
# aten graphs with their inputs and outputs fixed by the partition. Compiled,
# each stays a function with the same inputs and outputs, so what is kept
# between them is exactly what the policy saved: the compiler fuses and
# schedules inside a program, it cannot move a value across the boundary.
# They run where autograd does not record (the Function's forward, and its
# backward unless a second derivative is being taken), so the compiler makes
# inference graphs and no partitioner of its own is involved. Random calls stay
# eager, outside the graphs, so that they draw from, and replay with, the
# generator states remat keeps; so do the stores and loads of kept values stored
# off their device. Where a torch.func transform wraps the tensors a program
# would see, or when backward is differentiated again, the eager programs run:
# the compiled ones take plain tensors and are not differentiated.

_TORCH_COMPILE_OPTIONS = frozenset({"backend", "mode", "options", "fullgraph", "dynamic"})


@dataclasses.dataclass(frozen=True)
class CompiledPrograms:
    forward: Callable[..., Any]
    backward: Callable[..., Any]


def compile_options(compile: Any) -> dict[str, Any] | None:
    """`torch.compile` keyword arguments for the `compile` argument of `remat.checkpoint`, or None."""
    if compile is None or compile is False:
        return None
    if compile is True:
        options: dict[str, Any] = {}
    elif isinstance(compile, str) or callable(compile):
        options = {"backend": compile}
    elif isinstance(compile, Mapping):
        unknown = sorted(set(compile) - _TORCH_COMPILE_OPTIONS)
        if unknown:
            raise ValueError(
                f"remat.checkpoint: compile={dict(compile)!r} has {', '.join(map(repr, unknown))}, which "
                f"remat does not pass to torch.compile; use keys among {sorted(_TORCH_COMPILE_OPTIONS)}."
            )
        options = dict(compile)
    else:
        raise TypeError(
            f"remat.checkpoint: compile={compile!r} is not understood. Pass True (inductor), a backend "
            "(a name such as 'aot_eager', or a callable), or a dict of torch.compile arguments such as "
            "{'backend': 'inductor', 'mode': 'max-autotune'}."
        )
    # Each program serves one traced signature: nothing to gain from symbolic shapes.
    return {"dynamic": False, **options}


def compile_programs(programs: Programs, options: Mapping[str, Any]) -> CompiledPrograms:
    if options.get("fullgraph") and any(kept.rng_state for kept in programs.kept):
        raise ValueError(
            "remat.checkpoint: compile={..., 'fullgraph': True} cannot compile a function with random calls that "
            "are replayed: remat runs them outside the compiled graphs, with the generator states it keeps. "
            "Leave fullgraph unset, or save the random calls: "
            "`policy=remat.policies.save_any_of(policy, lambda call: call.is_random)`."
        )
    return CompiledPrograms(
        forward=torch.compile(_random_calls_eager(programs.forward), **options),
        backward=torch.compile(_random_calls_eager(programs.backward), **options),
    )


@torch.compiler.disable
def _run_keeping_state(device: torch.device, op: Any, /, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    return _rng.run_keeping_state(device, op, *args, **kwargs)


@torch.compiler.disable
def _replay_with_rng_state(state: torch.Tensor, device: torch.device, op: Any, /, *args: Any, **kwargs: Any) -> Any:
    return _rng.replay_with_rng_state(state, device, op, *args, **kwargs)


_EAGER: dict[Callable[..., Any], Callable[..., Any]] = {
    _rng.run_keeping_state: _run_keeping_state,
    _rng.replay_with_rng_state: _replay_with_rng_state,
    # Storing and loading kept values (copies to and from the host use streams and events of their own:
    # NOTE [offloading kept values]) runs eagerly: NOTE [kinds of storage].
    **{function: torch.compiler.disable(function) for function in program_functions()},
}


def _random_calls_eager(program: fx.GraphModule) -> fx.GraphModule:
    """A copy of `program` whose random calls the compiler leaves to eager execution."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _EAGER:
            node.target = _EAGER[node.target]
    return fx.GraphModule(program, graph)
