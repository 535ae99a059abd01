"""Checkpoint a model that calls a hand-written `torch.autograd.Function`.

`ScaledTanh` computes ``scale * tanh(x)`` with its own backward, which reads the
saved ``tanh(x)``. Traced by remat, its forward becomes several aten calls that
all carry the Function's class name as `Call.scope`, so a policy can keep or
replay a whole application as one unit: `remat.policies.save_scopes("ScaledTanh")`
keeps what its backward (and the next layer's) reads, `save_nothing` keeps
nothing and replays it. For each, the script prints what `remat.report` says is
kept, checks that the gradients equal those of the model without checkpointing
(float64), and that the gradient came from `ScaledTanh.backward`: remat records
that backward when it traces the model (once per input signature) and runs the
recorded ops on every later step; it never differentiates the forward itself.

Run: python examples/custom_function.py
"""

import argparse

import torch
from torch import nn

import remat
from remat import policies


class ScaledTanh(torch.autograd.Function):
    """``scale * tanh(x)``, with a backward that reuses the saved ``tanh(x)``."""

    backward_calls = 0  # how many times `backward` has run, on real or traced tensors

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return scale * y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ScaledTanh.backward_calls += 1
        (y,) = ctx.saved_tensors
        return grad * ctx.scale * (1 - y * y), None


class Model(nn.Module):
    """Three linear layers with `ScaledTanh` between them."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = ScaledTanh.apply(layer(x), 1.7)
        return self.layers[-1](x)


def gradients(fn, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    fn(x).square().mean().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="backward passes per policy (default 3)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Model().double()
    x = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    expected = gradients(model, model, x)

    trace = remat.trace(model, x)
    print(trace)
    scoped = [call.index for call in trace if call.scope == "ScaledTanh"]
    assert scoped, "no call of the trace has scope 'ScaledTanh'"
    print(f"calls inside ScaledTanh: {scoped}\n")

    for policy in (policies.save_scopes("ScaledTanh"), policies.save_nothing):
        checkpointed = remat.checkpoint(model, policy=policy)
        calls_before = ScaledTanh.backward_calls
        for _ in range(args.steps):
            got = gradients(checkpointed, model, x)
            error = max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))
            assert error < 1e-12, f"{policy!r}: gradients differ from the unwrapped model's by {error:.1e}"
        backward_calls = ScaledTanh.backward_calls - calls_before
        assert backward_calls >= 1, f"{policy!r}: ScaledTanh.backward never ran"

        report = remat.report(model, x, policy=policy)
        kept = [f"#{row.call.index} {row.call.name}" for row in report.rows if row.saved]
        print(f"{policy!r}:")
        print(f"  keeps {report.saved_bytes:,} bytes: {', '.join(kept) or 'nothing'}")
        print(f"  replays in backward: calls {list(report.replayed_calls)}")
        print(
            f"  ScaledTanh.backward ran {backward_calls} times in {args.steps} backward passes: once per application, "
            "when remat traced the model; every pass ran the recorded ops"
        )
        print(f"  gradients vs. no checkpoint: max error {error:.1e} OK")
    print()
    print(remat.report(model, x, policy=policies.save_scopes("ScaledTanh")))


if __name__ == "__main__":
    main()
