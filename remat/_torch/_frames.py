"""Where a traced call comes from: the user's line, and the custom autograd Functions being applied, found
from Python's frames and by noting each Function's application while tracing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "FunctionApplications",
    "function_applications_noted",
    "is_user_code",
    "source_and_scope",
]


# --- custom Functions applied ----------------------------------------------------------------------------


class FunctionApplications(Protocol):
    """What `function_applications_noted` tells about the custom autograd Functions applied."""

    def started(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...

    def finished(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any) -> None: ...


class _Noting(threading.local):
    listener: FunctionApplications | None = None
    depth = 0


_noting = _Noting()
_noting_lock = threading.Lock()
_noting_threads = 0
_ORIGINAL_APPLY = inspect.getattr_static(torch.autograd.Function, "apply")
_APPLY_IS_OWN = "apply" in vars(torch.autograd.Function)


def _apply_noting(cls: type, *args: Any, **kwargs: Any) -> Any:
    apply = _ORIGINAL_APPLY.__get__(None, cls)
    return _noted(cls, lambda: apply(*args, **kwargs), args, kwargs, lambda outputs: outputs)


def _noted(
    cls: type, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any], noted: Callable[[Any], Any]
) -> Any:
    """`run()`, an application of `cls` on `args` and `kwargs`, told to this thread's listener (with the
    outputs `noted` picks of what it returns) unless another thread's or inside another application."""
    listener = _noting.listener
    if listener is None or _noting.depth:
        return run()
    listener.started(args, kwargs)
    _noting.depth += 1
    try:
        outputs = run()
    finally:
        _noting.depth -= 1
    listener.finished(cls, args, kwargs, noted(outputs))
    return outputs


@contextlib.contextmanager
def function_applications_noted(listener: FunctionApplications) -> Iterator[None]:
    """Tell `listener` of each custom autograd Function applied on this thread while this runs (not
    those applied inside another's `forward`): `Function.apply` is wrapped meanwhile, for every thread,
    and passes other threads' calls straight on; and so is the `forward` of every Function class defined
    so far, for an `apply` taken before this started (`my_op = MyFunction.apply`), which the first does
    not see. A class that defines its own `apply` is seen through its `forward` only."""
    global _noting_threads
    with _noting_lock:
        if _noting_threads == 0:
            torch.autograd.Function.apply = classmethod(_apply_noting)  # type: ignore[assignment, method-assign]
            _wrap_forwards()
        _noting_threads += 1
    outer, _noting.listener = _noting.listener, listener
    try:
        yield
    finally:
        _noting.listener = outer
        with _noting_lock:
            _noting_threads -= 1
            if _noting_threads == 0:
                _unwrap_forwards()
                if _APPLY_IS_OWN:
                    torch.autograd.Function.apply = _ORIGINAL_APPLY  # type: ignore[method-assign]
                else:
                    del torch.autograd.Function.apply


_wrapped_forwards: dict[type, Any] = {}  # class -> its own `forward` attribute before wrapping (or _ABSENT)
_ABSENT = object()


def _wrap_forwards() -> None:
    """Wrap the `forward` of every custom Function class so far, each as the class sees it."""
    classes: dict[type, None] = {}
    pending: list[type] = [torch.autograd.Function]
    while pending:
        subclasses: list[type] = pending.pop().__subclasses__()
        for subclass in subclasses:
            if subclass not in classes:
                classes[subclass] = None
                pending.append(subclass)
    own_setup = inspect.getattr_static(torch.autograd.Function, "setup_context")
    wrappers = {}
    for cls in classes:
        forward = _class_attribute(cls, "forward")
        if isinstance(forward, staticmethod):
            forward = forward.__func__
        if not inspect.isfunction(forward):  # (a classmethod, a C function: left as it is)
            continue
        with_ctx = _class_attribute(cls, "setup_context") is own_setup  # old style: forward(ctx, ...)
        made = _forward_wrappers.get(cls)
        if made is None or made[0] is not forward or made[1] != with_ctx:
            made = _forward_wrappers[cls] = (forward, with_ctx, staticmethod(_forward_noting(cls, forward, with_ctx)))
        wrappers[cls] = made[2]
    for cls, wrapper in wrappers.items():
        _wrapped_forwards[cls] = vars(cls).get("forward", _ABSENT)
        type.__setattr__(cls, "forward", wrapper)


