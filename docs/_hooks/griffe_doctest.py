"""A griffe extension: render the `>>>` examples of remat's docstrings as code blocks.

remat's docstrings put their doctest examples in the description, where Markdown would read `>>>` as
a block quote and `[...]` outputs as reference links. This wraps each doctest block (a `>>>` line and
what follows it up to a blank line) in a ```` ```pycon ```` fence before the docstring is parsed.
The docstrings themselves, and what the doctest session runs, are unchanged.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    in_fence = False
    in_block = False
    indent = ""
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_block and not stripped:
            out.append(f"{indent}```")
            in_block = False
        if not in_fence and not in_block and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            in_block = True
        out.append(line)
    if in_block:
        out.append(f"{indent}```")
    return "\n".join(out)


class FenceDoctests(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
