"""What tracing notes about a traced graph's nodes for the stages after it, one typed accessor per fact.

The facts live in `node.meta`, under keys only this module names: the code that notes them (the capture
mode, the modes of `_in_place` and `_noting_modes`, the joint graph's builder) and the code that reads
them (the rules, the programs, the trace's calls) go through these functions, so each fact has one type
and one definition.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from torch import fx

__all__ = [
    "CallSite",
    "CustomApplication",
    "application_of",
    "computed_without_grad",
    "note_application",
    "note_computed_without_grad",
    "note_stacked_under_vmap",
    "note_written_in_place",
    "written_in_place",
    "stacked_under_vmap",
    "StopGradient",
    "add_tag",
    "differentiable_outputs",
    "fill_of",
    "note_differentiable_outputs",
    "note_fill",
    "note_site",
    "note_stop_gradient",
    "site_of",
    "stop_gradient_of",
    "tags_of",
]

_STOPS, _SITE, _FILL, _TAGS, _DIFFERENTIABLE, _APPLICATION, _WITHOUT_GRAD = (
    "remat_stops_gradient",
    "remat_site",
    "remat_fill",
    "remat_tags",
    "remat_differentiable_outputs",
    "remat_application",
    "remat_computed_without_grad",
)
_STACKED = "remat_stacked_under_vmap"
_IN_PLACE = "remat_in_place_in_base_layout"

# Why `fn` computed a value where autograd does not see: through a `detach()`, under `no_grad`, or as
# an in-place update under `no_grad` (see NOTE [differentiating the forward again]).
StopGradient = Literal["detach", "no_grad", "no_grad_update"]


@dataclasses.dataclass(frozen=True)
class CallSite:
    """Where an op call came from: module path, source line, and the custom
    `autograd.Function`s it runs inside (outermost first, joined by "/")."""

    module: str | None
    source: str | None
    scope: str | None = None


def stop_gradient_of(node: fx.Node) -> StopGradient | None:
    """Why `fn` computed `node` where autograd does not see, or None."""
    return node.meta.get(_STOPS)  # type: ignore[no-any-return]


def note_stop_gradient(node: fx.Node, why: StopGradient | None, *, unless_noted: bool = False) -> None:
    """Note why `node` stops the gradient (None: it does not, a view passing a history on); with
    `unless_noted`, only where nothing was noted yet."""
    if not unless_noted or _STOPS not in node.meta:
        node.meta[_STOPS] = why


def site_of(node: fx.Node) -> CallSite:
    """Where the call of `node` came from (nothing known: a node tracing made itself)."""
    return node.meta.get(_SITE, CallSite(None, None))  # type: ignore[no-any-return]


def note_site(node: fx.Node, site: CallSite) -> None:
    """Note where the call of `node` came from, unless noted already (the innermost call says)."""
    node.meta.setdefault(_SITE, site)


def fill_of(node: fx.Node) -> Any:
    """How eager laid out the random fill `node` draws (`_random_fills.FillInEagerLayout`), or None: NOTE [random fills
    draw in eager's layout]."""
    return node.meta.get(_FILL)


def note_fill(node: fx.Node, fill: Any) -> None:
    node.meta[_FILL] = fill


def tags_of(node: fx.Node) -> frozenset[str]:
    """The names `remat.tag` gave the value of `node`."""
    return node.meta.get(_TAGS, frozenset())  # type: ignore[no-any-return]


def add_tag(node: fx.Node, name: str) -> None:
    node.meta[_TAGS] = tags_of(node) | {name}


def differentiable_outputs(node: fx.Node) -> tuple[bool, ...] | None:
    """Which outputs of the multi-output call `node` autograd differentiates (None: not noted, all)."""
    return node.meta.get(_DIFFERENTIABLE)  # type: ignore[no-any-return]


def note_differentiable_outputs(node: fx.Node, flags: tuple[bool, ...]) -> None:
    node.meta[_DIFFERENTIABLE] = flags


@dataclasses.dataclass(frozen=True, eq=False)
class CustomApplication:
    """One application of a custom autograd Function in `fn`: the class, its arguments with each tensor
    as the graph node it was, the nodes of its tensor outputs (in order), and the nodes its forward made.
    See NOTE [custom Functions applied again]."""

    function: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[fx.Node, ...]
    region: tuple[fx.Node, ...]  # in the order traced

    def argument_nodes(self) -> list[fx.Node]:
        """The graph nodes of its tensor arguments, in order."""
        nodes: list[fx.Node] = []
        fx.node.map_arg((self.args, self.kwargs), nodes.append)
        return nodes


def application_of(node: fx.Node) -> tuple[CustomApplication, int] | None:
    """The custom Function application whose output `node` is, and which of its tensor outputs, or None."""
    return node.meta.get(_APPLICATION)  # type: ignore[no-any-return]


def note_application(node: fx.Node, application: CustomApplication, index: int) -> None:
    node.meta.setdefault(_APPLICATION, (application, index))


def computed_without_grad(node: fx.Node) -> bool:
    """Whether a backward traced in grad mode computed `node` with grad mode off (a `once_differentiable`
    backward): NOTE [regions of a backward without grad]."""
    return bool(node.meta.get(_WITHOUT_GRAD))


def note_computed_without_grad(node: fx.Node) -> None:
    node.meta[_WITHOUT_GRAD] = True


def stacked_under_vmap(node: fx.Node) -> bool:
    """Whether `node` marks the value of an op that vmap runs example by example, a stack under vmap:
    NOTE [ops vmap runs example by example]."""
    return bool(node.meta.get(_STACKED))


def note_stacked_under_vmap(node: fx.Node) -> None:
    node.meta[_STACKED] = True


def written_in_place(node: fx.Node) -> bool:
    """Whether `node` is the functional form of an in-place op (`masked_fill` for `masked_fill_`), whose
    value eager lays out as the tensor it wrote into: NOTE [in-place ops keep their tensor's layout]."""
    return bool(node.meta.get(_IN_PLACE))


def note_written_in_place(node: fx.Node) -> None:
    node.meta[_IN_PLACE] = True
