"""Which torch.func transforms and autograd features work through which checkpointing method.

For a small float64 MLP (a function of its input and weights, and the same MLP
as an `nn.Module` where parameters are passed by name), every row runs one
transform of the MLP wrapped by each method and compares the result with the
same transform of the unwrapped MLP:

- "works": it ran and every result equals the unwrapped one (`torch.allclose`);
- "wrong result": it ran, but some result differs;
- otherwise the first line of the error it raised.

The methods: `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, selective
activation checkpointing (SAC) with a policy that saves matmuls, `torch_remat.checkpoint`,
and `remat.checkpoint` under `save_nothing` and under a policy that saves matmuls.
Everything runs on CPU in seconds. Each row says which peers fail it, and what they
raise: `tests/test_torch_func_table.py` runs every cell, the peers' failures as
expected failures (strict: a peer that starts working fails the test until its row
says so). With `--out`, it writes the generated part of `docs/torch-func.md` (between
its markers): the table and what each row runs; the rest of the page is written by hand.

Run: python -m benchmarks.transform_table [--out docs/torch-func.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optree
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils.checkpoint import CheckpointError

import remat
from remat import policies

from . import peers

aten = torch.ops.aten
DTYPE = torch.float64
BATCH, IN, HIDDEN, OUT = 3, 4, 5, 2
ERROR_CHARS = 120
COMMAND = "python -m benchmarks.transform_table --out docs/torch-func.md"

Fn = Callable[..., Any]

# --- the checkpointing methods ---------------------------------------------------------------------


def _sac_checkpoint(fn: Fn) -> Fn:
    return peers.selective(fn, save=(aten.mm.default, aten.addmm.default))


class _SharingModule(nn.Module):
    """Calls `module` through a function wrapper, under the module's own parameter names
    (as `remat.checkpoint(module)` does), so `functional_call` takes the same names."""

    def __init__(self, module: nn.Module, wrap: Callable[[Fn], Fn]):
        super().__init__()
        for table in ("_parameters", "_buffers", "_modules"):
            object.__setattr__(self, table, getattr(module, table))
        object.__setattr__(self, "wrapped", wrap(module))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrapped(x)


@dataclasses.dataclass(frozen=True)
class Method:
    """A checkpointing method: how it wraps a function, and how it wraps a module."""

    name: str
    function: Callable[[Fn], Fn]
    module: Callable[[nn.Module], nn.Module]


def _peer(name: str, wrap: Callable[[Fn], Fn]) -> Method:
    return Method(name, wrap, lambda module: _SharingModule(module, wrap))


def _remat(name: str, policy: Any) -> Method:
    return Method(name, lambda fn: remat.checkpoint(fn, policy=policy), lambda m: remat.checkpoint(m, policy=policy))


CHECKPOINT, SAC, TORCH_REMAT = "torch.utils.checkpoint", "SAC (save matmuls)", "torch_remat"
REFERENCE = Method("no checkpoint", lambda fn: fn, lambda module: module)
METHODS = (
    REFERENCE,
    _peer(CHECKPOINT, peers.checkpointed),
    _peer(SAC, _sac_checkpoint),
    _peer(TORCH_REMAT, lambda fn: peers.torch_remat_regions(fn, "mlp")),
    _remat("remat (save_nothing)", policies.save_nothing),
    _remat("remat (save matmuls)", policies.save_ops(aten.mm, aten.addmm)),
)

# --- the functions and their inputs ----------------------------------------------------------------


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """The region every method checkpoints: two layers with a tanh between them."""
    return torch.tanh(x @ w1 + b1) @ w2 + b2


def dropout_mlp(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """`mlp` with dropout on the hidden layer."""
    return F.dropout(torch.tanh(x @ w1 + b1), p=0.5, training=True) @ w2 + b2


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def inputs() -> tuple[torch.Tensor, ...]:
    """Fresh (x, w1, b1, w2, b2), none requiring grad."""
    return (
        _randn(BATCH, IN, seed=0),
        _randn(IN, HIDDEN, seed=1) / 2,
        _randn(HIDDEN, seed=2) / 2,
        _randn(HIDDEN, OUT, seed=3) / 2,
        _randn(OUT, seed=4) / 2,
    )


def leaves(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.requires_grad_() for t in tensors)


def mlp_module() -> nn.Module:
    """`mlp` as an `nn.Module`, with the weights of `inputs()`."""
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).to(DTYPE)
    _, w1, b1, w2, b2 = inputs()
    with torch.no_grad():
        for param, value in zip(model.parameters(), (w1.T, b1, w2.T, b2), strict=True):
            param.copy_(value)
    return model


def _loss(region: Fn) -> Fn:
    return lambda *args: region(*args).square().sum()


PER_SAMPLE = (0, None, None, None, None)  # vmap over the rows of x, weights shared

# --- the rows --------------------------------------------------------------------------------------
# Each takes a method and returns what to compare with the reference method's result.


def run_grad(method: Method) -> Any:
    return grad(_loss(method.function(mlp)), argnums=(0, 1, 2, 3, 4))(*inputs())


def run_grad_and_value(method: Method) -> Any:
    return grad_and_value(_loss(method.function(mlp)), argnums=(0, 1, 3))(*inputs())


def run_vjp(method: Method) -> Any:
    out, vjp_fn = vjp(method.function(mlp), *inputs())
    return out, vjp_fn(_randn(BATCH, OUT, seed=5))


def run_jacrev(method: Method) -> Any:
    return jacrev(method.function(mlp), argnums=(0, 1))(*inputs())


def run_jacfwd(method: Method) -> Any:
    return jacfwd(method.function(mlp), argnums=(0, 1))(*inputs())


def run_jvp(method: Method) -> Any:
    primals = inputs()
    tangents = tuple(_randn(*p.shape, seed=10 + i) for i, p in enumerate(primals))
    return jvp(method.function(mlp), primals, tangents)


def run_jvp_of_vmap(method: Method) -> Any:
    primals = inputs()
    tangents = tuple(_randn(*p.shape, seed=10 + i) for i, p in enumerate(primals))
    return jvp(vmap(method.function(mlp), in_dims=PER_SAMPLE), primals, tangents)


def run_hessian(method: Method) -> Any:
    return hessian(_loss(method.function(mlp)), argnums=1)(*inputs())


def run_jacrev_of_jacfwd(method: Method) -> Any:
    return jacrev(jacfwd(_loss(method.function(mlp)), argnums=1), argnums=1)(*inputs())


def run_jacfwd_of_jacfwd(method: Method) -> Any:
    return jacfwd(jacfwd(_loss(method.function(mlp)), argnums=1), argnums=1)(*inputs())


def run_jvp_of_jvp(method: Method) -> Any:
    primals = inputs()
    inner = tuple(_randn(*p.shape, seed=10 + i) for i, p in enumerate(primals))
    outer = tuple(_randn(*p.shape, seed=20 + i) for i, p in enumerate(primals))
    return jvp(lambda *p: jvp(method.function(mlp), p, inner)[1], primals, outer)


def _vmap_then_backward(fn: Fn) -> Any:
    x, *params = inputs()
    params = list(leaves(*params))
    out = fn(x, *params)
    return out, torch.autograd.grad(out.square().sum(), params)


def run_vmap(method: Method) -> Any:
    return _vmap_then_backward(vmap(method.function(mlp), in_dims=PER_SAMPLE))


def run_checkpoint_of_vmap(method: Method) -> Any:
    return _vmap_then_backward(method.function(vmap(mlp, in_dims=PER_SAMPLE)))


def run_per_sample_grads(method: Method) -> Any:
    return vmap(grad(_loss(method.function(mlp)), argnums=(1, 2, 3, 4)), in_dims=PER_SAMPLE)(*inputs())


def _per_sample_grads_with_dropout(method: Method, randomness: str) -> Any:
    per_sample = vmap(
        grad(_loss(method.function(dropout_mlp)), argnums=(1, 3)), in_dims=PER_SAMPLE, randomness=randomness
    )
    torch.manual_seed(0)
    return per_sample(*inputs()), torch.rand(1)  # the random stream must end where the reference's does


def run_randomness_different(method: Method) -> Any:
    return _per_sample_grads_with_dropout(method, "different")


def run_randomness_same(method: Method) -> Any:
    return _per_sample_grads_with_dropout(method, "same")


def run_grad_of_grad(method: Method) -> Any:
    loss = _loss(method.function(mlp))
    every_argument = (0, 1, 2, 3, 4)

    def norm_of_gradient(*args: torch.Tensor) -> torch.Tensor:
        return sum(g.square().sum() for g in grad(loss, argnums=every_argument)(*args))  # type: ignore[return-value]

    return grad(norm_of_gradient, argnums=every_argument)(*inputs())


def run_grad_of_grad_fewer(method: Method) -> Any:
    loss = _loss(method.function(mlp))

    def norm_of_input_gradient(*args: torch.Tensor) -> torch.Tensor:
        return grad(loss, argnums=0)(*args).square().sum()

    return grad(norm_of_input_gradient, argnums=(0, 1, 2, 3, 4))(*inputs())


def run_functional_call(method: Method) -> Any:
    model = method.module(mlp_module())
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, params, (x,)) - target).square().sum()

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, inputs()[0], _randn(BATCH, OUT, seed=6))


def run_double_backward(method: Method) -> Any:
    args = leaves(*inputs())
    loss = _loss(method.function(mlp))(*args)
    with warnings.catch_warnings():  # torch's note on `.grad` cycles, for the row's own call; the grads are reset below
        warnings.filterwarnings("ignore", "Using backward\\(\\) with create_graph=True", UserWarning)
        loss.backward(create_graph=True)
    first = [a.grad for a in args]
    for a in args:
        a.grad = None
    sum(g.square().sum() for g in first).backward()  # type: ignore[union-attr]
    return first, [a.grad for a in args]


def run_backward_twice(method: Method) -> Any:
    args = leaves(*inputs())
    loss = _loss(method.function(mlp))(*args)
    return torch.autograd.grad(loss, args, retain_graph=True), torch.autograd.grad(loss, args)


def run_gradcheck(method: Method) -> Any:
    return torch.autograd.gradcheck(method.function(mlp), leaves(*inputs()))


def run_gradgradcheck(method: Method) -> Any:
    return torch.autograd.gradgradcheck(method.function(mlp), leaves(*inputs()))


def run_forward_ad(method: Method) -> Any:
    x, *params = inputs()
    with fwAD.dual_level():
        out = fwAD.unpack_dual(method.function(mlp)(fwAD.make_dual(x, _randn(BATCH, IN, seed=7)), *params))
        return out.primal, out.tangent


def run_forward_ad_of_vmap(method: Method) -> Any:
    x, *params = inputs()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, _randn(BATCH, IN, seed=7))
        out = fwAD.unpack_dual(vmap(method.function(mlp), in_dims=PER_SAMPLE)(dual, *params))
        return out.primal, out.tangent


def run_backward_of_forward_ad(method: Method) -> Any:
    x, *params = inputs()
    params = list(leaves(*params))
    with fwAD.dual_level():
        out = fwAD.unpack_dual(method.function(mlp)(fwAD.make_dual(x, _randn(BATCH, IN, seed=7)), *params))
    return out.tangent, torch.autograd.grad(out.tangent.square().sum() + out.primal.sum(), params)


def run_nested(method: Method) -> Any:
    inner = method.function(mlp)

    def outer(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return torch.tanh(inner(x.sin(), *params))

    args = leaves(*inputs())
    out = method.function(outer)(*args)
    return out, torch.autograd.grad(out.square().sum(), args)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    what: str
    run: Callable[[Method], Any]
    fails: Mapping[str, type[BaseException]] = dataclasses.field(default_factory=dict)  # peer -> what it raises


# How the peers fail. torch.func's reverse-mode transforms refuse saved-tensor hooks, which every peer
# installs; vmap over them loses track of the batch; torch_remat's autograd.Function has no vmap or jvp
# rule; SAC replays a region once, so a second backward through it fails.
_HOOKS = {CHECKPOINT: RuntimeError, SAC: RuntimeError, TORCH_REMAT: RuntimeError}
_NO_FUNCTORCH_RULE = {TORCH_REMAT: RuntimeError}
_SAC_ONCE = {SAC: RuntimeError}

ROWS = (
    Row("`grad`", "`torch.func.grad` of a scalar loss of the MLP, for every argument", run_grad, _HOOKS),
    Row("`grad_and_value`", "`grad_and_value` with `argnums=(0, 1, 3)`", run_grad_and_value, _HOOKS),
    Row("`vjp`", "`torch.func.vjp` and its pullback", run_vjp, _HOOKS),
    Row("`jacrev`", "`jacrev` with respect to the input and the first weight", run_jacrev, _HOOKS),
    Row("`jacfwd`", "`jacfwd`, likewise", run_jacfwd, _NO_FUNCTORCH_RULE),
    Row("`jvp`", "`torch.func.jvp` with a tangent for every argument", run_jvp, _NO_FUNCTORCH_RULE),
    Row(
        "`jvp(vmap)`",
        "`torch.func.jvp` of the `vmap` below, a tangent for every argument",
        run_jvp_of_vmap,
        _NO_FUNCTORCH_RULE,
    ),
    Row("`hessian`", "`hessian` of the loss with respect to the first weight", run_hessian, _HOOKS),
    Row("`jacrev(jacfwd)`", "the same Hessian, reverse mode over forward mode", run_jacrev_of_jacfwd, _HOOKS),
    Row(
        "`jacfwd(jacfwd)`",
        "the same Hessian, forward mode over forward mode",
        run_jacfwd_of_jacfwd,
        _NO_FUNCTORCH_RULE,
    ),
    Row(
        "`jvp(jvp)`",
        "`torch.func.jvp` of the tangent of another, for every argument",
        run_jvp_of_jvp,
        _NO_FUNCTORCH_RULE,
    ),
    Row("`vmap`", "`vmap(checkpointed, in_dims=(0, None, ...))`, then `backward` to the weights", run_vmap, _HOOKS),
    Row(
        "`checkpoint(vmap)`",
        "the method applied to `vmap(mlp)`, then `backward` to the weights",
        run_checkpoint_of_vmap,
    ),
    Row("`vmap(grad)`", "per-sample gradients of the weights", run_per_sample_grads, _HOOKS),
    Row(
        '`vmap(grad)`, dropout, `randomness="different"`',
        "per-sample gradients of an MLP with dropout, seeded; and the next random number drawn after them",
        run_randomness_different,
        _HOOKS,
    ),
    Row(
        '`vmap(grad)`, dropout, `randomness="same"`',
        'the same with `randomness="same"`',
        run_randomness_same,
        _HOOKS,
    ),
    Row("`grad(grad)`", "`grad` of the squared norm of the full inner `grad`", run_grad_of_grad, _HOOKS),
    Row(
        "`grad(grad)`, inner `argnums=0`",
        "`grad` (every argument) of the squared norm of the inner `grad` with respect to the input only",
        run_grad_of_grad_fewer,
        _HOOKS,
    ),
    Row(
        "`functional_call` + `vmap(grad)`",
        "per-sample gradients of the `nn.Module` form, parameters passed by name to `functional_call`",
        run_functional_call,
        _HOOKS,
    ),
    Row(
        "double backward",
        "`loss.backward(create_graph=True)`, then `backward` of the squared gradient norm",
        run_double_backward,
        _SAC_ONCE,
    ),
    Row(
        "`autograd.grad` twice",
        "`torch.autograd.grad(..., retain_graph=True)`, then again",
        run_backward_twice,
        _SAC_ONCE,
    ),
    Row("`gradcheck`", "`torch.autograd.gradcheck` of the MLP", run_gradcheck, _SAC_ONCE),
    Row("`gradgradcheck`", "`torch.autograd.gradgradcheck` of the MLP", run_gradgradcheck, _SAC_ONCE),
    Row(
        "`forward_ad` dual tensors",
        "`torch.autograd.forward_ad.make_dual` on the input",
        run_forward_ad,
        {TORCH_REMAT: NotImplementedError},
    ),
    Row(
        "`forward_ad`, then backward",
        "`backward` to the weights of a loss of the dual input's output and its tangent",
        run_backward_of_forward_ad,
        {CHECKPOINT: CheckpointError, SAC: RuntimeError, TORCH_REMAT: NotImplementedError},
    ),
    Row(
        "`forward_ad` dual tensors through `vmap`",
        "the `vmap` below of the method, called on a dual input",
        run_forward_ad_of_vmap,
        _NO_FUNCTORCH_RULE,
    ),
    Row(
        "nested checkpoints",
        "the method applied to a function that calls the MLP through the method",
        run_nested,
        {TORCH_REMAT: NotImplementedError},
    ),
)

# Before torch 2.12, torch.utils.checkpoint (and SAC, built on it) has no forward-mode or vmap rule either:
# under forward mode it raises "You must implement the jvp function for custom autograd.Function" (a
# `NotImplementedError` on 2.10) or "You tried to vmap over _NoopSaveInputs". The page shows the newest release's cells; these are the expected
# failures of the rows run under forward mode on the older ones.
_FORWARD_MODE_ROWS = frozenset(
    {
        "`jacfwd`",
        "`jvp`",
        "`jvp(vmap)`",
        "`jacfwd(jacfwd)`",
        "`jvp(jvp)`",
        "`forward_ad` dual tensors",
        "`forward_ad`, then backward",
        "`forward_ad` dual tensors through `vmap`",
    }
)
_NO_JVP_BEFORE_2_12 = {CHECKPOINT: RuntimeError, SAC: RuntimeError}


def fails_on(row: Row, release: str) -> Mapping[str, type[BaseException]]:
    """What each peer raises in `row` on torch `release` ("2.11")."""
    if release in ("2.10", "2.11") and row.name in _FORWARD_MODE_ROWS:
        return {**row.fails, **_NO_JVP_BEFORE_2_12}
    return row.fails


# --- running the cells -----------------------------------------------------------------------------


def error_text(error: BaseException) -> str:
    """`Type: first line of the message`, without addresses, cut to ERROR_CHARS."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    text = re.sub(r"0x[0-9a-fA-F]+", "0x…", text)  # addresses would make the page change from run to run
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 1] + "…"


