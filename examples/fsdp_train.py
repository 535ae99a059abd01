"""Train with remat inside FSDP2: checkpointed blocks, sharded parameters, gradients checked.

A small residual MLP stack is sharded with `torch.distributed.fsdp.fully_shard` (one unit per
block, parameters re-gathered for forward and again for backward), after its blocks were
checkpointed in place with `remat.checkpoint_modules`, as torchtitan applies activation
checkpointing before FSDP. Each rank trains a few steps on its own data, and checks its loss
and every gradient against the same model without checkpoints, sharded the same way.

    torchrun --nproc-per-node 2 examples/fsdp_train.py          # CPU (gloo) or GPUs (nccl)
    python examples/fsdp_train.py                               # starts 2 CPU processes itself
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

import remat


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def save_first_linear(call: remat.Call) -> bool:
    """A per-call policy: keep each block's first matmul, replay the GELU and the rest."""
    return call.module == "fc1"


def shard(model: nn.Sequential) -> nn.Module:
    for block in model:
        fully_shard(block, reshard_after_forward=True)
    return fully_shard(model)


def activation_bytes(policy: remat.policies.PolicyLike, width: int, depth: int, x: torch.Tensor) -> int:
    """Activation bytes one rank keeps for backward: `depth` blocks, as `remat.report` counts them
    (`save_everything` keeps what eager keeps); parameters, sharded or not, are not activations."""
    block = Block(width).to(x.device)
    return depth * remat.report(block, x, policy=policy).saved_bytes


def activations_after_forward(model: nn.Module, x: torch.Tensor) -> int:
    """Activation bytes one forward leaves alive for backward, measured by `FSDPMemTracker`, which
    follows every tensor and tells activations from FSDP's own buffers. Total allocated memory is no
    measure here: whether a block's re-gathered parameters are still alive when forward returns is
    up to FSDP's timing, and one block's parameters weigh as much as the activations remat saves."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    tracker = FSDPMemTracker(model)
    with tracker:
        loss = model(x).square().mean()
        live = tracker.get_tracker_snapshot("current").get(x.device, {}).get(_FSDPRefType.ACT, 0)
        loss.backward()
    return int(live)


def train(steps: int, width: int, depth: int) -> None:
    rank, device = dist.get_rank(), torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial model on every rank
    plain = nn.Sequential(*[Block(width) for _ in range(depth)]).to(device)
    checkpointed = copy.deepcopy(plain)
    remat.checkpoint_modules(checkpointed, Block, policy=save_first_linear)
    models = {"no checkpoint": shard(plain), "remat": shard(checkpointed)}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, model in models.items()}
    generator = torch.Generator(device).manual_seed(rank)  # each rank its own data
    for step in range(steps):
        x = torch.randn(32, width, device=device, generator=generator)
        losses, grads = {}, {}
        for name, model in models.items():
            optimizers[name].zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            losses[name] = loss.item()
            grads[name] = [p.grad.full_tensor() for p in model.parameters()]
            optimizers[name].step()
        error = max(float((a - b).abs().max()) for a, b in zip(grads["remat"], grads["no checkpoint"], strict=True))
        if rank == 0:
            print(f"step {step}: loss {losses['remat']:.5f} (no checkpoint {losses['no checkpoint']:.5f}), ", end="")
            print(f"max gradient difference {error:.1e}")
        assert abs(losses["remat"] - losses["no checkpoint"]) <= 1e-5 * abs(losses["no checkpoint"]), losses
        assert error <= 1e-5, error
    eager_bytes = activation_bytes(remat.policies.save_everything, width, depth, x)
    remat_bytes = activation_bytes(save_first_linear, width, depth, x)
    eager_live, remat_live = (activations_after_forward(model, x) for model in models.values())
    if rank == 0:
        print(f"activations kept for backward per rank: {eager_bytes:,} bytes without remat, {remat_bytes:,} with")
        print(f"measured alive after forward per rank: {eager_live:,} bytes without remat, {remat_live:,} with")
    assert remat_bytes < eager_bytes
    # The tracker also counts the forward's output and the loss, alike for both models, so the bytes
    # remat saves must be the report's to the byte.
    assert eager_live - remat_live == eager_bytes - remat_bytes, (eager_live, remat_live)
    if rank == 0:
        print(f"OK: {dist.get_world_size()} ranks, losses and gradients equal to the model without checkpoints")


def _spawned(rank: int, world: int, port: int, steps: int, width: int, depth: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    _run(steps, width, depth)
    # Leave without the interpreter's shutdown: now and then a gloo worker thread still being torn
    # down aborts the process there ("terminate called without an active exception"), after the
    # work is done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(steps: int, width: int, depth: int) -> None:
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend)
    try:
        train(steps, width, depth)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--processes", type=int, default=2, help="when not started by torchrun")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # started by torchrun
        _run(args.steps, args.width, args.depth)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.processes, port, args.steps, args.width, args.depth), nprocs=args.processes)


if __name__ == "__main__":
    main()
