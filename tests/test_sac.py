"""`from_sac`: torch selective-activation-checkpointing policy functions as remat policies."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from typing import Any

import models
import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import remat
from remat._torch import SAC_BYPASSES_HOOKS
from remat.policies import from_sac
from remat.testing import assert_checkpoint_equivalent

aten = torch.ops.aten
DTYPE = torch.float64
S, R = remat.SAVE, remat.RECOMPUTE

# torchtitan's save list (torchtitan/models/llama3/infra/parallelize.py, `_save_list`), with the
# CPU flash-attention variant that `F.scaled_dot_product_attention` dispatches to on the CPU.
TORCHTITAN_SAVE_LIST = frozenset(
    {
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.max.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)
# `nn.Linear` on a 3-D input dispatches to `addmm` and a 4-D `@` to `bmm`, so on a GPT-2 block
# torchtitan's list would save only the attention call; these save and count those matmuls too.
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})
GPT2_SAVE_LIST = TORCHTITAN_SAVE_LIST | MATMULS


def torchtitan_policy(save_list: Iterable[Any] = TORCHTITAN_SAVE_LIST, counted: Iterable[Any] = (aten.mm.default,)):
    """torchtitan's SAC policy: save the ops of `save_list`, except every second call of a `counted` op.

    A fresh function with a fresh counter each time, as torchtitan's `context_fn` builds one per forward.
    """
    save_list, counted = frozenset(save_list), frozenset(counted)
    meta: collections.defaultdict[str, int] = collections.defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        mm_count_key = f"{mode}_mm_count"
        if func in counted:
            meta[mm_count_key] += 1
        # Saves output of all compute ops, except every second mm
        to_save = func in save_list and not (func in counted and meta[mm_count_key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac_saved_calls(fn: Callable[..., Any], args: tuple[Any, ...], policy_fn: Callable[..., Any]) -> list[Any]:
    """(op, occurrence among calls of that op) of the calls `torch.utils.checkpoint`'s SAC saves in forward."""
    occurrences: collections.Counter[Any] = collections.Counter()
    saved = []

    def spy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        decision = policy_fn(ctx, func, *args, **kwargs)
        if not ctx.is_recompute:
            if decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True):
                saved.append((func, occurrences[func]))
            occurrences[func] += 1
        return decision

    context_fn = functools.partial(create_selective_checkpoint_contexts, spy)
    out = checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **SAC_BYPASSES_HOOKS)
    torch.autograd.backward(out, torch.ones_like(out))  # recompute runs too, and must not break the spy
    return saved


def remat_saved_calls(fn: Callable[..., Any], args: tuple[Any, ...], policy: remat.policies.Policy) -> list[Any]:
    report = remat.report(fn, *args, policy=policy)
    return [(row.call.op, row.call.occurrence) for row in report.rows if row.decision is S]


def mm_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    h = (x @ w1).tanh()  # mm 0
    h = (h @ w2).sin()  # mm 1
    h = h @ w3  # mm 2
    return h * h.max()  # max 0


def mm_chain_args() -> tuple[torch.Tensor, ...]:
    return (
        models.randn(3, 4, seed=1),
        models.randn(4, 5, seed=2),
        models.randn(5, 5, seed=3),
        models.randn(5, 2, seed=4),
    )


# --- torchtitan's policy: the same calls saved as under torch's SAC, and the same gradients -------


@pytest.mark.parametrize("attention", ["sdpa", "softmax"])
def test_torchtitan_policy_saves_what_sac_saves_on_a_gpt2_block(attention: str) -> None:
    block, x = models.GPT2Block(attention=attention), models.gpt2_input()

    def policy() -> Callable[..., Any]:
        return torchtitan_policy(GPT2_SAVE_LIST, counted=MATMULS)

    expected = collections.Counter(sac_saved_calls(block, (x,), policy()))
    actual = collections.Counter(remat_saved_calls(block, (x,), from_sac(policy())))

    assert actual == expected
    # Not vacuous: the counter skipped some matmuls, and saved others (and the attention call).
    addmms = {occurrence for op, occurrence in actual if op is aten.addmm.default}
    assert addmms == {0, 2}  # four Linear layers: every second one is recomputed
    if attention == "sdpa":
        assert (aten._scaled_dot_product_flash_attention_for_cpu.default, 0) in actual
    else:
        # The count runs over all matmuls: addmm 0 (1st), bmm 0 (2nd), bmm 1 (3rd), addmm 1 (4th), ...
        assert (aten.bmm.default, 1) in actual and (aten.bmm.default, 0) not in actual
    assert all(op in GPT2_SAVE_LIST for op, _ in actual)


