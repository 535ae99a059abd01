"""remat inside PyTorch's own data parallelism: DDP and FSDP2 (`fully_shard`), 2 CPU processes on gloo.

Each case trains a few steps of a small GPT-2-style transformer whose blocks are checkpointed with
`remat.checkpoint_modules`, and compares every rank's losses and gradients with the same model
without checkpointing under the same wrapper. The cases run one after another in one process group
(`CASES`), and each test reads its case's outcome on every rank.
"""

from __future__ import annotations

import copy
import datetime
import os
import random
import socket
import sys
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import remat
from remat import _torch, policies

pytestmark = [
    pytest.mark.slow,  # the cases run in one process group of their own
    pytest.mark.xdist_group("distributed"),  # which one worker starts, once
]


WORLD = 2
STEPS = 3
DTYPE = torch.float64


def _mixed(call: remat.Call) -> bool:
    """Save each block's attention input projection and first MLP matmul, replay the rest."""
    return call.module in ("c_attn", "mlp.0")


POLICIES = {"save_nothing": policies.save_nothing, "mixed": _mixed}


def _worker(rank: int, port: int, results: Any, world: int = WORLD, names: tuple[str, ...] | None = None) -> None:
    """Run every case of `CASES` (or those `names`) in one process group of `world` gloo ranks, reporting
    each to `results`."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # A case that fails on one rank leaves the other in a collective: the timeout ends it instead of a hang.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for name, (case, args) in CASES.items():
            if names is not None and name not in names:
                continue
            try:
                case(rank, *args)
                outcome = "ok"
            except BaseException as error:  # reported by the test of the case
                outcome = repr(error)
            results[(rank, name)] = outcome
            dist.barrier()  # no rank goes on to the next case, or tears down, while another still runs one
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's shutdown, where a gloo thread still being torn down now
    # and then aborts the process after its result is in (see examples/fsdp_train.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def outcomes() -> dict[Any, str]:
    """Every case's outcome on every rank, from one process group (starting one per case took a process
    start, torch's and remat's imports included, per rank and case)."""
    if not dist.is_available():
        pytest.fail("torch.distributed is not available in this build")
    results = mp.Manager().dict()
    try:
        mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD)
    except Exception as error:  # a rank died (a case left the other in a collective): what ran still reports
        results["group"] = repr(error)
    return dict(results)


def _assert_ran_on_every_rank(outcomes: dict[Any, str], name: str) -> None:
    got = {rank: outcomes.get((rank, name)) for rank in range(WORLD)}
    assert got == {rank: "ok" for rank in range(WORLD)}, f"{got}; the process group: {outcomes.get('group', 'ok')}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wrap(model: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model:
        fully_shard(block, reshard_after_forward=True)
    return fully_shard(model)


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _steps(model: nn.Module, rank: int, dtype: torch.dtype) -> tuple[list[float], list[list[torch.Tensor]]]:
    """STEPS steps of SGD on the rank's batches: each step's loss and full gradients. The generator is
    seeded first, so that two runs draw the same dropout masks."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(1 + rank)
    losses, grads = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(torch.randn(2, 8, 32, dtype=dtype, generator=generator)).square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append([_full(p.grad).clone() for p in model.parameters()])
        optimizer.step()
    return losses, grads


