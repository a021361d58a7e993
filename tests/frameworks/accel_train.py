"""A small model trained with accelerate, checkpointed through ckptd (tests/test_accelerate.py).

    [torchrun --nproc-per-node N] python accel_train.py OUT_DIR [--kill-after STEP] [--resume]

Every 3 steps: ckptd_accelerate.save_state. --kill-after STEP: once every process's
share of STEP is durable, each process SIGKILLs itself. --resume: load_state, then go
on from the step after. Batches come from the global RNG (so a resume must restore
it), the model has dropout. Process 0 writes OUT_DIR/final.safetensors and
OUT_DIR/counter.json. CKPTD_ENDPOINT, CKPTD_ROOT and CKPTD_RUN say where the daemon is.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import save_file

from ckptd.integrations import accelerate as ckptd_accelerate

STEPS, EVERY = 12, 3


class Counter:
    """An object registered for checkpointing: how many batches this run has seen."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def setup() -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, object, Counter]:
    accelerator = Accelerator(cpu=True)
    set_seed(0, device_specific=True)  # each process its own batches
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, opt, sched, counter


def train_step(accelerator, model, opt, sched, counter) -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    sched.step()
    opt.zero_grad()
    counter.seen += len(x)


def main(argv: list[str]) -> None:
    out, args = argv[0], argv[1:]
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    kill_after = int(args[args.index("--kill-after") + 1]) if "--kill-after" in args else None
    accelerator, model, opt, sched, counter = setup()
    start = 1
    if "--resume" in args:
        start = ckptd_accelerate.load_state(accelerator).step + 1
    for step in range(start, STEPS + 1):
        train_step(accelerator, model, opt, sched, counter)
        if step % EVERY == 0:
            handle = ckptd_accelerate.save_state(accelerator, step, staging_size="8MiB")
            if step == kill_after:
                handle.wait(60)
                accelerator.wait_for_everyone()
                os.kill(os.getpid(), signal.SIGKILL)
    ckptd_accelerate.close()
    if accelerator.is_main_process:
        os.makedirs(out, exist_ok=True)
        save_file(dict(accelerator.unwrap_model(model).state_dict()), os.path.join(out, "final.safetensors"))
        with open(os.path.join(out, "counter.json"), "w") as f:
            json.dump({"seen": counter.seen, "lr": sched.get_last_lr()}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
