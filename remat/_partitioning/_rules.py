"""The rules: what the programs keep, replay and recompute under any decisions, written once.

Each rule is a set of clauses over atoms of a trace's value graph (`_value_graph`):

- `SAVED(c)`: the decisions keep call c's values (SAVE or OFFLOAD), given;
- `REPLAYED(c)`: backward replays call c;
- `KEPT(v)`: the programs keep value v of a saved call from forward to backward;
- `COPIED(w)`: they keep a copy of input w, which may be overwritten before backward;
- `AS_IS(w)`: they read input w as it is when backward runs (by reference, no memory);
- `RECOMPUTED(c)`: the pure forward recomputes call c, to differentiate a kept value again;
- `STATE(c)`: they keep the generator state from before random call c.

`resolve` finds what holds under given decisions: the fewest atoms the clauses allow. The partition
builds its programs from that result, `_accounting` counts it for the planners, `remat.report` and the
log, and the budget planner's 0-1 program is the same clauses as linear rows (`Rules.rows`). So a rule
changes here, once, for all of them.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Collection, Iterable, Iterator
from typing import Any, NamedTuple

from .._core._calls import Value
from ._value_graph import ValueGraph

__all__ = [
    "AS_IS",
    "COPIED",
    "KEPT",
    "RECOMPUTED",
    "REPLAYED",
    "SAVED",
    "STATE",
    "Atom",
    "Clause",
    "Resolution",
    "Row",
    "Rules",
    "rules_of",
]

SAVED, REPLAYED, KEPT, COPIED, AS_IS, RECOMPUTED, STATE = (
    "saved",
    "replayed",
    "kept",
    "copied",
    "as is",
    "recomputed",
    "state",
)


class Atom(NamedTuple):
    """One fact about a call (`key` its index) or a value (`key` the value)."""

    kind: str
    key: Any


class Clause(NamedTuple):
    """`head` holds if every atom of `when` holds and no atom of `unless` does."""

    head: Atom
    when: tuple[Atom, ...] = ()
    unless: tuple[Atom, ...] = ()


class Row(NamedTuple):
    """The linear constraint `sum(coefficient * atom) <= bound` over 0-1 atoms."""

    coefficients: dict[Atom, float]
    bound: float


def _clauses(graph: ValueGraph, forward_mode: bool) -> Iterator[Clause]:
    """Every clause, rule by rule."""
    # Backward reads values: one of a saved call is kept, one of another call is replayed; an input is
    # read as it is or, if something may overwrite it first, from a copy (NOTE [kept inputs]).
    for value in graph.backward_reads:
        yield from _read(graph, value, True, ())
    # A replay reads the values its call reads, likewise; an input whose value does not matter to the
    # call is read as it is (`_value_graph.reads_any_value`).
    for call, values in enumerate(graph.reads):
        for value in values:
            yield from _read(graph, value, value not in graph.read_as_they_are[call], (Atom(REPLAYED, call),))
    # Differentiating again (NOTE [differentiating the forward again]): the pure forwards recompute each
    # kept value with a derivative that the Function does not return. For a second derivative through the
    # kept values, what has a first derivative (`varying`); where custom Functions are applied again, also
    # what that recomputation differentiates (`varying_again`, which reads kept fills as kept).
    if forward_mode:
        varying = graph.varying_forward_mode
        recomputed_if_kept = varying
    else:
        varying = graph.varying_again if graph.recomputes_returned else graph.varying
        recomputed_if_kept = varying | graph.varying
    for value in graph.nodes:
        if value[0] >= 0 and value in recomputed_if_kept and value not in graph.returned:
            yield Clause(Atom(RECOMPUTED, value[0]), (Atom(KEPT, value),))
    # The pure forward recomputes the returned outputs too: traced for forward mode (for their tangents), and
    # where it applies custom Functions again (NOTE [custom Functions applied again]).
    if forward_mode or graph.recomputes_returned:
        for value in graph.shown_by_returned:
            yield from _recomputation_reads(graph, value, True, (), varying)
    # Recomputing an output of a custom Function applied again reads the Function's arguments, and the
    # generator states its forward's draws start from (NOTE [custom Functions applied again]).
    for applied in graph.reapplied:
        for call in applied.outputs:
            for value in applied.reads:
                yield from _recomputation_reads(graph, value, True, (Atom(RECOMPUTED, call),), varying)
            for draw in applied.draws:
                yield Clause(Atom(STATE, draw), (Atom(RECOMPUTED, call),))
    # A recomputation reads what its call reads, up to kept values without a derivative: constants to
    # any derivative, which stand for themselves.
    for call, values in enumerate(graph.reads):
        for value in values:
            by_value = value not in graph.read_as_they_are[call]
            yield from _recomputation_reads(graph, value, by_value, (Atom(RECOMPUTED, call),), varying)
    # A replayed or recomputed random call draws from its kept generator state (NOTE [replaying random calls]).
    for call, nbytes in enumerate(graph.rng_state_nbytes):
        if nbytes:
            yield Clause(Atom(STATE, call), (Atom(REPLAYED, call),))
            yield Clause(Atom(STATE, call), (Atom(RECOMPUTED, call),))


def _read(graph: ValueGraph, value: Value, by_value: bool, when: tuple[Atom, ...]) -> Iterator[Clause]:
    """What reading `value` (for its value, or as it is) needs, when `when` holds."""
    call = value[0]
    if call >= 0:
        yield Clause(Atom(KEPT, value), (*when, Atom(SAVED, call)))
        yield Clause(Atom(REPLAYED, call), when, (Atom(SAVED, call),))
    else:
        yield _input_read(graph, value, by_value, when)


def _recomputation_reads(
    graph: ValueGraph, value: Value, by_value: bool, when: tuple[Atom, ...], varying: frozenset[Value]
) -> Iterator[Clause]:
    """What recomputing a value that reads `value` needs, when `when` holds."""
    call = value[0]
    if call >= 0:
        yield Clause(Atom(RECOMPUTED, call), when, () if value in varying else (Atom(KEPT, value),))
    else:
        yield _input_read(graph, value, by_value, when)


def _input_read(graph: ValueGraph, value: Value, by_value: bool, when: tuple[Atom, ...]) -> Clause:
    copied = by_value and value in graph.overwritten
    return Clause(Atom(COPIED if copied else AS_IS, value), when)


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What holds under one set of decisions."""

    needed: tuple[Value, ...]  # what the programs keep or read as it is, in order of first need
    kept: frozenset[Value]  # values of saved calls kept from forward to backward
    copied: frozenset[Value]  # inputs kept as copies
    as_is: frozenset[Value]  # inputs read as they are
    replayed: frozenset[int]  # calls backward replays
    recomputed: frozenset[int]  # calls the pure forward recomputes
    states: tuple[int, ...]  # random calls whose generator state is kept, in order


