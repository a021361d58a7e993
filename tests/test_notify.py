"""sd_notify, for real: the test is the service manager's end of NOTIFY_SOCKET.

A real AF_UNIX datagram socket (a path, or an @abstract name) receives what a real
``ckptd serve`` sends, with the sender's credentials attached by the kernel, as
systemd receives them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import statistics
import struct
import time
from pathlib import Path

import pytest
import torch

from ckptd import CheckpointError

WATCHDOG_S = 1.2


class Message(dict):
    """One datagram's ``KEY=VALUE`` lines, with when it came and the sender's pid."""

    def __init__(self, data: bytes, at: float, pid: int) -> None:
        super().__init__(line.split("=", 1) for line in data.decode().split("\n") if line)
        self.at = at
        self.pid = pid


class Listener:
    """The service manager's end of NOTIFY_SOCKET."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # as systemd does
        self.messages: list[Message] = []

    def _receive(self, timeout: float) -> Message | None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except socket.timeout:
            return None
        pid = next(struct.unpack("3i", d)[0] for level, kind, d in ancillary
                   if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS))
        m = Message(data, time.monotonic(), pid)
        self.messages.append(m)
        return m

    def wait_for(self, key: str, timeout: float = 30.0) -> Message:
        """The next message (already received or not) that has ``key``."""
        for m in self.messages:
            if key in m and not getattr(m, "seen", False):
                m.seen = True
                return m
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            m = self._receive(left)
            if m is not None and key in m:
                m.seen = True
                return m
        raise AssertionError(f"no {key}= within {timeout} s; got {self.messages}")

    def collect(self, seconds: float) -> list[Message]:
        """Everything that arrives within ``seconds``."""
        got, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            m = self._receive(left)
            if m is not None:
                got.append(m)
        return got

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener(tmp_path: Path):
    made: list[Listener] = []

    def make(address: str | None = None) -> Listener:
        made.append(Listener(address or str(tmp_path / "notify.sock")))
        return made[-1]

    yield make
    for m in made:
        m.close()


def test_ready_watchdog_stopping(make_daemon, listener, monkeypatch) -> None:
    notify = listener()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.address)
    monkeypatch.setenv("WATCHDOG_USEC", str(int(WATCHDOG_S * 1e6)))
    d = make_daemon(start=False)
    orphan = d.root / "t/step-000000000007/r00000-000000.safetensors"  # a crash's leftover
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"half a chunk")
    d.start(wait=False)

    ready = notify.wait_for("READY")
    assert ready["READY"] == "1"
    # READY=1 means: listening, and what a crash left is gone
    assert (d.sock_dir / "d.sock").is_socket()
    assert not orphan.exists()
    assert ready["STATUS"] == "0 producer(s); 0.0 MiB queued; no commit yet"
    assert ready.pid == d.proc.pid  # from the main process, as NotifyAccess=main wants

    pings = [m for m in notify.collect(3 * WATCHDOG_S) if "WATCHDOG" in m]
    assert {m["WATCHDOG"] for m in pings} == {"1"} and {m.pid for m in pings} == {d.proc.pid}
    gaps = [b.at - a.at for a, b in zip([ready, *pings], pings)]
    assert len(pings) >= 4, gaps
    assert max(gaps) < WATCHDOG_S, gaps  # the watchdog never runs out...
    assert statistics.mean(gaps) > WATCHDOG_S / 3, gaps  # ...at about half its interval, not a flood

    d.proc.send_signal(signal.SIGTERM)
    stopping = notify.wait_for("STOPPING")
    assert stopping["STOPPING"] == "1" and stopping.pid == d.proc.pid
    assert stopping["STATUS"].startswith("stopping: 0 commit(s) in progress, 0 open step(s)")
    assert d.proc.wait(30) == 0


def test_abstract_socket_and_a_watchdog_meant_for_another_process(make_daemon, listener, monkeypatch) -> None:
    notify = listener(f"@ckptd-test-{os.getpid()}")
    monkeypatch.setenv("NOTIFY_SOCKET", notify.address)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.setenv("WATCHDOG_PID", "1")  # not the daemon: it must not ping
    d = make_daemon(start=False)
    d.start(wait=False)
    assert notify.wait_for("READY")["READY"] == "1"
    with d.producer() as p:
        p.save({"w": torch.arange(10.0)}, 3).wait(30)
        status = notify.wait_for("STATUS", timeout=10)
        while "last commit" not in status["STATUS"]:
            status = notify.wait_for("STATUS", timeout=10)
        assert status["STATUS"].startswith("1 producer(s) of run(s) t; ")
        assert "; last commit: run t step 3 at " in status["STATUS"]
    assert not [m for m in notify.messages if "WATCHDOG" in m]
    d.proc.send_signal(signal.SIGTERM)
    assert notify.wait_for("STOPPING")["STOPPING"] == "1"
    assert d.proc.wait(30) == 0


