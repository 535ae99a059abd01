"""torch.compile's partitioned graphs, recorded: what its partitioner saves and recomputes, for the
benchmarks that compare remat's plans with it (`planner`, `compiled`)."""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["expected_compile_warnings", "is_view", "recording_backend"]


@contextlib.contextmanager
def expected_compile_warnings() -> Iterator[None]:
    """Silence the warnings torch.compile is known to raise here, and nothing else.

    Importing inductor's decomposition table imports `torch.utils.mkldnn`, whose module body
    uses the deprecated `torch.jit.script_method` (a DeprecationWarning at import, about torch's
    own code); pytest runs with filterwarnings=error.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.script_method` is deprecated", DeprecationWarning)
        yield


def recording_backend(partition_fn: Callable[..., Any], graphs: dict[str, torch.fx.GraphModule]) -> Any:
    """`aot_eager_decomp_partition` with compilers that record the partitioned graphs and run them as they are."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    with expected_compile_warnings():
        from torch._inductor.compile_fx import select_decomp_table

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        decompositions=select_decomp_table,
        partition_fn=partition_fn,
    )


def is_view(node: torch.fx.Node) -> bool:
    """A getitem or an op whose output aliases an input: no arithmetic, and remat does not trace it."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
