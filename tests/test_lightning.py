"""PyTorch Lightning and Fabric through CkptdCheckpointIO, with the real Lightning and a real daemon."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from statistics import median
from pathlib import Path

import pytest
import torch

import lightning as L
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

import ckptd
from ckptd.integrations.lightning import CkptdCheckpointIO, PrepareStaging, read_pointer

FRAMEWORKS = Path(__file__).parent / "frameworks"
sys.path.insert(0, str(FRAMEWORKS))
import lightning_fit  # noqa: E402  (tests/frameworks: the training script the subprocesses run)


def _env(daemon, run: str) -> dict[str, str]:
    return dict(os.environ, CKPTD_ENDPOINT=daemon.endpoint, CKPTD_ROOT=str(daemon.root), CKPTD_RUN=run,
                PYTHONUNBUFFERED="1", TESTS_FORKSERVER_PRELOAD="lightning")  # tests/forkserver.py


def _start(daemon, run: str, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(FRAMEWORKS / "lightning_fit.py"), str(out), *args],
                            env=_env(daemon, run), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def _fit(daemon, run: str, out: Path, *args: str) -> tuple[int, str]:
    return _finish(_start(daemon, run, out, *args))


@pytest.mark.slow
def test_sigkill_then_fit_ckpt_path_last_is_bit_exact(daemon, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "crash"
    crash = _start(daemon, "crash", out, "--kill-after", "8")  # side by side with the reference
    for key, value in _env(daemon, "ref").items():
        monkeypatch.setenv(key, value)
    try:
        lightning_fit.main([str(tmp_path / "ref")])  # uninterrupted, in this process
    finally:
        torch.use_deterministic_algorithms(False)
    reference = load_file(tmp_path / "ref" / "final.safetensors")

    rc, log = _finish(crash)
    assert rc == -signal.SIGKILL, log[-3000:]
    assert read_pointer(out / "ckpt" / "last.ckpt") == ("crash", 8)
    assert ckptd.latest("crash", root=daemon.root).step == 8
    assert not (out / "final.safetensors").exists()

    rc, log = _fit(daemon, "crash", out, "--resume")
    assert rc == 0, log[-3000:]
    assert "Restored all states from the checkpoint at" in log
    final = load_file(out / "final.safetensors")
    assert final.keys() == reference.keys()
    for name in reference:
        assert torch.equal(final[name], reference[name]), name
    assert ckptd.latest("crash", root=daemon.root).step == 12
    state = ckptd.load("crash", root=daemon.root)
    assert state["global_step"] == 12 and state["hyper_parameters"] == {"lr": 0.05, "width": 16}


@pytest.mark.slow
def test_ddp_rank_zero_saves_and_every_rank_resumes_bit_exact(daemon, tmp_path: Path) -> None:
    """strategy="ddp" on 2 CPU processes: Lightning saves from global rank 0 (one copy of the
    replicated model, a world of one in ckptd); every rank loads "last"."""
    reference = _start(daemon, "ddp-ref", tmp_path / "ref", "--ddp")  # side by side with the crash
    out = tmp_path / "crash"
    rc, log = _fit(daemon, "ddp", out, "--ddp", "--kill-after", "4")  # 2 steps an epoch on each rank
    assert rc == -signal.SIGKILL, log[-3000:]
    info = ckptd.latest("ddp", root=daemon.root)
    assert info.step == 4 and [p.name for p in Path(info.path).glob("manifest-*")] == ["manifest-r00000.json"]
    rc, log = _finish(reference)
    assert rc == 0, log[-3000:]
    rc, log = _fit(daemon, "ddp", out, "--ddp", "--resume")
    assert rc == 0, log[-3000:]
    expected, final = load_file(tmp_path / "ref" / "final.safetensors"), load_file(out / "final.safetensors")
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    assert ckptd.latest("ddp", root=daemon.root).step == 6


class Scored(lightning_fit.Tiny):
    """Logs a fixed score per step, so which checkpoints are the best is known."""

    SCORES = [3.0, 1.0, 4.0, 1.5, 5.0, 0.5, 2.0, 6.0]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("score", self.SCORES[self.global_step])
        return loss


def test_save_top_k_keeps_the_best_and_waits_for_durability(daemon, tmp_path: Path) -> None:
    plugin = CkptdCheckpointIO("topk", endpoint=daemon.endpoint, root=daemon.root, staging_size="8MiB")
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="score", mode="min", save_top_k=2,
                           every_n_train_steps=1)
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, plugins=[plugin], callbacks=[best],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Scored(), lightning_fit.data())  # two epochs of 4 steps
    # scores 3, 1, 4, 1.5, 5, 0.5, 2, 6 at steps 1..8: the two lowest are at steps 6 and 2
    kept = sorted(read_pointer(p)[1] for p in best.best_k_models)
    assert kept == [2, 6]
    infos = ckptd.list_checkpoints("topk", root=daemon.root)
    assert [i.step for i in infos] == [2, 6]
    assert [i.metadata for i in infos] == [{"score": 1.0}, {"score": 0.5}]  # what keep_best ranks by
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(Path(p).name for p in best.best_k_models)

    # A removal that Lightning asks for while the newer save is not yet durable waits for it.
    dump = trainer._checkpoint_connector.dump_checkpoint()
    plugin.save_checkpoint({**dump, "global_step": 100}, tmp_path / "ckpt" / "a.ckpt")
    plugin.flush(30)
    daemon.proc.send_signal(signal.SIGSTOP)  # the daemon takes nothing until SIGCONT
    try:
        plugin.save_checkpoint({**dump, "global_step": 101}, tmp_path / "ckpt" / "b.ckpt")  # copied, not durable
        plugin.remove_checkpoint(tmp_path / "ckpt" / "a.ckpt")
        assert not (tmp_path / "ckpt" / "a.ckpt").exists()
        assert ckptd.latest("topk", root=daemon.root).step == 100  # the newest complete one stays
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    plugin.teardown()  # flush, then the deferred removal
    assert [i.step for i in ckptd.list_checkpoints("topk", root=daemon.root)] == [2, 6, 101]


def test_fabric_save_load_and_blocked_time(daemon, tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    plugin = CkptdCheckpointIO("fabric", endpoint=daemon.endpoint, root=daemon.root, staging_size="32MiB")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 2.1M parameters, 8 MiB
    opt = torch.optim.Adam(model.parameters())
    model, opt = fabric.setup(model, opt)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    torch_fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[TorchCheckpointIO()])
    timings: dict[str, list[float]] = {"ckptd": [], "torch": []}
    # the first saves through ckptd also connect and touch fresh staging pages; later ones reuse them
    for step in range(1, 8):
        state = {"model": model, "optimizer": opt, "step": step, "note": "hello"}
        for name, f in (("ckptd", fabric), ("torch", torch_fabric)):
            started = time.perf_counter()
            f.save(tmp_path / ("f.ckpt" if name == "ckptd" else "torch.ckpt"), state)
            timings[name].append(time.perf_counter() - started)
        plugin.flush(60)  # as training between checkpoints would let the daemon catch up
    with capsys.disabled():  # in the test output even without -s
        print("\nblocked per checkpoint (8 MiB model + Adam state), Fabric.save, ms: "
              + "; ".join(f"{n} " + " ".join(f"{t * 1e3:.1f}" for t in ts) + f" (median of the warm ones {median(ts[2:]) * 1e3:.1f})"
                          for n, ts in (("through ckptd", timings["ckptd"]), ("TorchCheckpointIO", timings["torch"]))))

    assert read_pointer(tmp_path / "f.ckpt") == ("fabric", 7)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    restored = {"model": model, "optimizer": opt}
    remainder = fabric.load(tmp_path / "f.ckpt", restored)
    assert remainder == {"step": 7, "note": "hello"}
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert opt.state_dict()["state"][0]["step"] == 1
    fabric.strategy.teardown()


def test_values_without_a_safe_conversion_are_refused_by_path(daemon, tmp_path: Path) -> None:
    plugin = CkptdCheckpointIO("odd", endpoint=daemon.endpoint, root=daemon.root, staging_size="8MiB")
    try:
        with pytest.raises(TypeError, match=r"state\['hyper_parameters'\]\['args'\] is a argparse.Namespace"):
            plugin.save_checkpoint({"global_step": 1, "hyper_parameters": {"args": argparse.Namespace(a=1)}},
                                   tmp_path / "x.ckpt")
        assert not (tmp_path / "x.ckpt").exists()
        # a dict subclass (Lightning's AttributeDict) is stored as a plain dict
        from lightning.fabric.utilities.data import AttributeDict

        plugin.save_checkpoint({"global_step": 2, "hyper_parameters": AttributeDict(lr=0.1)}, tmp_path / "y.ckpt")
        plugin.flush(30)
        assert plugin.load_checkpoint(tmp_path / "y.ckpt")["hyper_parameters"] == {"lr": 0.1}
        (tmp_path / "torch.ckpt").write_bytes(b"\x80\x04not a pointer")
        with pytest.raises(ValueError, match="is not a ckptd checkpoint pointer"):
            plugin.load_checkpoint(tmp_path / "torch.ckpt")
        plugin.remove_checkpoint(tmp_path / "torch.ckpt")  # not ours: left alone
        assert (tmp_path / "torch.ckpt").exists()
    finally:
        plugin.teardown()


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class Wide(L.LightningModule):
    """16 MiB of parameters and 32 MiB of Adam state: more than the 32 MiB "auto" staging starts with."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 2048),
                                       torch.nn.Linear(2048, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class StagingBeforeTheFirstSave(L.Callback):
    """What the plugin's producer says at the end of the first two steps, before the first save
    (at step 2; a user's callback runs before ckptd's and ModelCheckpoint's)."""

    def __init__(self, plugin: CkptdCheckpointIO) -> None:
        self.plugin = plugin
        self.seen: list[tuple[int, int, int]] = []  # (prepared bytes, the state's bytes, steps saved)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if len(self.seen) < 2:
            state = {"model": pl_module.state_dict(), "optim": [o.state_dict() for o in trainer.optimizers]}
            prepared = self.plugin.producer.stats()["staging_prepared_bytes"]
            saved = len(ckptd.list_checkpoints("first", root=self.plugin.root))
            self.seen.append((prepared, _tensor_bytes(state), saved))


def test_staging_is_made_for_the_whole_checkpoint_before_the_first_save(daemon, tmp_path: Path) -> None:
    plugin = CkptdCheckpointIO("first", endpoint=daemon.endpoint, root=daemon.root)  # staging_size "auto"
    probe = StagingBeforeTheFirstSave(plugin)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                        callbacks=[probe, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)],
                        enable_progress_bar=False, enable_model_summary=False)
    # ckptd's entry point (pyproject.toml) gave this Trainer its PrepareStaging
    assert sum(isinstance(c, PrepareStaging) for c in trainer.callbacks) == 1
    trainer.fit(Wide(), lightning_fit.data())
    (before, _, saved0), (after, state_bytes, saved1) = probe.seen
    assert (before, saved0, saved1) == (0, 0, 0)  # nothing prepared before the first step's end
    assert state_bytes > 48 * 2**20 and after >= state_bytes  # then the whole model and Adam state
    assert [i.step for i in ckptd.list_checkpoints("first", root=daemon.root)] == [2, 4]
