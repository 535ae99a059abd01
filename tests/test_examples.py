"""Every script in examples/ runs to completion, warning-free, and prints its key line.

Each example checks its own claim (gradients equal, memory lower, loss falling)
and exits non-zero if it does not hold; these tests run them as users would, as
subprocesses, with arguments small enough for CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example runs in a process of its own


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# script -> (arguments, a line its output must contain); "{tmp}" is the test's temporary folder.
RUNS: dict[str, tuple[list[str], str]] = {
    "quickstart.py": ([], "save_everything"),
    "per_sample_grads.py": ([], "per-sample gradient norms match the unwrapped model's"),
    "train_gpt.py": (["--steps", "20"], "OK: loss fell from"),
    "custom_function.py": (["--steps", "1"], "calls inside ScaledTanh"),
    "budget.py": (["--out", "{tmp}"], "OK: within budget"),
    "fsdp_train.py": (["--steps", "2", "--depth", "2"], "OK: 2 ranks, losses and gradients equal"),
}


def test_every_example_is_run() -> None:
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs(script: str, tmp_path: Path) -> None:
    arguments, key_line = RUNS[script]
    command = [sys.executable, "-W", "error", str(EXAMPLES / script)]
    command += [argument.replace("{tmp}", str(tmp_path)) for argument in arguments]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env=environment
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert key_line in result.stdout, f"{script} did not print {key_line!r}:\n{result.stdout[-3000:]}"
    assert "MISMATCH" not in result.stdout
    if script == "budget.py":
        assert (tmp_path / "pareto.png").stat().st_size > 0
