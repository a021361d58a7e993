"""A training job for `torchrun --max-restarts=1` (tests/test_elastic.py), and the training
itself, which the test repeats in one process as the uninterrupted reference.

Each rank trains its own small model (no collectives: the test is about the checkpoints)
and saves every 5 steps. In attempt 0, at step 10, rank 0 commits its share and waits;
rank 1 sends part of its share, then SIGKILLs itself: torchrun stops rank 0 and starts
both again (attempt 1), which resume from the newest complete step and save step 10
again, rank 0's share replacing attempt 0's.

    torchrun ... elastic_job.py ENDPOINT ROOT FLAGS_DIR STEPS
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

RUN = "elastic"
EVERY = 5
KILL_AT = 10


def make(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def main(endpoint: str, root: str, flags: Path, steps: int) -> None:
    import ckptd
    from ckptd import Producer
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model, opt = make(rank)
    start = 0
    info = ckptd.latest(RUN, root=root)
    if info is not None:
        state = ckptd.load(RUN, info.step, root=root, rank=rank)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    (flags / f"resumed-a{restart}-r{rank}").write_text(str(start))
    # rank 0 sleeps through torchrun's SIGTERM: the default preempt_grace (30 s, as long
    # as torchrun waits before SIGKILL) held each restart that long
    p = Producer(endpoint, RUN, staging_size="8MiB", timeout=10, preempt_grace=1)
    for step in range(start + 1, steps + 1):
        train_step(model, opt, step, rank)
        if step % EVERY:
            continue
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        if restart == 0 and step == KILL_AT:
            if rank == 0:
                p.save(state, step).wait(60)
                (flags / "r0-committed").touch()
                time.sleep(120)  # torchrun stops this worker once rank 1 died
            while not (flags / "r0-committed").exists():
                time.sleep(0.01)
            p.emit("model.0.weight", model[0].weight, step=step)  # part of its share, then death
            p.latest()  # answered after that tensor was received: the step is open in the daemon
            os.kill(os.getpid(), signal.SIGKILL)
        p.save(state, step).wait(60)
    p.close()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(flags / f"final-r{rank}.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
