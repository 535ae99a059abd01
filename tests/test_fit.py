"""`remat.fit`: a whole training step planned to a memory target, measured against it."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
import torch.nn.functional as F
from conftest import examples
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import remat
from remat import policies
from remat._memory import _step

CPU = torch.device("cpu")


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """An embedding, blocks of one class (or two), and a head whose logits are `vocab` wide."""

    def __init__(self, blocks: list[nn.Module], d: int, vocab: int):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = self.embed(x) * scale
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def mlp_stack(n: int = 6, d: int = 32, hidden: int = 128, vocab: int = 96, dtype: torch.dtype = torch.float32) -> Stack:
    torch.manual_seed(0)
    return Stack([MLPBlock(d, hidden) for _ in range(n)], d, vocab).to(dtype)


def gpt_stack(n: int = 4, d: int = 32, vocab: int = 64) -> Stack:
    return Stack([models.GPT2Block(d, 4, "softmax", seed=i) for i in range(n)], d, vocab).to(torch.float32)


def square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def measured_peak(model: nn.Module, *args: Any, loss: Callable[[Any], torch.Tensor] = square_loss) -> int:
    """The peak bytes of forward, loss and backward above what was live before (no gradients at the start),
    as MemTracker measures it (on a GPU: the allocator's counters); the step is run once before, untracked,
    so that no tracing is measured."""
    for run in range(2):
        for p in model.parameters():
            p.grad = None
        if run == 0:
            loss(model(*args)).backward()
            continue
        if args[0].is_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            value = loss(model(*args))
            value.backward()
            del value
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        tracker = MemTracker()
        tracker.track_external(*model.parameters(), *args)
        with tracker:
            before = tracker.get_tracker_snapshot("current")[CPU]["Total"]
            value = loss(model(*args))
            value.backward()
            del value
        return int(tracker.get_tracker_snapshot("peak")[CPU]["Total"] - before)
    raise AssertionError


def eager_and_lowest(model: nn.Module, block: type[nn.Module], x: torch.Tensor) -> tuple[int, int]:
    """The measured peaks of the step without checkpointing and with every block saving nothing."""
    eager = measured_peak(model, x)
    remat.checkpoint_modules(model, block)
    lowest = measured_peak(model, x)
    remat.uncheckpoint_modules(model)
    return eager, lowest


@pytest.mark.parametrize(
    ("build", "share"),
    [
        pytest.param(mlp_stack, 0.05, marks=pytest.mark.slow),
        (mlp_stack, 0.3),
        *(pytest.param(mlp_stack, share, marks=pytest.mark.slow) for share in (0.6, 0.9)),
        *(pytest.param(gpt_stack, share, marks=pytest.mark.slow) for share in (0.05, 0.6)),
    ],
    ids=["mlp-0.05", "mlp-0.3", "mlp-0.6", "mlp-0.9", "gpt-0.05", "gpt-0.6"],
)
def test_the_measured_peak_stays_within_the_target_and_is_predicted(build: Callable[[], Stack], share: float) -> None:
    model = build()
    x = torch.randn(2, 48, 32) if build is gpt_stack else torch.randn(256, 32)
    block = type(model.blocks[0])
    eager, lowest = eager_and_lowest(model, block, x)
    assert eager > 1.3 * lowest  # activations dominate: there is room to plan in
    target = int(lowest + share * (eager - lowest))
    plan = remat.fit(model, block, x, peak_bytes=target, loss=square_loss)
    measured = measured_peak(model, x)
    assert measured <= target
    assert plan.predicted_peak <= target
    assert abs(plan.predicted_peak - measured) <= 0.05 * measured
    assert plan.report.peak_keeping_nothing == pytest.approx(lowest, rel=0.05)
    assert plan.report.peak_keeping_everything >= plan.predicted_peak


@pytest.mark.slow
def test_a_looser_target_replays_less() -> None:
    model, x = mlp_stack(), torch.randn(256, 32)
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    costs = []
    for share in (0.1, 0.5, 1.0):
        plan = remat.fit(model, MLPBlock, x, peak_bytes=int(lowest + share * (eager - lowest)) + 1, loss=square_loss)
        costs.append(plan.replay_cost)
        remat.uncheckpoint_modules(model)
    assert costs[0] > costs[1] > costs[2] == 0  # at eager's peak, nothing needs replaying


def _inputs_of(model: Stack, x: torch.Tensor) -> list[torch.Tensor]:
    inputs: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach())) for b in model.blocks]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return inputs


UNIFORM = [
    policies.save_nothing,
    policies.save_everything,
    policies.dots_saveable,
    policies.dots_with_no_batch_dims_saveable,
    *(policies.budget(fraction=k / 10) for k in range(1, 10)),
]


@pytest.mark.slow
def test_never_costlier_than_a_uniform_plan_that_fits() -> None:
    model, x = mlp_stack(), torch.randn(256, 32)
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    inputs = _inputs_of(model, x)
    uniform = []  # (measured peak, replay FLOPs) of each policy applied to every block
    for policy in UNIFORM:
        remat.checkpoint_modules(model, MLPBlock, policy=policy)
        flops = sum(
            remat.report(b.forward, h.requires_grad_(), policy=policy).recompute_flops
            for b, h in zip(model.blocks, inputs, strict=True)
        )
        uniform.append((measured_peak(model, x), flops))
        remat.uncheckpoint_modules(model)
    for share in (0.2, 0.5, 0.8):
        target = int(lowest + share * (eager - lowest))
        fitting = [flops for peak, flops in uniform if peak <= target]
        assert fitting, "some uniform plan fits each target tried"
        plan = remat.fit(model, MLPBlock, x, peak_bytes=target, loss=square_loss)
        assert plan.replay_cost <= min(fitting)
        assert measured_peak(model, x) <= target
        remat.uncheckpoint_modules(model)


def test_gradients_match_eager_in_float64() -> None:
    model = mlp_stack(n=3, dtype=torch.float64)
    x = torch.randn(64, 32, dtype=torch.float64)
    reference = mlp_stack(n=3, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    remat.fit(model, MLPBlock, x, peak_bytes=(eager + lowest) // 2, loss=square_loss)
    for m in (model, reference):
        for p in m.parameters():
            p.grad = None
        square_loss(m(x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf input", "non-leaf input"])
def test_a_signature_planned_at_call_time_leaves_the_callers_batch_alone(leaf: bool) -> None:
    # NOTE [the probe step runs on copies of the batch]: run on the caller's tensors, the probe step's
    # backward doubled a leaf input's gradient (issue 69) and ran into the graph behind a non-leaf one.
    model, reference = mlp_stack(n=3, dtype=torch.float64), mlp_stack(n=3, dtype=torch.float64)
    example = torch.randn(64, 32, dtype=torch.float64)  # does not require grad: the call below replans
    eager, lowest = eager_and_lowest(model, MLPBlock, example)
    remat.fit(model, MLPBlock, example, peak_bytes=(eager + lowest) // 2, loss=square_loss)
    grads = []
    for m in (model, reference):
        start = torch.randn(48, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        start.requires_grad_()
        x = start if leaf else start * 2
        if not leaf:
            x.retain_grad()
        for p in m.parameters():
            p.grad = None
        square_loss(m(x)).backward()
        grads.append([start.grad, x.grad, *(p.grad for p in m.parameters())])
    assert len(model.forward.planner.fits.items()) == 2
    for got, expected in zip(*grads, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.slow
def test_blocks_of_one_structure_may_get_different_plans() -> None:
    model, x = mlp_stack(n=6), torch.randn(256, 32)
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    plan = remat.fit(model, MLPBlock, x, peak_bytes=int(lowest + 0.35 * (eager - lowest)), loss=square_loss)
    assert len({block.decisions for block in plan.blocks}) > 1
    assert [block.name for block in plan.blocks] == [f"blocks.{i}" for i in range(6)]
    assert model.blocks[0].forward.cache_info().traces + model.blocks[1].forward.cache_info().traces == 1  # shared


def test_a_target_below_the_lowest_peak_says_what_the_lowest_is() -> None:
    model, x = mlp_stack(), torch.randn(256, 32)
    _, lowest = eager_and_lowest(model, MLPBlock, x)
    with pytest.raises(
        ValueError, match=r"no plan fits the step in .* the lowest predicted peak is .*\(([\d,]+) bytes\)"
    ) as info:
        remat.fit(model, MLPBlock, x, peak_bytes=lowest // 2, loss=square_loss)
    stated = int(
        info.value.args[0].split("lowest predicted peak is")[1].split("(")[1].split(" bytes")[0].replace(",", "")
    )
    assert stated == pytest.approx(lowest, rel=0.05)
    assert not any("forward" in vars(m) for m in model.modules())  # a failed fit leaves the model as it was
    remat.fit(model, MLPBlock, x, peak_bytes=stated, loss=square_loss)  # the lowest stated is reachable


def test_a_plan_below_saving_nothings_peak_is_said_as_less() -> None:
    # A GPT-2 block's backward peaks in its replay: saving some of its calls lowers that peak, so the lowest
    # plan lies below saving nothing, and the error says by how much (it once said "-166 KiB more").
    blocks = nn.Sequential(*[models.GPT2Block() for _ in range(3)]).double()
    x = models.gpt2_input(batch=4, seq=32)
    with pytest.raises(ValueError, match=r"are live when every block saves nothing and [\d.]+ KiB less under") as info:
        remat.fit(blocks, models.GPT2Block, x, peak_bytes=1000, loss=lambda y: y.square().mean())
    assert "-" not in info.value.args[0].split("saves nothing")[1]


@pytest.mark.slow
def test_a_new_input_signature_plans_again_for_the_same_target() -> None:
    model, x = mlp_stack(), torch.randn(256, 32)
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    target = int(lowest + 0.5 * (eager - lowest))
    remat.fit(model, MLPBlock, x, peak_bytes=target, loss=square_loss)
    smaller = torch.randn(160, 32)
    square_loss(model(smaller)).backward()  # plans at this signature, then steps
    assert len(model.forward.planner.fits.items()) == 2
    assert measured_peak(model, smaller) <= target
    assert measured_peak(model, x) <= target


class _Scale:
    """An object handed to the model, made anew for each batch (as a flex attention mask is)."""

    def __init__(self, factor: torch.Tensor):
        self.factor = factor


class _ScaledStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = mlp_stack(n=2)

    def forward(self, x: torch.Tensor, scale: _Scale) -> torch.Tensor:
        return self.stack(x) * scale.factor


def test_an_object_made_anew_for_each_batch_is_the_same_signature() -> None:
    model, x = _ScaledStack(), torch.randn(64, 32)
    remat.fit(model, MLPBlock, x, kwargs={"scale": _Scale(torch.ones(()))}, peak_bytes=10**9, loss=square_loss)
    for _ in range(2):
        square_loss(model(x, scale=_Scale(torch.full((), 2.0)))).backward()
    assert len(model.forward.planner.fits.items()) == 1
    square_loss(model(x, scale=_Scale(torch.ones(3, 1, 1)))).backward()  # another shape: planned again
    assert len(model.forward.planner.fits.items()) == 2


def test_uncheckpoint_modules_undoes_fit() -> None:
    model, x = mlp_stack(n=2), torch.randn(64, 32)
    remat.fit(model, MLPBlock, x, peak_bytes=10**9, loss=square_loss)
    assert isinstance(vars(model)["forward"], remat._api._apply.InstalledForward)
    assert remat.uncheckpoint_modules(model) is model
    assert not any("forward" in vars(m) for m in model.modules())
    remat.checkpoint_modules(model, MLPBlock)
    with pytest.raises(ValueError, match=r"remat\.fit: `model` already has checkpointed modules"):
        remat.fit(model, MLPBlock, x, peak_bytes=10**9, loss=square_loss)


def test_a_new_signature_is_planned_before_the_models_hooks_run() -> None:
    # NOTE [planning before the model's hooks]: a hook that sets up state for the call (FSDP2's gathers the
    # root's parameters) sees the probe step's call first, then the real call's, never the probe inside it.
    model, x = mlp_stack(n=2), torch.randn(64, 32)
    kind = type(model)
    in_probe: list[bool] = []
    model.register_forward_pre_hook(lambda module, args: in_probe.append(remat._memory._step.recorder is not None))
    remat.fit(model, MLPBlock, x, peak_bytes=10**9, loss=square_loss)
    assert in_probe == [True]
    report = vars(model)["forward"].planner.fits.items()[0][1].report
    assert report.unsharded == report.prefetched == report.unreduced_gradients == 0  # no FSDP2
    assert "unsharded" not in str(report) and "unreduced" not in str(report)
    square_loss(model(torch.randn(48, 32))).backward()
    assert in_probe == [True, True, False]
    assert type(model).__name__ == kind.__name__ and isinstance(model, kind) and type(model) is not kind
    remat.uncheckpoint_modules(model)  # the subclass stays, calling straight through
    square_loss(model(torch.randn(40, 32))).backward()
    assert in_probe == [True, True, False, False]


def test_a_failed_fit_leaves_the_models_class_as_it_was() -> None:
    model, x = mlp_stack(n=2), torch.randn(64, 32)
    kind = type(model)
    with pytest.raises(ValueError, match="lowest predicted peak"):
        remat.fit(model, MLPBlock, x, peak_bytes=1, loss=square_loss)
    assert type(model) is kind


def test_fit_when_called_plans_at_the_first_call_with_gradients() -> None:
    model, x = mlp_stack(n=2), torch.randn(64, 32)
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    target = int(lowest + 0.3 * (eager - lowest))
    remat._planning._fit.fit_when_called(model, MLPBlock, peak_bytes=target, loss_for=lambda args, kwargs: square_loss)
    planner = vars(model)["forward"].planner
    with torch.no_grad():
        model(x)
    assert planner.fits.items() == []  # nothing to plan without gradients
    assert measured_peak(model, x) <= target
    [(_, plan)] = planner.fits.items()
    assert plan.peak_bytes == target and any(remat.RECOMPUTE in block.decisions for block in plan.blocks)


class NoisyBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear, self.norm, self.drop = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.norm(self.linear(x)).tanh())


def test_the_probe_step_puts_back_gradients_buffers_and_generators() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(NoisyBlock(16), NoisyBlock(16))
    x = torch.randn(32, 16)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    expected_draw = torch.rand(3)
    torch.manual_seed(1)
    remat.fit(model, NoisyBlock, x, peak_bytes=10**9, loss=lambda out: out.sum())
    assert torch.equal(torch.rand(3), expected_draw)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())


@pytest.mark.slow
def test_keyword_arguments_and_the_default_loss() -> None:
    model, x = mlp_stack(n=2), torch.randn(64, 32)
    plan = remat.fit(model, MLPBlock, x, peak_bytes=10**9, kwargs={"scale": 0.5})
    assert plan.predicted_peak > 0 and len(plan.blocks) == 2

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mlp_stack(n=2)

        def forward(self, x: torch.Tensor) -> Any:
            return type("Output", (), {"loss": self.inner(x).square().mean()})()

    assert len(remat.fit(WithLoss(), MLPBlock, x, peak_bytes=10**9).blocks) == 2


def test_the_report_answers_what_activations_cost() -> None:
    model, x = mlp_stack(), torch.randn(256, 32)
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    plan = remat.fit(model, MLPBlock, x, peak_bytes=int(lowest + 0.5 * (eager - lowest)), loss=square_loss)
    report = plan.report
    assert report.gradients == sum(p.numel() * 4 for p in model.parameters())
    assert report.parameters == report.gradients
    assert report.peak_keeping_nothing <= report.peak <= report.peak_keeping_everything
    assert report.peak_keeping_everything == pytest.approx(eager, rel=0.05)
    assert 0 < report.activations < report.peak
    assert set(report.kept) == {f"blocks.{i}" for i in range(6)}
    text = str(plan)
    assert "activations are" in text and "keeping everything it would be" in text and "blocks.5" in text


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"peak_bytes": 0}, ValueError, "`peak_bytes` must be a positive integer"),
        ({"peak_bytes": 1.5e9}, ValueError, "`peak_bytes` must be a positive integer"),
        ({"peak_bytes": 10**9, "loss": 3}, TypeError, "`loss` must be a function"),
        ({"peak_bytes": 10**9, "kwargs": [1]}, TypeError, "`kwargs` must be a dict"),
        ({"peak_bytes": 10**9, "cost": "seconds"}, ValueError, "remat.fit: `cost` must be"),
        ({"peak_bytes": 10**9, "exact": 1}, TypeError, "`exact` must be True or False"),
        ({"peak_bytes": 10**9, "pack": "yes"}, TypeError, "`pack` must be True or False"),
        ({"peak_bytes": 10**9, "offload": True}, ValueError, r"remat.fit: offload=True .* needs cost='roofline"),
        ({"peak_bytes": 10**9, "offload": True, "cost": "roofline:h100"}, ValueError, "runs on the CPU"),
        ({"peak_bytes": 10**9, "loss": lambda out: out}, ValueError, "must give a scalar tensor"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict[str, Any], error: type[Exception], match: str) -> None:
    model = mlp_stack(n=2)
    with pytest.raises(error, match=match):
        remat.fit(model, MLPBlock, torch.randn(8, 32), **arguments)
    assert not any("forward" in vars(m) for m in model.modules())


def test_which_selects_nothing() -> None:
    with pytest.raises(ValueError, match=r"remat\.fit: no module of Stack matches"):
        remat.fit(mlp_stack(n=2), nn.Conv1d, torch.randn(8, 32), peak_bytes=10**9)


@examples(ci=6, soak=200)
@given(
    n=st.integers(1, 5),
    d=st.sampled_from([16, 32]),
    hidden=st.sampled_from([16, 64, 128]),
    vocab=st.sampled_from([8, 64, 160]),
    rows=st.sampled_from([32, 96, 160]),
    share=st.floats(0.0, 1.0),
)
def test_random_stacks_stay_within_their_targets(
    n: int, d: int, hidden: int, vocab: int, rows: int, share: float
) -> None:
    model, x = mlp_stack(n, d, hidden, vocab), torch.randn(rows, d)
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    target = int(lowest + share * max(0, eager - lowest)) + 1
    plan = remat.fit(model, MLPBlock, x, peak_bytes=target, loss=square_loss)
    measured = measured_peak(model, x)
    assert measured <= target
    assert abs(plan.predicted_peak - measured) <= 0.05 * measured


def test_the_example_of_the_docs_runs_as_shown() -> None:
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "fit.md").read_text()
    code = text.split("```python\n")[1].split("```")[0].replace("print(plan)", "")
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/fit.md", "exec"), scope)
    plan = scope["plan"]
    assert plan.predicted_peak <= 8 * 2**20
    assert str(plan).startswith("remat.fit: predicted peak 7.9 MiB of 8.0 MiB")


class WideFirst(nn.Module):
    """A step whose peak lies before the first block: a wide temporary in the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp_stack(n=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.repeat(1, 256).sin()  # 256 times the batch, freed before the blocks run
        return self.inner(x + wide[:, :32])


@pytest.mark.slow
def test_a_peak_before_the_first_block_counts() -> None:
    model, x = WideFirst(), torch.randn(64, 32)
    _, lowest = eager_and_lowest(model, MLPBlock, x)
    assert lowest > x.numel() * 4 * 256  # the temporary sets the peak, whatever the blocks keep
    with pytest.raises(ValueError, match="outside the blocks"):
        remat.fit(model, MLPBlock, x, peak_bytes=lowest - 1, loss=square_loss)
    remat.fit(model, MLPBlock, x, peak_bytes=lowest, loss=square_loss)
    assert measured_peak(model, x) <= lowest


@pytest.mark.parametrize(
    "share", [0.1, 0.4, pytest.param(0.7, marks=pytest.mark.slow), pytest.param(0.95, marks=pytest.mark.slow)]
)
def test_the_chain_planner_finds_the_0_1_programs_optimum(monkeypatch: pytest.MonkeyPatch, share: float) -> None:
    # A stack of blocks is a chain, planned by dynamic programming; HiGHS solves the same program for a step
    # that is not one. Both are exact: their optima agree.
    model, x = mlp_stack(n=8), torch.randn(128, 32)
    eager, lowest = eager_and_lowest(model, MLPBlock, x)
    target = int(lowest + share * (eager - lowest))
    by_chain = remat.fit(model, MLPBlock, x, peak_bytes=target, loss=square_loss)
    remat.uncheckpoint_modules(model)
    monkeypatch.setattr(remat._planning._fit, "solve_chain", lambda *args: (None, False))
    by_milp = remat.fit(model, MLPBlock, x, peak_bytes=target, loss=square_loss, exact=True)
    assert by_chain.replay_cost == pytest.approx(by_milp.replay_cost, rel=1e-9)
    assert by_chain.predicted_peak <= target and by_milp.predicted_peak <= target


def measured_peak_with_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> int:
    """`measured_peak` of forward, loss, backward and `optimizer.step()`, as a first step (no state)."""
    for run in range(2):
        for p in model.parameters():
            p.grad = None
        optimizer.state.clear()
        if run == 0:
            square_loss(model(x)).backward()
            optimizer.step()
            continue
        tracker = MemTracker()
        tracker.track_external(*model.parameters(), x)
        with tracker:
            before = tracker.get_tracker_snapshot("current")[CPU]["Total"]
            value = square_loss(model(x))
            value.backward()
            del value
            optimizer.step()
        optimizer.state.clear()
        return int(tracker.get_tracker_snapshot("peak")[CPU]["Total"] - before)
    raise AssertionError


@pytest.mark.parametrize(
    "make",
    [lambda ps: torch.optim.AdamW(ps, lr=1e-3), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)],
    ids=["adamw", "sgd_momentum"],
)
def test_the_optimizers_state_and_step_count(make: Callable[[Any], torch.optim.Optimizer]) -> None:
    model, x = mlp_stack(n=6, d=64, hidden=256, vocab=32), torch.randn(64, 64)
    optimizer = make(model.parameters())
    remat.checkpoint_modules(model, MLPBlock)
    lowest = measured_peak_with_step(model, optimizer, x)
    remat.uncheckpoint_modules(model)
    target = int(lowest * 1.1)
    without = remat.fit(model, MLPBlock, x, peak_bytes=target, loss=square_loss)
    remat.uncheckpoint_modules(model)
    plan = remat.fit(model, MLPBlock, x, peak_bytes=target, loss=square_loss, optimizer=optimizer)
    assert not optimizer.state  # measured on meta copies: the real optimizer is untouched
    measured = measured_peak_with_step(model, optimizer, x)
    assert measured <= target
    assert plan.predicted_peak == pytest.approx(measured, rel=0.05)
    per_parameter = 2 if isinstance(optimizer, torch.optim.AdamW) else 1
    assert plan.report.optimizer_state >= per_parameter * plan.report.gradients
    assert plan.predicted_peak > without.predicted_peak or plan.replay_cost > without.replay_cost
    assert "optimizer" in str(plan.report)


def sdpa_stack(n: int = 4, d: int = 32, vocab: int = 64) -> Stack:
    torch.manual_seed(0)
    return Stack([models.GPT2Block(d, 4, "sdpa", seed=i) for i in range(n)], d, vocab).to(torch.float32)


def counting_probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each probe step (each planning) from now on."""
    probes: list[int] = []
    probe = remat._planning._fit.probe_step
    monkeypatch.setattr(remat._planning._fit, "probe_step", lambda *a: probes.append(1) or probe(*a))
    return probes


def assert_the_plan_holds_once_materialized(
    model: nn.Module, real: nn.Module, x: torch.Tensor, plan: remat.Fit, target: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model`, planned on meta, materialized where `x` is with `real`'s weights: it runs without planning
    again, within the target, at the predicted peak (within 2%)."""
    model.to_empty(device=x.device)
    model.load_state_dict(real.state_dict())
    probes = counting_probes(monkeypatch)
    peak = measured_peak(model, x)
    assert probes == []  # the batch has the planned signature: not planned again
    assert peak <= target
    assert abs(peak - plan.predicted_peak) <= 0.02 * peak


def test_a_plan_made_on_the_meta_device_holds_on_the_materialized_model(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sdpa_stack()
    with torch.device("meta"):
        model = sdpa_stack()
    x = torch.randn(4, 64, 32)
    eager, lowest = eager_and_lowest(real, models.GPT2Block, x)
    target = (eager + lowest) // 2
    plan = remat.fit(model, models.GPT2Block, x.to("meta"), peak_bytes=target, loss=square_loss, device="cpu")
    assert plan.predicted_peak <= target
    assert any(block.kept_bytes for block in plan.blocks)  # not the materialized model's default plan
    assert_the_plan_holds_once_materialized(model, real, x, plan, target, monkeypatch)
    # The probe ran on fake CPU tensors: the blocks were traced with the CPU's attention kernel (the meta
    # device's own is the math kernel, which keeps the T x T scores), and the plan is the one made on the CPU.
    on_cpu = remat.fit(real, models.GPT2Block, x, peak_bytes=target, loss=square_loss)
    assert [b.decisions for b in on_cpu.blocks] == [b.decisions for b in plan.blocks]
    assert on_cpu.predicted_peak == plan.predicted_peak


@pytest.mark.slow  # compiles two block structures, two batch sizes
@pytest.mark.filterwarnings("ignore:.*context_fn is passed to torch.utils.checkpoint")
def test_a_fitted_model_trains_under_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    torch._dynamo.reset()
    model, eager = sdpa_stack(), sdpa_stack()
    x = torch.randn(2, 48, 32)
    high, low = eager_and_lowest(eager, models.GPT2Block, x)
    remat.fit(model, models.GPT2Block, x, peak_bytes=(high + low) // 2, loss=square_loss)
    probes = counting_probes(monkeypatch)
    compiled = torch.compile(model, backend="aot_eager")
    for batch in (2, 3):  # the second batch size is planned (outside the compiled graph) for the same target
        x = torch.randn(batch, 48, 32)
        for m, call in ((model, compiled), (eager, eager)):
            m.zero_grad(set_to_none=True)
            square_loss(call(x)).backward()
        for got, want in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)
    assert probes == [1]
    torch._dynamo.reset()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_on_cuda_the_measured_peak_stays_within_the_target_and_is_predicted() -> None:
    model = sdpa_stack(d=256, vocab=512).cuda()
    x = torch.randn(8, 512, 256, device="cuda")
    eager, lowest = eager_and_lowest(model, models.GPT2Block, x)
    assert eager > 1.3 * lowest
    for share in (0.2, 0.6):
        target = int(lowest + share * (eager - lowest))
        plan = remat.fit(model, models.GPT2Block, x, peak_bytes=target, loss=square_loss)
        measured = measured_peak(model, x)
        assert measured <= target
        assert abs(plan.predicted_peak - measured) <= 0.05 * measured
        remat.uncheckpoint_modules(model)


@needs_cuda
@pytest.mark.parametrize("walked", [False, True], ids=["engine", "walked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_plan_made_on_meta_for_cuda_holds_on_the_gpu(
    dtype: torch.dtype, walked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On meta, attention runs the math kernel, which keeps the T x T scores; on the GPU, SDPA picks a
    # fused kernel (memory-efficient in float32, flash in bfloat16) that keeps none. The probe runs on
    # fake CUDA tensors, which pick the GPU's kernel: the plan is the one made on the real model. Walked
    # (as on a machine without a GPU), the probe's backward plans the same.
    if walked:
        monkeypatch.setattr(remat._planning._fit_probe, "engine_runs_on", lambda device: False)
    real = sdpa_stack(d=256, vocab=512).to("cuda", dtype)
    with torch.device("meta"):
        model = sdpa_stack(d=256, vocab=512).to(dtype)
    x = torch.randn(8, 512, 256, device="cuda", dtype=dtype)
    eager, lowest = eager_and_lowest(real, models.GPT2Block, x)
    target = (eager + lowest) // 2
    plan = remat.fit(model, models.GPT2Block, x.to("meta"), peak_bytes=target, loss=square_loss, device="cuda")
    on_gpu = remat.fit(real, models.GPT2Block, x, peak_bytes=target, loss=square_loss)
    assert [b.decisions for b in on_gpu.blocks] == [b.decisions for b in plan.blocks]
    assert on_gpu.predicted_peak == plan.predicted_peak
    assert_the_plan_holds_once_materialized(model, real, x, plan, target, monkeypatch)


def test_fit_asks_for_the_device_to_plan_a_model_on_meta_for() -> None:
    with torch.device("meta"):
        model = mlp_stack(n=2)
    x = torch.randn(8, 32, device="meta")
    with pytest.raises(ValueError, match="name the device to plan for"):
        remat.fit(model, MLPBlock, x, peak_bytes=2**20, loss=square_loss)
    with pytest.raises(ValueError, match="not 'meta'"):
        remat.fit(model, MLPBlock, x, peak_bytes=2**20, loss=square_loss, device="meta")
    with pytest.raises(TypeError, match="must name a device"):
        remat.fit(model, MLPBlock, x, peak_bytes=2**20, loss=square_loss, device=3.5)
    with pytest.raises(ValueError, match="leave out `device`"):
        remat.fit(mlp_stack(n=2), MLPBlock, torch.randn(8, 32), peak_bytes=2**20, loss=square_loss, device="cuda")
    assert not any(
        isinstance(m.__dict__.get("forward"), remat._api._apply.CheckpointedForward) for m in model.modules()
    )


@st.composite
def random_chains(draw: st.DrawFn) -> tuple[list[Any], list[Any], list[int], int]:
    """A stack's step as the planner sees it: per block call, options (cost, kept bytes, forward and backward
    peaks; option 0 the probe's plan), and the probe's segments: each forward, the stretch after it, each
    backward in reverse; with a target between the lowest and highest peaks."""
    from remat import Peak
    from remat._memory import _step
    from remat._planning import _fit_choice

    n = draw(st.integers(1, 6))
    groups = []
    for call in range(n):
        options = []
        for k in range(draw(st.integers(1, 5))):
            kept = 0 if k == 0 else draw(st.integers(0, 40))
            peak = Peak(
                forward=kept + draw(st.integers(0, 30)),
                after_forward=kept,
                backward=draw(st.integers(0, 60)),
            )
            cost = 100.0 if k == 0 else float(draw(st.integers(0, 99)))
            options.append(_fit_choice.Candidate(f"option {k}", (), cost, peak))
        groups.append(_fit_choice.Group(f"block {call}", None, None, tuple(options)))  # type: ignore[arg-type]
    segments = []
    for call in range(n):
        segments.append(_step.Segment(_step.Phase.FORWARD, call, frozenset(range(call)), draw(st.integers(0, 50)), ""))
        segments.append(
            _step.Segment(_step.Phase.OUTSIDE, None, frozenset(range(call + 1)), draw(st.integers(0, 50)), "")
        )
    for call in reversed(range(n)):
        segments.append(_step.Segment(_step.Phase.BACKWARD, call, frozenset(range(call)), draw(st.integers(0, 50)), ""))
        segments.append(_step.Segment(_step.Phase.OUTSIDE, None, frozenset(range(call)), draw(st.integers(0, 50)), ""))
    timeline = _step.Timeline((), tuple(segments), 0, 0, 0)
    group_of = list(range(n))
    rows = _fit_choice.step_rows(timeline, group_of, groups)
    return groups, rows, group_of, draw(st.integers(0, 300))


@given(random_chains())
def test_the_chain_planners_pruning_keeps_the_optimum_of_the_0_1_program(
    chain: tuple[list[Any], list[Any], list[int], int],
) -> None:
    # The dynamic program carries only states that can still fit and options no other beats; HiGHS solves
    # the whole program exactly. They agree on whether a choice fits, and on its least cost.
    pytest.importorskip("highspy")
    from remat._planning import _fit_choice

    groups, rows, group_of, target = chain
    by_chain, is_chain = _fit_choice.solve_chain(groups, rows, group_of, target)
    by_milp, _ = _fit_choice.solve(groups, rows, target, exact=True)
    assert is_chain
    assert (by_chain is None) == (by_milp is None)
    if by_chain is not None and by_milp is not None:
        assert _fit_choice.predicted_peak(rows, by_chain)[0] <= target

        def cost(choice: list[int]) -> float:
            return sum(groups[g].options[k].cost for g, k in enumerate(choice))

        assert cost(by_chain) == pytest.approx(cost(by_milp), abs=1e-6)


class _EachMatmulTakes:
    """Stands for a GPU's kernels on the CPU: every matmul takes `nbytes` of its own and frees them."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def run(self, op: Any, call: Callable[[], Any]) -> tuple[Any, int]:
        matmul = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return call(), self.nbytes if matmul else 0


def test_kernels_workspaces_count_where_they_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU, fit's probe measures what each op's kernels take and free beyond their outputs (cuDNN's
    # convolution workspace) by the allocator's counters: NOTE [kernels' workspaces].
    model, x = mlp_stack(), torch.randn(256, 32)
    reports, plans = {}, {}
    for nbytes in (0, 2**20):
        monkeypatch.setattr(_step, "kernel_workspaces", lambda tensors, n=nbytes: _EachMatmulTakes(n) if n else None)
        reports[nbytes] = remat.fit(model, MLPBlock, x, peak_bytes=2**40, loss=square_loss).report
        remat.uncheckpoint_modules(model)
    without, taken = reports[0], reports[2**20]
    for peak in ("peak_keeping_nothing", "peak_keeping_everything"):
        assert getattr(without, peak) < getattr(taken, peak) <= getattr(without, peak) + 2**20
    # At one target, the plan that counts the workspaces replays more to leave room for them.
    target = (taken.peak_keeping_nothing + taken.peak_keeping_everything) // 2
    for nbytes in (0, 2**20):
        monkeypatch.setattr(_step, "kernel_workspaces", lambda tensors, n=nbytes: _EachMatmulTakes(n) if n else None)
        plans[nbytes] = remat.fit(model, MLPBlock, x, peak_bytes=target, loss=square_loss)
        remat.uncheckpoint_modules(model)
        assert plans[nbytes].predicted_peak <= target
    assert plans[2**20].replay_cost > plans[0].replay_cost
    monkeypatch.undo()
    assert _step.kernel_workspaces(list(model.parameters())) is None  # a CPU's kernels are not measured


class ConvBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x)))


@needs_cuda
def test_on_cuda_a_convolution_stack_stays_within_the_target_with_its_workspaces() -> None:
    # cuDNN's convolutions take workspaces of their own during each call (NOTE [kernels' workspaces]).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), *[ConvBlock(32) for _ in range(8)]).cuda()
    x = torch.randn(16, 3, 32, 32, device="cuda")
    eager, lowest = eager_and_lowest(model, ConvBlock, x)
    for share in (0.2, 0.6):
        target = int(lowest + share * (eager - lowest))
        plan = remat.fit(model, ConvBlock, x, peak_bytes=target, loss=square_loss)
        measured = measured_peak(model, x)
        assert measured <= target
        assert abs(plan.predicted_peak - measured) <= 0.05 * measured
        remat.uncheckpoint_modules(model)


def test_a_kernels_workspace_is_what_it_allocated_less_what_it_left(monkeypatch: pytest.MonkeyPatch) -> None:
    # The caching allocator's counters around one call: it allocated 8 bytes of output and 32 of
    # workspace, and freed the workspace before it returned.
    counters = iter([(100, 50), (140, 58)])
    monkeypatch.setattr(
        torch.cuda,
        "memory_stats",
        lambda device: dict(
            zip(("allocated_bytes.all.allocated", "allocated_bytes.all.current"), next(counters), strict=True)
        ),
    )
    out, taken = _step.KernelWorkspaces(torch.device("cuda", 0)).run(torch.ops.aten.mm.default, lambda: "out")
    assert (out, taken) == ("out", 32)


@pytest.mark.release
@pytest.mark.skipif(
    not torch.backends.cuda.is_built() or torch.cuda.is_available(),
    reason="needs a CUDA build of torch on a machine without a GPU (fake CUDA tensors)",
)
def test_fit_offloads_where_copies_cost_less_than_replays_planning_for_cuda_on_meta() -> None:
    # A step a GPU would run, planned on fake CUDA tensors: at one target, offloading lets blocks keep
    # values in host memory whose copies compute hides, and replay less; the device's peak holds.
    class Block(nn.Module):
        def __init__(self, d: int = 2048):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    with torch.device("meta"):
        model = nn.Sequential(*[Block() for _ in range(4)]).to(torch.bfloat16)
    x = torch.zeros(1, 4096, 2048, dtype=torch.bfloat16, device="meta")
    options: dict[str, Any] = {
        "loss": lambda out: out.float().square().mean(),
        "device": "cuda",
        "cost": "roofline:h100",
    }
    unbound = remat.fit(model, Block, x, peak_bytes=2**40, **options)
    remat.uncheckpoint_modules(model)
    low, high = unbound.report.peak_keeping_nothing, unbound.report.peak_keeping_everything
    target = low + (high - low) // 2
    on_device = remat.fit(model, Block, x, peak_bytes=target, **options)
    remat.uncheckpoint_modules(model)
    plan = remat.fit(model, Block, x, peak_bytes=target, offload=True, **options)
    assert plan.predicted_peak <= target
    assert any(block.host_bytes for block in plan.blocks) and not any(b.host_bytes for b in on_device.blocks)
    assert any(remat.OFFLOAD in block.decisions for block in plan.blocks)
    assert plan.replay_cost < on_device.replay_cost
    assert "(host " in str(plan)
