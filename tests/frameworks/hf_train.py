"""A tiny GPT-2 trained by the Hugging Face Trainer, as its own process (tests/test_transformers.py).

    python hf_train.py OUT_DIR {ckptd|trainer} [--kill-after STEP] [--resume]

Random init from a small GPT2Config, synthetic tokens, nothing downloaded.
"ckptd" checkpoints through CkptdCallback, "trainer" with the Trainer's own files.
--kill-after STEP SIGKILLs this process once STEP's checkpoint is durable (ckptd) or
written (trainer); --resume calls train(resume_from_checkpoint=True). Writes the final
weights to OUT_DIR/final.safetensors, log_history to OUT_DIR/log_history.json and the
blocked time of each checkpoint (seconds) to OUT_DIR/blocked.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ckptd.integrations.transformers import CkptdCallback

SAVE_STEPS, MAX_STEPS = 4, 12


class Tokens(torch.utils.data.Dataset):
    """24 sequences of 16 synthetic tokens: 6 batches of 4 an epoch."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 96, (24, 16), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KillAfter(TrainerCallback):
    def __init__(self, step: int, ckptd: CkptdCallback | None) -> None:
        self.step, self.ckptd = step, ckptd

    def on_save(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step:
            if self.ckptd is not None:
                self.ckptd.flush(60)  # acknowledged: durable in ckptd
            os.kill(os.getpid(), signal.SIGKILL)


def build(out: str, mode: str, kill_after: int | None, width: int = 32,
          staging: str = "16MiB", **callback_options) -> tuple[Trainer, CkptdCallback | None]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=width, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=out, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, logging_steps=1,
                             per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=2, seed=7,
                             save_total_limit=2, report_to=[], use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True, full_determinism=True)
    ckptd = CkptdCallback(staging_size=staging, **callback_options) if mode == "ckptd" else None
    callbacks: list[TrainerCallback] = [ckptd] if ckptd else []
    if kill_after is not None:
        callbacks.append(KillAfter(kill_after, ckptd))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    return trainer, ckptd


def run(out: str, mode: str, kill_after: int | None = None, resume: bool = False) -> None:
    torch.set_num_threads(1)
    trainer, ckptd = build(out, mode, kill_after)
    blocked: list[float] = []
    save = trainer._save_checkpoint  # the Trainer's own writer, or CkptdCallback's

    def timed(*args, **kwargs):
        started = time.perf_counter()
        save(*args, **kwargs)
        blocked.append(time.perf_counter() - started)

    trainer._save_checkpoint = timed
    trainer.train(resume_from_checkpoint=True if resume else None)
    save_file({k: v.clone() for k, v in trainer.model.state_dict().items()},  # lm_head is tied to wte
              os.path.join(out, "final.safetensors"))
    with open(os.path.join(out, "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f)
    with open(os.path.join(out, "blocked.json"), "w") as f:
        json.dump(blocked, f)
    if ckptd is not None:
        ckptd.close()


if __name__ == "__main__":
    argv = sys.argv[1:]
    run(argv[0], argv[1], int(argv[argv.index("--kill-after") + 1]) if "--kill-after" in argv else None,
        "--resume" in argv)