def test_torchtitan_policy_saves_what_sac_saves_with_mm_and_max() -> None:
    args = mm_chain_args()
    expected = collections.Counter(sac_saved_calls(mm_chain, args, torchtitan_policy()))
    actual = collections.Counter(remat_saved_calls(mm_chain, args, from_sac(torchtitan_policy())))

    assert actual == expected
    assert actual == collections.Counter({(aten.mm.default, 0): 1, (aten.mm.default, 2): 1, (aten.max.default, 0): 1})


@pytest.mark.parametrize("attention", ["sdpa", "softmax"])
def test_torchtitan_policy_gives_the_eager_gradients_on_a_gpt2_block(attention: str) -> None:
    block, x = models.GPT2Block(attention=attention), models.gpt2_input()
    checkpointed = remat.checkpoint(block, policy=from_sac(torchtitan_policy(GPT2_SAVE_LIST, counted=MATMULS)))
    assert_checkpoint_equivalent(block, x, checkpointed=checkpointed)


def test_torchtitan_policy_gives_the_eager_gradients_with_mm_and_max() -> None:
    assert_checkpoint_equivalent(mm_chain, *mm_chain_args(), policy=from_sac(torchtitan_policy()))


# --- what the policy function is asked, and how its answers map --------------------------------------


def two_matmuls(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    h = a @ b  # 0: mm (2,3)@(3,4)
    h = h.sin()  # 1: sin
    h = h @ c  # 2: mm (2,4)@(4,5)
    return h.sum()  # 3: sum


def two_matmuls_trace() -> remat.Trace:
    shapes = [(2, 3), (3, 4), (4, 5)]
    args = [models.randn(*shape, seed=i) for i, shape in enumerate(shapes)]
    trace = remat.trace(two_matmuls, *args)
    assert [call.name for call in trace] == [
        "aten.mm.default",
        "aten.sin.default",
        "aten.mm.default",
        "aten.sum.default",
    ]
    return trace


def test_policy_fn_is_called_once_per_call_in_trace_order() -> None:
    seen = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append((type(ctx), ctx.is_recompute, op, kwargs))
        return False

    from_sac(policy).plan(two_matmuls_trace())
    context = torch.utils.checkpoint.SelectiveCheckpointContext
    assert seen == [
        (context, False, aten.mm.default, {}),
        (context, False, aten.sin.default, {}),
        (context, False, aten.mm.default, {}),
        (context, False, aten.sum.default, {}),
    ]


def test_bool_returning_policy_fn() -> None:
    def save_sin(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is aten.sin.default

    assert from_sac(save_sin).plan(two_matmuls_trace()) == (R, S, R, R)


@pytest.mark.parametrize(
    ("value", "decision"),
    [
        (CheckpointPolicy.MUST_SAVE, S),
        (CheckpointPolicy.PREFER_SAVE, S),
        (CheckpointPolicy.MUST_RECOMPUTE, R),
        (CheckpointPolicy.PREFER_RECOMPUTE, R),
        (True, S),
        (False, R),
    ],
)
def test_checkpoint_policy_values_map_to_decisions(value: Any, decision: remat.Decision) -> None:
    trace = two_matmuls_trace()
    assert from_sac(lambda ctx, op, *args, **kwargs: value).plan(trace) == (decision,) * len(trace)
    assert from_sac(lambda ctx, op, *args, **kwargs: value)(trace[0]) is decision


def test_every_checkpoint_policy_value_is_mapped() -> None:
    trace = two_matmuls_trace()
    mapped = {
        value.name: from_sac(lambda ctx, op, *args, value=value, **kwargs: value).plan(trace)[0]
        for value in CheckpointPolicy
    }
    offload = {"MUST_CPU_OFFLOAD": remat.OFFLOAD, "PREFER_CPU_OFFLOAD": remat.OFFLOAD}
    if not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):  # torch 2.10: no offload values
        offload = {}
    assert mapped == {"MUST_SAVE": S, "PREFER_SAVE": S, "MUST_RECOMPUTE": R, "PREFER_RECOMPUTE": R, **offload}


@pytest.mark.parametrize("value", ["save", None, 1, 0, remat.SAVE])
def test_bad_return_value_raises_type_error_naming_it(value: Any) -> None:
    def bad_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return value

    with pytest.raises(TypeError, match=r"from_sac: the SAC policy function .*bad_policy returned") as info:
        from_sac(bad_policy).plan(two_matmuls_trace())
    message = str(info.value)
    assert f"returned {value!r} (of type {type(value).__qualname__})" in message
    assert "aten.mm.default" in message
    assert f"({', '.join(policy.name for policy in CheckpointPolicy)})" in message  # (offload from torch 2.11)


def test_bad_return_value_raises_through_checkpoint() -> None:
    checkpointed = remat.checkpoint(two_matmuls, policy=from_sac(lambda ctx, op, *args, **kwargs: "save"))
    args = [models.randn(*shape, seed=i) for i, shape in enumerate([(2, 3), (3, 4), (4, 5)])]
    with pytest.raises(TypeError, match="returned 'save'"):
        checkpointed(*args)


@pytest.mark.parametrize("not_callable", [None, "aten.mm", [aten.mm.default], 3])
def test_non_callable_raises_type_error(not_callable: Any) -> None:
    with pytest.raises(TypeError, match=r"from_sac: expected a SAC policy function .* but got") as info:
        from_sac(not_callable)
    assert repr(not_callable) in str(info.value)


def test_args_are_meta_tensors_with_the_traced_shapes() -> None:
    seen = []

    def save_mm_to_5_columns(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        seen.append([(a.device.type, a.dtype, tuple(a.shape)) for a in args if isinstance(a, torch.Tensor)])
        if op is aten.mm.default and args[1].shape == (4, 5):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    assert from_sac(save_mm_to_5_columns).plan(two_matmuls_trace()) == (R, R, S, R)
    assert seen == [
        [("meta", DTYPE, (2, 3)), ("meta", DTYPE, (3, 4))],
        [("meta", DTYPE, (2, 4))],
        [("meta", DTYPE, (2, 4)), ("meta", DTYPE, (4, 5))],
        [("meta", DTYPE, (2, 5))],
    ]


def test_non_tensor_args_pass_as_they_are_and_op_output_is_meta() -> None:
    seen = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append((op, args[1:], ctx.op_output))
        return False

    trace = remat.trace(lambda x: torch.cat([x, x], dim=1).softmax(dim=0), models.randn(2, 3))
    from_sac(policy).plan(trace)
    (cat, cat_args, cat_out), (softmax, softmax_args, softmax_out) = seen
    assert (cat, cat_args) == (aten.cat.default, (1,))
    assert (softmax, softmax_args) == (aten._softmax.default, (0, False))
    for out in (cat_out, softmax_out):
        assert isinstance(out, torch.Tensor) and out.device.type == "meta" and out.shape == (2, 6)


def test_list_of_tensors_arrives_as_a_list_of_meta_tensors() -> None:
    seen = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append(args[0])
        return False

    from_sac(policy).plan(remat.trace(lambda x, y: torch.cat([x, y]), models.randn(2, 3), models.randn(1, 3)))
    (tensors,) = seen
    assert isinstance(tensors, list)
    assert [(t.device.type, tuple(t.shape)) for t in tensors] == [("meta", (2, 3)), ("meta", (1, 3))]


# --- a small immutable value -----------------------------------------------------------------------------


def test_repr_names_the_function() -> None:
    assert repr(from_sac(torchtitan_policy)) == "from_sac(torchtitan_policy)"
    assert repr(from_sac(torchtitan_policy())) == "from_sac(torchtitan_policy.<locals>.policy)"


def test_equal_and_hashable_for_the_same_function() -> None:
    policy_fn = torchtitan_policy()
    assert from_sac(policy_fn) == from_sac(policy_fn)
    assert hash(from_sac(policy_fn)) == hash(from_sac(policy_fn))
    assert from_sac(policy_fn) != from_sac(torchtitan_policy())
    assert len({from_sac(policy_fn), from_sac(policy_fn)}) == 1
    with pytest.raises(AttributeError):
        from_sac(policy_fn).policy_fn = torchtitan_policy()  # type: ignore[misc]


def test_combines_with_builtin_policies() -> None:
    save_first_mm = from_sac(lambda ctx, op, *args, **kwargs: op is aten.mm.default) & remat.policies.save_calls(0)
    assert isinstance(save_first_mm, remat.policies.Policy)
    trace = two_matmuls_trace()
    assert save_first_mm.plan(trace) == (S, R, R, R)
    save_sum_too = remat.policies.save_ops(aten.sum) | from_sac(lambda ctx, op, *args, **kwargs: op is aten.mm.default)
    assert save_sum_too.plan(trace) == (S, R, S, S)


def test_keyword_arguments_arrive_by_name() -> None:
    seen = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append((op, len(args), kwargs))
        return op is aten.gelu.default and kwargs.get("approximate") == "tanh"

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x, approximate="tanh") * 2

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    plan = from_sac(policy).plan(remat.trace(fn, x))
    assert seen[0] == (aten.gelu.default, 1, {"approximate": "tanh"})
    assert plan[0] is remat.SAVE
