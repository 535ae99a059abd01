"""Which torch.func transforms and autograd features work through which checkpointing method.

For a small float64 MLP (a function of its input and weights, and the same MLP
as an `nn.Module` where parameters are passed by name), every row runs one
transform of the MLP wrapped by each method and compares the result with the
same transform of the unwrapped MLP:

- "works": it ran and every result equals the unwrapped one (`torch.allclose`);
- "wrong result": it ran, but some result differs;
- otherwise the first line of the error it raised.

The methods: `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, selective
activation checkpointing (SAC) with a policy that saves matmuls, and
`remat.checkpoint` under `save_nothing` and under a policy that saves matmuls.
Everything runs on CPU in seconds. With `--out`, it writes the whole page
`docs/torch-func.md`: the table, how it was made, and a guide to composing
remat with torch.func.

Run: python -m benchmarks.transform_table [--out docs/torch-func.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import optree
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap

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


REFERENCE = Method("no checkpoint", lambda fn: fn, lambda module: module)
METHODS = (
    REFERENCE,
    _peer("torch.utils.checkpoint", peers.checkpointed),
    _peer("SAC (save matmuls)", _sac_checkpoint),
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


ROWS = (
    Row("`grad`", "`torch.func.grad` of a scalar loss of the MLP, for every argument", run_grad),
    Row("`grad_and_value`", "`grad_and_value` with `argnums=(0, 1, 3)`", run_grad_and_value),
    Row("`vjp`", "`torch.func.vjp` and its pullback", run_vjp),
    Row("`jacrev`", "`jacrev` with respect to the input and the first weight", run_jacrev),
    Row("`jacfwd`", "`jacfwd`, likewise", run_jacfwd),
    Row("`jvp`", "`torch.func.jvp` with a tangent for every argument", run_jvp),
    Row("`jvp(vmap)`", "`torch.func.jvp` of the `vmap` below, a tangent for every argument", run_jvp_of_vmap),
    Row("`hessian`", "`hessian` of the loss with respect to the first weight", run_hessian),
    Row("`jacrev(jacfwd)`", "the same Hessian, reverse mode over forward mode", run_jacrev_of_jacfwd),
    Row("`jacfwd(jacfwd)`", "the same Hessian, forward mode over forward mode", run_jacfwd_of_jacfwd),
    Row("`jvp(jvp)`", "`torch.func.jvp` of the tangent of another, for every argument", run_jvp_of_jvp),
    Row("`vmap`", "`vmap(checkpointed, in_dims=(0, None, ...))`, then `backward` to the weights", run_vmap),
    Row(
        "`checkpoint(vmap)`",
        "the method applied to `vmap(mlp)`, then `backward` to the weights",
        run_checkpoint_of_vmap,
    ),
    Row("`vmap(grad)`", "per-sample gradients of the weights", run_per_sample_grads),
    Row(
        '`vmap(grad)`, dropout, `randomness="different"`',
        "per-sample gradients of an MLP with dropout, seeded; and the next random number drawn after them",
        run_randomness_different,
    ),
    Row('`vmap(grad)`, dropout, `randomness="same"`', 'the same with `randomness="same"`', run_randomness_same),
    Row("`grad(grad)`", "`grad` of the squared norm of the full inner `grad`", run_grad_of_grad),
    Row(
        "`grad(grad)`, inner `argnums=0`",
        "`grad` (every argument) of the squared norm of the inner `grad` with respect to the input only",
        run_grad_of_grad_fewer,
    ),
    Row(
        "`functional_call` + `vmap(grad)`",
        "per-sample gradients of the `nn.Module` form, parameters passed by name to `functional_call`",
        run_functional_call,
    ),
    Row(
        "double backward",
        "`loss.backward(create_graph=True)`, then `backward` of the squared gradient norm",
        run_double_backward,
    ),
    Row("`autograd.grad` twice", "`torch.autograd.grad(..., retain_graph=True)`, then again", run_backward_twice),
    Row("`gradcheck`", "`torch.autograd.gradcheck` of the MLP", run_gradcheck),
    Row("`gradgradcheck`", "`torch.autograd.gradgradcheck` of the MLP", run_gradgradcheck),
    Row("`forward_ad` dual tensors", "`torch.autograd.forward_ad.make_dual` on the input", run_forward_ad),
    Row(
        "`forward_ad`, then backward",
        "`backward` to the weights of a loss of the dual input's output and its tangent",
        run_backward_of_forward_ad,
    ),
    Row(
        "`forward_ad` dual tensors through `vmap`",
        "the `vmap` below of the method, called on a dual input",
        run_forward_ad_of_vmap,
    ),
    Row("nested checkpoints", "the method applied to a function that calls the MLP through the method", run_nested),
)

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


def run_cell(row: Row, method: Method) -> tuple[str | None, Any]:
    """(None, result) if the cell ran, else (error text, None)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peers warn about use_reentrant and the like; the table says what matters
        try:
            return None, row.run(method)
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

