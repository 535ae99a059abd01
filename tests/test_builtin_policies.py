"""Built-in policies and reports, checked against the trace and against outside measurements.

Each built-in policy's SAVE set on a GPT-2 block is worked out here from the
trace alone (op packets, indices, tags, module paths, scopes, roofline costs),
never from remat's own decisions, then compared with `remat.report`. Report
totals are compared with what `saved_tensors_hooks` sees kept and what
`torch.utils.flop_counter.FlopCounterMode` counts in forward and backward.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import remat
from remat import policies
from remat.costs import DEVICES, MATMUL_OPS, Device, estimate_seconds
from remat.policies import (
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    from_sac,
    save_all_of,
    save_any_of,
    save_by_cost,
    save_calls,
    save_everything,
    save_modules,
    save_nothing,
    save_ops,
    save_scopes,
    save_tagged,
    save_tagged_except,
    save_unless,
)
from remat.testing import assert_checkpoint_equivalent

aten = torch.ops.aten
DTYPE = torch.float64
ATTENTIONS = ("sdpa", "softmax")

# Written out here rather than read from `remat.costs.MATMUL_OPS`, so that the expected sets are independent.
UNBATCHED_DOTS = frozenset({aten.mm, aten.addmm, aten.mv, aten.addmv, aten.dot})
ATTENTION_KERNELS = frozenset(
    {
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_attention_math,
    }
)
ALL_DOTS = UNBATCHED_DOTS | {aten.bmm, aten.baddbmm, aten.convolution} | ATTENTION_KERNELS


# --------------------------------------------------------------------------- block variants


class TaggedBlock(models.GPT2Block):
    """The GPT-2 block with names: the attention output, the MLP's pre-activation and hidden."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + remat.tag(self._attend(self.ln_1(x)), "attn")
        pre = remat.tag(remat.tag(self.mlp[0](self.ln_2(x)), "mlp"), "hidden")  # two names on one call
        hidden = remat.tag(self.mlp[1](pre), "hidden")
        return x + self.mlp[2](hidden)


