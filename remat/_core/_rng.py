"""Generator states: captured in forward before a random call, restored around its replay.

See NOTE [replaying random calls].
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from .._torch import default_generator, innermost

__all__ = [
    "DrawnGenerators",
    "GeneratorMadeInside",
    "GlobalSeeding",
    "check_generators_outlive_fn",
    "generators_at",
    "seeding_refused",
    "has_zero_derivative",
    "is_random_factory",
    "replay_with_rng_state",
    "run_keeping_state",
    "snapshot",
    "state_nbytes",
]

# NOTE [replaying random calls]
# A random call that backward needs but the policy does not save is replayed
# with the generator state it started from in forward: the forward program
# reads the state right before the call (kept like an activation: 5,056 bytes
# for a CPU generator, 16 for a CUDA one), and the replay sets it, runs the
# call, then puts back the state it found, so that the replay draws exactly the
# same numbers and leaves the generator where it was. The forward itself runs
# every random call once, in order, as eager does; so after backward the
# stream is where eager execution leaves it. Threads: remat reads a state and
# draws (or sets, draws and restores) under one lock, so checkpointed functions
# on several threads each replay their own numbers; a thread drawing from the
# same generator outside remat at that moment is not held back by the lock.


# Random ops whose output has a zero derivative with respect to every input: a
# kept output of one of them stands for the call exactly, to any order.
_ZERO_DERIVATIVE = frozenset(
    {
        "bernoulli", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
        "uniform", "exponential", "geometric", "cauchy", "log_normal", "multinomial", "poisson", "random",
    }
)  # fmt: skip


# Among those, the factories: they read only the shape of a tensor argument, and autograd gives
# their output no history. The others (`bernoulli`, `normal`, `uniform_` ...) carry a zero
# derivative, so their outputs require grad when an input does, as in eager.
_FACTORIES = frozenset({"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm"})


def has_zero_derivative(node: fx.Node) -> bool:
    """Whether the random call `node` is a plain draw, with no derivative to carry."""
    return _random_name(node) in _ZERO_DERIVATIVE


def is_random_factory(node: fx.Node) -> bool:
    """Whether `node` draws a new tensor that autograd connects to no input (`rand_like`)."""
    return _random_name(node) in _FACTORIES


def _random_name(node: fx.Node) -> str | None:
    packet = getattr(node.target, "overloadpacket", None)
    return None if packet is None else packet.__name__.removesuffix("_")


def _resolve(device: torch.device, generator: torch.Generator | None) -> torch.Generator:
    return default_generator(device) if generator is None else generator


# Reading a generator's state and drawing from it must happen as one step, and so must
# setting it, drawing and restoring it: a draw by another thread in between would give
# forward and replay different numbers. Remat's own calls take this lock for both.
_GENERATORS = threading.RLock()


def run_keeping_state(device: torch.device, op: Any, /, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Run the random call `op(*args, **kwargs)` on `device`; return the state of the generator
    it drew from, as it was right before, and the call's result."""
    resolved = _resolve(device, kwargs.get("generator"))
    with _GENERATORS:
        state = resolved.get_state()
        return state, op(*args, **kwargs)


