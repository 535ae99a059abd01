"""`remat.checkpoint` of an `nn.Module`: a module again, with the same parameters under the same names."""

from __future__ import annotations

from typing import Any

from torch import nn

from ._checkpointed import Checkpointed, DelegatesToCheckpointed

__all__ = ["CheckpointedModule"]


class CheckpointedModule(DelegatesToCheckpointed, nn.Module):
    """An `nn.Module` checkpointed by `remat.checkpoint`: call it like the original.

    It shares the wrapped module's parameters, buffers and submodules (the same
    objects under the same names), so `named_parameters()`, `state_dict()`,
    `.to()`, optimizers and `torch.func.functional_call` see exactly the
    original module; `train()` and `eval()` reach the wrapped module too.

    >>> import torch, remat
    >>> layer = torch.nn.Linear(3, 2)
    >>> checkpointed = remat.checkpoint(layer)
    >>> [name for name, _ in checkpointed.named_parameters()]
    ['weight', 'bias']
    >>> checkpointed.weight is layer.weight
    True
    """

    checkpointed: Checkpointed[..., Any]

    def __init__(self, module: nn.Module, policy: Any, cache_size: int, compile: Any = False):
        super().__init__()
        # Share the wrapped module's tables rather than registering it as a child,
        # so that every name is the wrapped module's own.
        for table in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            object.__setattr__(self, table, getattr(module, table))
        object.__setattr__(self, "checkpointed", Checkpointed(module, policy, cache_size, compile))
        self.training = module.training

    @property
    def __wrapped__(self) -> nn.Module:
        return self.checkpointed.__wrapped__  # type: ignore[return-value]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.checkpointed(*args, **kwargs)

    def train(self, mode: bool = True) -> CheckpointedModule:
        self.__wrapped__.train(mode)
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"policy={self.policy!r}, module={type(self.__wrapped__).__name__}"
