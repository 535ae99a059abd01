"""The torch.func table of docs/torch-func.md, as tests: every transform through remat gives what it gives
on the unwrapped MLP; the peers fail where their rows say, raising what the rows say (strict expected
failures: a peer that starts working fails here until its row says so); and the page shows the same."""

from __future__ import annotations

import importlib.util
import re

import pytest

from benchmarks import transform_table as table
from benchmarks.transform_table import METHODS, REFERENCE, ROWS, TORCH_REMAT, Method, Row
from remat import _torch


def _cases() -> list[object]:
    cases = []
    for row in ROWS:
        for method in METHODS[1:]:
            marks = []
            if method.name == TORCH_REMAT and importlib.util.find_spec("torch_remat") is None:
                marks.append(pytest.mark.skip(reason="torch_remat is not installed (pip install torch-remat)"))
            fails = table.fails_on(row, _torch.RELEASE)
            if method.name in fails:
                marks.append(pytest.mark.xfail(raises=fails[method.name], strict=True))
            cases.append(pytest.param(row, method, marks=marks, id=f"{row.name} | {method.name}"))
    return cases


@pytest.mark.parametrize(("row", "method"), _cases())
def test_a_transform_through_a_method_equals_it_on_the_unwrapped_function(row: Row, method: Method) -> None:
    expected = table.run(row, REFERENCE)
    got = table.run(row, method)
    assert table.same(got, expected)


def test_only_peers_are_declared_to_fail() -> None:
    peers = {table.CHECKPOINT, table.SAC, TORCH_REMAT}
    assert all(set(table.fails_on(row, release)) <= peers for row in ROWS for release in _torch.SUPPORTED)
    assert {name for row in ROWS for name in row.fails} == peers
    assert not any(method.name.startswith("remat") for method in METHODS if method.name in peers)


def _page_cells() -> dict[str, dict[str, str]]:
    """The table of docs/torch-func.md: row name -> method name -> cell text."""
    text = table.PAGE.read_text()
    generated = text[text.index(table.BEGIN) : text.index(table.END)]
    lines = [line for line in generated.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows[cells[0]] = dict(zip(header[1:], cells[1:], strict=True))
    return rows


def test_the_page_shows_what_the_rows_declare() -> None:
    page = _page_cells()
    assert list(page) == [row.name for row in ROWS]
    for row in ROWS:
        assert list(page[row.name]) == [method.name for method in METHODS]
        for method in METHODS:
            cell = page[row.name][method.name]
            failure = row.fails.get(method.name)
            if failure is None:
                assert cell == "works", (row.name, method.name, cell)
            else:
                assert cell.startswith(f"{failure.__name__}:"), (row.name, method.name, cell)
