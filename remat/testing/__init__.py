"""Property-test your own code with remat: random functions, inputs, policies and an equivalence check.

`remat.checkpoint` promises the outputs and gradients of the function it
wraps, whatever the policy. This package lets users (and remat's own test
suite) check that promise on their models and on random programs: hypothesis
strategies that draw random functions from a catalog of aten-level behaviours
(`functions`), inputs for them (`inputs`) and per-call policies for a trace
(`policies`), and `assert_checkpoint_equivalent`, which compares a function
with its checkpoint and explains any difference.

It needs `hypothesis` (an optional dependency), so `import remat` does not
import it; use `import remat.testing`.

>>> import torch, remat.testing
>>> remat.testing.assert_checkpoint_equivalent(lambda x: x.sin().exp(), torch.randn(3, requires_grad=True))
CheckpointedRun(outputs=Tensor(shape=(3,), dtype=torch.float32), input_grads=(Tensor(shape=(3,), dtype=torch.float32),), param_grads=())

The package owns remat's testing oracle, one job per module: the catalog of behaviours
(`_catalog`), the strategies (`_strategies`), the torch.func transforms a comparison runs under
(`_transforms`), one run's record (`_runs`) and the equivalence check (`_equivalence`). Each reads
its siblings through their `__all__` only, never their underscore names. It may import remat's public
API and remat's internals (`from .. import ...`), which it sits above; nothing in remat imports it
(`tests/test_architecture.py` checks that, and that no module here imports another's underscore
names).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._storing import _offload
from ._catalog import (
    AS_STRIDED_WRITES,
    CATALOG,
    LOW_PRECISION_OPS,
    RANDOM_OPS,
    REFUSABLE_OPS,
    STATEFUL_OPS,
    CatalogState,
)
from ._equivalence import CheckpointedRun, assert_checkpoint_equivalent
from ._strategies import RandomFunction, Step, functions, inputs, policies, transforms_for
from ._transforms import TRANSFORMS

__all__ = [
    "AS_STRIDED_WRITES",
    "CATALOG",
    "LOW_PRECISION_OPS",
    "RANDOM_OPS",
    "REFUSABLE_OPS",
    "STATEFUL_OPS",
    "TRANSFORMS",
    "CatalogState",
    "CheckpointedRun",
    "RandomFunction",
    "Step",
    "assert_checkpoint_equivalent",
    "functions",
    "inputs",
    "offloading_on_cpu",
    "policies",
    "transforms_for",
]


@contextlib.contextmanager
def offloading_on_cpu() -> Iterator[None]:
    """Within this context, offloaded CPU tensors are copied for real (in the thread that enters it only).

    A CPU tensor is its own host copy, so offloading on the CPU copies nothing. Inside this
    context the copies are made (a new tensor to the host in forward, another back in
    backward), so a test on any machine follows what a GPU run does: the value the forward
    made is freed once forward no longer reads it, the copy is what `saved_tensors_hooks`
    see, and backward reads a third tensor.

    >>> import torch, remat, remat.testing
    >>> f = remat.checkpoint(lambda x: x.sin().sin().sum(), policy=remat.policies.offload(remat.policies.save_everything))
    >>> x = torch.ones(3, requires_grad=True)
    >>> with remat.testing.offloading_on_cpu():
    ...     f(x).backward()
    >>> torch.allclose(x.grad, torch.cos(torch.sin(x)) * torch.cos(x))
    True
    """
    token = _offload.CPU_COPIES.set(True)
    try:
        yield
    finally:
        _offload.CPU_COPIES.reset(token)