INTRO = """\
# Composing remat with torch.func

`remat.checkpoint` composes with `torch.func` transforms and with higher-order autograd. The table below
runs each transform on a small float64 MLP checkpointed by each method and compares the result with the
same transform of the MLP without checkpointing."""

FOOTNOTE = f"""\
"works": the transform ran and every result equals the unwrapped MLP's (`torch.allclose`); "wrong result":
it ran, but a result differs; otherwise the cell holds the first line of the error raised. SAC is
`torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, context_fn=...)` with
`create_selective_checkpoint_contexts` and a policy that saves `aten.mm` and `aten.addmm`; "remat (save
matmuls)" is `remat.policies.save_ops(aten.mm, aten.addmm)`. The MLP is `tanh(x @ w1 + b1) @ w2 + b2` with
`x` of shape ({BATCH}, {IN}); for `nn.Module` rows, `nn.Sequential(Linear, Tanh, Linear)` with the same
weights, and the peers wrapped in a module that shares its parameter names.

Generated by `{COMMAND}`; what each row runs is in
[`benchmarks/transform_table.py`](../benchmarks/transform_table.py):"""

GUIDE = """\
## Per-sample gradients of a checkpointed module

`remat.checkpoint(module, policy=...)` of an `nn.Module` returns a `remat.CheckpointedModule`: a module that
shares the wrapped module's parameters, buffers and submodules, under the same names. So
`torch.func.functional_call` takes the same dictionary of parameters for both, and per-sample gradients
are the usual recipe:

```python
import torch
from torch.func import functional_call, grad, vmap
import remat

model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
checkpointed = remat.checkpoint(model, policy=remat.policies.save_ops(torch.ops.aten.addmm))
params = {name: p.detach() for name, p in model.named_parameters()}   # same names in `checkpointed`

def loss(params, x, y):  # one example: x of shape (16,), y of shape (1,)
    return (functional_call(checkpointed, params, (x,)) - y).square().mean()

x, y = torch.randn(8, 16), torch.randn(8, 1)
per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)    # {name: (8, *param.shape)}
```

Under `vmap`, remat traces the function at the per-example shape, outside the transforms, and runs the
traced programs on the batched tensors: the trace is the one the function has outside `vmap` at that
shape, and shares its cache entry (unless it applies dropout to a non-contiguous tensor: see Randomness
under vmap below). [`examples/per_sample_grads.py`](../examples/per_sample_grads.py) does
this for a small transformer and checks the result against the unwrapped model.

## Randomness under vmap

A random call inside a checkpointed function (dropout) is replayed in backward from the generator state
the forward kept, so the mask of the gradient is the mask of the forward. Under `vmap`:

- `randomness="different"` works: each example gets its own mask, the same ones (and the same gradients)
  as without checkpointing for the same seed, and the random stream ends where it would without
  checkpointing.
- `randomness="same"` works for random calls on contiguous tensors (dropout of a contiguous input
  included): remat runs an in-place random fill (`bernoulli_`, `normal_`, dropout's mask) as eager does,
  in place on a tensor of eager's layout, so functorch's rule for in-place random ops draws one mask for
  the whole batch. It fails for dropout of a non-contiguous input: there eager draws the mask from an
  unbatched tensor, remat into one shaped like the (batched) input, and functorch refuses a random call on
  a batched tensor under same randomness ("Vmap does not currently support same randomness with a batched
  tensor input"). Make the input contiguous, draw the mask outside `vmap`, or use `"different"`.
- `randomness="error"` (the default) raises for any random call, as it does without checkpointing.

Random calls draw eager's numbers whatever the layout of the tensor they fill: a transposed, permuted or
strided tensor is filled in its own memory order, as eager fills it (NOTE [random fills draw in eager's
layout] in `remat/_fidelity.py`). Under a transform (`grad`, `vmap`) torch's dropout functions draw their
mask out of place, into a contiguous tensor; for a non-contiguous input that gives other numbers than
without a transform, so remat traces such a function separately for calls under a transform, and each
trace draws what eager draws in its setting (NOTE [dropout under torch.func]).

## Higher-order derivatives

On the MLP of the table, double backward (`create_graph=True`), `grad(grad)`, `hessian`, `jacfwd`, `jvp`
and `gradgradcheck` through `remat.checkpoint` equal the same derivatives of the MLP without
checkpointing: they are derivatives of the function itself, not of an approximation. The values the
backward keeps are differentiable outputs of remat's `autograd.Function`; a second-order derivative that
flows through them is carried to the inputs by differentiating a pure program that recomputes those values
from the inputs (random calls replayed from their kept generator states, in-place updates of inputs
skipped). Forward mode (`jvp`, `jacfwd`, `hessian`) takes its tangents from the same program, by the
forward-mode formulas of its ops (as eager computes tangents), so a transform outside (`jacrev(jacfwd)`, a
`backward` of a `forward_ad` tangent) differentiates them as it does eager's. See NOTE [differentiating
the forward again] in `remat/_programs.py`.

Under two levels of forward mode (`jvp(jvp)`, `jacfwd(jacfwd)`, and `grad` of those) the checkpointed
function runs as it is written, without remat: torch does not differentiate the tangents of a custom
`autograd.Function`'s jvp rule at an outer forward-mode level (every such derivative comes out zero, for
any Function: pytorch/pytorch#197867), and forward mode keeps nothing for a backward, so there is nothing
to leave out. A reverse-mode level inside them keeps what eager keeps. NOTE [forward mode over forward
mode] in `remat/_execute.py`.

Under `jvp(vmap(f))` (and `jacfwd`), remat's jvp rule runs forward mode inside the batching, the order
of `vmap(jvp(f))`. There torch warns that it resized an `out=` tensor (a deprecation) for a random draw
followed by a log-sigmoid, as it does for eager's `vmap(jvp(f))`; the values are eager's.

Forward mode sees through `torch.no_grad()`, as in eager (a value computed under `no_grad` still carries
a tangent), and not through `.detach()`. An input that the function updates in place has its tangent
updated in place too, under `torch.autograd.forward_ad`; under `torch.func.jvp` (and `jacfwd`,
`hessian`) torch does not let a custom `autograd.Function` do that, and remat raises
`NotImplementedError` saying so (under `vmap` of `jvp` too): update a copy of the input instead. An
update of an input through `.detach()` keeps the input's old tangent beside its new value, as in eager.

For most functions this keeps nothing beyond what the policy keeps. When a kept value depends on an input
that requires grad, the pure program may need two more kinds of values, and they are kept whether or not a
second derivative is ever taken (both show in `remat.report`):

- the generator state (5,056 bytes on CPU, in `rng_state_bytes`) of a random call whose output has a
  derivative with respect to its inputs and that the kept value depends on. Dropout needs none: its mask
  (`aten.bernoulli`) has no derivative, and a kept value that depends on it stands for it;
- a copy of an input that the function overwrites in place (in `saved_bytes`), when the kept value was
  computed from its old value.

## Nested checkpoints

A `remat.checkpoint` called inside a function that is itself checkpointed does not trace separately: its
calls become part of the outer trace, and its own policy decides them (asked as if its calls were a
trace of their own, indexed from 0), while the outer policy decides the rest. `remat.report` of the outer
function shows the result:

```python
import torch
import remat

w1, w2 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
inner = remat.checkpoint(lambda h: (h @ w1).sin(), policy=remat.policies.save_everything)
outer = remat.checkpoint(lambda x: (inner(x.tanh()) @ w2).cos(), policy=remat.policies.save_nothing)
print(remat.report(outer, torch.randn(3, 4)))   # inner's mm and sin: SAVE; outer's tanh, mm, cos: RECOMPUTE
```

Its gradients equal those of the function without checkpoints (the last row of the table).
"""


