"""Values that depend on data: sizes (`nonzero`, boolean masks) and values Python reads (`if t > 0:`).

See NOTE [values Python reads] and NOTE [data-dependent sizes count at their bound].
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import pytest
import torch

import remat
import remat.testing
from remat import policies

POLICIES = [policies.save_nothing, policies.save_everything, policies.dots_saveable, policies.budget(fraction=0.5)]


def randn(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()


# --- sizes that depend on data ---------------------------------------------------------------------


def masked(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = (x @ w).tanh()
    positive = y[y > 0]  # boolean-mask indexing
    rows = torch.nonzero(y.sum(dim=1) > 0)[:, 0]
    return positive.exp().sum() + y[rows].cos().sum(), torch.masked_select(y, y < 0).square()


def split_by_counts(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    pieces = torch.split(x, counts.tolist())  # split sizes from tensor values
    return torch.cat([piece.sin() * (i + 1) for i, piece in enumerate(pieces)])


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_sizes_that_depend_on_data_trace_once_and_give_eager_gradients(policy: remat.Policy) -> None:
    checkpointed = remat.checkpoint(masked, policy=policy)
    w = randn(3, 5, seed=0)
    for seed in range(3):  # other masks, other sizes: one trace
        x = randn(4, 3, seed=seed + 1)
        remat.testing.assert_checkpoint_equivalent(masked, x, w, policy=policy, transforms=("grad", "vjp"))
        checkpointed(x, w)
    assert checkpointed.cache_info().traces == 1


def test_a_data_dependent_size_is_accounted_at_its_bound() -> None:
    trace = remat.trace(masked, randn(4, 3, seed=1), randn(3, 5, seed=0))
    index = next(
        call for call in trace if call.op is torch.ops.aten.index.Tensor and call.inputs[1][0].dtype == torch.bool
    )
    (output,) = index.outputs
    assert output.shape == (20,) and output.data_dependent == (0,)  # at most 4 * 5 elements
    assert output.nbytes == 20 * 8 == index.nbytes
    assert str(output) == "float64[<=20]"
    assert not any(call.op is torch.ops.aten.sym_size.int for call in trace)  # sizes are not calls


def test_split_sizes_from_tensor_values() -> None:
    x = randn(6, 2, seed=3)
    checkpointed = remat.checkpoint(split_by_counts)
    for counts in ([1, 5], [4, 2], [3, 3]):
        remat.testing.assert_checkpoint_equivalent(split_by_counts, x, torch.tensor(counts))
        checkpointed(x, torch.tensor(counts))
    assert checkpointed.cache_info().traces == 1


def narrowed(x: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.narrow(x, 0, start, 2), x[start.item() :].T  # `narrow` reads a tensor start's value


def narrowed_and_computed(x: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, ...]:
    counts = start + 1
    y = (x[start.item() :] @ x.T).sin()
    return x.select(0, counts.item()), y, counts  # a row at an index read from a value it returns


@pytest.mark.parametrize("fn", [narrowed, narrowed_and_computed])
@pytest.mark.parametrize("policy", POLICIES[:2], ids=repr)
def test_returned_views_of_inputs_at_offsets_read_from_values(
    fn: Callable[..., torch.Tensor], policy: remat.Policy
) -> None:
    # It was `KeyError: _local_scalar_dense`: the views of inputs rebuilt after the Function took
    # offsets the graph computed from a value, which they did not compute (OpInfo's `narrow` samples).
    checkpointed = remat.checkpoint(fn, policy=policy)
    x = randn(5, 5, seed=4)
    for start in (1, 2):  # the offset stays symbolic: one trace
        remat.testing.assert_checkpoint_equivalent(fn, x, torch.tensor(start), policy=policy, transforms=("vjp",))
        checkpointed(x, torch.tensor(start))
    assert checkpointed.cache_info().traces == 1


def view_at_a_computed_offset(x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    return x[: (start * 2).item()]


def view_at_a_computed_offset_then_read(x: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, ...]:
    counts = (start * 2).sum()
    return x[: counts.item()], x.sin(), counts  # rebuilt before the Function (x is read after the view)


def view_at_an_offset_then_updated(x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    view = x[start.item() :]
    start.add_(1)
    return view


def view_sized_by_a_value_beside_a_computed_output(x: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x[start.item() :], x.sin()  # rebuilt after the Function, whose backward reads its (zero) gradient


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (view_at_a_computed_offset, "a tensor it computed and does not return.*or return that tensor too"),
        (view_at_a_computed_offset_then_read, "a tensor it computed, and it uses that input again.*after its last use"),
        (view_at_an_offset_then_updated, "an input it then updates in place"),
        (view_sized_by_a_value_beside_a_computed_output, "size depends on values.*could not tell the view's size"),
    ],
)
def test_a_returned_view_at_an_offset_that_cannot_be_read_again_is_refused(
    fn: Callable[..., torch.Tensor], why: str
) -> None:
    with pytest.raises(remat.TraceError, match=f"(returns a view of an input whose size or offset|is a view).*{why}"):
        remat.checkpoint(fn)(randn(5, 5, seed=4), torch.tensor(1))


def masked_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x[x > 0].sin(), x.cos()


def first_rows(x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x[: (n * 2).item()].sin(), x.cos()


@pytest.mark.parametrize(("fn", "args"), [(masked_rows, ()), (first_rows, (torch.tensor(2),))], ids=["mask", "item"])
def test_an_output_sized_by_values_that_gets_no_gradient(fn: Callable[..., torch.Tensor], args: tuple) -> None:
    # It was `RuntimeError: The size of tensor a (6) must match the size of tensor b (3)`: backward handed
    # the output's gradient formula zeros at the size's bound, not at this call's size.
    x = randn(6, seed=5)
    (grad,) = torch.autograd.grad(remat.checkpoint(fn)(x, *args)[1].sum(), x)
    (expected,) = torch.autograd.grad(fn(x, *args)[1].sum(), x)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_a_value_read_for_arithmetic_stays_symbolic() -> None:
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * x.detach().sum().item()

    checkpointed = remat.checkpoint(scaled)
    for seed in range(3):
        remat.testing.assert_checkpoint_equivalent(scaled, randn(3, seed=seed))
        checkpointed(randn(3, seed=seed))
    assert checkpointed.cache_info().traces == 1


@pytest.mark.parametrize(
    "op",
    [
        lambda n: torch.xlogy(n, n.exp()),
        lambda n: torch.special.xlog1py(n, n),
        lambda n: torch.copysign(n, -n),
        lambda n: torch.xlogy(n.reshape(-1, 1), n.reshape(1, -1).exp()),
    ],
    ids=["xlogy", "xlog1py", "copysign", "xlogy broadcast"],
)
def test_ops_that_choose_their_layout_on_tensors_sized_by_values(op: Callable[..., torch.Tensor]) -> None:
    # The CPU layout these ops choose (TensorIterator's) was computed on meta tensors, which take no
    # symbolic size: "SymIntArrayRef expected to contain only concrete integers".
    def fn(x: torch.Tensor) -> torch.Tensor:
        return op(x[x > 0]).sum() + x.sum()

    for policy in POLICIES[:2]:
        remat.testing.assert_checkpoint_equivalent(fn, randn(5, 3, seed=4), policy=policy)


def test_a_masked_assignment_before_a_batch_norm_with_a_cumulative_average() -> None:
    # The gradient of the mask's elements has a size of its own, made in backward, and torch's checks of
    # it (`u4 == u2`) were taken for checks the forward makes: a bare AssertionError from the trace.
    norm = torch.nn.BatchNorm1d(3, momentum=None).double()  # the average reads `num_batches_tracked`

    def fn(x: torch.Tensor) -> torch.Tensor:
        t = torch.zeros_like(x)
        t[x > 0] = x[x > 0] * 2
        return norm(t)

    for policy in POLICIES[:2]:
        remat.testing.assert_checkpoint_equivalent(fn, randn(5, 3, seed=5), policy=policy, params=norm.parameters())


def test_regression_a_random_fill_of_a_tensor_sized_by_values() -> None:
    # The fill's strides hold the size of the masked elements, a symbol (`Max(1, u1)`), which the program's
    # code printed as it is: `NameError: name 'Max' is not defined` (issue 69). They are the filled tensor's
    # own as it runs.
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.flatten()[x.flatten() > 0]
        return t.unsqueeze(0).expand(2, *t.shape).clone().uniform_() * t.sum()

    for policy in POLICIES[:2]:
        remat.testing.assert_checkpoint_equivalent(fn, randn(3, 4, seed=6), policy=policy, calls=2)


# --- values Python reads --------------------------------------------------------------------------


class _NormThenTwoLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(8, momentum=None)  # the average reads `num_batches_tracked`
        self.up, self.down = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(self.norm(x)).relu())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regression_blocks_with_a_cumulative_batch_norm_average_under_checkpoint_modules(seed: int) -> None:
    # Discovery's run of the block incremented `num_batches_tracked` in the real copy the trace with values
    # then read too, whenever the fake mode's memo of storages handed that copy on (it depended on what
    # memory was reused): the trace read 2 where the call read 1, and was refused (issue 69).
    import copy

    torch.manual_seed(seed)
    eager = torch.nn.Sequential(_NormThenTwoLinear(), _NormThenTwoLinear()).double()
    model = copy.deepcopy(eager)
    remat.checkpoint_modules(model, _NormThenTwoLinear)
    for call in range(3):
        x = randn(16, 8, seed=call)
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        for (name, got), expected in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
            assert torch.equal(got, expected), (call, name)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=f"call {call}: {name}")


def branches(x: torch.Tensor) -> torch.Tensor:
    y = torch.nn.functional.dropout(x, 0.5, training=True)  # draws before the value is read
    if (y > 0).sum() > 2:
        return y.sin()
    return y.cos() * 3


def loops_over_chosen_rows(x: torch.Tensor) -> torch.Tensor:
    """A mixture-of-experts loop in miniature: over the rows some test picks, as eager experts do."""
    chosen = (x > 0).any(dim=1).nonzero()
    out = torch.zeros_like(x)
    for row in chosen:
        row = row[0]
        if row == x.shape[0]:  # never true: a check that must pass on every call
            continue
        out = out.index_add(0, row[None], x[row][None].sin() * (row + 1))
    return out


def experts(x: torch.Tensor, expert_weights: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """The example of docs/debugging.md ("Values that depend on data")."""
    picked = (x @ router).argmax(-1)  # the expert of each token
    out = torch.zeros_like(x)
    for e in torch.nonzero(torch.bincount(picked, minlength=len(expert_weights))):  # the experts picked
        e = e[0]
        tokens = torch.nonzero(picked == e)[:, 0]  # how many: a size that depends on data
        out = out.index_add(0, tokens, x[tokens] @ expert_weights[e])
    return out


@pytest.mark.slow
def test_the_documented_experts_loop_traces_once_for_every_routing() -> None:
    weights, router = randn(4, 8, 8, seed=0), randn(8, 4, seed=1).detach()
    checkpointed = remat.checkpoint(experts)
    for seed in range(4):
        x = randn(32, 8, seed=seed + 2)
        remat.testing.assert_checkpoint_equivalent(experts, x, weights, router)
        checkpointed(x, weights, router)
    assert checkpointed.cache_info().traces == 1


@pytest.mark.slow
@pytest.mark.parametrize("fn", [branches, loops_over_chosen_rows])
@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=repr)
def test_code_reading_values_is_traced_for_them_and_checked(
    fn: Callable[..., torch.Tensor], policy: remat.Policy
) -> None:
    for seed in range(6):
        remat.testing.assert_checkpoint_equivalent(fn, randn(4, 3, seed=seed), policy=policy)


def rows_chosen(rows: list[int], seed: int) -> torch.Tensor:
    """A 4x3 input whose `rows` are all positive and whose other rows are all negative."""
    magnitudes = torch.rand(4, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1
    signs = -torch.ones(4, 1, dtype=torch.float64)
    signs[rows] = 1.0
    return (magnitudes * signs).requires_grad_()


@pytest.mark.parametrize("row", range(4))
def test_a_loop_over_exactly_one_chosen_row_gives_eager_gradients(row: int) -> None:
    # Iterating over `nonzero` squeezes each row: NOTE [squeezing a size that depends on data].
    remat.testing.assert_checkpoint_equivalent(loops_over_chosen_rows, rows_chosen([row], seed=row))


def squeezes_chosen_rows(x: torch.Tensor) -> torch.Tensor:
    chosen = x[(x > 0).all(dim=1)]  # (rows chosen, 3)
    return chosen.squeeze(0).sin()  # (3,) where one row is chosen: eager squeezes a size of 1


def squeezes_chosen_rows_in_place(x: torch.Tensor) -> torch.Tensor:
    chosen = x[(x > 0).all(dim=1)].clone()
    chosen.squeeze_(0)
    return chosen.sin()


def squeezes_every_dimension_of_chosen_rows(x: torch.Tensor) -> torch.Tensor:
    return x[(x > 0).all(dim=1)].squeeze().cos()


@pytest.mark.parametrize(
    "fn", [squeezes_chosen_rows, squeezes_chosen_rows_in_place, squeezes_every_dimension_of_chosen_rows]
)
def test_a_squeeze_of_a_size_that_depends_on_data_squeezes_where_eager_does(fn: Callable[..., torch.Tensor]) -> None:
    checkpointed = remat.checkpoint(fn)
    with logged_by("torch._subclasses.fake_tensor") as records:  # torch logs a fake kernel that raised
        for rows in ([1], [0, 2], [3], [0, 1, 3], [0, 2]):
            x = rows_chosen(rows, seed=len(rows))
            out, expected = checkpointed(x), fn(x)
            assert out.shape == expected.shape
            remat.testing.assert_checkpoint_equivalent(fn, x, checkpointed=checkpointed)
    assert checkpointed.cache_info().traces == 3  # one row, two rows, three rows
    assert not records  # the size was read before torch's kernel could fail on it


class ErrorRecords(logging.Handler):
    """The errors a logger logs (torch's loggers do not propagate to pytest's `caplog`)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def logged_by(name: str) -> Iterator[list[logging.LogRecord]]:
    """The errors logger `name` logs inside."""
    handler = ErrorRecords()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def chosen_rows_by_sign_of_sum(x: torch.Tensor) -> torch.Tensor:
    chosen = x[(x > 0).all(dim=1)]  # a size that depends on data, returned
    return chosen.sin() if x.sum() > 0 else chosen.cos()  # and a value Python reads


