"""Keep linalg ops' error checks in a trace, where functionalization would drop them.

linalg ops check their results and raise (a singular matrix) through an op that functionalization
would thread effect tokens through. `FunctionalModeKeepingChecks`, the functionalization mode of a
trace, traces the check as it is, and `kept_as_dead_code` keeps its node (NOTE [error checks of linalg
ops]). The mode also runs out of place the in-place ops whose meta kernels fail under forward AD
(`_fake_kernels`).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _quirks
from .._torch import (
    FunctionalTensor,
    FunctionalTensorMode,
    from_functional,
    inherit_higher_order_rules,
    sync,
    tree_map_only,
)
from ._fake_kernels import check_in_place_result, out_of_place_under_forward_ad

__all__ = [
    "FunctionalModeKeepingChecks",
    "kept_as_dead_code",
]


# NOTE [error checks of linalg ops]
# `torch.linalg.inv`, `solve`, `cholesky`, `slogdet`, `lu_factor` and friends
# run their `_ex` form and then `aten._linalg_check_errors(info, ...)`, which
# raises (a singular matrix, a matrix that is not positive-definite) and
# returns nothing. Since torch 2.13 functionalization marks that op effectful
# and wants an effect token threaded through the graph, which only
# AOTAutograd sets up ("Could not find a token for effect"). The check is a
# pure read of `info`: it is traced as it is, unfunctionalized, so
# the forward program runs it where eager does and raises what eager raises.
# Its node has no output, so no policy keeps anything for it and backward
# never replays it (a replayed `_ex` call is not checked again: its forward
# already was). Dead-code elimination must keep the node (`kept_as_dead_code`):
# on a release that does not mark the op effectful, fx would remove it, and
# with it the check.
_ERROR_CHECKS = _quirks.LINALG_CHECKS_ARE_EFFECTFUL.table


def kept_as_dead_code(node: Any) -> bool:
    """Whether dead-code elimination must keep the traced node `node`: it has side effects."""
    return bool(node.is_impure()) or node.target in _ERROR_CHECKS


class FunctionalModeKeepingChecks(FunctionalTensorMode):
    """The `FunctionalTensorMode` of a trace, which traces error checks as they are."""

    def __enter__(self) -> Any:
        inherit_higher_order_rules(type(self))  # See NOTE [higher-order ops under remat's modes].
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _ERROR_CHECKS:  # NOTE [error checks of linalg ops]
            args, kwargs = tree_map_only(FunctionalTensor, _unwrap, (args, kwargs or {}))
            return func(*args, **kwargs)  # this mode is off while it dispatches: make_fx records the op
        out_of_place = out_of_place_under_forward_ad(func)
        if out_of_place is not None:  # See NOTE [in-place ops whose meta kernels fail under forward AD].
            result = self.__torch_dispatch__(out_of_place, types, args, kwargs)
            check_in_place_result(func, args[0], result)
            target = args[0]  # updated as functionalization updates a tensor in place
            target.replace_(from_functional(result))
            target.commit_update()
            target.sync()
            return target
        return super().__torch_dispatch__(func, types, args, kwargs)


def _unwrap(functional: FunctionalTensor) -> torch.Tensor:
    sync(functional)
    return from_functional(functional)
