"""accelerate's save_state / load_state through ckptd: kill and resume bit-exact, on one process
and on two under torchrun (CPU, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from statistics import median
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

import ckptd
from ckptd.integrations import accelerate as ckptd_accelerate

FRAMEWORKS = Path(__file__).parent / "frameworks"
SCRIPT = str(FRAMEWORKS / "accel_train.py")


def _start(daemon, run: str, command: list[str]) -> subprocess.Popen:
    env = dict(os.environ, CKPTD_ENDPOINT=daemon.endpoint, CKPTD_ROOT=str(daemon.root), CKPTD_RUN=run,
               PYTHONUNBUFFERED="1", TESTS_FORKSERVER_PRELOAD="accelerate")  # tests/forkserver.py
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out[-3000:]


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def _kill_resume_equals_uninterrupted(daemon, tmp_path: Path, launcher: list[str], world: int) -> None:
    # the uninterrupted run and the one that is killed run side by side
    ref = _start(daemon, "ref", [*launcher, SCRIPT, str(tmp_path / "ref")])
    out = tmp_path / "crash"
    rc, log = _finish(_start(daemon, "crash", [*launcher, SCRIPT, str(out), "--kill-after", "6"]))
    assert rc != 0 and not (out / "final.safetensors").exists(), log
    rc, log = _finish(ref)
    assert rc == 0, log
    info = ckptd.latest("crash", root=daemon.root)
    assert info.step == 6
    assert len(list(Path(info.path).glob("manifest-r*.json"))) == world  # every process its share
    rc, log = _finish(_start(daemon, "crash", [*launcher, SCRIPT, str(out), "--resume"]))
    assert rc == 0, log
    expected, final = load_file(tmp_path / "ref" / "final.safetensors"), load_file(out / "final.safetensors")
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    assert json.loads((out / "counter.json").read_text()) == json.loads((tmp_path / "ref" / "counter.json").read_text())
    assert ckptd.latest("crash", root=daemon.root).step == 12


@pytest.mark.slow
def test_one_process_killed_and_resumed_is_bit_exact(daemon, tmp_path: Path) -> None:
    _kill_resume_equals_uninterrupted(daemon, tmp_path, [sys.executable], 1)


@pytest.mark.slow
def test_two_processes_under_torchrun_killed_and_resumed_are_bit_exact(daemon, tmp_path: Path) -> None:
    _kill_resume_equals_uninterrupted(daemon, tmp_path, _torchrun(2), 2)


def _one_adam_step(daemon, monkeypatch):
    """An accelerate-prepared 4-layer model (16 MiB) and Adam after one step (its state, 32 MiB, exists)."""
    from accelerate import Accelerator

    monkeypatch.setenv("CKPTD_ENDPOINT", daemon.endpoint)
    monkeypatch.setenv("CKPTD_ROOT", str(daemon.root))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 16 MiB, Adam 32 MiB more
    opt = torch.optim.Adam(model.parameters())
    model, opt = accelerator.prepare(model, opt)
    accelerator.backward(model(torch.randn(2, 1024)).sum())
    opt.step()
    return accelerator, model, opt


def test_blocked_time_and_mismatches(daemon, tmp_path: Path, capsys, monkeypatch) -> None:
    accelerator, model, opt = _one_adam_step(daemon, monkeypatch)
    times: dict[str, list[float]] = {"ckptd save_state": [], "Accelerator.save_state": []}
    for step in range(1, 6):  # the first saves also connect and touch fresh staging pages
        started = time.perf_counter()
        handle = ckptd_accelerate.save_state(accelerator, step, run="timing", staging_size="64MiB")
        times["ckptd save_state"].append(time.perf_counter() - started)
        started = time.perf_counter()
        accelerator.save_state(str(tmp_path / f"own-{step}"))
        times["Accelerator.save_state"].append(time.perf_counter() - started)
        handle.wait(60)
    with capsys.disabled():  # in the test output even without -s
        print("\nblocked per checkpoint of the same state (48 MiB), ms: "
              + "; ".join(f"{n} " + " ".join(f"{t * 1e3:.1f}" for t in ts) + f" (median of the warm ones {median(ts[2:]) * 1e3:.1f})" for n, ts in times.items()))

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    info = ckptd_accelerate.load_state(accelerator, run="timing")
    assert info.step == 5
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    accelerator.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(ValueError, match="the checkpoint holds 0 objects registered for checkpointing, and this "
                                         "accelerator has 1"):
        ckptd_accelerate.load_state(accelerator, 5, run="timing")
    with pytest.raises(ckptd.CheckpointNotFound):
        ckptd_accelerate.load_state(accelerator, run="nothing-here")
    ckptd_accelerate.close()


def test_prepare_makes_staging_for_the_whole_share_before_the_first_save(daemon, tmp_path: Path, monkeypatch) -> None:
    accelerator, model, opt = _one_adam_step(daemon, monkeypatch)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # the weights, exp_avg(_sq)
    room = ckptd_accelerate.prepare(accelerator, run="first")  # staging_size "auto"
    producer = ckptd_accelerate.producer_for(accelerator, "first")
    assert room >= state_bytes and producer.stats()["staging_prepared_bytes"] == room
    assert ckptd.latest("first", root=daemon.root) is None  # nothing saved by it
    ckptd_accelerate.save_state(accelerator, 1, run="first").wait(60)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert ckptd_accelerate.load_state(accelerator, run="first").step == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    ckptd_accelerate.close()