def test_a_function_that_reads_values_can_return_a_size_that_depends_on_data() -> None:
    checkpointed = remat.checkpoint(chosen_rows_by_sign_of_sum)
    for rows in ([0, 2], [1], [0, 1, 2, 3], [1, 3]):
        x = rows_chosen(rows, seed=len(rows))
        remat.testing.assert_checkpoint_equivalent(chosen_rows_by_sign_of_sum, x, checkpointed=checkpointed)


@torch.library.custom_op("remat_test_values::row_sums", mutates_args=())
def row_sums(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=1)


@row_sums.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)  # a wrong rule: the real kernel drops a dimension


def test_an_op_whose_fake_and_real_outputs_differ_in_rank_is_named() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return row_sums(x) * 2 if x.sum() > 0 else x  # a value read: traced with real values beside fakes

    with pytest.raises(
        remat.TraceError,
        match=r"`remat_test_values.row_sums.default`.* of 2 dimensions while tracing and of 1 in eager",
    ):
        remat.checkpoint(fn)(torch.ones(4, 3, requires_grad=True))


def test_a_trace_for_values_is_reused_while_they_hold_and_retraced_when_they_change() -> None:
    checkpointed = remat.checkpoint(loops_over_chosen_rows)
    all_rows = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
    two_rows = torch.tensor([[1.0] * 3, [-1.0] * 3, [1.0] * 3, [-1.0] * 3], dtype=torch.float64, requires_grad=True)
    calls = [all_rows, all_rows * 2, two_rows, all_rows, two_rows * 3, all_rows]
    for x in calls:
        out = checkpointed(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        expected = loops_over_chosen_rows(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), x)[0])
    assert checkpointed.cache_info().traces == 2  # one per set of chosen rows


