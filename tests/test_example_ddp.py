"""examples/ddp_torchrun.py under a real torchrun (2 ranks, gloo): killed once every rank's share
of a step is durable, the same command resumes, and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptd

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_torchrun.py"


def _torchrun(daemon, run: str, out: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, CKPTD_ENDPOINT=daemon.endpoint, CKPTD_ROOT=str(daemon.root), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(EXAMPLE), "--run-name", run, "--steps", "30", "--every", "10", "--staging", "8MiB",
                             "--out", str(out), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


@pytest.mark.slow
def test_torchrun_ddp_killed_and_rerun_resumes_bit_exact(daemon, tmp_path: Path) -> None:
    # the uninterrupted run and the one that is killed run side by side
    reference = _torchrun(daemon, "ref", tmp_path / "ref.safetensors")
    crash = _torchrun(daemon, "ddp", tmp_path / "ddp.safetensors", "--kill-at", "20")
    rc, out = _finish(crash)
    assert rc != 0 and "Signal 9 (SIGKILL) received" in out, out[-3000:]
    info = ckptd.latest("ddp", root=daemon.root)
    assert info.step == 20 and len(list(Path(info.path).glob("manifest-r*.json"))) == 2  # each rank its share
    rc, out = _finish(reference)
    assert rc == 0, out[-3000:]

    rc, out = _finish(_torchrun(daemon, "ddp", tmp_path / "ddp.safetensors"))
    assert rc == 0, out[-3000:]
    assert "rank 0: resumed from step 20" in out and "rank 1: resumed from step 20" in out
    expected, final = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "ddp.safetensors")
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    assert ckptd.load("ddp", root=daemon.root, rank=1)["step"] == 30


FSDP_EXAMPLE = EXAMPLE.parent / "fsdp2_torchrun.py"


@pytest.mark.slow
def test_the_fsdp2_example_resumes_on_another_number_of_ranks(daemon) -> None:
    env = dict(os.environ, CKPTD_ENDPOINT=daemon.endpoint, CKPTD_ROOT=str(daemon.root), PYTHONUNBUFFERED="1")

    def torchrun(ranks: int, steps: int) -> str:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={ranks}", str(FSDP_EXAMPLE), "--run-name", "fsdp",
                            "--steps", str(steps), "--every", "10"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        return r.stdout

    torchrun(2, 20)
    assert ckptd.latest("fsdp", root=daemon.root).step == 20
    out = torchrun(1, 30)  # one process takes over what two saved
    assert "rank 0: resumed from step 20 (saved by 2 ranks)" in out, out
    whole = ckptd.load("fsdp", root=daemon.root)  # one rank saved it: plain tensors, global shapes
    assert whole["step"] == 30 and whole["model"]["2.weight"].shape == (7, 64)
