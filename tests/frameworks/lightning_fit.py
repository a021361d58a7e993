"""A tiny Lightning fit through CkptdCheckpointIO, as its own process (tests/test_lightning.py).

    python lightning_fit.py OUT_DIR [--resume] [--kill-after STEP] [--plain] [--ddp]

Trains a small MLP for 3 epochs of 4 batches, checkpointing every 4 steps with
save_last=True; --kill-after STEP flushes the plugin once STEP was saved and
SIGKILLs this process; --resume fits with ckpt_path="last"; --plain uses Lightning's
own TorchCheckpointIO; --ddp trains on 2 CPU processes (strategy="ddp"). Writes the final weights to OUT_DIR/final.safetensors.
CKPTD_ENDPOINT, CKPTD_ROOT and CKPTD_RUN say where the daemon is.
"""

from __future__ import annotations

import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file

from ckptd.integrations.lightning import CkptdCheckpointIO

STEPS_PER_EPOCH, EPOCHS, EVERY = 4, 3, 4


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.05, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()  # an AttributeDict in the checkpoint: stored as a plain dict
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * STEPS_PER_EPOCH, 8, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)


class KillAfter(L.Callback):
    """Once step ``step`` was saved and made durable, die as a crash would."""

    def __init__(self, plugin: CkptdCheckpointIO, step: int) -> None:
        self.plugin, self.step = plugin, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step + 1:  # ModelCheckpoint saved `step` a batch ago
            self.plugin.flush(60)  # on rank 0, which saved; the other ranks have nothing to flush
            # under DDP, a rank that dies makes Lightning SIGKILL the others: no rank dies
            # before rank 0's save is durable
            trainer.strategy.barrier("ckptd-kill-after")
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    out, args = argv[0], argv[1:]
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    plugin = None if "--plain" in args else CkptdCheckpointIO(staging_size="8MiB")
    callbacks: list[L.Callback] = [ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=EVERY,
                                                   save_last=True)]
    if "--kill-after" in args:
        callbacks.insert(0, KillAfter(plugin, int(args[args.index("--kill-after") + 1])))
    ddp = {"devices": 2, "strategy": "ddp"} if "--ddp" in args else {"devices": 1}
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", **ddp, plugins=[plugin] if plugin else None,
                        callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, default_root_dir=out)
    model = Tiny()
    trainer.fit(model, data(), ckpt_path="last" if "--resume" in args else None)
    if trainer.is_global_zero:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out, "final.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1:])