def known_issues(cells: list[dict[str, str]]) -> str:
    """Lines for the remat cells that do not work, with what is known about them."""
    notes = {
        '`vmap(grad)`, dropout, `randomness="same"`': "see Randomness under vmap below.",
        "`grad(grad)`, inner `argnums=0`": (
            "the inner `grad` does not differentiate the weights, so remat traces them as not requiring grad, "
            "and the outer `grad` misses the part of their derivative that flows through kept values."
        ),
        "`forward_ad` dual tensors": (
            "remat's `jvp` rule calls `torch.func.jvp`, which cannot enter a second `forward_ad.dual_level`; "
            "`torch.func.jvp` and `jacfwd` of a checkpointed function work."
        ),
    }
    lines = []
    for row, row_cells in zip(ROWS, cells, strict=True):
        failing = [m.name for m in METHODS if m.name.startswith("remat") and row_cells[m.name] != "works"]
        if failing:
            lines.append(f"- {row.name} ({', '.join(failing)}): {notes.get(row.name, row_cells[failing[0]])}")
    if not lines:
        return ""
    return "Where remat does not work yet:\n\n" + "\n".join(lines)


def page(cells: list[dict[str, str]]) -> str:
    date = datetime.now(timezone.utc).date().isoformat()
    rows = "\n".join(f"- {row.name}: {row.what}." for row in ROWS)
    parts = [
        INTRO,
        f"torch {torch.__version__}, remat {remat.__version__}, generated {date}.",
        render(cells),
        FOOTNOTE + "\n\n" + rows,
        known_issues(cells),
        GUIDE,
    ]
    return "\n\n".join(part.strip() for part in parts if part) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the markdown page to this file")
    args = parser.parse_args()
    cells = table()
    print(render(cells))
    if args.out:
        with open(args.out, "w") as f:
            f.write(page(cells))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
