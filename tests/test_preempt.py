"""A preemption notice (a signal, or ``Producer.preempt()``) makes the next ``should_save``
answer True, that save is durable before the signal goes on, and the process ends as
the signal meant (tests/preempt_job.py is the training loop)."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.errors import ConfigError
import preempt_job
from conftest import free_port

JOB = Path(preempt_job.__file__)
GRACE = 20.0  # preempt_job's preempt_grace


def start(daemon, tmp_path: Path, mode: str, run: str = "pre", **env_vars: str) -> subprocess.Popen:
    env = dict(os.environ, CKPTD_ROOT=str(daemon.root), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_vars)
    return subprocess.Popen([sys.executable, str(JOB), daemon.endpoint, run, str(tmp_path), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reached(out: Path, rank: int = 0) -> int:
    try:
        return int((out / f"step-r{rank}").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def wait_for_step(out: Path, step: int, procs: list, ranks: int = 1, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while min(reached(out, r) for r in range(ranks)) < step or \
            not all((out / f"ready-r{r}").exists() for r in range(ranks)):
        for proc in procs:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"the loop did not reach step {step}"
        time.sleep(0.02)


def assert_saved_the_last_step(daemon, out: Path, run: str, ranks: int = 1) -> int:
    """The newest complete step is the last step every rank reached, and loads bit-exact."""
    info = ckptd.latest(run, root=daemon.root)
    last = {reached(out, r) for r in range(ranks)}
    assert info is not None and last == {info.step}, (info, last)
    for rank in range(ranks):
        got = ckptd.load(run, info.step, root=daemon.root, rank=rank) if ranks > 1 else \
            ckptd.load(run, info.step, root=daemon.root)
        want = preempt_job.state(info.step)
        assert got["step"] == info.step
        for name in ("w", "b"):
            assert got["model"][name].dtype == want["model"][name].dtype
            assert torch.equal(got["model"][name], want["model"][name]), name
    return info.step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_the_step_reached_and_ends_the_process_as_the_signal_does(daemon, tmp_path, sig) -> None:
    proc = start(daemon, tmp_path, "default")
    wait_for_step(tmp_path, random.randint(3, 15), [proc])
    sent = time.monotonic()
    proc.send_signal(sig)
    output = proc.communicate(timeout=GRACE + 30)[0]
    took = time.monotonic() - sent
    assert proc.returncode == -sig, output[-4000:]
    assert took < GRACE, took
    step = assert_saved_the_last_step(daemon, tmp_path, "pre")
    assert f"step {step} is durable in the root" in output
    assert [i.step for i in ckptd.list_checkpoints("pre", root=daemon.root)] == [step]  # no save but the notice's


def test_the_users_own_handler_runs_after_the_save(daemon, tmp_path) -> None:
    proc = start(daemon, tmp_path, "handler")
    wait_for_step(tmp_path, random.randint(3, 10), [proc])
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=GRACE + 30)[0]
    assert proc.returncode == 7, output[-4000:]  # the handler's own exit
    assert (tmp_path / "handled-r0").read_text() == str(int(signal.SIGTERM))
    assert_saved_the_last_step(daemon, tmp_path, "pre")


def test_a_second_signal_ends_the_process_at_once(daemon, tmp_path) -> None:
    proc = start(daemon, tmp_path, "slow")  # 2 s a step after the first: the notice waits for the next should_save
    wait_for_step(tmp_path, 1, [proc])
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert time.monotonic() - sent < 1.5  # not at the end of the step, nor of the grace
    assert ckptd.latest("pre", root=daemon.root) is None


def test_a_loop_that_saves_no_more_still_ends_at_the_grace(daemon, tmp_path) -> None:
    proc = start(daemon, tmp_path, "stuck")  # a step of 60 s after the first, a grace of 3 s
    wait_for_step(tmp_path, 1, [proc])
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=30)[0]
    assert proc.returncode == -signal.SIGTERM, output[-4000:]
    assert 3.0 <= time.monotonic() - sent < 10.0
    assert "no save within the 3 s grace" in output
    assert ckptd.latest("pre", root=daemon.root) is None


def test_a_rank_waiting_in_a_collective_whose_peer_is_gone_still_ends_at_the_grace(daemon, tmp_path) -> None:
    """Rank 0 waits in gloo's all-reduce (C++: Python runs no handler until it returns) for
    rank 1, which never comes: after SIGTERM the grace still ends it, as the signal does,
    long before a launcher's SIGKILL (torchrun's, 30 s on)."""
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [start(daemon, tmp_path, "peer_gone", RANK=str(r), **env) for r in (0, 1)]
    try:
        wait_for_step(tmp_path, 1, procs, ranks=2)
        deadline = time.monotonic() + 60
        while not (tmp_path / "collective-r0").exists():
            assert procs[0].poll() is None and time.monotonic() < deadline, "rank 0 never reached the collective"
            time.sleep(0.02)
        time.sleep(0.5)  # into gloo's wait
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        output = procs[0].communicate(timeout=30)[0]
        assert procs[0].returncode == -signal.SIGTERM, output[-4000:]
        assert 3.0 <= time.monotonic() - sent < 10.0
        assert "no save within the 3 s grace" in output
        assert reached(tmp_path, 0) == 1 and ckptd.latest("pre", root=daemon.root) is None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_no_preempt_signals_leaves_the_handlers_as_they_were(daemon, tmp_path) -> None:
    proc = start(daemon, tmp_path, "off")
    wait_for_step(tmp_path, 3, [proc])
    assert (tmp_path / "dispositions").read_text() == f"{signal.SIG_DFL} {signal.SIG_DFL}"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert ckptd.latest("pre", root=daemon.root) is None  # nothing heard, nothing saved


def test_preempt_from_user_code_and_the_handlers_put_back_at_close(daemon) -> None:
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]
    with daemon.producer("own") as p:
        assert not p.should_save(1, min_steps=1000) and not p.preempted
        assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)] != before  # heard, chained
        p.preempt()
        assert p.preempted and p.should_save(2, min_steps=1000)
        p.save({"w": torch.arange(5.0)}, 2)  # returns once durable; no signal to hand on: the loop goes on
        assert ckptd.latest("own", root=daemon.root).step == 2
        assert not p.should_save(3, min_steps=1000) and p.preempted
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)] == before


def test_a_wakeup_fd_set_before_hears_every_signal_and_is_put_back_at_close(daemon) -> None:
    """asyncio sets a wakeup fd: the notice's thread hears through one of its own, passes
    each byte on to the one it found, and puts that one back at close."""
    found, theirs = socket.socketpair()
    theirs.setblocking(False)
    before = signal.set_wakeup_fd(theirs.fileno())
    try:
        with daemon.producer("wake") as p:
            assert not p.should_save(1, min_steps=1000)
            os.kill(os.getpid(), signal.SIGUSR1)
            found.settimeout(10)
            assert found.recv(1) == bytes([signal.SIGUSR1])
            assert p.preempted
        assert signal.set_wakeup_fd(-1) == theirs.fileno()
    finally:
        signal.set_wakeup_fd(before)
        found.close()
        theirs.close()


LATE_BYTE = """
import os, signal, sys, threading, time
from ckptd.producer.preempt import Notices
notices = Notices(("SIGUSR1",), 30.0, (None, "root"))
notices.install()
wakeup = notices._wakeup
heard, late = wakeup._hear, threading.Event()
def slow(signum):
    late.wait(10)
    heard(signum)
