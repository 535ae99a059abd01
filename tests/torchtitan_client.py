"""torchtitan's llama3 debug model, trained on the CPU with a chosen activation checkpointing; run by
tests/test_torchtitan.py, alone or under `torchrun --nproc_per_node 2` (FSDP2 over gloo):

    python tests/torchtitan_client.py ASSETS OUT.json {remat,remat-fit:BYTES,selective,full,none} [SPMD_BACKEND]

ASSETS holds the tokenizer and the data set (`write_assets`, made by the test: nothing from a hub).
Rank 0 writes, per step, the loss and gradient norm torchtitan logs, and each block's cache counts;
with `remat-fit:BYTES` (`RematAC.Config(peak_bytes=BYTES)`), the plans every rank made.

remat is plugged in through torchtitan's own configuration: the trainer's `activation_checkpoint` field
takes `remat.torchtitan.RematAC.Config`, as docs/distributed.md shows. torchtitan's source is not
patched; what the CPU needs is shimmed in this process only, for every run alike (`_shim_for_the_cpu`).
"""

from __future__ import annotations

import json
import os
import random
import sys
import types
from pathlib import Path
from typing import Any

import torch


def write_assets(root: Path, words: int = 200, documents: int = 200) -> None:
    """A word-level tokenizer (with the special tokens torchtitan's llama3 reads) and a small data set
    of random documents, in the layout torchtitan's `c4_test` loader reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = [f"w{i}" for i in range(words)]
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*specials, *vocabulary, "<unk>"])}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[1]}
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    rng = random.Random(0)
    (root / "data").mkdir(exist_ok=True)
    with open(root / "data" / "data.json", "w") as lines:
        for _ in range(documents):
            text = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(20, 200)))
            lines.write(json.dumps({"text": text}) + "\n")


def _shim_for_the_cpu() -> None:
    """What torchtitan needs to train on a machine without a GPU (before its trainer is imported)."""
    import torch.nn.attention.flex_attention as flex
    import torchtitan.tools.utils

    class CPUModule(types.SimpleNamespace):
        """torch.cpu, with what torchtitan asks of a device module (it falls back to `cuda`)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cpu, name)

        get_device_name = staticmethod(lambda device=None: "cpu")
        current_device = staticmethod(lambda: 0)
        get_device_properties = staticmethod(lambda device=None: types.SimpleNamespace(total_memory=1 << 34))
        reset_peak_memory_stats = staticmethod(lambda device=None: None)
        empty_cache = staticmethod(lambda: None)
        memory_stats = staticmethod(lambda device=None: {"num_alloc_retries": 0, "num_ooms": 0})
        set_device = staticmethod(lambda device: None)
        device_count = staticmethod(lambda: 1)
        synchronize = staticmethod(lambda device=None: None)

    torchtitan.tools.utils.device_type, torchtitan.tools.utils.device_module = "cpu", CPUModule()
    from torchtitan.models.common.attention import FlexAttention

    # Flex attention: torch's Python wrapper refuses its backward on the CPU (the op itself runs), and
    # torchtitan compiles it with inductor, whose flex kernels are for GPUs: the op runs uncompiled.
    flex._validate_device = lambda *args: None  # type: ignore[attr-defined]
    FlexAttention._compiled_flex_attn = flex.flex_attention


def _sum_reductions(trainer: Any) -> None:
    """gloo has no PREMUL_SUM: FSDP2 reduces gradients with plain sums and divides after."""
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def _plan_record(plan: Any) -> dict[str, Any]:
    report = plan.report
    return {
        "peak_bytes": plan.peak_bytes,
        "predicted_peak": plan.predicted_peak,
        "peak_keeping_nothing": report.peak_keeping_nothing,
        "peak_keeping_everything": report.peak_keeping_everything,
        "unsharded": report.unsharded,
        "replays": [any(d.name == "RECOMPUTE" for d in block.decisions) for block in plan.blocks],
        "text": str(plan),
    }


def main(assets: Path, out: Path, checkpointing: str, spmd_backend: str | None) -> None:
    _shim_for_the_cpu()
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from remat.torchtitan import RematAC

    if "RANK" not in os.environ:  # one process, without a launcher
        os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
    config = llama3_debugmodel()
    config.hf_assets_path = str(assets / "tokenizer")
    config.dataloader.dataset_path = str(assets / "data")
    config.training.steps, config.training.seq_len, config.training.local_batch_size = 4, 64, 2
    config.training.disable_cuda_graphs = True
    config.debug.seed = 0
    config.dump_folder = str(out.parent / f"dump-{out.stem}")
    if spmd_backend is not None:
        config.parallelism.spmd_backend = spmd_backend
    if checkpointing.startswith("remat-fit:"):
        config.activation_checkpoint = RematAC.Config(peak_bytes=int(checkpointing.split(":")[1]))
    else:
        config.activation_checkpoint = {
            "remat": lambda: RematAC.Config(),
            "selective": SelectiveAC.Config,
            "full": FullAC.Config,
            "none": lambda: None,
        }[checkpointing]()
    trainer = config.build()
    _sum_reductions(trainer)
    steps: list[dict[str, float]] = []
    log = trainer.metrics_processor.log

    def logged(step: int, loss: float, max_loss: float, grad_norm: float, **rest: Any) -> Any:
        steps.append({"step": step, "loss": loss, "grad_norm": grad_norm})
        return log(step, loss, max_loss, grad_norm, **rest)

    trainer.metrics_processor.log = logged
    try:
        trainer.train()
    finally:
        trainer.close()
    blocks = list(trainer.model_parts[0].get_submodule("layers").children())
    caches = []
    for block in blocks:
        cache_info = getattr(block.__dict__.get("forward"), "cache_info", None)  # a checkpointed block's
        info = None if cache_info is None else cache_info()
        caches.append(None if info is None else {"traces": info.traces, "shared": info.shared})
    model = trainer.model_parts[0]
    planner = getattr(model.__dict__.get("forward"), "planner", None)  # a model `remat.fit` plans
    plans = [] if planner is None else [_plan_record(plan) for _, plan in planner.fits.items()]
    if torch.distributed.is_initialized():  # every rank's
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, plans)
        plans = [plan for rank in everyone for plan in rank]
    if os.environ["RANK"] == "0":
        out.write_text(json.dumps({"steps": steps, "caches": caches, "plans": plans}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
