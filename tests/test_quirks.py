"""Each entry of `remat._quirks` still describes the running torch: a probe of the behaviour finds it
exactly where the entry says it is (on the releases it names), and the modules ask the registry."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from remat import _quirks, _torch
from remat._core._contexts import dispatch_keys_put_back
from remat._quirks import Quirk

aten = torch.ops.aten


def _detach_traces_as_alias() -> bool:
    graph = make_fx(lambda x: x.detach())(torch.ones(2)).graph
    targets = [node.target for node in graph.nodes if node.op == "call_function"]
    assert len(targets) == 1 and targets[0] in _quirks.DETACH_TRACES_AS_ALIAS.table
    return targets[0] is aten.alias.default


def _unbacked_symbols_are_named_u() -> bool:
    graph = make_fx(lambda x: x.nonzero(), tracing_mode="symbolic")(torch.tensor([1, 0, 1])).graph
    (size,) = {str(node.meta["val"].shape[0]) for node in graph.nodes if node.op == "call_function"}
    return _quirks.UNBACKED_SYMBOL_NAMES.table.fullmatch(size) is not None


def _linalg_checks_are_effectful() -> bool:
    from torch._higher_order_ops.effects import _get_effect

    return _get_effect(aten._linalg_check_errors.default) is not None


def _batch_norm_cpu_kernel_chooses_its_layout() -> bool:
    x = torch.randn(2, 5, 3).transpose(1, 2)  # (2, 3, 5), not contiguous
    args = (None, None, None, None, True, 0.1, 1e-5)
    real = aten.native_batch_norm.default(x, *args)[0]
    with FakeTensorMode() as mode:
        fake = aten.native_batch_norm.default(mode.from_tensor(x), *args)[0]
    return fake.stride() != real.stride()


def _fake_batch_norm_backward_ignores_the_mask() -> bool:
    def masked_input_gradient(mode: FakeTensorMode | None) -> object:
        tensors = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(3), torch.randn(3), torch.rand(3)]
        if mode is not None:
            tensors = [mode.from_tensor(t) for t in tensors]
        grad_out, x, weight, mean, invstd = tensors
        mask = [False, True, True]
        return aten.native_batch_norm_backward.default(grad_out, x, weight, None, None, mean, invstd, True, 1e-5, mask)[
            0
        ]

    assert masked_input_gradient(None) is None  # the real kernel leaves it out
    with FakeTensorMode() as mode:
        return masked_input_gradient(mode) is not None


def _batch_norm_training_ignores_running_stats() -> bool:
    x = torch.randn(6, 3, dtype=torch.float64)
    weight, bias = torch.rand(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    grad_out = torch.randn(6, 3, dtype=torch.float64)

    def forward_and_backward(running: float) -> list[torch.Tensor]:
        mean, var = torch.full((3,), running, dtype=torch.float64), torch.full((3,), 1 + running, dtype=torch.float64)
        out, save_mean, save_invstd, _, _ = aten._native_batch_norm_legit_functional.default(
            x, weight, bias, mean, var, True, 0.1, 1e-5
        )
        grads = aten.native_batch_norm_backward.default(
            grad_out, x, weight, mean, var, save_mean, save_invstd, True, 1e-5, [True, True, True]
        )
        return [out, save_mean, save_invstd, *grads]

    native = all(torch.equal(a, b) for a, b in zip(forward_and_backward(0.0), forward_and_backward(5.0), strict=True))
    return native and _gpu_batch_norm_backward_ignores_running_stats()


def _gpu_batch_norm_backward_ignores_running_stats() -> bool:
    """cuDNN's backward kernel gives the same gradients whatever running statistics it is given: on a GPU,
    run; elsewhere torch's decomposition of it (what torch says the kernel computes) stands in, on the CPU."""
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    x, grad_out = (torch.randn(6, 3, 4, dtype=torch.float64, device=device) for _ in range(2))
    weight = torch.rand(3, dtype=torch.float64, device=device)
    backward = aten.cudnn_batch_norm_backward.default
    if gpu:
        _, save_mean, save_invstd, reserve = aten.cudnn_batch_norm.default(x, weight, None, None, None, True, 0.1, 1e-5)
    else:
        from torch._decomp import decomposition_table

        backward = decomposition_table[backward]
        _, save_mean, save_invstd = aten.native_batch_norm.default(x, weight, None, None, None, True, 0.1, 1e-5)
        reserve = torch.empty(0, dtype=torch.uint8)

    def gradients(running: float) -> list[torch.Tensor]:
        mean, var = (torch.full((3,), v, dtype=torch.float64, device=device) for v in (running, 1 + running))
        return list(backward(x, grad_out, weight, mean, var, save_mean, save_invstd, 1e-5, reserve))

    return all(torch.equal(a, b) for a, b in zip(gradients(0.0), gradients(5.0), strict=True))


