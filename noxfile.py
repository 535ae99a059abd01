"""Developer sessions: `nox -s tests`, `nox -s fast`, `nox -s coverage`, `nox -s lint`, `nox -s doctest`,
`nox -s soak`, `nox -s bench`, `nox -s docs`, `nox -s torchtitan`.

`nox -s tests` runs the suite on every supported torch release, each in its own venv, and records the
results in docs/torch-versions.md; `nox -s "tests(torch='2.15.0')"` runs one.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import nox

# The newest patch of each minor release remat supports (remat/_torch/_releases.py: SUPPORTED).
TORCH_RELEASES = ["2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
DEFAULT_TORCH = "2.13.0"  # the CPU build lies on this machine's disk; the others are CUDA builds from the registry

nox.options.sessions = [f"tests(torch='{DEFAULT_TORCH}')", "lint"]
nox.options.default_venv_backend = "venv"

# A machine-wide pip config here caps torch at 2.14.1. A newer release is installed as a user without
# that config would install it: with the config ignored, for torch and for remat's own dependencies
# (which the cap would otherwise resolve back down to 2.14.1).
_CAPPED_AT = (2, 14, 1)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split("."))


def install(session: nox.Session, extras: str, torch: str = DEFAULT_TORCH) -> None:
    env = {"PIP_CONFIG_FILE": os.devnull} if _release(torch) > _CAPPED_AT else {}
    session.install(f"torch=={torch}", env=env)
    session.install("-e", f".[{extras}]", env=env)


@nox.session
@nox.parametrize("torch", TORCH_RELEASES)
def tests(session: nox.Session, torch: str) -> None:
    """The test suite (doctests included), with the fast hypothesis profile, on one torch release.

    Without extra arguments, the counts are written to docs/torch-versions.md.
    """
    started = time.monotonic()
    install(session, "test", torch)
    installed = time.monotonic() - started
    junit = Path(session.create_tmp()) / "junit.xml"
    started = time.monotonic()
    session.run(
        "python", "-m", "pytest", "-n", "auto", "-q", f"--junitxml={junit}", *session.posargs, success_codes=[0, 1]
    )  # fmt: skip
    seconds = time.monotonic() - started
    counts = _counts(junit)
    if not session.posargs:
        _record(torch, counts, seconds, installed)
    if counts["failed"] or not counts["passed"]:
        session.error(f"torch {torch}: {counts['failed']} failed, {counts['passed']} passed")


def _counts(junit: Path) -> dict[str, int]:
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, f"{junit} holds no test suite"
    total, failed, errors, skipped = (int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed + errors, "skipped": skipped}


_TABLE = Path(__file__).parent / "docs" / "torch-versions.md"
_BEGIN, _END = "<!-- nox tests: begin -->", "<!-- nox tests: end -->"


def _record(torch: str, counts: dict[str, int], seconds: float, installed: float) -> None:
    """Replace this release's row of the table in docs/torch-versions.md (rows kept in release order)."""
    text = _TABLE.read_text()
    head, rest = text.split(_BEGIN)
    rows_text, tail = rest.split(_END)
    rows = {}
    for line in rows_text.strip().splitlines()[2:]:
        rows[line.split("|")[1].strip()] = line
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows[torch] = (
        f"| {torch} | {counts['passed']} | {counts['failed']} | {counts['skipped']} | {seconds / 60:.1f} min "
        f"| {installed / 60:.1f} min | {date} | {commit or '?'} | {machine} |"
    )
    header = (
        "| torch | passed | failed | skipped | suite | install | date | commit | machine |\n"
        "|---|---:|---:|---:|---:|---:|---|---|---|"
    )
    body = "\n".join(rows[version] for version in sorted(rows, key=_release))
    _TABLE.write_text(f"{head}{_BEGIN}\n{header}\n{body}\n{_END}{tail}")


# The edit-test loop: the suite without the tests marked `slow` (tests/conftest.py says which).
FAST = ["-m", "not slow"]