class Rules:
    """The clauses of one value graph (forward mode or not), indexed to resolve decisions quickly."""

    def __init__(self, graph: ValueGraph, forward_mode: bool, omit: frozenset[str] = frozenset()):
        # Nothing here refers to `graph`: the cache below holds rules as long as their graph lives.
        self.clauses = tuple(c for c in _clauses(graph, forward_mode) if c.head.kind not in omit)
        read = {a.kind for c in self.clauses for a in (*c.when, *c.unless)}
        assert not read & omit, f"remat: the rules read {read & omit}, which cannot be left out"
        stratum = _strata(self.clauses)
        self._strata = max(stratum.values(), default=0)
        # Resolving runs on atoms numbered 0, 1, ... (a flag each) and clauses of numbers: `resolve` is
        # called for every candidate a planner weighs.
        self._atoms: list[Atom] = list(dict.fromkeys(a for c in self.clauses for a in (c.head, *c.when, *c.unless)))
        number = {atom: j for j, atom in enumerate(self._atoms)}
        self._saved = {atom.key: j for atom, j in number.items() if atom.kind == SAVED}
        self._compiled = [
            (number[c.head], tuple(number[a] for a in c.when), tuple(number[a] for a in c.unless)) for c in self.clauses
        ]
        self._facts: list[list[int]] = [[] for _ in range(self._strata + 1)]
        # per atom: the clauses it triggers in its own stratum (reversed, to push), and in later ones
        self._same: list[list[int]] = [[] for _ in self._atoms]
        self._later: list[list[tuple[int, int]]] = [[] for _ in self._atoms]
        for i, clause in enumerate(self.clauses):
            level = stratum[clause.head.kind]
            triggers = [a for a in dict.fromkeys(clause.when) if a.kind != SAVED]
            if not triggers:
                self._facts[level].append(i)
            for atom in triggers:
                if stratum.get(atom.kind, level) == level:  # (a kind no clause derives never holds)
                    self._same[number[atom]].append(i)
                else:
                    self._later[number[atom]].append((level, i))
        for same in self._same:
            same.reverse()
        self._rows: dict[tuple[Atom, ...], tuple[Row, ...]] = {}

    def resolve(self, saved: Collection[int]) -> Resolution:
        """What holds when exactly the calls `saved` are saved: the least set of atoms closed under
        the clauses, stratum by stratum (an `unless` reads only atoms of lower strata, final by then)."""
        holds = bytearray(len(self._atoms))
        for c in saved:
            j = self._saved.get(c)
            if j is not None:
                holds[j] = 1
        order: list[int] = []
        pending = [list(facts) for facts in self._facts]
        compiled, same, later = self._compiled, self._same, self._later
        for stratum in range(self._strata + 1):
            stack = pending[stratum][::-1]
            while stack:
                head, when, unless = compiled[stack.pop()]
                if holds[head]:
                    continue
                for a in when:
                    if not holds[a]:
                        break
                else:
                    for a in unless:
                        if holds[a]:
                            break
                    else:
                        holds[head] = 1
                        order.append(head)
                        stack.extend(same[head])
                        for level, i in later[head]:
                            pending[level].append(i)
        by_kind: dict[str, list[Any]] = {kind: [] for kind in (KEPT, COPIED, AS_IS, REPLAYED, RECOMPUTED, STATE)}
        atoms = self._atoms
        needed = []
        for j in order:
            kind, key = atoms[j]
            by_kind[kind].append(key)
            if kind in (KEPT, COPIED, AS_IS):
                needed.append(key)
        return Resolution(
            needed=tuple(needed),
            kept=frozenset(by_kind[KEPT]),
            copied=frozenset(by_kind[COPIED]),
            as_is=frozenset(by_kind[AS_IS]),
            replayed=frozenset(by_kind[REPLAYED]),
            recomputed=frozenset(by_kind[RECOMPUTED]),
            states=tuple(sorted(by_kind[STATE])),
        )

    def rows(self, atoms: Iterable[Atom]) -> tuple[Row, ...]:
        """The clauses as linear rows over 0-1 variables (for the budget planner's program), and the
        converse rows that make the atoms an `unless` reads exact (a claim the planner could otherwise
        make for free: say, a kept constant that stops a recomputation). `atoms` are the program's other
        variables, and those of them no clause derives are zero. (Made once per `atoms`: planners ask
        often.)"""
        key = tuple(atoms)
        found = self._rows.get(key)
        if found is None:
            found = self._rows.setdefault(key, tuple(self._made_rows(key)))
        return found

    def _made_rows(self, atoms: tuple[Atom, ...]) -> Iterator[Row]:
        rows = []
        bodies: dict[Atom, list[Clause]] = {}
        for clause in self.clauses:
            bodies.setdefault(clause.head, []).append(clause)
            # head >= when - unless - (|when| - 1)
            coefficients: dict[Atom, float] = {atom: 1.0 for atom in clause.when}
            for atom in clause.unless:
                coefficients[atom] = coefficients.get(atom, 0.0) - 1.0
            coefficients[clause.head] = coefficients.get(clause.head, 0.0) - 1.0
            rows.append(Row(coefficients, len(clause.when) - 1.0))
        exact = _read_by_unless(self.clauses)
        for head in dict.fromkeys([*atoms, *bodies]):
            if head.kind in exact:
                rows.extend(_converse(head, bodies.get(head, [])))
        return iter(rows)