def _batch_norm_updates_undeclared() -> bool:
    # Each schema leaves the running statistics undeclared as written. Their kernels need a GPU: the native
    # kernel, of the same schema, stands for them here. It writes the statistics, and its outputs in training
    # are those it gives without them.
    undeclared = all(
        _torch.op_schema(op).arguments[i].alias_info is None
        for op, (_, stats) in _quirks.BATCH_NORM_UPDATES_UNDECLARED.table.items()
        for i in stats
    )
    x = torch.randn(6, 3, dtype=torch.float64)
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    with_stats = aten.native_batch_norm.default(x, None, None, mean, var, True, 0.1, 1e-5)
    without = aten.native_batch_norm.default(x, None, None, None, None, True, 0.1, 1e-5)
    same = all(torch.equal(a, b) for a, b in zip(with_stats, without, strict=True))
    return undeclared and same and not torch.equal(mean, torch.zeros(3, dtype=torch.float64))


def _rrelu_functional_derivative_reads_its_noise_input() -> bool:
    x = torch.tensor([-1.0, -2.0, 3.0], requires_grad=True)
    y, noise = aten.rrelu_with_noise_functional.default(x, torch.full((3,), 7.0), 0.1, 0.3, True)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert noise[:2].lt(1).all()  # the slopes drawn for the negative inputs
    transposed = torch.randn(3, 5).t()
    functional, _ = aten.rrelu_with_noise_functional.default(transposed, torch.empty(5, 3), 0.1, 0.3, True)
    in_place = aten.rrelu_with_noise.default(transposed, torch.empty(5, 3), 0.1, 0.3, True)
    return bool(grad[0] == 7.0) and not functional.is_contiguous() and in_place.is_contiguous()


