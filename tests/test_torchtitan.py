"""torchtitan as a real client: its llama3 debug model trains with remat as its activation checkpointing,
on one process and on two (FSDP2 over gloo), with the losses and gradient norms of its own; and with
`RematAC.Config(peak_bytes=...)`, planned by `remat.fit` on each rank within the budget.

Each run is a process of its own (tests/torchtitan_client.py, under torchrun for two). Skipped where
torchtitan is not installed: `nox -s torchtitan` installs it (it needs torch 2.14 or newer).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan (nox -s torchtitan)"),
]

CLIENT = Path(__file__).parent / "torchtitan_client.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(tmp: Path, processes: int, checkpointing: str, spmd_backend: str | None = None) -> dict[str, Any]:
    """The steps torchtitan logged, and each block's cache counts (None where remat is not in use)."""
    out = tmp / f"{checkpointing}-{processes}-{spmd_backend}.json"
    port = str(_free_port())
    arguments = [str(tmp / "assets"), str(out), checkpointing, *([spmd_backend] if spmd_backend else [])]
    if processes == 1:
        command = [sys.executable, str(CLIENT), *arguments]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}"]
        command = [*launcher, f"--master_port={port}", str(CLIENT), *arguments]
    environment = {**os.environ, "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp, env=environment)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(CLIENT.parent))
    try:
        import torchtitan_client
    finally:
        sys.path.remove(str(CLIENT.parent))
    root = tmp_path_factory.mktemp("torchtitan")
    torchtitan_client.write_assets(root / "assets")
    return root


@pytest.mark.parametrize("processes", [1, 2], ids=["1 process", "2 processes (FSDP2)"])
def test_remat_trains_torchtitans_llama3_as_its_own_activation_checkpointing(assets: Path, processes: int) -> None:
    own = {name: train(assets, processes, name)["steps"] for name in ("selective", "full")}
    assert len(own["selective"]) == 4
    assert own["full"] == own["selective"]  # the reference: torchtitan's two ways agree bit for bit
    for backend in ("spmd_types", "partial_dtensor"):
        run = train(assets, processes, "remat", backend)
        assert run["steps"] == own["selective"], backend  # losses and gradient norms, bit for bit
        # The blocks share one trace, although each module carries its own `forward` closure and
        # sharding configuration (NOTE [sharing traces between identical blocks]).
        caches = run["caches"]
        assert caches[0] == {"traces": 1, "shared": 0}, backend
        assert caches[1:] == [{"traces": 0, "shared": 1}] * (len(caches) - 1), backend


def test_fit_from_torchtitans_config_plans_each_ranks_step_after_sharding(assets: Path) -> None:
    # `RematAC.Config(peak_bytes=...)`: planned at the first step, on every rank, on the sharded model.
    selective = train(assets, 2, "selective")["steps"]
    unbound = train(assets, 2, f"remat-fit:{2**40}")
    assert unbound["steps"] == selective
    first = unbound["plans"][0]
    nothing, everything = first["peak_keeping_nothing"], first["peak_keeping_everything"]
    assert nothing < everything and first["predicted_peak"] == everything and not any(first["replays"])
    target = (nothing + everything) // 2
    run = train(assets, 2, f"remat-fit:{target}")
    assert run["steps"] == selective  # losses and gradient norms, bit for bit
    plans = run["plans"]
    assert len(plans) == 2  # one per rank: the first step's batch shape, planned once
    assert plans[0]["replays"] == plans[1]["replays"]  # every rank checkpoints alike
    assert any(plans[0]["replays"]) and not all(plans[0]["replays"])  # the target binds
    for plan in plans:
        assert plan["predicted_peak"] <= target == plan["peak_bytes"]
        assert plan["unsharded"] > 0  # planned on the sharded model: FSDP2's gathered parameters counted