def replay_with_rng_state(state: torch.Tensor, device: torch.device, op: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Run `op(*args, **kwargs)` as it ran when its generator was in `state`, leaving the generator as found."""
    with generators_at([(state, device, kwargs.get("generator"))]):
        return op(*args, **kwargs)


@contextlib.contextmanager
def generators_at(states: Sequence[tuple[torch.Tensor, torch.device, torch.Generator | None]]) -> Iterator[None]:
    """Inside, each generator (the default one of `device`, or the one given) is in its `state`; after,
    they are as found. One lock is held throughout: see NOTE [replaying random calls]."""
    # (`innermost`: a state kept under a torch.func transform is wrapped)
    resolved = [(_resolve(device, generator), innermost(state)) for state, device, generator in states]
    with _GENERATORS:
        found = [generator.get_state() for generator, _ in resolved]
        for generator, state in resolved:
            generator.set_state(state)
        try:
            yield
        finally:
            for (generator, _), before in zip(reversed(resolved), reversed(found), strict=True):
                generator.set_state(before)


def snapshot(generators: Iterable[torch.Generator] = ()) -> Callable[[], None]:
    """A function that puts the default generators (CPU, and CUDA where it is in use), and `generators`,
    back as they are now."""
    every = [torch.default_generator]
    if torch.cuda.is_initialized():
        every += list(torch.cuda.default_generators)
    every += [g for g in generators if all(g is not other for other in every)]
    states = [generator.get_state() for generator in every]

    def restore() -> None:
        for generator, state in zip(every, states, strict=True):
            generator.set_state(state)

    return restore


class DrawnGenerators:
    """The user's `torch.Generator`s a trace drew from for real, each with its state before the first
    draw (tracing with values draws real numbers: NOTE [values Python reads]), to put them back."""

    def __init__(self) -> None:
        self._before: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def note(self, generator: Any) -> None:
        """Remember `generator`'s state, if it is a user's generator seen for the first time."""
        if isinstance(generator, torch.Generator) and id(generator) not in self._before:
            self._before[id(generator)] = (generator, generator.get_state())

    def put_back(self) -> None:
        for generator, state in self._before.values():
            generator.set_state(state)

    def seen(self) -> frozenset[int]:
        """The ids of the generators noted so far (each is held here, so no other object takes its id)."""
        return frozenset(self._before)


class GeneratorMadeInside(RuntimeError):
    """`fn` draws from a `torch.Generator` it creates itself: see NOTE [generators made inside the function]."""


# NOTE [generators made inside the function]
# A trace records the `torch.Generator` a call draws from as a constant of the graph: the generator
# object itself. One that `fn` creates on every call (`torch.Generator().manual_seed(0)` inside it)
# is another object in each run of `fn`, and the trace would keep drawing from the one made while
# tracing, where eager draws from a fresh one: other numbers from the second call on, silently. Tracing
# runs `fn` twice (discovery, then the joint trace), so such a generator shows as one that the trace
# draws from but discovery never did; tracing refuses it.
def check_generators_outlive_fn(traced: Iterable[torch.Generator], discovered: frozenset[int]) -> None:
    """Raise `GeneratorMadeInside` if the trace draws from a generator discovery did not."""
    if any(id(generator) not in discovered for generator in traced):
        raise GeneratorMadeInside("the checkpointed function draws from a torch.Generator it creates itself")


def state_nbytes(device: torch.device) -> int:
    """Bytes of one generator state on `device` (without touching the device)."""
    return torch.default_generator.get_state().numel() if device.type == "cpu" else 16


# NOTE [seeding inside a checkpointed function]
# A traced function records its random calls, not the generator's state: the
# forward program draws from the generator as it finds it at each call. A seed
# that `fn` sets itself (`torch.manual_seed(42)`, `torch.set_rng_state(...)`,
# `torch.random.fork_rng`, OpInfo's `wrapper_set_seed`) would run once, while
# tracing, and never again: later calls would draw other numbers than eager,
# silently. So tracing refuses it: while a trace runs, the seeding functions of
# `torch`, `torch.random` and `torch.cuda` raise `GlobalSeeding` when the
# tracing thread calls them, before they change anything. Other threads call
# through (they may seed and draw while this one traces), and so does an
# error unwinding `fn` (the `finally` of `fork_rng` putting its state back),
# so that the error reported is the first one. Comparing generator states
# instead would also catch `torch.default_generator.manual_seed(...)`, but
# cannot tell `fn`'s changes from another thread's draws; a Generator's own
# methods, and a seeding function imported under another name before the
# trace, are therefore not watched (docs/debugging.md says so).
class GlobalSeeding(RuntimeError):
    """`fn` called a function that sets a default generator's state while being traced."""

    def __init__(self, how: str):
        super().__init__(f"the checkpointed function sets a default generator's state ({how})")
        self.how = how


_SEEDING_FUNCTIONS = {
    "torch": ("manual_seed", "seed", "set_rng_state"),
    "torch.random": ("manual_seed", "seed", "set_rng_state"),
    "torch.cuda": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"),
    "torch.cuda.random": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"),
}


def _refusing(function: Callable[..., Any], how: str, thread: int) -> Callable[..., Any]:
    @functools.wraps(function)
    def refusing(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread and sys.exc_info()[1] is None:
            raise GlobalSeeding(how)
        return function(*args, **kwargs)

    return refusing


@contextlib.contextmanager
def seeding_refused() -> Iterator[None]:
    """Trace inside this: the seeding functions raise `GlobalSeeding` on this thread.

    See NOTE [seeding inside a checkpointed function]."""
    thread = threading.get_ident()
    patched = []
    try:
        for module_name, names in _SEEDING_FUNCTIONS.items():
            module = importlib.import_module(module_name)
            for name in names:
                original = getattr(module, name)
                setattr(module, name, _refusing(original, f"`{module_name}.{name}`", thread))
                patched.append((module, name, original))
        yield
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)
