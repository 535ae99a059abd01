"""What CUDA's caching allocator counts for a tensor (remat/_memory/_cuda_allocator.py), against a table worked out
from the allocator's rules: requests round up to 512 bytes (or to a power-of-two division where set),
small and middling requests are carved from shared segments, and a request of 10 MiB or more takes its
whole 2 MiB-rounded segment where the rest is 1 MiB or less."""

from __future__ import annotations

import pytest
import torch

from remat import _torch
from remat._memory._cuda_allocator import AllocatorSettings, allocated_nbytes, block_nbytes, settings_from_environment
from remat._memory._measure import storage_nbytes

KIB, MIB, GIB = 2**10, 2**20, 2**30
DEFAULT = AllocatorSettings()

TABLE = [
    # (requested bytes, settings, bytes the allocator counts, why)
    (0, "", 0, "no block at all"),
    (1, "", 512, "the smallest block"),
    (512, "", 512, "a multiple of 512"),
    (513, "", 1024, "the next multiple of 512"),
    (MIB, "", MIB, "the largest small request"),
    (MIB + 1, "", MIB + 512, "from a 20 MiB segment, split"),
    (10 * MIB - 1, "", 10 * MIB, "rounded to 512, still below 10 MiB"),
    (10 * MIB, "", 10 * MIB, "its own segment, exactly"),
    (10 * MIB + 1, "", 10 * MIB + 512, "a 12 MiB segment, the 2 MiB rest split off"),
    (11 * MIB - 512, "", 11 * MIB - 512, "the rest is 1 MiB + 512: split off"),
    (11 * MIB, "", 12 * MIB, "the rest is exactly 1 MiB: the whole segment"),
    (11 * MIB + 512 * KIB, "", 12 * MIB, "the rest is half a MiB: the whole segment"),
    (11 * MIB + 512 * KIB, "expandable_segments:True", 11 * MIB + 512 * KIB, "expandable segments always split"),
    (11 * MIB - 512, "max_split_size_mb:20", 11 * MIB - 512, "below max_split_size: split"),
    (20 * MIB + 512 * KIB, "", 20 * MIB + 512 * KIB, "the 1.5 MiB rest split off"),
    (20 * MIB + 512 * KIB, "max_split_size_mb:20", 22 * MIB, "at or above max_split_size: never split"),
    (1200 * KIB, "roundup_power2_divisions:4", 1280 * KIB, "4 steps between 1 and 2 MiB: 1.25 MiB"),
    (1200 * KIB, "roundup_power2_divisions:2", 1536 * KIB, "2 steps: 1.5 MiB"),
    (MIB + 1, "roundup_power2_divisions:1", MIB + 512, "one division rounds nothing"),
    (1500, "roundup_power2_divisions:4", 1536, "below 512 x divisions: a multiple of 512"),
    (2500, "roundup_power2_divisions:4", 2560, "2048 to 4096 in steps of 512"),
    (3 * MIB, "roundup_power2_divisions:4", 3 * MIB, "on a step already"),
    (300 * MIB, "roundup_power2_divisions:[256:1,512:2,>:4]", 300 * MIB, "the 256 MiB interval: 1 division"),
    (600 * MIB, "roundup_power2_divisions:[256:1,512:2,>:4]", 768 * MIB, "the 512 MiB interval: 2 divisions"),
    (GIB + 1, "roundup_power2_divisions:[256:1,512:2,>:4]", GIB + 256 * MIB, "from 1 GiB up: 4 divisions"),
    (3 * MIB, "roundup_power2_divisions:[256:1,512:2,>:4]", 3 * MIB, "below the first size: its value (1)"),
    (
        3 * MIB + 1,
        "garbage_collection_threshold:0.6,roundup_power2_divisions:[2:4,>:8]",
        3 * MIB + 512 * KIB,
        "2 MiB: 4",
    ),
    (5 * MIB + 1, "roundup_power2_divisions:[2:4,>:8]", 5 * MIB + 512 * KIB, "from 4 MiB up: 8"),
]


@pytest.mark.parametrize(("requested", "settings", "counted", "why"), TABLE, ids=[row[3] for row in TABLE])
def test_a_block_counts_what_the_allocator_hands_out(requested: int, settings: str, counted: int, why: str) -> None:
    assert block_nbytes(requested, AllocatorSettings.parse(settings)) == counted


def test_settings_are_read_from_the_configuration_string() -> None:
    settings = AllocatorSettings.parse(
        "expandable_segments:True, max_split_size_mb:128,roundup_power2_divisions:[64:8,>:2]"
    )
    assert settings.expandable_segments and settings.max_split_bytes == 128 * MIB
    assert settings.divisions == (8,) * 7 + (2,) * 9  # 1 MiB to 64 MiB: 8; above: 2
    assert AllocatorSettings.parse("") == DEFAULT


def test_the_environment_names_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # As torch reads them: `PYTORCH_ALLOC_CONF`, else the older `PYTORCH_CUDA_ALLOC_CONF`.
    settings_from_environment.cache_clear()
    try:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        assert settings_from_environment().expandable_segments
        settings_from_environment.cache_clear()
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", "roundup_power2_divisions:4")
        assert settings_from_environment() == AllocatorSettings.parse("roundup_power2_divisions:4")
    finally:
        settings_from_environment.cache_clear()


def test_only_cuda_tensors_are_rounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    settings_from_environment.cache_clear()
    try:
        assert allocated_nbytes(4000, torch.device("cpu")) == 4000
        assert allocated_nbytes(4000, torch.device("meta")) == 4000
        assert allocated_nbytes(4000, torch.device("cuda", 1)) == 4096
        # remat's byte counts of a CUDA tensor, made without a GPU on a fake CUDA tensor: the allocator's
        with _torch.FakeTensorMode():
            on_gpu = torch.empty(1000, device="cuda")
            view = on_gpu.view(10, 100)
        assert storage_nbytes(on_gpu) == storage_nbytes(view) == 4096
        assert storage_nbytes(torch.empty(1000)) == 4000
    finally:
        settings_from_environment.cache_clear()
