"""Faults, for real: kill -9 of the daemon at random instants, the daemon
restarting under a live producer, kill -9 of a producer mid-step, a slow disk, and
many producers at once. The long versions run in ``benchmarks/stress.py``; the kill
loop and the load here are the same code, made small."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import CheckpointError
from ckptd.transport import wire
from ckptd.transport.oneshot import request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import stress  # noqa: E402  (benchmarks/stress.py: the kill loop, the load, the checks)

MiB = 2**20
# A producer must give up within its `timeout` (1 s below) and a little scheduling
# slack; this is a bound against hangs, far below any other timeout in play.
HANG_S = 10.0


def state(step: int, n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(2**16, generator=g) for i in range(n)}  # 256 KiB each


def status(d) -> dict:
    return request(d.endpoint, wire.encode("status", seq=1), 10.0)["status"]


def steps(d, run: str = "t") -> list[int]:
    return [i.step for i in ckptd.list_checkpoints(run, root=d.root)]


def assert_loads(d, step: int, want: dict[str, torch.Tensor], run: str = "t") -> None:
    got = ckptd.load(run, step, root=d.root, verify=True)
    assert stress.mismatch(got, want) is None


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


# -- kill -9 of the daemon at random instants, producers checkpointing -----------------------------
def test_kill_daemon_at_random_instants_loses_nothing(tmp_path) -> None:
    """After every restart: no orphans, every listed checkpoint and every acknowledged
    commit loads bit-exactly with its checksums; every producer reconnects."""
    r = stress.kill_loop(tmp_path, kills=3, producers=3, seed=7, pause=(0.05, 0.8), say=lambda _: None)
    assert r["violations"] == []
    assert r["kills_survived"] == 3
    assert r["commits_acked"] >= 3 * 4  # each producer: one before the first kill, one after each restart
    assert r["shares_verified"] > 0 and r["bytes_lost"] == 0
    assert r["hangs"] == 0


# -- the daemon restarts under a live producer -----------------------------------------------------
@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_step_in_flight_fails_when_the_daemon_dies_and_the_next_call_reconnects(make_daemon, transport) -> None:
    d = make_daemon()
    p = d.producer(timeout=60, heartbeat=0.2, transport=transport)
    assert p.save(state(1), 1).wait(30).step == 1
    assert p.stats()["transport"] == transport
    os.kill(d.proc.pid, signal.SIGSTOP)  # the commit of step 2 goes out and is never answered
    handle = p.save(state(2), 2)
    d.kill()
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="lost contact with the ckptd daemon"):
        handle.wait(30)
    assert time.monotonic() - t0 < HANG_S  # its pidfd, long before `timeout`: never a hang, never a success
    # while the daemon is away, the next step fails at once too, naming the problem
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="no daemon listens there now|cannot be shared with the daemon"):
        p.save(state(3), 3)
    assert time.monotonic() - t0 < HANG_S
    d.start()
    assert p.save(state(4), 4).wait(30).step == 4  # reconnected by itself
    p.flush()  # both failures were raised already
    p.close()
    assert steps(d) == [1, 4]
    assert_loads(d, 1, state(1))
    assert_loads(d, 4, state(4))
    assert stress.orphans(d.root) == []


def test_daemon_back_before_the_producer_noticed(make_daemon) -> None:
    """Restarted within the producer's timeout: the step in flight fails at once, either
    because the producer saw the old daemon's process exit (its pidfd) or because the new
    daemon, which does not know the session, said so at the producer's next message
    (whichever comes first; over tcp:// only the second can)."""
    d = make_daemon()
    p = d.producer(timeout=60, heartbeat=0.2)
    assert p.save(state(1), 1).wait(30).step == 1
    os.kill(d.proc.pid, signal.SIGSTOP)
    handle = p.save(state(2), 2)
    d.kill()
    d.start()
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"no longer knows this producer|its process \(pid \d+\) exited"):
        handle.wait(50)
    assert time.monotonic() - t0 < HANG_S  # long before the 60 s timeout
    assert p.save(state(3), 3).wait(30).step == 3
    p.close()
    assert steps(d) == [1, 3]
    assert_loads(d, 3, state(3))


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_emit_blocked_on_full_staging_fails_when_the_daemon_dies(make_daemon, transport) -> None:
    d = make_daemon()
    p = d.producer(staging_size="1MiB", timeout=60, heartbeat=0.2, emit_timeout=120, transport=transport)
    assert p.latest() is None  # connected
    os.kill(d.proc.pid, signal.SIGSTOP)  # a daemon that frees no staging
    p.emit("a", torch.ones(2**18 - 16), step=1)  # nearly fills staging
    outcome: dict = {}

    def emit_b() -> None:
        t0 = time.monotonic()
        try:
            p.emit("b", torch.ones(2**18), step=1)  # waits for staging space
        except CheckpointError as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - t0

    blocked = threading.Thread(target=emit_b)
    blocked.start()
    d.kill()
    blocked.join(HANG_S)
    assert not blocked.is_alive(), "emit stayed blocked after the daemon died"
    assert "lost contact with the ckptd daemon" in str(outcome.get("error"))  # not emit_timeout (120 s)
    with pytest.raises(CheckpointError, match="lost contact"):
        p.commit(1).wait(5)  # the step is known to be lost: its commit fails at once
    d.start()
    assert p.save(state(2), 2).wait(30).step == 2
    p.close()
    assert steps(d) == [2]
    assert stress.orphans(d.root) == []


