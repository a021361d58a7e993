"""FSDP2 training under torchrun, checkpointed through ckptd; resumes on any number of ranks.

    .venv/bin/ckptd serve -c config.toml &                  # one daemon per node
    .venv/bin/torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py --run-name fsdp-demo
    # kill it, then resume on the same or another number of ranks:
    .venv/bin/torchrun --nproc-per-node 4 examples/fsdp2_torchrun.py --run-name fsdp-demo

What each rank does (docs/training.md):

- shards the model with ``fully_shard`` (each rank holds a piece of every parameter
  and of Adam's state, uneven where a dimension does not divide by the ranks);
- saves ``get_state_dict``'s model and optimizer state every ``--every`` steps:
  ``producer.save`` stores each rank's local pieces with their place in the whole
  tensor, and returns once they are copied;
- on start, takes the target layout of *this* job (``get_state_dict`` of the freshly
  sharded model) and fills it in place from the newest step every rank can read
  (agreed by all) with ``ckptd.load_into``, whatever number of ranks saved it: each rank reads only the
  bytes of the stored pieces that overlap its own.

Every rank sees the same global batch, so a resumed job (on any world size) follows
the uninterrupted one. gloo on CPU runs anywhere; on GPUs use nccl and the device mesh
``"cuda"``. ``ckptd.load("fsdp-demo")`` in a plain process (no torchrun) gives the
whole, unsharded state.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import ckptd
from ckptd import producer


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # the same global batch on every rank
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :7].cos()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-name", dest="run", default=os.environ.get("CKPTD_RUN", "fsdp-demo"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    producer.configure(run=args.run)  # rank and world size: torchrun's
    start = 1
    found = ckptd.latest(args.run, agree=True)  # the newest step every rank can read, the same on all
    if found is not None:
        # this job's own layout, filled in place from whatever layout saved it
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        info = ckptd.load_into(state, args.run, found.step)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        start = info.step + 1
        print(f"rank {rank}: resumed from step {info.step} (saved by {info.world_size} ranks)", flush=True)

    for step in range(start, args.steps + 1):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step % args.every == 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            producer.save({"model": model_sd, "optim": optim_sd, "step": step}, step)
            if rank == 0:
                print(f"step {step}: checkpoint handed to ckptd", flush=True)
    producer.close()  # waits until every checkpoint is durable
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
