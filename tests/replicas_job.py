"""Jobs that torchrun starts for tests/test_replicas_training.py (gloo, CPU): replicated
state saved with one bit of one rank's copy flipped, as a bad core would.

    torchrun --nproc_per_node=4 tests/replicas_job.py flips OUT_DIR
    torchrun --nproc_per_node=3 tests/replicas_job.py resume OUT_DIR

Modes:
  flips   on 4 ranks, one after the other, each a run of its own:
          - "ddp" (warn) and "ddp-refuse" (compare_replicas = "refuse"): DDP + Adam on
            ranks 0..2 (a group of 3), saved with replicated=True at steps 1, 2 and 3
            (training between); before step 2 one rank flips one bit of one parameter
            (rank 2 in "ddp", rank 1 in "ddp-refuse") and puts it back after the save.
          - "hsdp": FSDP2 on a 2 x 2 mesh (replicate x shard): steps 1 and 2, rank 3
            flips a bit of its shard of a parameter before step 2; its copy's only
            other holder is rank 1.
          - "tp": tensor parallel on 4 ranks with a LayerNorm whose parameters are
            Replicate() (SequenceParallel): steps 1 and 2, rank 0 flips a bit of the
            norm's weight before step 2.
          Each rank writes OUT/flips-r<rank>.json: the parameters flipped, and each
          step's info as its commit returned it.
  resume  the "ddp-refuse" job restarted on 3 ranks: load_into its state with no step
          (the newest it may resume from), write OUT/resume-r<rank>.json with the step
          and whether every tensor equals what step 1 saved.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import ckptd

RANK = int(os.environ["RANK"])


def flip(param: torch.Tensor, byte: int = 5, bit: int = 4) -> None:
    """Flip one bit of this rank's copy of ``param``, in place (again: put it back)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    with torch.no_grad():
        local.data.view(-1).view(torch.uint8)[byte] ^= 1 << bit


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step * 10 + RANK % 3)  # each rank its own batch (data parallel)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def save(p: ckptd.Producer, state: dict, step: int, **kw) -> dict:
    info = p.save(state, step, **kw).wait(120)
    return {"step": step, "diverged": info.diverged, "rank": info.rank}


def ddp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def ddp(run: str, policy: str, flipper: int, group) -> dict:
    model = torch.nn.parallel.DistributedDataParallel(make_model(), process_group=group)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = []
    with ckptd.Producer(run=run, rank=RANK, world_size=3, compare_replicas=policy) as p:
        for step in (1, 2, 3):
            train_step(model, opt, step)
            target = model.module[2].weight
            if step == 2 and RANK == flipper:
                flip(target)
            steps.append(save(p, ddp_state(model, opt), step, replicated=True))
            if step == 2 and RANK == flipper:
                flip(target)  # put back: the ranks train on in step
    return {"flipped": "model.module.2.weight", "steps": steps}


def hsdp() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = []
    with ckptd.Producer(run="hsdp", rank=RANK, world_size=4) as p:
        for step in (1, 2):
            train_step(model, opt, step)
            if step == 2 and RANK == 3:
                flip(model[0].weight)
            steps.append(save(p, {"model": model.state_dict()}, step))
    return {"flipped": "model.0.weight", "steps": steps}


def tensor_parallel() -> dict:
    mesh = init_device_mesh("cpu", (4,))
    model = parallelize_module(make_model(), mesh, {"0": ColwiseParallel(), "1": SequenceParallel(),
                                                   "2": RowwiseParallel()})
    assert isinstance(model[1].weight, DTensor), "the norm's weight should be a Replicate() DTensor"
    steps = []
    with ckptd.Producer(run="tp", rank=RANK, world_size=4) as p:
        for step in (1, 2):
            if step == 2 and RANK == 0:
                flip(model[1].weight)
            steps.append(save(p, {"model": model.state_dict()}, step))
    return {"flipped": "model.1.weight", "steps": steps}


def flips(out: Path) -> None:
    group = dist.new_group([0, 1, 2])  # every rank makes it; ranks 0..2 train DDP in it
    result: dict = {}
    if RANK < 3:
        result["ddp"] = ddp("ddp", "warn", 2, group)
        result["ddp-refuse"] = ddp("ddp-refuse", "refuse", 1, group)
    dist.barrier()
    result["hsdp"] = hsdp()
    dist.barrier()
    result["tp"] = tensor_parallel()
    (out / f"flips-r{RANK}.json").write_text(json.dumps(result))


def resume(out: Path) -> None:
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, opt, 0)  # the optimizer's state exists, to be filled
    state = ddp_state(model, opt)
    info = ckptd.load_into(state, "ddp-refuse")
    saved = ckptd.load("ddp-refuse", 1, rank=RANK)
    same = all(torch.equal(state["model"][k], v) for k, v in saved["model"].items())
    (out / f"resume-r{RANK}.json").write_text(json.dumps({"step": info.step, "same_as_step_1": same}))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        {"flips": flips, "resume": resume}[mode](out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
