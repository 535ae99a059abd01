"""Hugging Face transformers models checkpointed in one line: `checkpoint_modules(model, GradientCheckpointingLayer)`.

Models come from small local configs (no download). Gradient checks compare
the checkpointed model with an unwrapped one in float64: the loss and the
`.grad` of every parameter, after several training steps, with one trace per
layer. See NOTE [key/value caches in checkpointed layers] for the cache.
"""

from __future__ import annotations

import copy
import os
import pathlib
import re
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import models
import pytest
import torch
import transformers
from conftest import ATOL, RTOL

import remat
import remat.testing

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "modules.md"
CACHE_WARNING = r"called with a key/value cache .* Call the model with `use_cache=False`"


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if isinstance(module, transformers.GradientCheckpointingLayer)]


def _returned_cache(out: Any) -> Any:
    """The key/value cache a model returned (`cache` since transformers 5.x renamed `past_key_values`)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def _train_steps(model: torch.nn.Module, input_ids: torch.Tensor, steps: int, **kwargs: Any) -> list[Any]:
    """Run `steps` forward/backward passes (gradients accumulate) and return the outputs."""
    outputs = []
    for _ in range(steps):
        out = model(input_ids=input_ids, labels=input_ids, **kwargs)
        out.loss.backward()
        outputs.append(out)
    return outputs


def _assert_same_losses_and_grads(
    checkpointed: torch.nn.Module, reference: torch.nn.Module, actual: list[Any], expected: list[Any]
) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a.loss, e.loss, rtol=RTOL, atol=ATOL, msg=lambda m, s=step: f"loss {s}: {m}")
    expected_params = dict(reference.named_parameters())
    compared = 0
    for name, parameter in checkpointed.named_parameters():
        reference_grad = expected_params[name].grad
        if reference_grad is None:
            assert parameter.grad is None, f"{name}: a gradient where the unwrapped model has none"
            continue
        assert parameter.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(
            parameter.grad, reference_grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"grad of {n}: {m}"
        )
        compared += 1
    assert compared == len(expected_params), "some parameters received no gradient"


def _docs_example() -> str:
    """The first Python block of the transformers section of docs/modules.md."""
    section = DOCS.read_text().split("## Hugging Face transformers models", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "docs/modules.md: no Python example in the transformers section"
    return match.group(1)


def test_docs_example_checkpoints_every_layer_with_one_trace_shared(capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, Any] = {}
    with pytest.warns(UserWarning, match=CACHE_WARNING):
        exec(compile(_docs_example(), str(DOCS), "exec"), namespace)  # float32, as users run it
    model = namespace["model"]
    assert next(model.parameters()).dtype == torch.float32 and model.training
    infos = [layer.forward.cache_info() for layer in model.model.layers]
    assert [(info.traces, info.shared, info.misses, info.hits) for info in infos] == [(1, 0, 1, 2), (0, 1, 1, 2)]
    assert "[(1, 0), (0, 1)]" in capsys.readouterr().out


def test_docs_example_gradients_equal_the_unwrapped_model_in_float64() -> None:
    namespace: dict[str, Any] = {}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the example's model is built in float64
    try:
        with pytest.warns(UserWarning, match=CACHE_WARNING):
            exec(compile(_docs_example(), str(DOCS), "exec"), namespace)
    finally:
        torch.set_default_dtype(default_dtype)
    model, input_ids = namespace["model"], namespace["input_ids"]
    assert next(model.parameters()).dtype == torch.float64
    checkpointed_loss = namespace["loss"].detach()
    checkpointed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    remat.uncheckpoint_modules(model)  # the same model, unwrapped, runs the same three steps
    model.zero_grad(set_to_none=True)
    for _ in range(3):
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
    torch.testing.assert_close(checkpointed_loss, loss.detach(), rtol=RTOL, atol=ATOL)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(checkpointed_grads[name], parameter.grad, rtol=RTOL, atol=ATOL, msg=name)


# (traces, shared, hits) of each layer after three steps: the second of two identical layers takes the
# first one's trace. T5's first encoder and decoder blocks hold the relative attention bias, so no two
# of its blocks are alike.
SHARED_TRACES = {
    "llama": [(1, 0, 2), (0, 1, 2)],
    "gpt2": [(1, 0, 2), (0, 1, 2)],
    "t5": [(1, 0, 2)] * 4,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", models.HF_MODELS)
def test_default_use_cache_trains_like_the_unwrapped_model_with_one_trace_per_layer_structure(name: str) -> None:
    reference = models.hf_model(name)
    model = copy.deepcopy(reference)
    remat.checkpoint_modules(model, transformers.GradientCheckpointingLayer)
    input_ids = models.hf_input_ids()

    with pytest.warns(UserWarning, match=CACHE_WARNING):
        actual = _train_steps(model, input_ids, steps=3)
    expected = _train_steps(reference, input_ids, steps=3)

    _assert_same_losses_and_grads(model, reference, actual, expected)
    layers = _layers(model)
    assert len(layers) == (4 if name == "t5" else 2)  # T5: encoder and decoder blocks
    infos = [layer.forward.cache_info() for layer in layers]
    assert [(info.traces, info.shared, info.hits) for info in infos] == SHARED_TRACES[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", models.HF_MODELS)
def test_the_cache_the_model_returns_stays_empty_and_the_warning_says_so(name: str) -> None:
    reference = models.hf_model(name)
    model = remat.checkpoint_modules(copy.deepcopy(reference), transformers.GradientCheckpointingLayer)
    input_ids = models.hf_input_ids(seq=8)

    with pytest.warns(UserWarning, match="the cache the model returns stays empty") as record:
        (out,) = _train_steps(model, input_ids, steps=1)
    (expected,) = _train_steps(reference, input_ids, steps=1)

    assert str(record[0].message).startswith(f"remat.checkpoint_modules: {type(_layers(model)[-1]).__name__}")
    assert _returned_cache(expected).get_seq_length() == 8  # the unwrapped layers fill it
    assert _returned_cache(out).get_seq_length() == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", models.HF_MODELS)
def test_use_cache_false_trains_without_a_warning(name: str) -> None:
    reference = models.hf_model(name)
    model = remat.checkpoint_modules(copy.deepcopy(reference), transformers.GradientCheckpointingLayer)
    input_ids = models.hf_input_ids()

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        actual = _train_steps(model, input_ids, steps=2, use_cache=False)
    expected = _train_steps(reference, input_ids, steps=2, use_cache=False)

    _assert_same_losses_and_grads(model, reference, actual, expected)
    assert [(layer.forward.cache_info().traces, layer.forward.cache_info().shared) for layer in _layers(model)] == [
        (traces, shared) for traces, shared, _ in SHARED_TRACES[name]
    ]


def test_generation_without_gradients_uses_the_cache_as_written() -> None:
    reference = models.hf_model("llama").eval()
    model = remat.checkpoint_modules(copy.deepcopy(reference), transformers.GradientCheckpointingLayer)
    prompt = models.hf_input_ids(batch=1, seq=4)

    generated = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = reference.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)

    assert torch.equal(generated, expected)
    assert all(layer.forward.cache_info().misses == 0 for layer in _layers(model))  # never traced: no gradients


def test_only_some_layers_checkpointed_leaves_the_others_writing_the_cache() -> None:
    reference = models.hf_model("llama")
    model = copy.deepcopy(reference)
    remat.checkpoint_modules(model, lambda name, module: name == "model.layers.1")
    input_ids = models.hf_input_ids(seq=8)

    with pytest.warns(UserWarning, match=CACHE_WARNING):
        actual = _train_steps(model, input_ids, steps=2)
    expected = _train_steps(reference, input_ids, steps=2)

    _assert_same_losses_and_grads(model, reference, actual, expected)
    cache = _returned_cache(actual[-1])
    assert (cache.get_seq_length(0), cache.get_seq_length(1)) == (8, 0)  # layer 0 is not checkpointed
    assert model.model.layers[1].forward.cache_info().traces == 1


def test_gpt2_with_dropout_draws_the_same_masks_as_the_unwrapped_model() -> None:
    reference = models.hf_model("gpt2")
    for module in reference.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1  # embeddings, attention (sdpa's dropout_p reads it), residuals and MLP
    model = remat.checkpoint_modules(copy.deepcopy(reference), transformers.GradientCheckpointingLayer)
    input_ids = models.hf_input_ids()

    actual, expected = [], []
    for seed in (1, 2):
        for which, outputs in ((model, actual), (reference, expected)):
            torch.manual_seed(seed)
            outputs.extend(_train_steps(which, input_ids, steps=1, use_cache=False))

    assert actual[0].loss.item() != actual[1].loss.item()  # the masks differ between seeds: dropout is on
    _assert_same_losses_and_grads(model, reference, actual, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", models.HF_MODELS)
def test_offloading_the_matmuls_trains_like_the_unwrapped_model(name: str) -> None:
    reference = models.hf_model(name)
    model = copy.deepcopy(reference)
    remat.checkpoint_modules(model, transformers.GradientCheckpointingLayer, policy=remat.policies.offload_dots)
    input_ids = models.hf_input_ids()
    with remat.testing.offloading_on_cpu():
        actual = _train_steps(model, input_ids, steps=2, use_cache=False)
    expected = _train_steps(reference, input_ids, steps=2, use_cache=False)
    _assert_same_losses_and_grads(model, reference, actual, expected)