def _train(rank: int, wrapper: str, policy_name: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(*[models.GPT2Block(seed=i) for i in range(2)]).to(DTYPE)
    checkpointed = copy.deepcopy(plain)
    remat.checkpoint_modules(checkpointed, models.GPT2Block, policy=POLICIES[policy_name])
    (plain_losses, plain_grads), (losses, grads) = (
        _steps(_wrap(model, wrapper), rank, DTYPE) for model in (plain, checkpointed)
    )
    # remat really ran inside the wrapper: every block was traced, and later steps hit its cache.
    for block in checkpointed:
        info = block.forward.cache_info()
        assert info.traces >= 1 and info.hits >= STEPS - 1, info
    for step in range(STEPS):
        torch.testing.assert_close(losses[step], plain_losses[step], rtol=1e-12, atol=0)
        for actual, expected in zip(grads[step], plain_grads[step], strict=True):
            torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


WRAPPERS = ("ddp", "fsdp2")


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_training_steps_match_the_model_without_checkpoints(
    outcomes: dict[Any, str], wrapper: str, policy_name: str
) -> None:
    _assert_ran_on_every_rank(outcomes, f"{wrapper}-{policy_name}")


def _collective_case(rank: int) -> None:
    import torch.distributed._functional_collectives as collectives

    def fn(x: torch.Tensor) -> torch.Tensor:
        total = collectives.all_reduce(x.sin(), "sum", dist.group.WORLD)
        return total.cos().sum()

    x = torch.randn(4, dtype=DTYPE, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    trace = remat.trace(fn, x)
    collective_calls = [call.index for call in trace if call.op.namespace == "_c10d_functional"]
    assert len(collective_calls) == 2, trace  # the all_reduce and its wait
    for policy in (policies.save_nothing, policies.budget(max_bytes=2 * 32, exact=True)):
        report = remat.report(fn, x, policy=policy)
        assert all(report.rows[i].decision is remat.SAVE for i in collective_calls), report
        assert not set(collective_calls) & set(report.replayed_calls), report
        if _torch.RELEASE == "2.10":  # its functional collectives have no derivative: as eager raises, so does remat
            for f in (fn, remat.checkpoint(fn, policy=policy)):
                with pytest.raises(RuntimeError, match="differentiated Tensors appears to not have been used"):
                    torch.autograd.grad(f(x), x)
            continue
        (grad,) = torch.autograd.grad(remat.checkpoint(fn, policy=policy)(x), x)
        (expected,) = torch.autograd.grad(fn(x), x)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_collectives_are_saved_whatever_the_policy_and_never_replayed(outcomes: dict[Any, str]) -> None:
    _assert_ran_on_every_rank(outcomes, "collectives")


def _in_place_collective_case(rank: int) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        dist.all_reduce(y)
        return y.sum()

    with pytest.raises(remat.TraceError, match=r"in-place collective .* Use the functional collectives"):
        remat.checkpoint(fn)(torch.randn(4, dtype=DTYPE, requires_grad=True))


def test_an_in_place_collective_is_a_trace_error_that_names_the_functional_one(
    outcomes: dict[Any, str],
) -> None:
    _assert_ran_on_every_rank(outcomes, "in-place collective")


class _DropoutBlock(nn.Module):
    """A ReLU MLP with dropout after the ReLU: the ReLU's output and the dropout's mask are packable."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.dropout(torch.relu(self.up(x)), 0.2, self.training))


# Kept values in another storage than the device as they are: (policy, dtype, the storage a block keeps in).
STORED = {
    "pack": (policies.pack_everything, torch.float64, "bits"),
    "fp8": (policies.compress(policies.save_everything, "fp8"), torch.float32, "fp8"),
}


def _train_stored(rank: int, wrapper: str, storage: str) -> None:
    """Packed values give the wrapped model's losses and gradients exactly; FP8 ones its first loss exactly
    (forward reads the values themselves) and gradients within FP8's rounding."""
    policy, dtype, kind = STORED[storage]
    torch.manual_seed(0)
    plain = nn.Sequential(*[_DropoutBlock() for _ in range(2)]).to(dtype)
    checkpointed = copy.deepcopy(plain)
    remat.checkpoint_modules(checkpointed, _DropoutBlock, policy=policy)
    example = torch.randn(2, 8, 32, dtype=dtype, requires_grad=True)
    assert any(row.storage == kind for row in remat.report(checkpointed[0], example).rows)
    (plain_losses, plain_grads), (losses, grads) = (
        _steps(_wrap(model, wrapper), rank, dtype) for model in (plain, checkpointed)
    )
    assert losses[0] == plain_losses[0]
    for step in range(STEPS):
        for actual, expected in zip(grads[step], plain_grads[step], strict=True):
            if kind == "bits":
                assert torch.equal(actual, expected)
            else:
                torch.testing.assert_close(actual, expected, rtol=0.1, atol=0.02 * expected.abs().max().item())
    if kind == "bits":
        assert losses == plain_losses
    else:
        torch.testing.assert_close(losses, plain_losses, rtol=1e-2, atol=0)


@pytest.mark.parametrize("storage", list(STORED))
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_packed_and_compressed_values_under_the_wrapper(outcomes: dict[Any, str], wrapper: str, storage: str) -> None:
    _assert_ran_on_every_rank(outcomes, f"{wrapper}-{storage}")


class _TanhBlock(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 128):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _measured_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The step's peak above what was live before it, by MemTracker, after an untracked step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model(x).square().mean().backward()
    for p in model.parameters():
        p.grad = None
    tracker = MemTracker()
    tracker.track_external(model, x)
    cpu = torch.device("cpu")
    with tracker:
        before = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        _square_mean(model(x)).backward()
    for p in model.parameters():
        p.grad = None
    return int(tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before)


def _fit_case(rank: int) -> None:
    """`remat.fit` of a stack of FSDP2 blocks, called on every rank: each rank's measured peak within the
    target and predicted, one plan on every rank, and training steps equal to the uncheckpointed model's."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[_TanhBlock() for _ in range(4)]).to(DTYPE)
    fitted = _wrap(copy.deepcopy(plain), "fsdp2")
    x = torch.randn(128, 32, dtype=DTYPE, generator=torch.Generator().manual_seed(rank))
    eager = _measured_peak(fitted, x)
    remat.checkpoint_modules(fitted, _TanhBlock, policy=policies.save_nothing)
    lowest = _measured_peak(fitted, x)
    remat.uncheckpoint_modules(fitted)
    assert eager > 1.3 * lowest, (eager, lowest)
    # The prediction holds each all-gather's buffer as long as the backend's thread may (NOTE [what FSDP2
    # adds]): never below the measurement, above it by at most the one block's gathered parameters that the
    # measured step freed early.
    one_block = sum(p.numel() * p.element_size() for p in _TanhBlock().to(DTYPE).parameters())
    unbound = remat.fit(fitted, _TanhBlock, x, peak_bytes=10 * eager, loss=_square_mean)
    assert _measured_peak(fitted, x) == eager <= unbound.predicted_peak <= eager + one_block, (eager, unbound)
    remat.uncheckpoint_modules(fitted)
    target = int(lowest + 0.4 * (eager - lowest))
    plan = remat.fit(fitted, _TanhBlock, x, peak_bytes=target, loss=_square_mean)
    measured = _measured_peak(fitted, x)
    assert any(remat.RECOMPUTE in block.decisions for block in plan.blocks)  # the target binds
    assert measured <= plan.predicted_peak <= target and plan.predicted_peak - measured <= one_block, (measured, plan)
    # At the peak (a block's backward), FSDP2 holds that block's parameters gathered (and the next one's where
    # it prefetched them by then), and full-size gradients of some of them, before their reduce-scatter.
    report = plan.report
    assert one_block <= report.unsharded - report.prefetched <= 2 * one_block  # its buffer, until it is freed
    assert report.prefetched in (0, one_block)
    assert 0 < report.unreduced_gradients <= one_block
    assert "unsharded" in str(report) and "unreduced" in str(report)
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, [block.decisions for block in plan.blocks])
    assert all(theirs == plans[0] for theirs in plans)
    runs = []
    for model in (_wrap(plain, "fsdp2"), fitted):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, grads = [], []
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = _square_mean(model(x + step))
            loss.backward()
            losses.append(loss.item())
            grads.append([_full(p.grad).clone() for p in model.parameters()])
            optimizer.step()
        runs.append((losses, grads))
    (plain_losses, plain_grads), (losses, grads) = runs
    assert losses == plain_losses
    for step in range(STEPS):
        assert all(torch.equal(a, e) for a, e in zip(grads[step], plain_grads[step], strict=True))


def test_fit_under_fsdp2_holds_each_ranks_target_with_one_plan(outcomes: dict[Any, str]) -> None:
    _assert_ran_on_every_rank(outcomes, "fsdp2-fit")


def _fit_random_stacks_case(rank: int) -> None:
    """Stacks drawn alike on every rank (a seeded generator), as `test_fit.py` draws them for one device: each
    rank's measured peak within the target, one plan on every rank, the prediction never below the
    measurement nor above it by more than one block's unsharded parameters (docs/distributed.md)."""
    draw = random.Random(0)
    for _ in range(4):
        n, d, hidden = draw.randint(1, 5), draw.choice([16, 32]), draw.choice([16, 64, 128])
        rows, share = draw.choice([32, 96, 160]), draw.random()
        torch.manual_seed(0)
        model = _wrap(nn.Sequential(*[_TanhBlock(d, hidden) for _ in range(n)]).to(DTYPE), "fsdp2")
        x = torch.randn(rows, d, dtype=DTYPE, generator=torch.Generator().manual_seed(rank))
        eager = _measured_peak(model, x)
        remat.checkpoint_modules(model, _TanhBlock, policy=policies.save_nothing)
        lowest = _measured_peak(model, x)
        remat.uncheckpoint_modules(model)
        bounds = torch.tensor([eager, lowest])
        dist.all_reduce(bounds, dist.ReduceOp.MAX)  # one target for every rank
        eager, lowest = (int(b) for b in bounds)
        # The lowest prediction, of a step saving nothing, is at most one block's gathered parameters above
        # its measurement (a step may hold a buffer longer: NOTE [what FSDP2 adds]).
        one_block = sum(p.numel() * p.element_size() for p in _TanhBlock(d, hidden).to(DTYPE).parameters())
        target = int(lowest + one_block + share * max(0, eager - lowest)) + 1
        plan = remat.fit(model, _TanhBlock, x, peak_bytes=target, loss=_square_mean)
        measured = _measured_peak(model, x)
        context = (n, d, hidden, rows, share, measured, plan.predicted_peak, target)
        assert measured <= target and measured <= plan.predicted_peak <= measured + one_block, context
        plans: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(plans, [block.decisions for block in plan.blocks])
        assert all(theirs == plans[0] for theirs in plans), context


def test_fit_under_fsdp2_on_random_stacks(outcomes: dict[Any, str]) -> None:
    _assert_ran_on_every_rank(outcomes, "fsdp2-fit-random")


def test_fit_under_fsdp2_on_four_ranks() -> None:
    # Its own process group of four ranks (the other cases run on two).
    results = mp.Manager().dict()
    names = ("fsdp2-fit", "fsdp2-fit-optimizer")
    mp.spawn(_worker, args=(_free_port(), results, 4, names), nprocs=4)
    for name in names:
        assert {rank: results.get((rank, name)) for rank in range(4)} == dict.fromkeys(range(4), "ok"), name


def _stack_with_a_root() -> nn.Sequential:
    """Blocks between an input and an output layer that the root holds (as a language model's embedding
    and head): FSDP2 gathers them in the root's forward pre-hook."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), *[_TanhBlock() for _ in range(4)], nn.Linear(32, 32)).to(DTYPE)


def _shard_blocks(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model:
        if isinstance(block, _TanhBlock):
            fully_shard(block)
    return fully_shard(model)


def _fit_new_signatures_case(rank: int) -> None:
    """A fitted FSDP2 model whose root holds parameters plans each new batch shape before FSDP2's hooks run
    (NOTE [planning before the model's hooks]), planned after sharding (`fit`) or before it, at its first
    step (`fit_when_called`: torchtitan's order): losses and gradients equal the plain FSDP2 model's over
    batches of three shapes, and every rank's measured peak stays within the target."""
    x = torch.randn(128, 32, dtype=DTYPE, generator=torch.Generator().manual_seed(rank))
    probe = _shard_blocks(_stack_with_a_root())
    eager = _measured_peak(probe, x)
    remat.checkpoint_modules(probe, _TanhBlock, policy=policies.save_nothing)
    bounds = torch.tensor([eager, _measured_peak(probe, x)])
    dist.all_reduce(bounds, dist.ReduceOp.MAX)
    eager, lowest = (int(b) for b in bounds)
    target = int(lowest + 0.4 * (eager - lowest))
    after = _shard_blocks(_stack_with_a_root())
    remat.fit(after, _TanhBlock, x, peak_bytes=target, loss=_square_mean)
    before = _stack_with_a_root()
    remat._planning._fit.fit_when_called(
        before, _TanhBlock, peak_bytes=target, loss_for=lambda args, kwargs: _square_mean
    )
    before = _shard_blocks(before)
    runs = []
    for model in (_shard_blocks(_stack_with_a_root()), after, before):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, grads = [], []
        for step, rows in enumerate((128, 64, 96)):
            optimizer.zero_grad()
            loss = _square_mean(model(x[:rows] + step))
            loss.backward()
            losses.append(loss.item())
            grads.append([_full(p.grad).clone() for p in model.parameters()])
            optimizer.step()
        runs.append((losses, grads))
    (plain_losses, plain_grads), *fitted = runs
    for losses, grads in fitted:
        assert losses == plain_losses
        for step in range(3):
            assert all(torch.equal(a, e) for a, e in zip(grads[step], plain_grads[step], strict=True))
    for model in (after, before):
        plans = [plan for _, plan in model.forward.planner.fits.items()]
        assert len(plans) == 3 and all(plan.report.unsharded > 0 for plan in plans)  # planned sharded
        assert any(remat.RECOMPUTE in block.decisions for block in plans[0].blocks)  # the target binds
        for rows in (128, 64):
            assert _measured_peak(model, x[:rows]) <= target, rows


def test_a_fitted_fsdp2_model_plans_new_batch_shapes_before_fsdp2s_hooks(outcomes: dict[Any, str]) -> None:
    _assert_ran_on_every_rank(outcomes, "fsdp2-fit-new-signatures")


def _prefetch_case(rank: int) -> None:
    """With explicit forward prefetching, the probe step tells the next block's gathered parameters, held
    during a block's forward, from the running block's own (NOTE [what FSDP2 adds])."""
    torch.manual_seed(0)
    model = _wrap(nn.Sequential(*[_TanhBlock() for _ in range(4)]).to(DTYPE), "fsdp2")
    for block, after in zip(model, list(model)[1:], strict=False):
        block.set_modules_to_forward_prefetch([after])
    x = torch.randn(128, 32, dtype=DTYPE, generator=torch.Generator().manual_seed(rank))
    _square_mean(model(x)).backward()  # a first step: FSDP2's first gathers allocate
    remat.fit(model, _TanhBlock, x, peak_bytes=10**9, loss=_square_mean)
    timeline, _ = remat._planning._fit_probe.probe_step(model, _square_mean, None, None, (x,), {})
    one_block = sum(p.numel() * p.element_size() for p in _TanhBlock().to(DTYPE).parameters())
    forwards = [s for s in timeline.segments if s.phase is remat._memory._step.Phase.FORWARD]
    # Each block's own parameters, in their storages and in its all-gather's buffer until it is freed; and,
    # but in the last block's forward, the next block's, prefetched into its buffer.
    assert [s.prefetched for s in forwards] == [one_block] * 3 + [0]
    assert all(one_block <= s.resized - s.prefetched <= 2 * one_block for s in forwards)
    assert all(s.unreduced == 0 for s in forwards)  # no gradient yet


def test_the_probe_step_tells_prefetched_parameters_apart(outcomes: dict[Any, str]) -> None:
    _assert_ran_on_every_rank(outcomes, "fsdp2-prefetch")


def _fit_optimizer_case(rank: int) -> None:
    """Under FSDP2 the step report counts what this rank holds: its shards of the parameters, of their
    gradients (one storage per block) and of Adam's state."""
    torch.manual_seed(0)
    model = _wrap(nn.Sequential(*[_TanhBlock() for _ in range(4)]).to(DTYPE), "fsdp2")
    x = torch.randn(128, 32, dtype=DTYPE, generator=torch.Generator().manual_seed(rank))
    optimizer = torch.optim.Adam(model.parameters())
    plan = remat.fit(model, _TanhBlock, x, peak_bytes=10**8, loss=_square_mean, optimizer=optimizer)
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    assert shard * dist.get_world_size() == sum(p.numel() * p.element_size() for p in model.parameters())
    report = plan.report
    assert report.parameters == report.gradients == shard
    assert shard * 2 <= report.optimizer_state <= shard * 2 + 8 * len(list(model.parameters()))


def test_fit_under_fsdp2_counts_this_ranks_shards(outcomes: dict[Any, str]) -> None:
    _assert_ran_on_every_rank(outcomes, "fsdp2-fit-optimizer")


CASES: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {
    **{f"{w}-{p}": (_train, (w, p)) for w in WRAPPERS for p in POLICIES},
    **{f"{w}-{s}": (_train_stored, (w, s)) for w in WRAPPERS for s in STORED},
    "fsdp2-fit": (_fit_case, ()),
    "fsdp2-fit-optimizer": (_fit_optimizer_case, ()),
    "fsdp2-fit-random": (_fit_random_stacks_case, ()),
    "fsdp2-fit-new-signatures": (_fit_new_signatures_case, ()),
    "fsdp2-prefetch": (_prefetch_case, ()),
    "collectives": (_collective_case, ()),
    "in-place collective": (_in_place_collective_case, ()),
}