def _converse(head: Atom, clauses: list[Clause]) -> Iterator[Row]:
    """Rows saying `head` holds only if one of its clauses' bodies does (in linear form: it implies
    every literal they share, and, when each has a triggering atom, one of those)."""
    if not clauses:
        yield Row({head: 1.0}, 0.0)
        return
    common_when = set.intersection(*(set(c.when) for c in clauses))
    common_unless = set.intersection(*(set(c.unless) for c in clauses))
    for atom in sorted(common_when):
        yield Row({head: 1.0, atom: -1.0}, 0.0)
    for atom in sorted(common_unless):
        yield Row({head: 1.0, atom: 1.0}, 1.0)
    rest = [[a for a in c.when if a not in common_when] for c in clauses]
    if all(rest):
        some = dict.fromkeys(atoms[0] for atoms in rest)
        yield Row({head: 1.0, **{atom: -1.0 for atom in some}}, 0.0)


def _strata(clauses: Collection[Clause]) -> dict[str, int]:
    """The stratum of each atom kind: at least those of the atoms its clauses need, above those they
    need not to hold (so that an `unless` reads only atoms already final)."""
    shapes = _shapes(clauses)
    stratum: dict[str, int] = {SAVED: 0}
    kinds = {head for head, _, _ in shapes}
    for _ in range(len(kinds) + 1):
        changed = False
        for head, when, unless in shapes:
            need = max([1, *(stratum.get(k, 1) for k in when), *(stratum.get(k, 1) + 1 for k in unless)])
            if stratum.get(head, 1) < need:
                stratum[head] = need
                changed = True
        if not changed:
            return {kind: stratum.get(kind, 1) for kind in kinds | {SAVED}}
    raise AssertionError("remat: the rules are not stratified (an atom needs its own absence)")