def test_reload_keeps_producers_and_applies_the_log_level(make_daemon, listener, monkeypatch) -> None:
    notify = listener()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.address)
    d = make_daemon(start=False)  # log_level = "debug"
    d.start(wait=False)
    notify.wait_for("READY")
    original = d.config.read_text()
    with d.producer() as p:
        p.save({"w": torch.ones(4)}, 1).wait(30)
        assert "committed run=t step=1" in d.log_text()

        d.config.write_text(original.replace('"debug"', '"warning"').replace('"4MiB"', '"8MiB"'))
        d.proc.send_signal(signal.SIGHUP)
        reloading = notify.wait_for("RELOADING")
        assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) > 0
        assert notify.wait_for("READY")["READY"] == "1"
        p.save({"w": torch.ones(4)}, 2).wait(30)  # the same session: no new hello
        log = d.log_text()
        assert "reloaded " + str(d.config) + ": log_level = warning" in log
        assert "chunk_size changed in " + str(d.config) + "; a restart applies it" in log
        assert "committed run=t step=2" not in log  # an info line, below the new level

        d.config.write_text(original.replace('"debug"', '"loud"'))  # a bad file changes nothing
        d.proc.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING")
        assert notify.wait_for("READY")["READY"] == "1"
        assert p.save({"w": torch.ones(4)}, 3).wait(30).step == 3
    log = d.log_text()
    assert "SIGHUP: not reloaded, the running settings stay: bad value for 'log_level'" in log
    assert log.count("producer connected") == 1
    assert d.proc.poll() is None


def test_log_lines_carry_journal_priorities_when_stderr_is_the_journal(make_daemon, monkeypatch) -> None:
    d = make_daemon(start=False)
    d.log.touch()  # the daemon's stderr: tell it that this file is "the journal"
    st = d.log.stat()
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    d.start()
    with d.producer() as p:
        p.save({"w": torch.ones(2)}, 1).wait(30)
        with pytest.raises(CheckpointError, match="already committed"):
            p.save({"w": torch.ones(2)}, 1).wait(30)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    lines = d.log_text().splitlines()
    assert any(line.startswith("<6>INFO ckptd.daemon: committed run=t step=1 ") for line in lines)
    assert any(line.startswith("<4>WARNING ckptd.daemon: run=t rank=0") and "already committed" in line
               for line in lines)
    assert all(re.match(r"<[2-7]>", line) for line in lines), lines


def test_no_journal_no_prefixes(daemon) -> None:
    with daemon.producer() as p:
        p.save({"w": torch.ones(2)}, 1).wait(30)
    assert "\nINFO ckptd.daemon: committed run=t step=1 " in daemon.log_text()
    assert "<6>" not in daemon.log_text()


def _wakeups(tid: int) -> int:
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/self/task/{tid}/status")


def test_the_launchers_notify_reader_sleeps_until_a_message_and_ends_on_close(daemon) -> None:
    """The launcher's reader lives in the caller's process (a training loop, in
    benchmarks/training_cost.py): between the daemon's messages it must not wake at all,
    and close() must end it without one."""
    reader = daemon._notify
    assert reader is not None and reader.ready.is_set()
    tid = reader._thread.native_id
    assert tid is not None
    before = _wakeups(tid)
    time.sleep(1.0)  # an idle daemon without WATCHDOG_USEC sends at most one STATUS= in a second
    assert _wakeups(tid) - before <= 2, "the reader woke without a message to read"
    thread = reader._thread
    daemon.close()
    assert not thread.is_alive()


def _policies(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread of ``pid``: (scheduling policy, nice), from /proc/PID/task/*/stat."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = task.joinpath("stat").read_text().rpartition(")")[2].split()
        out[int(task.name)] = (int(fields[38]), int(fields[16]))
    return out


@pytest.mark.parametrize("nice, policy", [("idle", os.SCHED_IDLE), (19, os.SCHED_OTHER)])
def test_every_daemon_thread_runs_at_the_configured_priority(make_daemon, nice, policy) -> None:
    """``[daemon] nice = "idle"``: nice 19 and SCHED_IDLE on every thread the daemon has,
    its writer pool's included (started at its first chunk, after the setting)."""
    d = make_daemon(nice=nice)
    with d.producer() as p:
        p.save({f"w{i}": torch.full((2**20,), float(i)) for i in range(12)}, 1).wait(30)
    threads = _policies(d.pid)
    assert len(threads) > 4
    assert set(threads.values()) == {(policy, 19)}, threads
