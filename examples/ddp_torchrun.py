"""Data-parallel training under torchrun, checkpointed through ckptd; the same command resumes.

    .venv/bin/ckptd serve -c config.toml &                 # one daemon per node
    .venv/bin/torchrun --nproc-per-node 2 examples/ddp_torchrun.py --run-name ddp-demo
    # kill it (kill -9, a preempted node, Ctrl-C), then run the same torchrun line: it
    # resumes from the newest step that every rank made durable

What each rank does (docs/training.md, "torchrun and multi-process jobs"):

- connects to the node's daemon: the producer reads ``$RANK`` and ``$WORLD_SIZE`` from
  torchrun, so a step is complete once every rank has committed its share;
- saves its share every ``--every`` steps: the model and optimizer, which every rank
  holds the same under DDP, are ``replicated=``: each of their tensors is written by
  one rank only (the work spread over the ranks), so the job writes them once, not
  once per rank; plus what is each rank's own: its RNG state and its data position;
- on start, agrees with the other ranks on the newest step all of them can read
  (``ckptd.latest(run, agree=True)``, one collective), loads its own share of it
  (``ckptd.load`` picks the share by ``$RANK``; the replicated tensors come from
  whichever rank wrote them) and goes on from the step after.

The gloo backend on CPU runs anywhere; on GPUs use nccl and move the model to
``cuda:LOCAL_RANK`` (emit copies GPU tensors to staging without blocking the CPU).
``--kill-at STEP`` (for the test) kills the job with SIGKILL once STEP is durable: rank 0
first, then each other rank when torchrun stops it.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import ckptd
from ckptd import producer


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of ``step``: its data position is the step itself."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 32, generator=g)
    return x, x[:, :8].sin()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-name", dest="run", default=os.environ.get("CKPTD_RUN", "ddp-demo"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--staging", default="auto", help='per rank; "auto" grows to fit the checkpoints')
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--out", default=None, help="rank 0 writes the final weights here (safetensors)")
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights everywhere; dropout draws from each rank's RNG
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(rank + 1)

    producer.configure(run=args.run, staging_size=args.staging)  # rank, world size: torchrun's
    start = 1
    info = ckptd.latest(args.run, agree=True)  # the newest step every rank can read, the same on all
    if info is not None:
        state = ckptd.load(args.run, info.step)  # this rank's share of it
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        start = state["step"] + 1
        print(f"rank {rank}: resumed from step {state['step']}", flush=True)

    for step in range(start, args.steps + 1):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step % args.every == 0:
            handle = producer.save({"model": model.module.state_dict(), "optim": opt.state_dict(),
                                    "rng": torch.get_rng_state(), "step": step}, step,
                                   replicated=["model.*", "optim.*"])  # the same on every DDP rank
            if step == args.kill_at:
                handle.wait(60)  # this rank's share is durable ...
                dist.barrier()   # ... and every other rank's
                # torchrun signals the ranks left once one fails; it fails itself if none is left
                while rank != 0 and not producer.preempted():  # its SIGTERM, heard as a notice
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
    producer.close()  # waits until every checkpoint is durable
    if rank == 0 and args.out:
        from safetensors.torch import save_file

        save_file(dict(model.module.state_dict()), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