def _class_attribute(cls: type, name: str) -> Any:
    """`cls`'s attribute `name` as its class dictionaries hold it (`inspect.getattr_static` for a class whose
    metaclass defines no such attribute, as Function's does not; five times faster, and this runs for every
    Function class on each trace)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


# class -> (the forward it wrapped, whether old style, the wrapper): made once per class and forward
_forward_wrappers: weakref.WeakKeyDictionary[type, tuple[Any, bool, staticmethod[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def _unwrap_forwards() -> None:
    for cls, own in _wrapped_forwards.items():
        if own is _ABSENT:
            type.__delattr__(cls, "forward")
        else:
            type.__setattr__(cls, "forward", own)
    _wrapped_forwards.clear()


def _forward_noting(cls: type, forward: Callable[..., Any], with_ctx: bool) -> Callable[..., Any]:
    """`forward`, noting its application where `Function.apply` did not (an `apply` taken before noting
    started): its arguments as `apply` got them, and its outputs, unless one is an argument itself (whose
    output `apply` makes a new view, which this does not see)."""

    @functools.wraps(forward)
    def noting(*args: Any, **kwargs: Any) -> Any:
        given = args[1:] if with_ctx else args

        def noted(outputs: Any) -> Any:  # (only for an application noted: not on every call)
            inputs = {id(a) for a in pytree.tree_leaves((given, kwargs)) if isinstance(a, torch.Tensor)}
            returned = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
            return () if any(id(t) in inputs for t in returned) else outputs

        return _noted(cls, lambda: forward(*args, **kwargs), given, kwargs, noted)

    return noting


# --- frames: where a call came from --------------------------------------------------------------------------

# torch's directory, remat's (the one above this package) and Python's frozen modules.
_REMAT_DIR = os.path.dirname(os.path.dirname(__file__))
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, _REMAT_DIR + os.sep, "<frozen")


def is_user_code(filename: str) -> bool:
    """Whether a frame of this file is the user's: not torch's, nor remat's, nor Python's own."""
    return not filename.startswith(_LIBRARY_DIRS)


# NOTE [custom Function scopes without apply's frame]
# Until torch 2.13 `Function.apply` was Python, and its frame named the class
# being applied; since 2.14 it is C++, with no frame. Either way, the
# Function's `forward` runs as a Python frame of the user's own code: a frame
# whose code is the `forward` of a Function subclass is inside that Function.
# Old-style forwards name their class through `ctx` (an instance of the
# class's backward node, which knows its Function); a forward with a separate
# `setup_context` has no ctx, and is found by its code among the subclasses.
def source_and_scope(skip: int) -> tuple[str | None, str | None]:
    """The innermost `file:line` of user code on the stack, and the custom `autograd.Function`s
    being applied (outermost first, joined by "/"). Starts `skip` frames above the caller."""
    source = None
    functions: list[str] = []
    frame: FrameType | None = sys._getframe(skip + 1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward":
            name = _function_of(frame)
            if name is not None:
                functions.append(name)
        if source is None and is_user_code(code.co_filename):
            source = f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return source, "/".join(reversed(functions)) or None


def _function_of(frame: FrameType) -> str | None:
    """The custom Function whose `forward` `frame` runs, if it is one."""
    forward_cls = getattr(type(frame.f_locals.get("ctx")), "_forward_cls", None)  # the ctx of an old-style forward
    if forward_cls is not None:
        return forward_cls.__name__  # type: ignore[no-any-return]
    if frame.f_code not in _FORWARDS:  # a forward not seen yet: of a Function defined since, or of a module
        _FORWARDS.update(_function_forwards())
        _FORWARDS.setdefault(frame.f_code, None)
    return _FORWARDS[frame.f_code]


_FORWARDS: dict[CodeType, str | None] = {}  # code of a `forward` -> the Function it belongs to, or None


def _function_forwards() -> dict[CodeType, str]:
    """The code of every `forward` a subclass of `torch.autograd.Function` defines -> its class name."""
    found: dict[CodeType, str] = {}
    pending = [torch.autograd.Function]
    while pending:
        cls = pending.pop()
        for subclass in cls.__subclasses__():
            pending.append(subclass)
            code = _code_of(subclass.__dict__.get("forward"))
            if code is not None:
                found.setdefault(code, subclass.__name__)
    return found


def _code_of(method: Any) -> CodeType | None:
    function = getattr(method, "__func__", method)  # a staticmethod
    function = getattr(function, "__wrapped__", function)  # while noted: see `function_applications_noted`
    return getattr(function, "__code__", None)
