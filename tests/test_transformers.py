"""The Hugging Face Trainer through CkptdCallback: a tiny GPT-2, killed and resumed, against the
same run resumed from the Trainer's own checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from statistics import median
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

import ckptd
from ckptd.integrations.transformers import CkptdCallback

FRAMEWORKS = Path(__file__).parent / "frameworks"
sys.path.insert(0, str(FRAMEWORKS))
import hf_train  # noqa: E402  (tests/frameworks: the training script the subprocesses run)


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is built from a config


def _start(daemon, out: Path, mode: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, CKPTD_ENDPOINT=daemon.endpoint, CKPTD_ROOT=str(daemon.root), CKPTD_RUN="gpt",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TESTS_FORKSERVER_PRELOAD="transformers")  # tests/forkserver.py
    return subprocess.Popen([sys.executable, str(FRAMEWORKS / "hf_train.py"), str(out), mode, *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out[-3000:]


@pytest.mark.slow
def test_killed_then_resumed_equals_the_trainers_own_resume(daemon, tmp_path: Path, capsys) -> None:
    modes = ("trainer", "ckptd")  # the two runs go side by side, one core each
    killed = {mode: _start(daemon, tmp_path / mode, mode, "--kill-after", "8") for mode in modes}
    for mode, proc in killed.items():
        rc, log = _finish(proc)
        assert rc == -signal.SIGKILL, log
    assert ckptd.latest("gpt", root=daemon.root).step == 8
    assert not list((tmp_path / "ckptd").glob("checkpoint-*"))  # the Trainer wrote none of its own
    assert [p.name for p in (tmp_path / "trainer").glob("checkpoint-*")] != []
    resumed = {mode: _start(daemon, tmp_path / mode, mode, "--resume") for mode in modes}
    results = {}
    for mode, proc in resumed.items():
        rc, log = _finish(proc)
        assert rc == 0, log
        out = tmp_path / mode
        results[mode] = (load_file(out / "final.safetensors"), json.loads((out / "log_history.json").read_text()),
                         json.loads((out / "blocked.json").read_text()))
    (own, own_log, own_blocked), (ours, our_log, our_blocked) = results["trainer"], results["ckptd"]
    assert own.keys() == ours.keys()
    for name in own:
        assert torch.equal(own[name], ours[name]), name
    losses = [e["loss"] for e in our_log if "loss" in e]
    assert len(losses) == hf_train.MAX_STEPS
    assert losses == [e["loss"] for e in own_log if "loss" in e]
    # step 12 was saved after the resume; save_total_limit=2 kept two steps
    assert [i.step for i in ckptd.list_checkpoints("gpt", root=daemon.root)] == [8, 12]
    with capsys.disabled():  # in the test output even without -s
        print(f"\nblocked by the step-12 checkpoint of the tiny GPT-2 (first save of the process): "
              f"CkptdCallback {our_blocked[0] * 1e3:.1f} ms, Trainer._save_checkpoint {own_blocked[0] * 1e3:.1f} ms")


def test_blocked_time_against_the_trainers_own_save_of_the_same_state(daemon, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_RUN", "timing")
    monkeypatch.setenv("CKPTD_ENDPOINT", daemon.endpoint)
    monkeypatch.setenv("CKPTD_ROOT", str(daemon.root))
    trainer, callback = hf_train.build(str(tmp_path / "out"), "ckptd", None, width=256, staging="64MiB")
    trainer.args.max_steps = 1
    trainer.train()  # one step: the optimizer has its state
    assert trainer._save_checkpoint == callback._save_checkpoint
    own = Trainer._save_checkpoint.__get__(trainer)
    times: dict[str, list[float]] = {"ckptd": [], "trainer": []}
    for step in range(2, 9):  # the first saves also touch fresh staging pages
        trainer.state.global_step = step
        for name, save in (("ckptd", trainer._save_checkpoint), ("trainer", own)):
            started = time.perf_counter()
            save(trainer.model, None)
            times[name].append(time.perf_counter() - started)
        callback.flush(60)
    nbytes = ckptd.latest("timing", root=daemon.root).nbytes
    with capsys.disabled():  # in the test output even without -s
        print(f"\nblocked per checkpoint of the same state ({nbytes / 2**20:.1f} MiB of tensors), ms: "
              + "; ".join(f"{n} " + " ".join(f"{t * 1e3:.1f}" for t in ts) + f" (median of the warm ones {median(ts[2:]) * 1e3:.1f})" for n, ts in times.items()))
    assert [i.step for i in ckptd.list_checkpoints("timing", root=daemon.root)] == [7, 8]  # save_total_limit=2
    state = ckptd.load("timing", root=daemon.root)
    assert json.loads(state["trainer_state"])["global_step"] == 8
    assert set(state) == {"model", "optimizer", "scheduler", "rng", "trainer_state"}
    callback.close()


def test_load_best_model_at_end_is_refused_clearly(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ckptd.integrations.transformers import CkptdCallback

    args = TrainingArguments(output_dir=str(tmp_path), load_best_model_at_end=True, eval_strategy="steps",
                             save_strategy="steps", report_to=[], use_cpu=True)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    with pytest.raises(ValueError, match="does not support load_best_model_at_end"):
        Trainer(model=model, args=args, eval_dataset=hf_train.Tokens(), callbacks=[CkptdCallback(run="x")])


def test_frozen_parameters_are_written_once(daemon, tmp_path: Path, monkeypatch) -> None:
    """A model whose first block does not train (as under LoRA): its parameters are
    declared frozen, copied and written once, and every step still loads them."""
    monkeypatch.setenv("CKPTD_RUN", "frozen")
    monkeypatch.setenv("CKPTD_ENDPOINT", daemon.endpoint)
    monkeypatch.setenv("CKPTD_ROOT", str(daemon.root))
    trainer, callback = hf_train.build(str(tmp_path / "out"), "ckptd", None, width=64, staging="64MiB")
    frozen = [n for n, p in trainer.model.named_parameters() if n.startswith("transformer.h.0.")]
    for n, p in trainer.model.named_parameters():
        p.requires_grad_(not n.startswith("transformer.h.0."))
    trainer.args.max_steps = 2
    trainer.args.save_steps = 1

    class Durable(TrainerCallback):  # a frozen tensor is linked from a step the daemon acknowledged
        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            callback.flush(60)

    trainer.add_callback(Durable())
    trainer.train()
    steps = [i.step for i in ckptd.list_checkpoints("frozen", root=daemon.root)]
    assert steps == [1, 2]
    manifests = [json.loads((daemon.root / "frozen" / f"step-{s:012d}" / "manifest-r00000.json").read_text())
                 for s in steps]
    for name in frozen:
        files = [daemon.root / "frozen" / f"step-{s:012d}" / m["tensors"][f"model.{name}"]["file"]
                 for s, m in zip(steps, manifests)]
        assert os.stat(files[0]).st_ino == os.stat(files[1]).st_ino, name  # one copy on disk
    state = ckptd.load("frozen", root=daemon.root, verify=True)
    live = trainer.model.state_dict()
    for name in frozen:
        assert torch.equal(state["model"][name], live[name])
    trained = "transformer.h.1.mlp.c_fc.weight"
    assert not torch.equal(ckptd.load("frozen", 1, root=daemon.root)["model"][trained], state["model"][trained])
    callback.close()


def test_every_auto_saves_at_the_advised_points_within_the_bounds(daemon, tmp_path: Path, monkeypatch) -> None:
    """every="auto": the Trainer saves when producer.should_save says so (the first step at
    once, no advice yet for the run; then the advice, far longer than this run, bounded by
    max_steps=3), not at its save_steps."""
    monkeypatch.setenv("CKPTD_RUN", "auto")
    monkeypatch.setenv("CKPTD_ENDPOINT", daemon.endpoint)
    monkeypatch.setenv("CKPTD_ROOT", str(daemon.root))
    trainer, callback = hf_train.build(str(tmp_path / "out"), "ckptd", None, every="auto",
                                       bounds={"max_steps": 3})
    trainer.args.max_steps = 11
    trainer.args.save_steps = 5
    trainer.args.save_total_limit = None  # keep every step
    trainer.train()
    callback.flush(60)
    assert [i.step for i in ckptd.list_checkpoints("auto", root=daemon.root)] == [1, 4, 7, 10]
    callback.close()
    with pytest.raises(ValueError, match=r"every='hourly'.*\"auto\""):
        hf_train.build(str(tmp_path / "x"), "ckptd", None, every="hourly")


class StagingAfterTheFirstStep(TrainerCallback):
    """After CkptdCallback's on_step_end of step 1 (callbacks run in order): the staging its
    producer was told of, and the bytes of the model and optimizer state."""

    def __init__(self, callback: CkptdCallback) -> None:
        self.callback = callback
        self.seen: list[tuple[int, int]] = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        if state.global_step == 1:
            tensors = [*model.state_dict().values(),
                       *(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
            self.seen.append((self.callback.producer.stats()["staging_prepared_bytes"],
                              sum(t.numel() * t.element_size() for t in tensors)))


def test_staging_is_made_for_model_and_optimizer_before_the_first_save(daemon, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_RUN", "first")
    monkeypatch.setenv("CKPTD_ENDPOINT", daemon.endpoint)
    monkeypatch.setenv("CKPTD_ROOT", str(daemon.root))
    trainer, callback = hf_train.build(str(tmp_path / "out"), "ckptd", None, width=64, staging="auto")
    probe = StagingAfterTheFirstStep(callback)
    trainer.add_callback(probe)
    trainer.args.max_steps = hf_train.SAVE_STEPS
    trainer.train()
    [(prepared, state_bytes)] = probe.seen
    assert state_bytes > 0 and prepared >= state_bytes  # asked for at step 1; the first save is at step 4
    assert [i.step for i in ckptd.list_checkpoints("first", root=daemon.root)] == [hf_train.SAVE_STEPS]
    callback.close()