def _read_by_unless(clauses: Collection[Clause]) -> set[str]:
    """The atom kinds an `unless` reads and those their clauses need, except the decisions."""
    shapes = _shapes(clauses)
    exact = {k for _, _, unless in shapes for k in unless} - {SAVED}
    grown = True
    while grown:
        needed = {k for head, when, unless in shapes if head in exact for k in (*when, *unless)} - {SAVED}
        grown = not needed <= exact
        exact |= needed
    return exact


def _shapes(clauses: Collection[Clause]) -> set[tuple[str, frozenset[str], frozenset[str]]]:
    """The clauses' kinds: (head, when, unless), each once."""
    return {(c.head.kind, frozenset(a.kind for a in c.when), frozenset(a.kind for a in c.unless)) for c in clauses}


_cache: weakref.WeakKeyDictionary[ValueGraph, dict[tuple[bool, bool], Rules]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def rules_of(graph: ValueGraph, forward_mode: bool = False, *, inputs: bool = True) -> Rules:
    """The rules of `graph` (made once per graph and arguments). Without `inputs`, they leave out
    which inputs are read as they are (no clause reads that, and it costs nothing): what the
    accounting and the planners need, not the partition."""
    with _cache_lock:
        by_mode = _cache.setdefault(graph, {})
    key = (forward_mode, inputs)
    found = by_mode.get(key)
    if found is None:
        found = by_mode.setdefault(key, Rules(graph, forward_mode, frozenset() if inputs else frozenset({AS_IS})))
    return found