# Each reads a bool in Python; the inputs below flip it from call to call.
BOOL_READS = {
    "if a sum is positive": lambda x: x.sin() if x.sum() > 0 else x.cos(),
    "if any": lambda x: x.sin() if (x > 1).any() else x.cos(),
    "if all": lambda x: x.sin() if (x > -2.5).all() else x.cos(),
    "item of a bool": lambda x: x.sin() if (x[0] > 0).item() else x.cos(),
    "two reads": lambda x: (x.sin() if x[0] > 0 else x.cos()) * (2.0 if x[1] > 0 else 3.0),
}


@pytest.mark.parametrize("fn", BOOL_READS.values(), ids=BOOL_READS.keys())
def test_a_bool_read_is_checked_on_every_call(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    # Torch 2.11 took a true read for statically known and asserted nothing: the trace made for
    # one value ran for the other, silently (a check of remat's own now: `_torch._check_bool_reads`).
    checkpointed = remat.checkpoint(fn)
    for values in ([1.0, 2.0, -3.0], [-1.0, -2.0, 3.0], [1.0, -2.0, 0.5], [-1.0, 2.0, -0.5], [1.0, 2.0, -3.0]):
        x = torch.tensor(values, dtype=torch.float64, requires_grad=True)
        out, expected = checkpointed(x), fn(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(expected.sum(), x)[0])
    assert checkpointed.cache_info().traces >= 2  # one per outcome of the reads


def test_a_failed_check_leaves_the_random_stream_as_eager_does() -> None:
    checkpointed = remat.checkpoint(branches)
    x = randn(4, 3, seed=0)
    for seed in range(8):  # the branch taken changes with the dropout mask: checks fail and retry
        torch.manual_seed(seed)
        out = checkpointed(x)
        after = torch.get_rng_state()
        torch.manual_seed(seed)
        torch.testing.assert_close(out, branches(x))
        assert torch.equal(after, torch.get_rng_state())
    assert checkpointed.cache_info().traces == 2


def test_the_report_of_a_trace_for_values_lists_its_checks() -> None:
    x = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
    joint_checks = remat.report(loops_over_chosen_rows, x).value_checks
    assert joint_checks and all("Runtime assertion failed for expression" in check for check in joint_checks)


def _user_generator_and_batch_norm(
    generator: torch.Generator, norm: torch.nn.Module
) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        noisy = x + 0.1 * torch.rand(x.shape, dtype=x.dtype, generator=generator)
        return norm(noisy).logsumexp(-1)  # momentum=None reads `num_batches_tracked` in Python

    return fn


def _calls(wrap: Callable[[Callable], Callable]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Three calls with fresh inputs, each backpropagated: outputs and gradients per call, then the
    user generator's state, the default one's and the running statistics after the last."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    norm = torch.nn.BatchNorm1d(4, momentum=None).double().train()
    fn = wrap(_user_generator_and_batch_norm(generator, norm))
    outputs, grads = [], []
    for seed in range(3):
        x = randn(3, 4, seed=seed)
        out = fn(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        outputs.append(out.detach())
        grads.append(grad)
    state = [
        generator.get_state(),
        torch.get_rng_state(),
        norm.running_mean,
        norm.running_var,
        norm.num_batches_tracked,
    ]
    return outputs, grads, state


@pytest.mark.parametrize("policy", [policies.save_nothing, policies.save_everything], ids=["nothing", "everything"])
def test_regression_a_failed_check_puts_back_the_users_generator_too(policy: remat.Policy) -> None:
    # The value check fails from the second call on and the call runs again: the default generator
    # was put back, the user's generator drew twice.
    expected = _calls(lambda fn: fn)
    actual = _calls(lambda fn: remat.checkpoint(fn, policy=policy))
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_regression_two_draws_from_one_user_generator_are_traced_as_two_draws() -> None:
    # Traced with values, each draw put the user's generator back: both drew the same numbers, the
    # value Python read was wrong for the call, and the first call raised.
    def run(wrap: Callable[[Callable], Callable]) -> tuple[list[torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(5)

        def fn(x: torch.Tensor) -> torch.Tensor:
            a = torch.rand(x.shape, dtype=x.dtype, generator=generator)
            b = torch.rand(x.shape, dtype=x.dtype, generator=generator)
            return x * (a - b) if (a - b).sum() > 0 else x.sin() * b

        checkpointed = wrap(fn)
        return [checkpointed(randn(3, 4, seed=seed)).detach() for seed in range(6)], generator.get_state()

    (expected, expected_state), (actual, state) = run(lambda fn: fn), run(remat.checkpoint)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert torch.equal(state, expected_state)


def test_tracing_with_values_leaves_a_users_generator_as_it_was() -> None:
    generator = torch.Generator().manual_seed(7)
    before = generator.get_state()
    remat.trace(lambda x: x * 2 if torch.rand(3, generator=generator).sum() > 1.5 else x, randn(3, seed=0))
    assert torch.equal(generator.get_state(), before)


@pytest.mark.parametrize("input_requires_grad", [False, True], ids=["input without grad", "input with grad"])
def test_regression_batch_norm_without_momentum_on_an_input_without_grad(input_requires_grad: bool) -> None:
    # Traced with values (momentum=None reads `num_batches_tracked`), batch norm's backward kernel
    # leaves the input's gradient undefined where its fake kernel gives one; remat blamed the fake
    # kernel. NOTE [backward kernels that skip outputs]
    def run(wrap: Callable[[Callable], Callable]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        norm = torch.nn.BatchNorm1d(4, momentum=None).double().train()
        fn = wrap(lambda x: norm(x).logsumexp(-1))
        results = []
        for seed in range(3):
            x = randn(3, 4, seed=seed).detach().requires_grad_(input_requires_grad)
            out = fn(x)
            out.sum().backward()
            results += [out.detach(), norm.weight.grad.clone(), norm.bias.grad.clone()]
            results += [x.grad if input_requires_grad else torch.zeros(())]
            norm.zero_grad()
        return [*results, norm.running_mean, norm.running_var, norm.num_batches_tracked]

    torch.testing.assert_close(run(remat.checkpoint), run(lambda fn: fn), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "read",
    [
        lambda y, index: torch.nn.functional.embedding(index, y),
        lambda y, index: y.index_select(0, index),
        lambda y, index: y[index],
    ],
    ids=["embedding", "index_select", "advanced_index"],
)
def test_regression_closed_over_indices_keep_their_values_when_traced_with_values(read: Callable) -> None:
    # On torch 2.13 a closed-over tensor detached under discovery's fake mode lost its real data:
    # traced with values, the indices were garbage and the trace failed with a raw IndexError.
    index = torch.tensor([0, 0, 0])

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() if x.sum() > 0 else x.cos()
        return read(y, index)

    for x in (torch.ones(1, 6, dtype=torch.float64), -torch.ones(1, 6, dtype=torch.float64)):
        remat.testing.assert_checkpoint_equivalent(fn, x.requires_grad_())
