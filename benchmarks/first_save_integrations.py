"""The first checkpoint's stall against a later one's, through each integration as a user runs it.

    .venv/bin/python benchmarks/first_save_integrations.py              # ~150 MiB per checkpoint
    .venv/bin/python benchmarks/first_save_integrations.py --width 4096  # ~600 MiB

One ``ckptd serve`` (defaults) and, in this process, one training run per way of saving:
a plain loop with ``producer.configure(..., prepare=state)`` (and, for comparison, without
it), Lightning with ``CkptdCheckpointIO``, the HF Trainer with ``CkptdCallback``, and
accelerate with ``ckptd.integrations.accelerate.prepare``. Each trains an MLP of three
``width x width`` layers with Adam (so a checkpoint is 3x the weights), saves every
``--every`` steps, ``--saves`` times, with staging left at "auto". Reported: each save's
blocked seconds and the first one's over the median of the later ones (goal: <= 2).
A training step here lasts ~``--step-ms``: the time staging has to be made in.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import torch  # noqa: E402

from daemons import DaemonProcess  # noqa: E402


def mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, width))


def step(model: torch.nn.Module, opt: Any, width: int, step_ms: float) -> None:
    started = time.perf_counter()
    opt.zero_grad()
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    time.sleep(max(0.0, step_ms / 1000 - (time.perf_counter() - started)))  # the rest of a training step


def plain(daemon: DaemonProcess, args: argparse.Namespace, prepare: bool) -> list[float]:
    from ckptd import producer

    model = mlp(args.width)
    opt = torch.optim.Adam(model.parameters())
    step(model, opt, args.width, args.step_ms)  # Adam's state exists from the first step
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    producer.configure(daemon.endpoint, f"plain-{prepare}", rank=0, world_size=1,
                       **({"prepare": state} if prepare else {}))
    blocked = []
    for n in range(1, args.every * args.saves + 1):
        step(model, opt, args.width, args.step_ms)
        if n % args.every == 0:
            t0 = time.perf_counter()
            producer.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=n)
            blocked.append(time.perf_counter() - t0)
    producer.close()
    return blocked


def lightning(daemon: DaemonProcess, args: argparse.Namespace, base: Path) -> list[float]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptd.integrations.lightning import CkptdCheckpointIO

    blocked: list[float] = []

    class Timed(CkptdCheckpointIO):
        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            t0 = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            blocked.append(time.perf_counter() - t0)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(args.width)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(args.step_ms / 1000)
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters())

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4 * args.every * args.saves,
                                                                                  args.width)), batch_size=4)
    plugin = Timed("lightning", endpoint=daemon.endpoint, root=daemon.root)
    trainer = L.Trainer(max_steps=args.every * args.saves, accelerator="cpu", devices=1, plugins=[plugin],
                        callbacks=[ModelCheckpoint(dirpath=base / "lightning", every_n_train_steps=args.every,
                                                   save_top_k=-1)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), data)
    return blocked


def transformers(daemon: DaemonProcess, args: argparse.Namespace, base: Path) -> list[float]:
    from transformers import Trainer, TrainingArguments

    from ckptd.integrations.transformers import CkptdCallback

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(args.width)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            time.sleep(args.step_ms / 1000)
            return {"loss": self.net(x).square().mean()}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4 * args.every * args.saves

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": torch.randn(args.width)}

    callback = CkptdCallback("transformers", endpoint=daemon.endpoint, root=daemon.root)
    targs = TrainingArguments(output_dir=str(base / "hf"), max_steps=args.every * args.saves, save_steps=args.every,
                              per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True,
                              dataloader_num_workers=0)
    Trainer(model=Model(), args=targs, train_dataset=Data(), callbacks=[callback]).train()
    callback.close()
    return callback.save_seconds


def accelerate(daemon: DaemonProcess, args: argparse.Namespace) -> list[float]:
    from accelerate import Accelerator

    from ckptd.integrations import accelerate as ckptd_accelerate

    accelerator = Accelerator(cpu=True)
    model = mlp(args.width)
    opt = torch.optim.Adam(model.parameters())
    model, opt = accelerator.prepare(model, opt)
    kw = {"run": "accelerate", "endpoint": daemon.endpoint}
    blocked = []
    for n in range(1, args.every * args.saves + 1):
        step(model, opt, args.width, args.step_ms)
        if n == 1:
            ckptd_accelerate.prepare(accelerator, **kw)  # once the optimizer's state exists
        if n % args.every == 0:
            t0 = time.perf_counter()
            ckptd_accelerate.save_state(accelerator, n, **kw)
            blocked.append(time.perf_counter() - t0)
    ckptd_accelerate.close()
    return blocked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=2048, help="the MLP's width (3 layers; checkpoint = 3 x weights)")
    ap.add_argument("--every", type=int, default=10, help="steps between saves")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=100.0, help="how long a training step lasts")
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="ckptd-first-"))
    daemon = DaemonProcess(base, None, name="daemon", tables={"retention": {"keep_last": 2}}).start()
    rows: dict[str, list[float]] = {}
    try:
        rows["plain loop, no prepare"] = plain(daemon, args, prepare=False)
        rows["plain loop, configure(prepare=state)"] = plain(daemon, args, prepare=True)
        rows["Lightning CkptdCheckpointIO"] = lightning(daemon, args, base)
        rows["HF Trainer CkptdCallback"] = transformers(daemon, args, base)
        rows["accelerate save_state + prepare"] = accelerate(daemon, args)
    finally:
        daemon.close()
        shutil.rmtree(base, ignore_errors=True)
    mib = 3 * 3 * args.width * (args.width + 1) * 4 / 2**20
    print(f"\nfirst save's stall against the later ones' ({mib:.0f} MiB per checkpoint, staging \"auto\", "
          f"a save every {args.every} steps of ~{args.step_ms:.0f} ms)")
    print("| | blocked per save, s | first / median of later |")
    print("|---|---|---|")
    for name, ts in rows.items():
        ratio = ts[0] / statistics.median(ts[1:])
        print(f"| {name} | {' '.join(f'{t:.3f}' for t in ts)} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