def _gradients_read_lu_factors() -> bool:
    a = torch.randn(3, 3, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
    b = torch.randn(3, 2, dtype=torch.float64)

    def gradient(a: torch.Tensor, create_graph: bool) -> torch.Tensor:
        a = a.detach().requires_grad_()
        return torch.autograd.grad(torch.linalg.solve(a, b).sum(), a, create_graph=create_graph)[0]

    ops = {
        mode: {node.target for node in make_fx(functools.partial(gradient, create_graph=mode))(a).graph.nodes}
        for mode in (False, True)
    }
    return aten.linalg_lu_solve.default in ops[False] and aten.linalg_lu_solve.default not in ops[True]


def _gradients_switch_in_grad_mode() -> bool:
    """Each op's traced gradient holds other calls where grad mode is on as it runs than where it is off."""
    a = torch.randn(3, 3, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
    functions: dict[object, Callable[[torch.Tensor], torch.Tensor]] = {
        aten.cumprod.default: lambda t: torch.cumprod(t, 0),
        aten._linalg_solve_ex.default: lambda t: torch.linalg.solve(t, t[:, :1].detach()),
        aten._linalg_det.default: torch.linalg.det,
        aten._linalg_slogdet.default: lambda t: torch.linalg.slogdet(t).logabsdet,
    }
    assert set(functions) == _quirks.GRADIENTS_SWITCH_IN_GRAD_MODE.table

    def calls(fn: Callable[[torch.Tensor], torch.Tensor], create_graph: bool) -> list[object]:
        def gradient(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().requires_grad_()
            return torch.autograd.grad(fn(t).sum(), t, create_graph=create_graph)[0]

        return [node.target for node in make_fx(gradient)(a).graph.nodes]

    return all(calls(fn, False) != calls(fn, True) for fn in functions.values())


def _slice_scatter_refuses_negative_bounds_under_vmap() -> bool:
    base, source = torch.zeros(2, 5, 4), torch.ones(2, 5, 2)
    try:
        torch.func.vmap(lambda b, s: torch.slice_scatter(b, s, 1, 1, -1))(base, source)
    except RuntimeError as error:
        assert "inconsistent with step sign" in str(error)
        return True
    return False


def _in_place_ops_functionalization_cannot_map() -> bool:
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.clone().polygamma_(1)

    try:
        with FunctionalTensorMode():
            fn(torch.rand(3) + 0.5)
    except RuntimeError as error:
        assert "alias annotations" in str(error)
        return True
    return False


def _batch_norm_functional_unbatched() -> bool:
    x, w = torch.randn(2, 5, 5, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    stats = torch.zeros(2, 5, dtype=torch.float64), torch.ones(2, 5, dtype=torch.float64)

    def strides(op: Any) -> tuple[int, ...]:
        def one(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
            return op(x, w, w, mean.clone(), var.clone(), True, 0.1, 1e-5)[0]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's, of its fallback
            return tuple(torch.func.vmap(one)(x, w, *stats).stride())

    functional, in_place = next(iter(_quirks.BATCH_NORM_FUNCTIONAL_UNBATCHED.table.items()))
    return strides(functional) != strides(in_place)


def _in_place_meta_kernels_fail_under_forward_ad() -> bool:
    failing = set()
    for op in _quirks.IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD.ops:
        try:  # the failure leaves the thread's dispatch keys changed: they are put back
            with dispatch_keys_put_back(), FakeTensorMode(), torch.autograd.forward_ad.dual_level():
                a, b, c = (torch.rand(2, 3, dtype=torch.float64) + 1 for _ in range(3))
                target = torch.autograd.forward_ad.make_dual(a, torch.ones_like(a))
                op(target, b, 0.5 if op is torch.ops.aten.lerp_.Scalar else c)
        except RuntimeError as error:
            assert "_fw_primal" in str(error)
            failing.add(op)
    return failing == set(_quirks.IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD.ops)


def _tangent_formulas_read_statistics() -> bool:
    aten = torch.ops.aten
    generator = torch.Generator().manual_seed(0)
    x, tangent, weights = (torch.randn(4, 3, 5, dtype=torch.float64, generator=generator) for _ in range(3))
    stats = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    calls = {
        aten.native_layer_norm.default: lambda t: aten.native_layer_norm(t, [5], None, None, 1e-5)[0],
        aten.native_batch_norm.default: lambda t: aten.native_batch_norm(t, None, None, None, None, True, 0.1, 1e-5)[0],
        aten._native_batch_norm_legit.default: lambda t: aten._native_batch_norm_legit(
            t, None, None, stats[0].clone(), stats[1].clone(), True, 0.1, 1e-5
        )[0],
        aten._native_batch_norm_legit.no_stats: lambda t: aten._native_batch_norm_legit.no_stats(
            t, None, None, True, 0.1, 1e-5
        )[0],
        aten._native_batch_norm_legit_functional.default: lambda t: aten._native_batch_norm_legit_functional(
            t, None, None, *stats, True, 0.1, 1e-5
        )[0],
    }
    # cuDNN's batch norm runs only on a GPU: `test_cuda_batch_norm_tangent_formula_reads_its_statistics`.
    assert set(calls) | {aten.cudnn_batch_norm.default} == _quirks.TANGENT_FORMULAS_READ_STATISTICS.table
    off = {op for op, call in calls.items() if _grad_of_jvp_off(call, x, tangent, weights)}
    return off == set(calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's batch norm runs only on a GPU")
def test_cuda_batch_norm_tangent_formula_reads_its_statistics() -> None:
    generator = torch.Generator().manual_seed(0)
    x, tangent, weights = (torch.randn(4, 3, 5, dtype=torch.float64, generator=generator).cuda() for _ in range(3))
    affine = torch.ones(3, dtype=torch.float64, device="cuda"), torch.zeros(3, dtype=torch.float64, device="cuda")
    norm = lambda t: torch.ops.aten.cudnn_batch_norm(t, *affine, None, None, True, 0.1, 1e-5)[0]  # noqa: E731
    assert _grad_of_jvp_off(norm, x, tangent, weights), "TANGENT_FORMULAS_READ_STATISTICS: cudnn_batch_norm"


def _grad_of_jvp_off(
    call: Callable[..., torch.Tensor], x: torch.Tensor, tangent: torch.Tensor, weights: torch.Tensor
) -> bool:
    """Whether eager's `grad` of `jvp` of `call` differs from the gradient of a finite-difference tangent."""
    step = 1e-5
    exact = torch.func.grad(lambda t: (weights * torch.func.jvp(call, (t,), (tangent,))[1]).sum())(x)
    differences = torch.func.grad(
        lambda t: (weights * (call(t + step * tangent) - call(t - step * tangent)) / (2 * step)).sum()
    )(x)
    return not torch.allclose(exact, differences, rtol=1e-5, atol=1e-5)


def _sac_asks_again_while_recomputing() -> bool:
    asked: list[bool] = []

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        asked.append(bool(getattr(ctx, "is_recompute", False)))
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

    def body(t: torch.Tensor) -> torch.Tensor:
        t = t.sin()
        torch._dynamo.graph_break()  # the region as Dynamo leaves it to run eagerly: 2.12 asks again there
        return t.cos()

    def region(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(body, x, use_reentrant=False, context_fn=context_fn)

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.compile's own deprecations, about torch's code
        torch.compile(region, backend="aot_eager")(torch.randn(3, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    assert asked
    return any(asked)


def _quantile_compares_tensors() -> bool:
    ops: list[object] = []

    class Recording(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with Recording():
        torch.quantile(torch.randn(3, 4), torch.tensor([0.2, 0.7]), dim=1)
    return torch.ops.aten.equal.default in ops


def _sac_errors_leave_modes_pushed() -> bool:
    asked_after: list[object] = []
    failing = True

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if failing:
            raise ValueError("the policy refuses")
        asked_after.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    try:
        checkpoint(torch.sin, torch.randn(3, requires_grad=True), use_reentrant=False, context_fn=context_fn)
    except ValueError:
        failing = False
        torch.ones(2).cos()  # after the region, while the error is alive
    return bool(asked_after)


def _regions_allocate_for_in_place_ops() -> bool:
    ops: list[object] = []

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        ops.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    norm = torch.nn.BatchNorm1d(3)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

    def region(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(norm, x, use_reentrant=False, context_fn=context_fn)

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(region, backend="aot_eager")(torch.randn(4, 3, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    return bool(set(ops) & _quirks.REGIONS_ALLOCATE_FOR_IN_PLACE_OPS.table)


def _sdpa_chooses_below_the_dispatcher() -> bool:
    if not torch.backends.cuda.is_built() or torch.cuda.is_available():
        pytest.skip("seen only on a CUDA build of torch on a machine without a GPU")
    with FakeTensorMode():
        q = torch.empty(2, 4, 64, 64, device="cuda", dtype=torch.bfloat16)  # what flash takes on sm80 and newer
        graph = make_fx(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q))(q).graph
    targets = {node.target for node in graph.nodes if node.op == "call_function"}
    return not targets & set(_quirks.SDPA_CHOOSES_BELOW_THE_DISPATCHER.table.values())


PROBES: dict[str, Callable[[], bool]] = {
    "DETACH_TRACES_AS_ALIAS": _detach_traces_as_alias,
    "UNBACKED_SYMBOL_NAMES": _unbacked_symbols_are_named_u,
    "LINALG_CHECKS_ARE_EFFECTFUL": _linalg_checks_are_effectful,
    "CPU_KERNELS_CHOOSE_LAYOUTS": _batch_norm_cpu_kernel_chooses_its_layout,
    "FAKE_BATCH_NORM_BACKWARD_IGNORES_MASK": _fake_batch_norm_backward_ignores_the_mask,
    "BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS": _batch_norm_training_ignores_running_stats,
    "BATCH_NORM_UPDATES_UNDECLARED": _batch_norm_updates_undeclared,
    "RRELU_FUNCTIONAL_DERIVATIVE": _rrelu_functional_derivative_reads_its_noise_input,
    "GRADIENTS_READ_LU_FACTORS": _gradients_read_lu_factors,
    "GRADIENTS_SWITCH_IN_GRAD_MODE": _gradients_switch_in_grad_mode,
    "SLICE_SCATTER_NEGATIVE_BOUNDS_UNDER_VMAP": _slice_scatter_refuses_negative_bounds_under_vmap,
    "BATCH_NORM_FUNCTIONAL_UNBATCHED": _batch_norm_functional_unbatched,
    "IN_PLACE_OPS_FUNCTIONALIZATION_CANNOT_MAP": _in_place_ops_functionalization_cannot_map,
    "IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD": _in_place_meta_kernels_fail_under_forward_ad,
    "TANGENT_FORMULAS_READ_STATISTICS": _tangent_formulas_read_statistics,
    "SAC_ASKS_AGAIN_WHILE_RECOMPUTING": _sac_asks_again_while_recomputing,
    "SAC_ERRORS_LEAVE_MODES_PUSHED": _sac_errors_leave_modes_pushed,
    "QUANTILE_COMPARES_TENSORS": _quantile_compares_tensors,
    "REGIONS_ALLOCATE_FOR_IN_PLACE_OPS": _regions_allocate_for_in_place_ops,
    "SDPA_CHOOSES_BELOW_THE_DISPATCHER": _sdpa_chooses_below_the_dispatcher,
}


def test_every_entry_has_a_probe() -> None:
    entries = {name for name in _quirks.__all__ if isinstance(getattr(_quirks, name), Quirk)}
    assert entries == set(PROBES)
    assert {id(getattr(_quirks, name)) for name in entries} == {id(quirk) for quirk in _quirks.QUIRKS}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_the_behaviour_is_there_exactly_on_the_releases_the_entry_names(name: str) -> None:
    quirk: Quirk = getattr(_quirks, name)
    running = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert PROBES[name]() == quirk.applies(running), f"{name}: {quirk.differs} (releases {quirk.releases})"


def test_an_entry_names_supported_releases_and_a_note() -> None:
    from remat._torch import SUPPORTED

    for quirk in _quirks.QUIRKS:
        assert quirk.releases is None or set(quirk.releases) <= set(SUPPORTED)
        assert quirk.differs and quirk.note


def test_only_the_registry_names_the_ops_of_its_entries_for_their_reason() -> None:
    """The modules that work around an entry read its table: the ops listed in the registry's batch norm,
    rrelu and linalg-check entries appear in no other module of remat."""
    package = pathlib.Path(_quirks.__file__).parent
    watched = {"_native_batch_norm_legit_functional", "rrelu_with_noise_functional", "_linalg_check_errors"}
    named = {}
    for path in package.rglob("*.py"):  # the subpackages' modules (`_torch/`, `testing/`) too
        if path.name == "_quirks.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in watched:
                named.setdefault(node.attr, []).append(f"{path.relative_to(package)}:{node.lineno}")
    assert not named, named
    assert re.search(r"_quirks\.", (package / "_partitioning" / "_partition.py").read_text())