# -- kill -9 of a producer mid-step ---------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys, torch
    from ckptd import Producer
    p = Producer(sys.argv[1], "victim-" + sys.argv[2], staging_size="32MiB", timeout=5, heartbeat=0.2,
                 transport=sys.argv[2])
    p.save({"w": torch.ones(1000)}, 1).wait(30)
    with p.checkpoint(2):
        p.emit("a", torch.ones(2**18))  # 1 MiB each: they wait in the daemon for a 4 MiB chunk
        p.emit("b", torch.ones(2**18))
        print("emitted", flush=True)
        sys.stdin.readline()  # killed here, mid-step
""")


def staging_maps(pid: int) -> int:
    """How many producers' staging arenas the daemon maps (shared memory)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:ckptd-staging" in line for line in f)


def test_kill_producers_mid_step_frees_their_memory_and_others_carry_on(make_daemon) -> None:
    """Two victims: one sends inline (its bytes sit in the daemon's memory), one through
    shared memory (the daemon maps its staging). Both are killed mid-step."""
    d = make_daemon()  # the victims' deaths are noticed through their pidfds, not by silence
    good = d.producer("good", heartbeat=0.2, transport="shm")
    acked: list[int] = []
    failed: list[str] = []
    stop = threading.Event()

    def train() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            try:
                acked.append(good.save(state(step, 2), step).wait(30).step)
            except CheckpointError as exc:
                failed.append(str(exc))

    trainer = threading.Thread(target=train)
    trainer.start()
    children: dict[str, subprocess.Popen] = {}
    try:
        wait_until(lambda: acked, 30, "the good producer commits")
        maps_before = staging_maps(d.proc.pid)
        for transport in ("inline", "shm"):
            children[transport] = subprocess.Popen([sys.executable, "-c", CHILD, d.endpoint, transport],
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for child in children.values():
            assert child.stdout.readline().strip() == "emitted"
        pids = {c.pid for c in children.values()}

        def victims(s: dict) -> list[dict]:
            return [p for p in s["producers"] if p["pid"] in pids]

        # the daemon holds the victims' open steps: bytes in its memory, a mapping of staging
        wait_until(lambda: [v["open_steps"] for v in victims(status(d))] == [[2], [2]], 20, "steps 2 are open")
        wait_until(lambda: status(d)["queued_bytes"] >= 2 * MiB, 20, "the daemon holds the inline 2 MiB")
        assert staging_maps(d.proc.pid) == maps_before + 1
        for child in children.values():
            child.kill()
            child.wait()
        # their deaths are noticed (a pidfd: ckptd.daemon.liveness), their steps dropped, their memory freed
        wait_until(lambda: not victims(status(d)), 20, "the victims' sessions are gone")
        wait_until(lambda: status(d)["queued_bytes"] == 0, 20, "queued_bytes is back to 0")
        wait_until(lambda: staging_maps(d.proc.pid) == maps_before, 20, "the shm victim's staging is unmapped")
        cli = subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "--endpoint", d.endpoint],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        report = json.loads(cli.stdout)
        assert report["queued_bytes"] == 0 and not victims(report)
        before = len(acked)
        wait_until(lambda: len(acked) >= before + 2, 30, "the good producer still commits")
    finally:
        stop.set()
        trainer.join(60)
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
    good.close()
    assert failed == []
    for transport in ("inline", "shm"):
        assert steps(d, f"victim-{transport}") == [1]
        assert not (d.root / f"victim-{transport}" / "step-000000000002").exists()
    for step in acked:
        assert_loads(d, step, state(step, 2), run="good")


