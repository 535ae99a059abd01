"""`checkpoint_modules` / `uncheckpoint_modules`: checkpointing chosen submodules of a model in place.

Every gradient check compares the model after `checkpoint_modules` with an
unwrapped deep copy of it, in float64, parameter gradients included.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
from torch import nn

import remat
from remat import checkpoint_modules, uncheckpoint_modules
from remat.testing import assert_checkpoint_equivalent

DTYPE = torch.float64


class Stack(nn.Module):
    """A small GPT-2-style model: a `ModuleList` of blocks and a linear head."""

    def __init__(self, depth: int = 2, d: int = 32, attention: str = "sdpa"):
        super().__init__()
        self.blocks = nn.ModuleList([models.GPT2Block(d, attention=attention, seed=i) for i in range(depth)])
        self.ln_f = nn.LayerNorm(d, dtype=models.DTYPE)
        self.head = nn.Linear(d, 3, dtype=models.DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class DropoutBlock(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=models.DTYPE)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x)).tanh()


def wrapped_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


# --- wrapping in place ---------------------------------------------------------------------------


def test_wraps_matching_modules_in_place_and_grads_match(mlp_model: nn.Sequential) -> None:
    reference = copy.deepcopy(mlp_model)
    returned = checkpoint_modules(mlp_model, nn.Linear, policy=remat.policies.save_nothing)
    assert returned is mlp_model
    assert wrapped_names(mlp_model) == ["0", "2", "4", "6"]
    assert all(type(module) is type(ref) for module, ref in zip(mlp_model.modules(), reference.modules(), strict=True))
    models.compare(reference, mlp_model, models.mlp_input())


def test_names_parameters_buffers_and_modules_are_unchanged() -> None:
    model = Stack()
    before_state = list(model.state_dict().keys())
    before_params = [(name, id(p)) for name, p in model.named_parameters()]
    before_buffers = [name for name, _ in model.named_buffers()]
    before_modules = [(name, id(m)) for name, m in model.named_modules()]
    before_attributes = [sorted(vars(m)) for m in model.modules()]

    checkpoint_modules(model, models.GPT2Block)
    model(models.gpt2_input()).sum().backward()  # traced at least once
    assert list(model.state_dict().keys()) == before_state
    assert [(name, id(p)) for name, p in model.named_parameters()] == before_params
    assert [name for name, _ in model.named_buffers()] == before_buffers
    assert [(name, id(m)) for name, m in model.named_modules()] == before_modules

    uncheckpoint_modules(model)
    assert [sorted(vars(m)) for m in model.modules()] == before_attributes, "something was left behind"
    assert all(m.forward.__func__ is type(m).forward for m in model.modules())  # type: ignore[attr-defined]


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_load_state_dict_into_wrapped_model_changes_its_outputs(assign: bool) -> None:
    model = Stack()
    checkpoint_modules(model, models.GPT2Block, policy=remat.policies.dots_saveable)
    x = models.gpt2_input()
    before = model(x).detach()  # traced here, for the signature compared below
    other = Stack()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1)
    model.load_state_dict(other.state_dict(), assign=assign)
    reference = copy.deepcopy(other)
    after = models.compare(reference, model, models.gpt2_input()).outputs.detach()
    assert not torch.allclose(after, before)
    if assign:  # new Parameter objects, and they are the ones that get .grad
        assert model.blocks[0].c_attn.weight.grad is not None
    # Not asserted: a *retrace* after `assign=True` (a new input signature) can pick the wrong
    # parameters, because the checkpointed forward's module roots map tensors to their slots by
    # `id()` and are cached across the swap. A bug in remat itself (`Checkpointed.roots`), reported.


# --- selection -----------------------------------------------------------------------------------


def test_gpt2_stack_class_and_predicate_select_the_same_blocks_and_a_training_step_matches() -> None:
    by_class = checkpoint_modules(Stack(), models.GPT2Block, policy=remat.policies.dots_saveable)
    by_name = checkpoint_modules(
        Stack(),
        lambda name, m: name.startswith("blocks.") and name.count(".") == 1,
        policy=remat.policies.dots_saveable,
    )
    assert wrapped_names(by_class) == wrapped_names(by_name) == ["blocks.0", "blocks.1"]

    reference = Stack()
    models.compare(reference, by_class, models.gpt2_input())
    torch.optim.SGD(by_class.parameters(), lr=0.1).step()  # from the grads just compared
    models.compare(reference, by_class, models.gpt2_input(seed=2))  # the next step sees the updated parameters


def test_predicate_is_given_qualified_names_and_modules() -> None:
    model = Stack(depth=1)
    seen: list[tuple[str, type[nn.Module]]] = []

    def which(name: str, module: nn.Module) -> bool:
        seen.append((name, type(module)))
        return name == "head"

    checkpoint_modules(model, which)
    assert seen[:3] == [("", Stack), ("blocks", nn.ModuleList), ("blocks.0", models.GPT2Block)]
    assert ("head", nn.Linear) in seen
    assert wrapped_names(model) == ["head"]


def test_outermost_match_wins() -> None:
    model = Stack()
    checkpoint_modules(model, (models.GPT2Block, nn.Linear))
    # The Linears inside the blocks are not wrapped again; the head, outside any block, is.
    assert wrapped_names(model) == ["blocks.0", "blocks.1", "head"]
    models.compare(Stack(), model, models.gpt2_input())


def test_the_model_itself_can_be_selected(mlp_model: nn.Sequential) -> None:
    reference = copy.deepcopy(mlp_model)
    checkpoint_modules(mlp_model, nn.Sequential)
    assert wrapped_names(mlp_model) == [""]
    models.compare(reference, mlp_model, models.mlp_input())


def test_second_call_raises_until_uncheckpointed(mlp_model: nn.Sequential) -> None:
    checkpoint_modules(mlp_model, nn.Linear)
    with pytest.raises(ValueError, match=r"already has checkpointed modules \(0, 2, 4, 6\).*uncheckpoint_modules"):
        checkpoint_modules(mlp_model, nn.Linear, policy=remat.policies.save_everything)
    uncheckpoint_modules(mlp_model)
    checkpoint_modules(mlp_model, nn.Linear, policy=remat.policies.save_everything)
    assert mlp_model[0].forward.policy is remat.policies.save_everything


def test_cache_size_and_cache_info_reach_each_module() -> None:
    model = checkpoint_modules(Stack(), models.GPT2Block, cache_size=3)
    model(models.gpt2_input()).sum().backward()
    model(models.gpt2_input(seed=2)).sum().backward()
    info = model.blocks[0].forward.cache_info()
    assert (info.maxsize, info.traces, info.hits) == (3, 1, 1)


def test_wrapped_blocks_keep_less_for_backward() -> None:
    def saved_bytes(model: nn.Module) -> int:
        storages: dict[Any, int] = {}

        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in parameters:  # activations only
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = models.gpt2_input()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        out.sum().backward()
        return sum(storages.values())

    eager = saved_bytes(Stack())
    checkpointed = saved_bytes(checkpoint_modules(Stack(), models.GPT2Block, policy=remat.policies.save_nothing))
    assert checkpointed < eager / 3


# --- undoing -------------------------------------------------------------------------------------


def test_uncheckpoint_restores_an_instance_forward_set_before() -> None:
    model = Stack(depth=1)
    head = model.head
    original_forward = head.forward

    def patched(x: torch.Tensor) -> torch.Tensor:
        return original_forward(x) * 2

    head.forward = patched  # type: ignore[method-assign, assignment]
    reference = copy.deepcopy(model)
    checkpoint_modules(model, nn.Linear)
    models.compare(reference, model, models.gpt2_input())  # the patched forward is what is checkpointed
    uncheckpoint_modules(model)
    assert vars(head)["forward"] is patched


def test_uncheckpoint_of_a_plain_model_changes_nothing(mlp_model: nn.Sequential) -> None:
    before = [dict(vars(m)) for m in mlp_model.modules()]
    assert uncheckpoint_modules(mlp_model) is mlp_model
    assert [dict(vars(m)) for m in mlp_model.modules()] == before


def test_deep_copy_of_a_wrapped_model_is_wrapped_and_independent() -> None:
    model = checkpoint_modules(Stack(), models.GPT2Block, policy=remat.policies.dots_saveable)
    model(models.gpt2_input()).sum().backward()
    clone = copy.deepcopy(model)
    assert wrapped_names(clone) == ["blocks.0", "blocks.1"]
    assert clone.blocks[0].forward.policy is remat.policies.dots_saveable
    assert clone.blocks[0].forward.cache_info().size == 0
    for p in clone.parameters():
        p.grad = None
    models.compare(Stack(), clone, models.gpt2_input())
    assert all(p.grad is not None for p in clone.parameters())
    uncheckpoint_modules(clone)
    assert wrapped_names(model) == ["blocks.0", "blocks.1"]


# --- hooks ---------------------------------------------------------------------------------------


def _hooked(model: Stack, log: list[Any]) -> None:
    block = model.blocks[0]

    def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        log.append(("pre", module, args[0].detach().clone()))
        return (args[0] * 1.5,)  # changes the input

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        log.append(("post", module, args[0].detach().clone(), output.detach().clone()))
        return output.tanh()  # changes the output

    block.register_forward_pre_hook(pre_hook)
    block.register_forward_hook(hook)


@pytest.mark.parametrize("when", ["before", "after"])
def test_forward_hooks_run_once_per_call_with_eager_values(when: str) -> None:
    reference, model = Stack(), Stack()
    reference_log: list[Any] = []
    log: list[Any] = []
    _hooked(reference, reference_log)
    if when == "before":
        _hooked(model, log)
        checkpoint_modules(model, models.GPT2Block)
    else:
        checkpoint_modules(model, models.GPT2Block)
        _hooked(model, log)
    models.compare(reference, model, models.gpt2_input())
    assert len(log) == len(reference_log) == 2  # one call of each model: its pre-hook and its hook
    for entry, expected in zip(log, reference_log, strict=True):
        assert entry[0] == expected[0] and entry[1] is model.blocks[0]
        for a, e in zip(entry[2:], expected[2:], strict=True):
            assert not isinstance(a, torch._subclasses.FakeTensor)
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_full_backward_hooks_see_eager_gradients_once_per_backward() -> None:
    def install(model: Stack, log: list[Any]) -> None:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            log.append(("full", [g.clone() for g in grad_input], [g.clone() for g in grad_output]))

        def pre_hook(module: nn.Module, grad_output: Any) -> tuple[torch.Tensor]:
            log.append(("pre", [], [g.clone() for g in grad_output]))
            return (grad_output[0] * 2,)  # changes the gradient flowing into the block

        model.blocks[1].register_full_backward_pre_hook(pre_hook)
        model.blocks[1].register_full_backward_hook(hook)

    reference, model = Stack(), Stack()
    reference_log: list[Any] = []
    log: list[Any] = []
    install(reference, reference_log)
    checkpoint_modules(model, models.GPT2Block)
    install(model, log)
    models.compare(reference, model, models.gpt2_input())
    assert [kind for kind, _, _ in log] == [kind for kind, _, _ in reference_log] == ["pre", "full"]
    for (_, grads_in, grads_out), (_, expected_in, expected_out) in zip(log, reference_log, strict=True):
        for a, e in zip([*grads_in, *grads_out], [*expected_in, *expected_out], strict=True):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_per_sample_gradients_through_functional_call() -> None:
    # `softmax` attention: vmap has no batching rule for CPU flash attention (a performance warning).
    model = checkpoint_modules(Stack(attention="softmax"), models.GPT2Block, policy=remat.policies.dots_saveable)
    reference = Stack(attention="softmax")
    parameters = {name: p.detach() for name, p in model.named_parameters()}

    def loss(params: dict[str, torch.Tensor], module: nn.Module, example: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(module, params, (example[None],)).sum()

    x = models.gpt2_input(requires_grad=False)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, None, 0))
    actual, expected = per_sample(parameters, model, x), per_sample(parameters, reference, x)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-10, atol=1e-12)


# --- train and eval ------------------------------------------------------------------------------


def test_dropout_train_matches_eager_with_the_same_seed_and_eval_is_deterministic() -> None:
    model = nn.Sequential(DropoutBlock(), DropoutBlock())
    reference = copy.deepcopy(model)
    checkpoint_modules(model, DropoutBlock)
    x = models.randn(4, 8, seed=3)

    train_out = models.compare(reference, model, x, seed=7).outputs

    model.eval()
    reference.eval()
    eval_out = model(x)
    assert torch.equal(eval_out, model(x))
    torch.testing.assert_close(eval_out, reference(x), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(train_out, eval_out), "dropout did not drop anything in train mode"
    models.compare(reference, model, x)

    model.train()
    reference.train()
    models.compare(reference, model, x, seed=8)


# --- trace and report ----------------------------------------------------------------------------


def test_trace_and_report_of_a_wrapped_block() -> None:
    model = checkpoint_modules(Stack(), models.GPT2Block, policy=remat.policies.dots_saveable)
    reference = Stack()
    x = models.gpt2_input()
    trace = remat.trace(model.blocks[0], x)
    expected = remat.trace(reference.blocks[0], x)
    assert [(c.name, c.module) for c in trace] == [(c.name, c.module) for c in expected]
    assert len(trace) > 5
    # The block's own policy decides its calls, as it does when the block is called.
    report = remat.report(model.blocks[0], x)
    assert report.saved_bytes == remat.report(reference.blocks[0], x, policy=remat.policies.dots_saveable).saved_bytes
    assert report.saved_bytes > 0


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which",
    [3, "blocks.0", (), (nn.Linear, int), int, [nn.Linear]],
    ids=["int", "str", "empty-tuple", "tuple-with-non-module", "non-module-class", "list"],
)
def test_which_of_the_wrong_type_raises(which: Any) -> None:
    with pytest.raises(TypeError, match=r"checkpoint_modules: `which` must be a subclass of nn.Module.*predicate"):
        checkpoint_modules(Stack(depth=1), which)


def test_which_as_a_module_instance_raises_with_a_hint() -> None:
    model = Stack(depth=1)
    with pytest.raises(TypeError, match=r"module instance GPT2Block.*lambda name, m: m is module"):
        checkpoint_modules(model, model.blocks[0])  # type: ignore[arg-type]


@pytest.mark.parametrize("which", [nn.Conv2d, lambda name, m: name == "block.0"], ids=["class", "predicate"])
def test_nothing_matched_raises(which: Any) -> None:
    model = Stack(depth=1)
    with pytest.raises(ValueError, match=r"no module of Stack matches `which`.*Check the class.*'blocks.0'"):
        checkpoint_modules(model, which)
    assert wrapped_names(model) == []


@pytest.mark.parametrize("function", [checkpoint_modules, uncheckpoint_modules])
def test_model_that_is_not_a_module_raises(function: Callable[..., Any]) -> None:
    args = (nn.Linear,) if function is checkpoint_modules else ()
    with pytest.raises(TypeError, match=r"expected an nn.Module as `model`, but got .* of type function"):
        function(lambda x: x, *args)


def test_regression_a_retrace_after_load_state_dict_with_assign_uses_the_new_parameters() -> None:
    # The table of where each parameter lives was keyed by id and never refreshed: after
    # `assign=True` the new parameters could reuse freed ids, and a retrace mixed them up.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 12), nn.Linear(12, 4)).to(DTYPE)
    checkpointed = remat.checkpoint(model)
    checkpointed(torch.randn(2, 4, dtype=DTYPE))
    other = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 12), nn.Linear(12, 4)).to(DTYPE)
    model.load_state_dict(other.state_dict(), assign=True)
    del other
    x = torch.randn(2, 4, dtype=DTYPE, requires_grad=True)  # a new signature: a retrace
    assert_checkpoint_equivalent(model, x, checkpointed=checkpointed)


def test_hooks_on_modules_inside_a_checkpoint_are_warned_about() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU()).to(DTYPE)
    model[0].register_forward_hook(lambda module, args, output: None)
    with pytest.warns(UserWarning, match=r"`0` has forward or backward hooks, but runs inside the checkpointed"):
        remat.checkpoint(model)(torch.randn(2, 3, dtype=DTYPE, requires_grad=True))
    # checkpoint_modules checkpoints the forward, so the module's own hooks stay outside: no warning.
    checkpoint_modules(model, nn.Linear)
    model(torch.randn(2, 3, dtype=DTYPE, requires_grad=True))


def test_report_of_a_model_with_checkpointed_modules_names_their_policies() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(DTYPE)
    checkpoint_modules(model, nn.Linear, policy=remat.policies.save_everything)
    report = remat.report(model, torch.randn(2, 4, dtype=DTYPE, requires_grad=True))
    assert report.nested_policies == (remat.policies.save_everything,)
    assert "nested checkpoints decide their own calls with save_everything" in str(report)
    assert report.to_dict()["nested_policies"] == ["save_everything"]
