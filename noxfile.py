"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s doctest`, `nox -s soak`, `nox -s bench`, `nox -s docs`."""

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch pulls a CUDA build


def install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (doctests included), with the fast hypothesis profile."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


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
        "python", "-m", "pytest", "-q", *(session.posargs or ["tests"]),
        env={"HYPOTHESIS_PROFILE": "soak"},
    )  # fmt: skip


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
