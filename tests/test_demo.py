"""The example examples/train_resume.py, end to end: a real daemon, a real SIGKILL, a bitwise match."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import ckptd

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "train_resume.py"


@pytest.fixture
def demo_config(tmp_path: Path):
    """A config of its own: the checkpoint root under tmp_path, a short socket path under /tmp."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ckd", dir="/tmp"))  # ipc paths are limited to 107 bytes
    root = tmp_path / "ckpt"
    config = tmp_path / "config.toml"
    config.write_text(f'[daemon]\nendpoint = "ipc://{sock_dir}/d.sock"\nroot = "{root}"\nlog_level = "debug"\n')
    yield config, root, sock_dir / "d.sock"
    shutil.rmtree(sock_dir, ignore_errors=True)


def run_demo(*args: str, timeout: float = 480.0) -> subprocess.CompletedProcess:
    # a bound against a hang: the demo takes 20-40 s alone, minutes beside other tests on 2 cores.
    # The demo gives up on a worker silent for 60 s, which suits a person's machine; beside
    # torchrun jobs on 2 cores a worker's `import torch` alone took longer (CI, twice): 180 s here.
    # Its own session, so a hung demo can be killed together with its daemon and workers.
    proc = subprocess.Popen([sys.executable, str(DEMO), *args, "--event-timeout", "180"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the demo did not finish within {timeout} s:\n{out}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def test_killed_run_resumes_bit_for_bit(demo_config, tmp_path: Path) -> None:
    config, root, sock = demo_config
    work = tmp_path / "work"
    result = run_demo("--config", str(config), "--run", "demo-test", "--steps", "60", "--every", "10",
                      "--hidden", "64", "--workdir", str(work))
    out = result.stdout
    assert result.returncode == 0, out
    assert "RESULT: resumed run matches uninterrupted run bit-for-bit" in out.splitlines(), out

    killed = int(re.search(r"killed worker during step (\d+)", out).group(1))
    resumed = int(re.search(r"resumed from checkpoint step (\d+)", out).group(1))
    durable = [int(s) for s in re.findall(r"\[train\] step +(\d+): checkpoint durable", out)]
    assert len(durable) >= 2, out
    assert killed % 10 != 0, "the kill should land between checkpoints"
    # Nothing reported durable was lost; a commit in flight at the kill may have landed too.
    assert durable[-1] <= resumed < killed, out

    # On disk: every checkpoint of both workers, the daemon gone, its socket removed.
    steps = [info.step for info in ckptd.list_checkpoints("demo-test", root=root)]
    assert steps == list(range(10, 61, 10))
    assert (work / "resumed.safetensors").exists() and (work / "reference.safetensors").exists()
    pid = int(re.search(r"daemon pid (\d+)", out).group(1))
    assert not Path(f"/proc/{pid}").exists(), "the demo left its daemon running"
    assert not sock.exists()


def test_too_short_a_run_fails_cleanly(demo_config, tmp_path: Path) -> None:
    """A run that ends before two checkpoints are durable cannot be killed: exit 1, nothing left behind."""
    config, _, sock = demo_config
    result = run_demo("--config", str(config), "--steps", "15", "--every", "10", "--hidden", "32",
                      "--workdir", str(tmp_path / "work"))
    assert result.returncode == 1, result.stdout
    assert "FAILED: the worker finished" in result.stdout
    pid = int(re.search(r"daemon pid (\d+)", result.stdout).group(1))
    assert not Path(f"/proc/{pid}").exists()
    assert not sock.exists()