@nox.session
def fast(session: nox.Session) -> None:
    """The fast selection, `python -m pytest -n auto -q -m "not slow"`: about a minute on two cores."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-n", "auto", "-q", *FAST, *session.posargs)


@nox.session
def coverage(session: nox.Session) -> None:
    """Line coverage of each module of remat, by the whole suite and by the fast selection.

    Fails where the fast selection covers a module less than half as well as the whole suite does:
    then a test of that module belongs in the fast selection.
    """
    install(session, "test")
    session.install("pytest-cov")
    reports = {}
    for name, selection in (("suite", []), ("fast", FAST)):
        reports[name] = Path(session.create_tmp()) / f"coverage-{name}.json"
        session.run(
            "python", "-m", "pytest", "-n", "auto", "-q", *selection, "--cov=remat",
            f"--cov-report=json:{reports[name]}", "--cov-report=", *session.posargs,
        )  # fmt: skip
    short = compare_coverage(reports["suite"], reports["fast"])
    if short:
        session.error(f"the fast selection covers less than half of what the suite covers in: {', '.join(short)}")


def compare_coverage(suite: Path, fast: Path) -> list[str]:
    """Print each module's coverage by both runs; return the modules the fast run covers under half as well."""
    percent = {
        name: {
            module: data["summary"]["percent_covered"] for module, data in json.loads(path.read_text())["files"].items()
        }
        for name, path in (("suite", suite), ("fast", fast))
    }
    print(f"{'module':<28} {'suite':>6} {'fast':>6}")
    short = []
    for module, covered in sorted(percent["suite"].items()):
        by_fast = percent["fast"].get(module, 0.0)
        print(f"{module:<28} {covered:5.1f}% {by_fast:5.1f}%")
        if by_fast < covered / 2:
            short.append(module)
    return short


@nox.session
def doctest(session: nox.Session) -> None:
    """The `>>>` examples of every public docstring."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-q", "remat", *session.posargs)


@nox.session
def soak(session: nox.Session) -> None:
    """The tests with the long hypothesis profile (over 10,000 random functions in tests/test_testing.py).

    Failures are appended to soak-failures.txt (or $REMAT_SOAK_FAILURES). Pass test paths to narrow
    it: `nox -s soak -- tests/test_testing.py`.
    """
    install(session, "test")
    session.run(
        "python", "-m", "pytest", "-n", "auto", "-q", "--timeout=0", *(session.posargs or ["tests"]),
        env={"HYPOTHESIS_PROFILE": "soak"},
    )  # fmt: skip


TORCHTITAN = "0.3.0"


@nox.session
def torchtitan(session: nox.Session) -> None:
    """torchtitan as a client (tests/test_torchtitan.py): its llama3 debug model trained on the CPU with
    remat as its activation checkpointing, on 1 and 2 processes, and planned by `fit` within a byte budget
    per rank on 2, its losses compared with torchtitan's selective and full checkpointing; on the newest
    torch (torchtitan needs 2.14 or newer). Not part of CI: installing a CUDA build of torch and
    torchtitan's dependencies, then eleven training runs, would take CI past its 20 minutes."""
    torch = TORCH_RELEASES[-1]
    env = {"PIP_CONFIG_FILE": os.devnull} if _release(torch) > _CAPPED_AT else {}
    session.install(f"torch=={torch}", env=env)
    session.install(f"torchtitan=={TORCHTITAN}", env=env)
    session.install("-e", ".[test,torchtitan]", env=env)  # after torchtitan: transformers' hub over datasets' pin
    session.run("python", "-m", "pytest", "-q", "-p", "no:randomly", "tests/test_torchtitan.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmarks (docs/benchmarks.md): `nox -s bench -- --suite cpu --repeats 15`.

    Arguments after `--` go to `python -m benchmarks`; results land in benchmarks/results/.
    """
    install(session, "bench")
    session.run("python", "-m", "benchmarks", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml), built with `mkdocs build --strict`: any warning fails it."""
    install(session, "docs")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """Formatting, lint and type checks over the whole package."""
    install(session, "dev")
    session.run("ruff", "format", "--check", "remat", "tests", "examples", "noxfile.py")
    session.run("ruff", "check", "remat", "tests", "examples", "noxfile.py")
    session.run("mypy")