wakeup._hear = slow
os.kill(os.getpid(), signal.SIGUSR1)
while not notices.preempted:
    time.sleep(0.01)
closing = threading.Thread(target=lambda: (time.sleep(0.5), late.set()))
closing.start()
notices.close()
closing.join()
print("alive")
"""


def test_a_signal_byte_the_thread_reads_after_close_does_not_end_the_process() -> None:
    """The main thread took the notice and the producer closed before the signals thread
    read its byte: that byte is the same signal, not a second one, and ends nothing."""
    done = subprocess.run([sys.executable, "-c", LATE_BYTE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "alive", (done.returncode, done.stderr[-2000:])


def test_bad_preempt_signals_are_refused_by_name(daemon) -> None:
    with pytest.raises(ConfigError, match="SIGKILL"):
        daemon.producer("bad", preempt_signals=["SIGKILL"])
    with pytest.raises(ConfigError, match="SIGNOPE"):
        daemon.producer("bad", preempt_signals=["SIGNOPE"])


@pytest.mark.slow
def test_every_rank_of_torchrun_saves_the_same_step_after_a_signal(daemon, tmp_path) -> None:
    """Two ranks over gloo, each sent SIGTERM (as torchrun forwards it) a moment apart:
    both save the same step, the newest complete one, and each ends by the signal."""
    env = dict(os.environ, CKPTD_ROOT=str(daemon.root), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CKPTD_CONFIG", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           "--monitor-interval=0.2", str(JOB), daemon.endpoint, "pre2", str(tmp_path), "default"]
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(tmp_path, random.randint(3, 15), [agent], ranks=2, timeout=300)
        pids = [int((tmp_path / f"pid-r{r}").read_text()) for r in (1, 0)]
        sent = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
            time.sleep(0.03)
        output = agent.communicate(timeout=GRACE + 60)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert time.monotonic() - sent < GRACE + 10
    for rank in (0, 1):  # torchrun's report of each worker's end
        assert re.search(rf"rank +: {rank} \(local_rank: {rank}\)\n +exitcode +: -15 ", output), output[-6000:]
    step = assert_saved_the_last_step(daemon, tmp_path, "pre2", ranks=2)
    # the first rank to end saw every rank's share durable; torchrun then ends the other (a
    # second signal), which may not have logged it yet
    assert f"step {step} is durable in the root" in output
    assert [i.step for i in ckptd.list_checkpoints("pre2", root=daemon.root)] == [step]