def same(got: Any, expected: Any) -> bool:
    got_leaves, got_spec = optree.tree_flatten(got, none_is_leaf=True)
    expected_leaves, expected_spec = optree.tree_flatten(expected, none_is_leaf=True)
    if got_spec != expected_spec:
        return False
    for a, b in zip(got_leaves, expected_leaves, strict=True):
        if isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b)):
                return False
        elif a != b:
            return False
    return True


def run(row: Row, method: Method) -> Any:
    """What `row` gives through `method`, from a fixed seed. The peers' warnings (about `use_reentrant` and
    the like) are silenced; remat's are not."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        if method.name in (CHECKPOINT, SAC, TORCH_REMAT):
            warnings.simplefilter("ignore")
        return row.run(method)


def run_cell(row: Row, method: Method) -> tuple[str | None, Any]:
    """(None, result) if the cell ran, else (error text, None)."""
    try:
        return None, run(row, method)
    except Exception as error:
        return error_text(error), None


def table() -> list[dict[str, str]]:
    """One dict per row: method name -> cell text."""
    rows = []
    for row in ROWS:
        reference_error, expected = run_cell(row, REFERENCE)
        cells = {REFERENCE.name: reference_error or "works"}
        for method in METHODS[1:]:
            error, got = run_cell(row, method)
            if error is None:
                cells[method.name] = "wrong result" if reference_error or not same(got, expected) else "works"
            else:
                cells[method.name] = error
        rows.append(cells)
    return rows


def render(cells: list[dict[str, str]]) -> str:
    header = ["transform", *(m.name for m in METHODS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row, row_cells in zip(ROWS, cells, strict=True):
        texts = [row.name, *(row_cells[m.name].replace("|", "\\|") for m in METHODS)]
        lines.append("| " + " | ".join(texts) + " |")
    return "\n".join(lines)


# --- the page --------------------------------------------------------------------------------------

PAGE = Path(__file__).parent.parent / "docs" / "torch-func.md"
BEGIN = f"<!-- generated by `{COMMAND}`: edit the rows in benchmarks/transform_table.py, not this part -->"
END = "<!-- end of the generated part -->"


def generated(cells: list[dict[str, str]]) -> str:
    """The page's generated part: the torch it ran on, the table, and what each row runs."""
    date = datetime.now(timezone.utc).date().isoformat()
    rows = "\n".join(f"- {row.name}: {row.what}." for row in ROWS)
    return "\n\n".join(
        [
            f"torch {torch.__version__}, remat {remat.__version__}, generated {date}.",
            render(cells),
            "What each row runs ([`benchmarks/transform_table.py`](../benchmarks/transform_table.py)):",
            rows,
        ]
    )


def write_page(path: Path, cells: list[dict[str, str]]) -> None:
    """Replace the generated part of the page at `path` (between its markers) with `cells`'."""
    text = path.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"{path}: expected one line {BEGIN!r} and one line {END!r} around the generated part")
    before, rest = text.split(BEGIN)
    _, after = rest.split(END)
    path.write_text(f"{before}{BEGIN}\n\n{generated(cells)}\n\n{END}{after}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="the page whose generated part to write")
    args = parser.parse_args(argv)
    cells = table()
    print(render(cells))
    if args.out:
        write_page(args.out, cells)
        print(f"wrote the generated part of {args.out}")


if __name__ == "__main__":
    main()