class TanhGelu(torch.autograd.Function):
    """GELU (tanh approximation) with a hand-written backward: several aten calls in one scope."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
        return 0.5 * x * (1 + torch.tanh(inner))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        c = math.sqrt(2 / math.pi)
        t = torch.tanh(c * (x + 0.044715 * x**3))
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x))


class ScopedBlock(models.GPT2Block):
    """The GPT-2 block whose MLP activation is the custom Function `TanhGelu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.ln_1(x))
        return x + self.mlp[2](TanhGelu.apply(self.mlp[0](self.ln_2(x))))


VARIANTS: dict[str, type[models.GPT2Block]] = {"plain": models.GPT2Block, "tagged": TaggedBlock, "scoped": ScopedBlock}


@functools.cache
def block(variant: str, attention: str) -> models.GPT2Block:
    return VARIANTS[variant](attention=attention)


@functools.cache
def gpt2_trace(variant: str, attention: str) -> remat.Trace:
    return remat.trace(block(variant, attention), models.gpt2_input())


def packet(call: remat.Call) -> Any:
    return getattr(call.op, "overloadpacket", None)


def indices(trace: remat.Trace, keep: Callable[[remat.Call], bool]) -> frozenset[int]:
    return frozenset(call.index for call in trace if keep(call))


# --------------------------------------------------------------------------- policies under test


def sac_save_addmm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A SAC policy function as written for `torch.utils.checkpoint`: keep the linear layers."""
    return CheckpointPolicy.MUST_SAVE if op is aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE


def sac_save_wide_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    """A SAC policy function returning bools, looking at the (meta) output: keep 128-wide outputs."""
    output = ctx.op_output if isinstance(ctx.op_output, torch.Tensor) else ctx.op_output[0]
    return output.shape[-1] == 128


def cost_ratio(call: remat.Call) -> float:
    return estimate_seconds(call, "h100") / max(call.nbytes, 1)


def cost_threshold(trace: remat.Trace) -> float:
    """A seconds-per-byte threshold strictly between two distinct ratios of the trace, near the middle."""
    ratios = sorted({cost_ratio(call) for call in trace})
    assert len(ratios) >= 2, ratios
    middle = len(ratios) // 2
    return math.sqrt(ratios[middle - 1] * ratios[middle])


def is_add(call: remat.Call) -> bool:  # a plain function as a policy, inside a combinator
    return call.op is aten.add.Tensor


def in_module(call: remat.Call, prefix: str) -> bool:
    return call.module is not None and (call.module == prefix or call.module.startswith(prefix + "."))


@dataclasses.dataclass(frozen=True)
class Case:
    """A policy (built from the trace, for those that need a threshold) and its SAVE set worked out independently."""

    name: str
    variant: str
    policy: Callable[[remat.Trace], Any]
    expected: Callable[[remat.Trace], frozenset[int]]
    # Which SAVE sets must be neither empty nor the whole trace.
    nontrivial: bool = True
    at_least: int = 1


def dots(trace: remat.Trace) -> frozenset[int]:
    return indices(trace, lambda c: packet(c) in ALL_DOTS)


def mlp_calls(trace: remat.Trace) -> frozenset[int]:
    return indices(trace, lambda c: in_module(c, "mlp"))


def everything(trace: remat.Trace) -> frozenset[int]:
    return frozenset(range(len(trace)))


CASES = [
    Case("save_nothing", "plain", lambda t: save_nothing, lambda t: frozenset(), nontrivial=False),
    Case("save_everything", "plain", lambda t: save_everything, everything, nontrivial=False),
    Case("dots_saveable", "plain", lambda t: dots_saveable, dots, at_least=5),
    Case(
        "dots_with_no_batch_dims_saveable",
        "plain",
        lambda t: dots_with_no_batch_dims_saveable,
        lambda t: indices(t, lambda c: packet(c) in UNBATCHED_DOTS),
        at_least=4,
    ),
    Case(
        "save_ops",
        "plain",
        # A packet matches all its overloads; an overload only itself.
        lambda t: save_ops(aten.addmm, aten.native_layer_norm.default, aten.add.Scalar),
        lambda t: indices(t, lambda c: packet(c) is aten.addmm or c.op is aten.native_layer_norm.default),
        at_least=6,
    ),
    Case(
        "save_calls",
        "plain",
        lambda t: save_calls(1, 3, -1),
        lambda t: frozenset({1, 3, len(t) - 1}),
        at_least=3,
    ),
    Case(
        "save_scopes",
        "scoped",
        lambda t: save_scopes("TanhGe*"),
        lambda t: indices(t, lambda c: c.scope is not None and "TanhGelu" in c.scope.split("/")),
        at_least=3,
    ),
    Case(
        "save_tagged",
        "tagged",
        lambda t: save_tagged("hidden", "attn"),
        lambda t: indices(t, lambda c: bool(c.tags & {"hidden", "attn"})),
        at_least=3,
    ),
    Case(
        "save_tagged_except",
        "tagged",
        lambda t: save_tagged_except("hidden"),
        lambda t: indices(t, lambda c: bool(c.tags - {"hidden"})),
        at_least=2,
    ),
    Case("save_modules", "plain", lambda t: save_modules("mlp"), mlp_calls, at_least=3),
    Case(
        "save_by_cost",
        "plain",
        lambda t: save_by_cost(cost_threshold(t), "roofline:h100"),
        lambda t: indices(t, lambda c: cost_ratio(c) >= cost_threshold(t)),
    ),
    Case(
        "from_sac",
        "plain",
        lambda t: from_sac(sac_save_addmm),
        lambda t: indices(t, lambda c: c.op is aten.addmm.default),
        at_least=4,
    ),
    Case(
        "from_sac_bool",
        "plain",
        lambda t: from_sac(sac_save_wide_outputs),
        lambda t: indices(t, lambda c: c.outputs[0].shape[-1] == 128),
        at_least=2,
    ),
    Case(
        "or",
        "plain",
        lambda t: dots_saveable | save_modules("ln_*"),
        lambda t: dots(t) | indices(t, lambda c: c.module in ("ln_1", "ln_2")),
        at_least=7,
    ),
    Case("and", "plain", lambda t: dots_saveable & save_modules("mlp"), lambda t: dots(t) & mlp_calls(t), at_least=2),
    Case("invert", "plain", lambda t: ~dots_saveable, lambda t: everything(t) - dots(t), at_least=4),
    Case(
        "save_any_of",
        "plain",
        lambda t: save_any_of(is_add, save_calls(0), save_ops(aten.gelu)),
        lambda t: indices(t, lambda c: c.op is aten.add.Tensor or c.index == 0 or packet(c) is aten.gelu),
        at_least=4,
    ),
    Case(
        "save_all_of",
        "plain",
        lambda t: save_all_of(dots_saveable, save_calls(0, 1, 2, 3), ~save_modules("c_proj")),
        lambda t: dots(t) & {0, 1, 2, 3} - indices(t, lambda c: c.module == "c_proj"),
    ),
    Case(
        "save_unless",
        "plain",
        lambda t: save_unless(save_everything, dots_saveable | save_modules("mlp")),
        lambda t: everything(t) - dots(t) - mlp_calls(t),
        at_least=4,
    ),
]


def decisions(report: remat.Report) -> frozenset[int]:
    return frozenset(row.call.index for row in report.rows if row.decision is remat.SAVE)


# The fast selection checks each case on one attention; the suite, on both.
@pytest.mark.parametrize(
    "attention", [ATTENTIONS[0], *(pytest.param(a, marks=pytest.mark.slow) for a in ATTENTIONS[1:])]
)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_builtin_policy_saves_what_it_documents(case: Case, attention: str):
    module = block(case.variant, attention)
    trace = gpt2_trace(case.variant, attention)
    policy = case.policy(trace)
    expected = case.expected(trace)
    if case.nontrivial:
        assert case.at_least <= len(expected) < len(trace), (case.name, sorted(expected), len(trace))

    x = models.gpt2_input()
    report = remat.report(module, x, policy=policy)
    assert [row.call.index for row in report.rows] == list(range(len(trace)))
    assert [row.call.op for row in report.rows] == [call.op for call in trace]
    assert decisions(report) == expected, f"{policy!r}: saved {sorted(decisions(report))}, expected {sorted(expected)}"
    assert report.policy == policy

    if attention == ATTENTIONS[0]:  # the gradients under any decisions: the random policies' properties
        assert_checkpoint_equivalent(module, x, policy=policy)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_block_variants_put_tags_scopes_and_kernels_where_expected(attention: str):
    """The expected sets above are only as good as these facts about the traces."""
    plain = gpt2_trace("plain", attention)
    assert sum(packet(c) is aten.addmm for c in plain) == 4
    kernels = [c for c in plain if packet(c) in ATTENTION_KERNELS]
    batched = [c for c in plain if packet(c) is aten.bmm]
    assert (len(kernels), len(batched)) == ((1, 0) if attention == "sdpa" else (0, 2))
    # dots_saveable keeps the attention products; the no-batch-dims variant does not.
    for call in [*kernels, *batched]:
        assert dots_saveable(call) is remat.SAVE
        assert dots_with_no_batch_dims_saveable(call) is remat.RECOMPUTE

    tagged = {c.module: c.tags for c in gpt2_trace("tagged", attention) if c.tags}
    assert tagged == {"c_proj": {"attn"}, "mlp.0": {"mlp", "hidden"}, "mlp.1": {"hidden"}}

    scoped = [c for c in gpt2_trace("scoped", attention) if c.scope is not None]
    assert len(scoped) >= 3 and {c.scope for c in scoped} == {"TanhGelu"}
    assert any(packet(c) is aten.tanh for c in scoped)

    # The roofline threshold really splits the calls into two groups of both kinds of op.
    threshold = cost_threshold(plain)
    saved = [c for c in plain if cost_ratio(c) >= threshold]
    assert 0 < len(saved) < len(plain)


# --------------------------------------------------------------------------- policies are values


def _policy_values() -> list[tuple[Callable[[], Any], str]]:
    mm = save_ops(aten.mm)
    return [
        (lambda: save_nothing, "save_nothing"),
        (lambda: save_everything, "save_everything"),
        (lambda: dots_saveable, "dots_saveable"),
        (lambda: dots_with_no_batch_dims_saveable, "dots_with_no_batch_dims_saveable"),
        (lambda: save_ops(aten.mm, aten.addmm.default), "save_ops(aten.mm, aten.addmm.default)"),
        (lambda: save_calls(0, -1), "save_calls(0, -1)"),
        (lambda: save_scopes("TanhGelu", "my*"), "save_scopes('TanhGelu', 'my*')"),
        (lambda: save_tagged("a", "b"), "save_tagged('a', 'b')"),
        (lambda: save_tagged("b", "a"), "save_tagged('a', 'b')"),  # names are a set
        (lambda: save_tagged_except("x"), "save_tagged_except('x')"),
        (lambda: save_modules("mlp", "layers.*.attn"), "save_modules('mlp', 'layers.*.attn')"),
        (lambda: save_by_cost(1e-12, "roofline:h100"), "save_by_cost(1e-12, cost='roofline:h100')"),
        (lambda: save_by_cost(2.5e-13, "roofline:h200"), "save_by_cost(2.5e-13, cost='roofline:h200')"),
        (lambda: from_sac(sac_save_addmm), "from_sac(sac_save_addmm)"),
        (lambda: save_ops(aten.mm) | save_calls(0), "save_any_of(save_ops(aten.mm), save_calls(0))"),
        (lambda: save_any_of(mm, dots_saveable), "save_any_of(save_ops(aten.mm), dots_saveable)"),
        (lambda: save_ops(aten.mm) & save_calls(0, 1), "save_all_of(save_ops(aten.mm), save_calls(0, 1))"),
        (lambda: save_all_of(save_nothing, mm), "save_all_of(save_nothing, save_ops(aten.mm))"),
        (lambda: ~dots_saveable, "~dots_saveable"),
        (lambda: save_unless(save_everything, mm), "save_all_of(save_everything, ~save_ops(aten.mm))"),
    ]


POLICY_VALUES = _policy_values()


@pytest.mark.parametrize(("make", "text"), POLICY_VALUES, ids=[text for _, text in POLICY_VALUES])
def test_policies_are_immutable_hashable_values_with_a_readable_repr(make: Callable[[], Any], text: str):
    policy, again = make(), make()
    assert repr(policy) == text
    assert policy == again and hash(policy) == hash(again)
    assert {policy: "cached"}[again] == "cached"  # usable in a cache key
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.anything = 1  # type: ignore[attr-defined]
    fields = dataclasses.fields(policy)
    assert fields
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(policy, fields[0].name, None)
    # The repr is the expression that builds the policy.
    namespace = {**{name: getattr(policies, name) for name in policies.__all__}, "aten": aten}
    namespace["sac_save_addmm"] = sac_save_addmm
    assert eval(text, namespace) == policy


def test_different_policies_are_not_equal():
    distinct = [
        save_nothing,
        save_everything,
        dots_saveable,
        dots_with_no_batch_dims_saveable,
        save_ops(aten.mm),
        save_ops(aten.mm.default),
        save_calls(0),
        save_calls(1),
        save_tagged("a"),
        save_tagged_except("a"),
        save_modules("a"),
        save_scopes("a"),
        save_by_cost(1e-12, "roofline:h100"),
        save_by_cost(1e-12, "roofline:h200"),
        save_by_cost(2e-12, "roofline:h100"),
        from_sac(sac_save_addmm),
        from_sac(sac_save_wide_outputs),
        save_calls(0) | save_calls(1),
        save_calls(0) & save_calls(1),
        save_calls(1) | save_calls(0),
        ~save_calls(0),
    ]
    assert len(set(distinct)) == len(distinct)


# --------------------------------------------------------------------------- report totals, measured from outside


def kept_bytes(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, state: list[torch.Tensor]):
    """Bytes of the distinct storages autograd keeps for `fn(x)` (inputs and `state` excluded), and the output."""
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(x)
    excluded = {t.untyped_storage().data_ptr() for t in (x, *state)}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in excluded), out


def counted_flops(run: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def is_counted(call: remat.Call) -> bool:
    # FlopCounterMode counts exactly the ops in torch's `flop_registry` (matmuls, convolutions, some attention
    # kernels) and nothing else; `Call.flops` uses the same formulas for those, and one FLOP per output element
    # for every other op. So the two are comparable exactly on the calls whose op is in the registry. (The CPU
    # attention kernel `_scaled_dot_product_flash_attention_for_cpu` is in it since torch 2.15.)
    return packet(call) in flop_registry


TOTALS_POLICIES = {
    "save_nothing": save_nothing,
    "dots_saveable": dots_saveable,
    "save_everything": save_everything,
    "save_calls": save_calls(0, 1, 5),
}


@functools.cache
def eager_flops(attention: str) -> tuple[int, int]:
    """FlopCounterMode's counts of the eager block's forward and of its backward (with `COTANGENT`)."""
    module, x = block("plain", attention), models.gpt2_input()
    forward = counted_flops(lambda: module(x))
    out = module(x)
    backward = counted_flops(lambda: out.backward(cotangent(out)))
    return forward, backward


def cotangent(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, generator=models.make_generator(7), dtype=DTYPE)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("name", list(TOTALS_POLICIES))
def test_report_totals_equal_outside_measurements(name: str, attention: str):
    policy = TOTALS_POLICIES[name]
    module = block("plain", attention)
    state = list(module.parameters())
    x = models.gpt2_input()
    checkpointed = remat.checkpoint(module, policy=policy)
    report = remat.report(checkpointed, x)  # traces once, for the report and the measured runs alike
    assert report.policy == policy
    trace = report.trace
    counted = MATMUL_OPS["unbatched"] | MATMUL_OPS["batched"] | MATMUL_OPS["attention"]
    assert all(packet(call) in counted for call in trace if is_counted(call))

    # (a) bytes kept between forward and backward, as a user's saved_tensors_hooks sees them.
    measured, out = kept_bytes(checkpointed, x, state)
    assert checkpointed.cache_info().traces == 1  # the measured call ran the cached programs
    assert report.rng_state_bytes == 0
    assert report.saved_bytes == measured
    assert report.saved_bytes == sum(row.saved_bytes for row in report.rows)
    if policy is save_nothing:
        assert measured == 0  # a deterministic block keeps nothing
    else:
        assert measured > 0
    if policy is save_everything:  # documented: "like running without a checkpoint"
        assert measured == kept_bytes(module, x, state)[0]

    # (b) FLOPs replayed in backward: checkpointed backward minus eager backward, on the counted ops.
    eager_forward, eager_backward = eager_flops(attention)
    checkpointed_backward = counted_flops(lambda: out.backward(cotangent(out)))
    counted_replay = sum(row.replay_flops for row in report.rows if is_counted(row.call))
    assert checkpointed_backward - eager_backward == counted_replay
    assert report.recompute_flops == sum(row.replay_flops for row in report.rows)
    assert report.replayed_calls == tuple(row.call.index for row in report.rows if row.replayed)
    if policy is save_everything:
        assert report.recompute_flops == 0 and report.replayed_calls == ()
    if policy is save_nothing:
        assert counted_replay > 0  # the linear layers are replayed: a non-vacuous comparison

    # (c) forward FLOPs: each call once, in eager and in the checkpointed forward alike.
    counted_forward = sum(call.flops for call in trace if is_counted(call))
    assert counted_forward > 0
    assert eager_forward == counted_forward
    assert counted_flops(lambda: checkpointed(x)) == counted_forward
    assert report.forward_flops == sum(call.flops for call in trace)

    # (d)
    assert report.replayed_fraction == report.recompute_flops / report.forward_flops


# --------------------------------------------------------------------------- report details


def test_read_by_names_backward_for_an_output_a_gradient_formula_reads():
    w1 = models.randn(6, 5, seed=2)
    w2 = models.randn(5, 3, seed=3)

    def fn(x):
        return (x @ w1) @ w2  # the second mm's backward (grad of w2) reads the first mm's output

    report = remat.report(fn, models.randn(4, 6, seed=1), policy=save_everything)
    first, second = report.rows
    assert first.saved and first.read_by == {"backward"}
    assert first.saved_bytes == 4 * 5 * 8
    assert not second.saved and second.read_by == frozenset()


def test_read_by_names_replay_for_an_output_a_replayed_call_reads():
    w1 = models.randn(6, 5, seed=2)
    w2 = models.randn(5, 3, seed=3)

    def fn(x):
        return (x @ w1).tanh() @ w2  # tanh's backward and grad of w2 read tanh's output, not the mm's

    x = models.randn(4, 6, seed=1)
    report = remat.report(fn, x, policy=save_calls(0))
    mm, tanh, _ = report.rows
    assert mm.saved and mm.read_by == {"replay"}
    assert tanh.replayed and not tanh.saved
    assert report.replayed_calls == (1,)
    assert report.saved_bytes == 4 * 5 * 8
    assert_checkpoint_equivalent(fn, x, policy=save_calls(0), params=[w1, w2])


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_saves_nothing_flags_a_save_whose_output_backward_never_reads(attention: str):
    module = block("plain", attention)
    x = models.gpt2_input()
    trace = gpt2_trace("plain", attention)
    (last_linear,) = [c.index for c in trace if c.module == "mlp.2"]
    assert packet(trace[last_linear]) is aten.addmm  # its output only feeds the residual add

    report = remat.report(module, x, policy=dots_saveable)
    assert report.saves_nothing == (last_linear,)
    row = report.rows[last_linear]
    assert row.saves_nothing and not row.saved and row.saved_bytes == 0 and row.read_by == frozenset()
    assert all(not r.saves_nothing for r in report.rows if r.saved or r.decision is remat.RECOMPUTE)
    text = str(report)
    (line,) = [line for line in text.splitlines() if line.startswith(f"{last_linear} ")]
    assert "SAVE (unused)" in line
    assert sum("(unused)" in line for line in text.splitlines()) == 1
    assert f"unused: the policy saves calls {last_linear}," in text

    # Saving only that call keeps exactly what saving nothing keeps: nothing.
    alone = remat.report(module, x, policy=save_calls(last_linear))
    assert alone.saves_nothing == (last_linear,) and alone.saved_bytes == 0
    assert "unused:" not in str(remat.report(module, x, policy=save_nothing))


def test_saves_nothing_flags_a_final_sum():
    w = models.randn(6, 5, seed=2)

    def fn(x):
        return (x @ w).sin().sum()

    report = remat.report(fn, models.randn(4, 6, seed=1), policy=save_everything)
    assert [row.call.op.overloadpacket for row in report.rows] == [aten.mm, aten.sin, aten.sum]
    # sum's backward reads only its input's shape, and sin's backward reads sin's input: no one reads sin's output.
    assert report.saves_nothing == (1, 2)
    assert report.rows[1].saves_nothing and report.rows[2].saves_nothing
    assert report.rows[0].saved and report.rows[0].read_by == {"backward"}  # sin's backward reads its input


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_to_dict_is_json_with_one_row_per_call_and_the_same_totals(attention: str):
    policy = dots_saveable | save_modules("ln_*")
    report = remat.report(block("plain", attention), models.gpt2_input(), policy=policy)
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert len(data["rows"]) == len(report.trace) == len(report.rows)
    assert data["policy"] == repr(policy)
    assert data["saved_bytes"] == report.saved_bytes > 0
    assert data["rng_state_bytes"] == report.rng_state_bytes
    assert data["recompute_flops"] == report.recompute_flops > 0
    assert data["forward_flops"] == report.forward_flops
    assert data["replayed_fraction"] == report.replayed_fraction
    assert data["replayed_calls"] == list(report.replayed_calls)
    assert data["saves_nothing"] == list(report.saves_nothing)
    for row, row_data in zip(report.rows, data["rows"], strict=True):
        assert row_data["index"] == row.call.index
        assert row_data["op"] == row.call.name
        assert row_data["decision"] == row.decision.name
        assert row_data["saved_bytes"] == row.saved_bytes
        assert row_data["replay_flops"] == row.replay_flops
    assert sum(row["saved_bytes"] for row in data["rows"]) == data["saved_bytes"]
    assert sum(row["replay_flops"] for row in data["rows"]) == data["recompute_flops"]


def test_report_of_a_checkpointed_function_uses_its_policy():
    w = models.randn(6, 5, seed=2)

    def fn(x):
        return (x @ w).tanh().relu() @ w.T

    x = models.randn(4, 6, seed=1)
    for policy in (dots_saveable, save_calls(1), ~dots_saveable):
        report = remat.report(remat.checkpoint(fn, policy=policy), x)
        direct = remat.report(fn, x, policy=policy)
        assert report.policy == policy
        assert [row.decision for row in report.rows] == [row.decision for row in direct.rows]
        assert (report.saved_bytes, report.replayed_calls) == (direct.saved_bytes, direct.replayed_calls)
        assert f"policy: {policy!r}" in str(report).splitlines()

    # A checkpointed module too, and an explicit policy overrides the checkpoint's own.
    module = block("plain", "sdpa")
    gx = models.gpt2_input()
    checkpointed = remat.checkpoint(module, policy=save_modules("mlp"))
    report = remat.report(checkpointed, gx)
    assert report.policy == save_modules("mlp")
    assert decisions(report) == mlp_calls(report.trace)
    assert decisions(remat.report(checkpointed, gx, policy=dots_saveable)) == dots(report.trace)


def test_report_without_a_policy_reports_save_nothing():
    report = remat.report(lambda x: x.sin().sin(), models.randn(3))
    assert report.policy == save_nothing
    assert "policy: save_nothing" in str(report).splitlines()
    assert report.replayed_calls == (0,) and report.saved_bytes == 0


# --------------------------------------------------------------------------- remat.costs


def one_call(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> remat.Call:
    (call,) = remat.trace(fn, *args)
    return call


# Hand-copied datasheet figures: (matmul FLOP/s for float32, for float64, vector FLOP/s, bandwidth B/s).
PEAKS = {
    "h100": (495e12, 67e12, 67e12, 3.35e12),
    "h200": (495e12, 67e12, 67e12, 4.8e12),
    "cpu": (2e12, 1e12, 1e12, 200e9),
}


@pytest.mark.parametrize("device", list(PEAKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [64, 1024])
def test_estimate_seconds_is_the_slower_of_flops_and_bytes(device: str, dtype: torch.dtype, n: int):
    f32, f64, vector, bandwidth = PEAKS[device]
    size = torch.finfo(dtype).bits // 8
    a, b = torch.ones(n, n // 2, dtype=dtype), torch.ones(n // 2, n, dtype=dtype)

    mm = one_call(torch.mm, a, b)
    assert mm.flops == 2 * n * (n // 2) * n and mm.nbytes == n * n * size
    moved = (2 * n * (n // 2) + n * n) * size
    peak = f32 if dtype == torch.float32 else f64
    assert estimate_seconds(mm, device) == pytest.approx(max(mm.flops / peak, moved / bandwidth), rel=1e-12)

    relu = one_call(torch.relu, a)
    assert relu.flops == n * (n // 2) and relu.nbytes == n * (n // 2) * size
    expected = max(relu.flops / vector, 2 * relu.nbytes / bandwidth)
    assert estimate_seconds(relu, device) == pytest.approx(expected, rel=1e-12)
    assert estimate_seconds(relu, DEVICES[device]) == estimate_seconds(relu, device)


def test_estimate_seconds_takes_either_bound():
    big = one_call(torch.mm, torch.ones(1024, 1024), torch.ones(1024, 1024))
    small = one_call(torch.mm, torch.ones(64, 64), torch.ones(64, 64))
    # 2.1 GFLOP at 495 TFLOP/s (4.34 us) beats 12 MiB at 3.35 TB/s (3.76 us): compute-bound.
    assert estimate_seconds(big, "h100") == pytest.approx(2 * 1024**3 / 495e12, rel=1e-12)
    # 48 KiB at 3.35 TB/s (14.7 ns) beats 0.5 MFLOP at 495 TFLOP/s (1.06 ns): memory-bound.
    assert estimate_seconds(small, "h100") == pytest.approx(3 * 64 * 64 * 4 / 3.35e12, rel=1e-12)


def test_h200_is_never_slower_than_h100():
    calls = [
        *gpt2_trace("plain", "sdpa"),
        *gpt2_trace("plain", "softmax"),
        one_call(torch.mm, torch.ones(1024, 1024), torch.ones(1024, 1024)),
        one_call(torch.relu, torch.ones(1024, 1024)),
    ]
    faster = 0
    for call in calls:
        h100, h200 = estimate_seconds(call, "h100"), estimate_seconds(call, "h200")
        assert h200 <= h100, call
        faster += h200 < h100
    assert faster > 0  # memory-bound calls gain from the bandwidth


def test_unknown_device_raises_listing_the_known_names():
    call = one_call(torch.relu, torch.ones(4))
    with pytest.raises(ValueError, match=r"unknown device 'tpu'") as excinfo:
        estimate_seconds(call, "tpu")
    assert "['cpu', 'h100', 'h200']" in str(excinfo.value)
    with pytest.raises(ValueError, match=r"unknown device 'H100'"):
        save_by_cost(1e-12, "roofline:H100")


def test_a_custom_device():
    toy = Device("toy", matmul_flops=((torch.float32, 1e9),), vector_flops=1e6, bandwidth=1e3)
    mm32 = one_call(torch.mm, torch.ones(8, 4), torch.ones(4, 2))
    mm64 = one_call(torch.mm, torch.ones(8, 4, dtype=DTYPE), torch.ones(4, 2, dtype=DTYPE))
    relu = one_call(torch.relu, torch.ones(8, 4))
    flops = 2 * 8 * 4 * 2
    # float32 matmuls use the matmul peak; float64 is not listed and falls back to the vector rate.
    assert estimate_seconds(mm32, toy) == max(flops / 1e9, (32 + 8 + 16) * 4 / 1e3)
    assert estimate_seconds(mm64, toy) == max(flops / 1e6, (32 + 8 + 16) * 8 / 1e3)
    assert estimate_seconds(relu, toy) == max(32 / 1e6, 2 * 32 * 4 / 1e3)

    # save_by_cost on it: relu moves 2 bytes per byte kept (0.002 s/byte); mm32 moves 56*4 / 16*4 = 3.5x.
    policy = save_by_cost(3e-3, toy)
    assert policy(mm32) is remat.SAVE and policy(relu) is remat.RECOMPUTE
    assert policy == save_by_cost(3e-3, Device("toy", ((torch.float32, 1e9),), 1e6, 1e3))
    assert repr(policy).startswith("save_by_cost(0.003, cost=Device(name='toy', ")
    assert eval(repr(policy), {"save_by_cost": save_by_cost, "Device": Device, "torch": torch}) == policy


@pytest.mark.parametrize("threshold", [0, 0.0, -1e-12, True, False, "1e-12", None, math.nan, math.inf])
def test_save_by_cost_rejects_thresholds_that_are_not_positive_numbers(threshold: Any):
    with pytest.raises(ValueError, match=r"remat.policies.save_by_cost: expected a positive, finite threshold"):
        save_by_cost(threshold)


def test_regression_cpu_attention_kernels_are_counted_with_the_attention_formula():
    # torch's FLOP counter has no formula for the CPU flash kernel: it was counted as one FLOP per output.
    b, h, s, d = 2, 4, 8, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    (call,) = [
        c for c in remat.trace(torch.nn.functional.scaled_dot_product_attention, q, k, v) if "attention" in c.name
    ]
    assert call.flops == 4 * b * h * s * s * d