# -- a full memory budget, a slow disk --------------------------------------------------------------------
def test_tensors_in_pieces_never_stall_a_full_daemon(make_daemon) -> None:
    """Tensors larger than staging travel in pieces; while they are below chunk_size the
    daemon used to hold the pieces until the last one came, filled memory_budget, stopped
    reading, and never got the last ones: every producer waited until emit_timeout."""
    d = make_daemon(memory_budget="8MiB", chunk_size="64MiB")
    producers = [d.producer("r", rank=i, world_size=4, staging_size="2MiB", transport="inline",
                            emit_timeout=60, timeout=30) for i in range(4)]
    results: dict[int, object] = {}

    def save(i: int) -> None:
        try:
            results[i] = producers[i].save({"w": torch.full((6 * MiB // 4,), float(i))}, 1).wait(60).step
        except CheckpointError as exc:
            results[i] = exc

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert results == {0: 1, 1: 1, 2: 1, 3: 1}
    for i, p in enumerate(producers):
        p.close()
        assert torch.equal(ckptd.load("r", 1, root=d.root, rank=i, verify=True)["w"],
                           torch.full((6 * MiB // 4,), float(i)))


class QueueWatch:
    """Polls the daemon's `status` report and keeps the largest queued_bytes seen."""

    def __init__(self, d) -> None:
        self.d, self.peak, self._stop = d, 0, threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, status(self.d)["queued_bytes"])

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_slow_disk_blocks_producers_and_memory_stays_in_budget(make_daemon, transport) -> None:
    """[daemon] write_rate slows the writer: the producer blocks (on_full = "block"),
    the daemon holds no more than memory_budget (plus the one message that crossed it)."""
    d = make_daemon(write_rate="16MiB", memory_budget="8MiB", chunk_size="1MiB")
    p = d.producer(staging_size="4MiB", transport=transport, timeout=30, emit_timeout=60)
    big = {f"w{i}": torch.randn(2**18, generator=torch.Generator().manual_seed(i)) for i in range(24)}  # 24 MiB
    watch = QueueWatch(d)
    try:
        t0 = time.monotonic()
        info = p.save(big, 1).wait(60)
        took = time.monotonic() - t0
    finally:
        peak = watch.close()
    assert info.nbytes == 24 * MiB
    assert took >= 0.8 * 24 / 16  # the cap held the writes to 16 MiB/s
    assert p.stats()["blocked_seconds"] > 0  # emit waited for the daemon: blocked, nothing dropped
    assert peak <= 8 * MiB + 4 * MiB  # memory_budget, plus at most one staging-sized message
    p.close()
    assert_loads(d, 1, big)


def test_slow_disk_with_on_full_raise_names_the_setting(make_daemon) -> None:
    d = make_daemon(write_rate="4MiB", memory_budget="4MiB", chunk_size="1MiB")
    p = d.producer(staging_size="2MiB", on_full="raise", transport="inline", timeout=30)
    sent = {}
    with pytest.raises(CheckpointError, match=r"staging memory is full.*staging_size.*on_full"):
        for i in range(128):  # 64 MiB: far more than staging plus the daemon's budget
            t = torch.full((2**17,), float(i))
            p.emit(f"w{i}", t, step=1)
            sent[f"w{i}"] = t
    # nothing was dropped silently: the step holds exactly what emit accepted
    assert p.commit(1).wait(60).ntensors == len(sent)
    p.close()
    assert_loads(d, 1, sent)


# -- load: many producer processes at once -------------------------------------------------------------------
def test_load_many_producers(tmp_path) -> None:
    r = stress.load(tmp_path, seconds=3, producers=4, runs=2, sizes=[4096, 64 * 1024, 256 * 1024],
                    say=lambda _: None)
    assert r["violations"] == []
    assert r["commits_acked"] > 4 and r["commits_failed"] == 0
    assert r["shares_verified"] == r["commits_acked"] and r["bytes_lost"] == 0
    assert r["peak_rss"] < r["memory_budget"] + stress.RSS_SLACK
    assert r["latency"]["p50_s"] is not None
