"""Errors raised by remat, and the translation of low-level tracing failures."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from .._core._rng import GeneratorMadeInside, GlobalSeeding
from .._eager._capture import DataPointerRead
from .._eager._fake_kernels import FakeKernelRefused
from .._eager._in_place import OverlappingWrite, ReadsWhatItWrites
from .._eager._specialize import FloatRead, UncheckedValue
from .._memory._gpu import asks_for_the_missing_gpu
from .._torch import (
    DATA_NOT_ALLOCATED,
    LEAF_UPDATED_IN_PLACE,
    UNTRACEABLE_COLLECTIVE,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeRankMismatch,
    GuardOnDataDependentSymNode,
    UnsupportedOperatorException,
    is_user_code,
)

__all__ = ["TraceError", "explain_tracing_errors", "user_line"]


class TraceError(RuntimeError):
    """`fn` could not be traced into a graph of op calls.

    Raised by `remat.checkpoint`, `remat.trace` and `remat.report` with an
    explanation of what in `fn` prevented tracing and how to change it.

    >>> import torch, remat
    >>> try:
    ...     remat.trace(lambda x: x * float(x.max()), torch.ones(3))  # a Python float of a tensor's value
    ... except remat.TraceError as error:
    ...     print(str(error).split(":")[0])
    remat.checkpoint could not trace `<lambda>`
    """


def _in_place_collective(fn: Callable[..., Any], error: BaseException) -> TraceError:
    return TraceError(
        f"remat.checkpoint could not trace `{_name(fn)}`: it calls an in-place collective{_at(error)} "
        "(`torch.distributed.all_reduce` and friends), which cannot be traced. Use the functional "
        "collectives of `torch.distributed._functional_collectives` (`all_reduce(tensor, 'sum', group)` "
        "returns the result), which remat traces and always saves, so that backward never replays one."
    )


def _needs_a_gpu(fn: Callable[..., Any], error: BaseException, op: str) -> TraceError:
    return TraceError(
        f"remat.checkpoint could not trace `{_name(fn)}` on CUDA tensors: {op}{_at(error)} runs only on a GPU, "
        "and this machine has none (torch asks the CUDA driver for it even on fake tensors: cuDNN's RNNs, grid "
        "sampler and CTC loss, the fused GRU cell). Trace or plan it on a machine with a GPU. For a cuDNN kernel, "
        "`with torch.backends.cudnn.flags(enabled=False):` around the call plans the kernel the GPU runs without "
        "cuDNN instead, which may keep other tensors for backward than cuDNN's."
    )


def user_line(tb: TracebackType | None) -> str | None:
    """The innermost `file:line` of a traceback that is user code (not torch's or remat's)."""
    found = None
    for frame in traceback.extract_tb(tb):
        if is_user_code(frame.filename):
            found = f"{frame.filename}:{frame.lineno}" + (f" ({frame.line.strip()})" if frame.line else "")
    return found


@contextmanager
def explain_tracing_errors(fn: Callable[..., Any]) -> Iterator[None]:
    """Turn low-level tracing failures into errors that say what to change in `fn`."""
    # Long by design: one `except` per failure, each its message, read top to bottom like a table.
    try:
        yield
    except DataDependentOutputException as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it calls an op{_at(error)} whose result is a Python "
            "value computed from tensors' values (such as `torch.equal` or `torch.allclose`), which a trace of "
            "tensor ops cannot hold. Compute it with tensor ops (`(a == b).all()`), or call it outside the "
            "checkpointed function."
        ) from error
    except GuardOnDataDependentSymNode as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it reads the value of a tensor in Python"
            f"{_at(error)} (`.item()`, `bool(tensor)`, `if tensor...:` or a Python number made from a tensor) "
            "where the value cannot be known while tracing: under a torch.func transform, or in backward. "
            "(Elsewhere remat traces such code for the values it reads, and checks them on each call.) Use "
            "`torch.where` instead of branching on a tensor, or pass the value as a non-tensor argument (it "
            "becomes part of the cache key)."
        ) from error
    except UncheckedValue as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it reads values of tensors in Python that remat "
            f"cannot check on later calls ({', '.join(error.args[0])}: a value torch reads inside an op, such as "
            "an index given as a tensor). Pass such values as Python ints, or compute them outside the function."
        ) from error
    except FloatRead as error:
        where = f" at {error.source}" if error.source else ""
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it reads a float value of a tensor in Python"
            f"{where} (`float(t)`, `if t.item() > 0.5:`). remat traces code "
            "that reads tensor values for the values it reads and checks them on each call; a float would "
            "hold for almost no other call, and each would trace again. Keep the value a tensor (`x * "
            "x.max()`), use `torch.where` instead of a branch, or pass it as a non-tensor argument."
        ) from error
    except DynamicOutputShapeException as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: an op{_at(error)} returns a tensor whose shape "
            "depends on the values of its inputs (such as `nonzero`, `masked_select` or boolean-mask "
            "indexing). Use a fixed-shape alternative such as `torch.where`."
        ) from error
    except DataPointerRead as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it reads a tensor's memory address{_at(error)} "
            "(`data_ptr()`), which a trace of tensor ops cannot hold, and which tensors made while tracing do not "
            "have. Decide what it decides outside the checkpointed function. (Hugging Face's `grouped_mm` "
            "experts do so on the CPU under torch 2.10 and older, to check the alignment of their operands: "
            'there, set `config._experts_implementation = "eager"`.)'
        ) from error
    except AssertionError as error:
        if not all(text in str(error) for text in UNTRACEABLE_COLLECTIVE):
            raise
        raise _in_place_collective(fn, error) from error
    except UnsupportedOperatorException as error:
        if error.func.namespace != "c10d":  # (torch 2.10 has no fake kernel for in-place collectives)
            raise
        raise _in_place_collective(fn, error) from error
    except OverlappingWrite as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it updates in place{_at(error)} a tensor whose "
            f"elements share memory (`{error.op}` into shape {error.shape}, strides {error.strides}: a broadcast "
            "`expand` or an overlapping `unfold`). Eager writes such elements one after another, which a traced "
            "graph cannot express. Write into a copy (`.clone()` the view first) or into the tensor it views."
        ) from error
    except ReadsWhatItWrites as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: `{error.op}`{_at(error)} updates a tensor in place "
            "from a tensor that shares part of its memory (`t.scatter_(1, index, t[:, :2])`). Eager then reads "
            "elements it has already overwritten, in its kernel's order, which a traced graph cannot express. "
            "Pass a copy as the source (`t[:, :2].clone()`)."
        ) from error
    except FakeRankMismatch as error:
        fake, real = (", ".join(map(str, ranks)) for ranks in (error.fake_ranks, error.real_ranks))
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: `{error.op}`{_at(error)} gives a tensor of {fake} "
            f"dimensions while tracing and of {real} in eager: its fake kernel (its rule for output shapes) does not "
            "match the real kernel here, as where a size that depends on data is 1. Give a custom op a rule that "
            "matches its kernel (`torch.library.register_fake`); for a torch op, call it outside the checkpointed "
            "function, and tell remat's maintainers which op it was."
        ) from error
    except FakeKernelRefused as error:
        if asks_for_the_missing_gpu(error):
            raise _needs_a_gpu(fn, error, str(error.op)) from error
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: `{error.op}`{_at(error)} refused its inputs while "
            f"tracing: {error.reason.rstrip('.')}. Tracing runs each op's fake kernel (its rule for output shapes and dtypes) "
            "instead of the op. If eager runs this line without error, that rule is stricter than the real "
            "kernel: call the op outside the checkpointed function, or give it a rule that matches the kernel "
            "(`torch.library.register_fake` for a custom op), and tell remat's maintainers which op it was."
        ) from error
    except GeneratorMadeInside as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it draws from a `torch.Generator` that it creates "
            "itself. A trace keeps the generator it was traced with and would go on drawing from that one, where "
            "eager draws from the new one each call makes: other numbers from the second call on. Create (and "
            "seed) the generator outside the function and let the function use it, or draw from the default "
            "generator, seeded before the call."
        ) from error
    except GlobalSeeding as error:
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it sets the state of the global random number "
            f"generator{_at(error)} ({error.how}). A checkpointed function draws its random numbers from the "
            "generator as it finds it when called; a seed set inside it would take effect only while tracing, "
            "so later calls would draw other numbers than eager. Seed before calling the checkpointed function "
            "(keep `torch.manual_seed`, `torch.set_rng_state` and `torch.random.fork_rng` outside it), or let it "
            "draw from a `torch.Generator` of your own (`generator=g`) that you seed outside it."
        ) from error
    except RuntimeError as error:
        if asks_for_the_missing_gpu(error):
            raise _needs_a_gpu(fn, error, "an op") from error
        if DATA_NOT_ALLOCATED in str(error):
            raise TraceError(
                f"remat.checkpoint could not trace `{_name(fn)}`: an op{_at(error)} reads the values of a tensor "
                "argument to decide its output's shape (such as `torch.tensor_split` given its indices as a tensor). "
                "Tracing runs on tensors without values. Pass those values as a "
                "Python list or int instead (`indices.tolist()` outside the checkpointed function); they become "
                "part of the cache key."
            ) from error
        if LEAF_UPDATED_IN_PLACE not in str(error):
            raise
        raise TraceError(
            f"remat.checkpoint could not trace `{_name(fn)}`: it updates in place{_at(error)} a leaf tensor that "
            "requires grad (such as a parameter), which autograd refuses in eager mode too. Update a copy instead "
            "(`w = w.clone()` first), or do the update under `torch.no_grad()` outside the checkpointed function."
        ) from error


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _at(error: BaseException) -> str:
    where = user_line(error.__traceback__)
    return f" at {where}" if where else ""
