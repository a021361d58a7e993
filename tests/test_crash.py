"""kill -9 of the daemon or of a producer at awkward moments (docs/reliability.md)."""

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
from ckptd import CheckpointError, layout


def referenced_files_only(root: Path) -> None:
    """Every file in every step folder is a manifest or named by one."""
    for step_dir in root.glob("*/step-*"):
        names = set(os.listdir(step_dir))
        referenced = set()
        for m in step_dir.glob("manifest-r*.json"):
            referenced.add(m.name)
            referenced.update(t["file"] for t in json.loads(m.read_bytes())["tensors"].values())
        assert names <= referenced, f"orphans in {step_dir}: {sorted(names - referenced)}"
        assert referenced, f"empty step folder left: {step_dir}"


def state(step: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(2**18, generator=g) for i in range(n)}  # 1 MiB each


def wait_for_files(step_dir: Path, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if step_dir.is_dir() and sum(1 for n in os.listdir(step_dir) if layout.CHUNK.fullmatch(n)) >= count:
            return
        time.sleep(0.0005)
    raise AssertionError(f"never saw {count} chunk files in {step_dir}")


@pytest.mark.parametrize("point, writers", [("1 file", 1), ("10 files", 1), ("30 files", 1),
                                           ("after commit sent", 1), ("3 files", 4)])
def test_kill_daemon_while_writing(make_daemon, point: str, writers: int) -> None:
    """``writers`` 4: four chunk files of four tensors each in flight at once, each
    tensor's bytes in one writev with the others of its file (datafile.DataFile.write)."""
    d = make_daemon(chunk_size="1MiB" if writers == 1 else "4MiB", writer_threads=writers)
    p = d.producer(staging_size="80MiB", timeout=60, heartbeat=0.2)
    p.save(state(1, 4), 1).wait(30)
    handle = p.save(state(2, 48), 2)
    step_dir = d.root / "t" / "step-000000000002"
    if point.endswith("files"):
        wait_for_files(step_dir, int(point.split()[0]))
    d.kill()

    # The producer is told: the step either committed before the kill or fails. Never silence.
    try:
        info = handle.wait(30)
        committed = True
        assert info.step == 2
    except CheckpointError as exc:
        committed = False
        assert "daemon" in str(exc)
    if point.endswith("files"):
        assert not committed  # the manifest is written after all 48 files

    d.start()  # start-up removes what the crash left
    latest = ckptd.latest("t", root=d.root)
    assert latest is not None and latest.step == (2 if committed else 1)
    expected = state(latest.step, 4 if latest.step == 1 else 48)
    loaded = ckptd.load("t", root=d.root, verify=True)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    referenced_files_only(d.root)

    # the same producer goes on against the restarted daemon
    assert p.save(state(3, 2), 3).wait(30).step == 3
    try:
        p.close()
    except CheckpointError:
        pass  # close re-raises the failed step 2, if it failed


PRODUCER_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    from ckptd import Producer
    p = Producer(sys.argv[1], "t", staging_size="32MiB", timeout=5, heartbeat=0.2)  # talks until stopped
    p.save({"w": torch.ones(1000)}, 1).wait(30)
    with p.checkpoint(2):
        p.emit("a", torch.ones(2**20))
        p.emit("b", torch.ones(2**20))
        p.flush()  # nothing to wait for: step 2 is not committed
        print("emitted", flush=True)
        sys.stdin.readline()  # the test kills us here, mid-step
""")


def test_kill_producer_mid_step(daemon) -> None:
    child = subprocess.Popen([sys.executable, "-c", PRODUCER_SCRIPT, daemon.endpoint],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "emitted"
    time.sleep(0.3)  # let the daemon receive (and write) part of step 2
    child.kill()
    child.wait()

    assert [i.step for i in ckptd.list_checkpoints("t", root=daemon.root)] == [1]
    # The next producer of the same run and rank replaces the dead one's session:
    # its unfinished step is discarded, and the daemon serves on.
    with daemon.producer() as p:
        p.save({"w": torch.zeros(10)}, 3).wait(30)
        deadline = time.monotonic() + 10
        while (daemon.root / "t" / "step-000000000002").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not (daemon.root / "t" / "step-000000000002").exists()
    assert [i.step for i in ckptd.list_checkpoints("t", root=daemon.root)] == [1, 3]
    assert "unfinished step" in daemon.log_text()


def test_silent_producer_session_expires(make_daemon) -> None:
    """A producer that stopped talking without anyone replacing it (frozen: SIGSTOP; a dead
    local one is noticed at once, tests/test_liveness.py): its step is dropped after
    session_timeout."""
    d = make_daemon(session_timeout="1s")
    child = subprocess.Popen([sys.executable, "-c", PRODUCER_SCRIPT, d.endpoint],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "emitted"
    time.sleep(0.3)
    child.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while "was silent" not in d.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "was silent" in d.log_text()
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 5
    while (d.root / "t" / "step-000000000002").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (d.root / "t" / "step-000000000002").exists()
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [1]


def test_kill_daemon_while_a_save_streams_through_staging_made_for_it(make_daemon) -> None:
    """A first save of 160 MiB with ``staging_size = "auto"`` streams through the 128 MiB
    made on the spot for it (sizing.bridge_for); the daemon, writing at 64 MiB/s, is
    killed while the save still waits for room. The save fails within the producer's
    timeout, naming the daemon; after a restart the same producer saves again, through
    the arena grown meanwhile or the one made for the first, and every listed step loads."""
    d = make_daemon(write_rate="64MiB", chunk_size="4MiB")
    p = d.producer(staging_size="auto", timeout=60, heartbeat=0.2)
    big = state(1, 160)
    outcome: list[object] = []

    def save() -> None:
        try:
            outcome.append(p.save(big, 1).wait(60))
        except CheckpointError as exc:
            outcome.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    wait_for_files(d.root / "t" / "step-000000000001", 2)
    assert saver.is_alive() and p.stats()["staging_bytes"] == 128 * 2**20  # still streaming
    d.kill()
    saver.join(30)
    assert not saver.is_alive(), "a save streaming into a dead daemon never returned"
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointError) and "daemon" in str(outcome[0])

    d.start()  # start-up removes what the crash left
    assert ckptd.latest("t", root=d.root) is None
    for step in (2, 3):  # the first through what staging is now, the second after it grew
        assert p.save(state(step, 160), step).wait(60).step == step
    for step in (2, 3):
        loaded = ckptd.load("t", step=step, root=d.root, verify=True)
        expected = state(step, 160)
        assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], v) for k, v in expected.items())
    referenced_files_only(d.root)
    try:
        p.close()
    except CheckpointError:
        pass  # close re-raises the failed step 1


STREAMING_PRODUCER = textwrap.dedent("""
    import sys, torch
    from ckptd import Producer
    p = Producer(sys.argv[1], "t", staging_size="auto", timeout=5, heartbeat=0.2)
    p.save({"w": torch.ones(1000)}, 1).wait(30)
    print("saving", flush=True)
    p.save({f"w{i}": torch.full((2**18,), float(i)) for i in range(160)}, 2)  # killed in here
""")


def staging_maps(pid: int) -> list[int]:
    """The sizes of the producers' staging memfds that the process ``pid`` has mapped."""
    sizes = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "memfd:ckptd-staging" in line:
            begin, end = (int(x, 16) for x in line.split()[0].split("-"))
            sizes.append(end - begin)
    return sizes


def test_kill_producer_while_its_save_streams_through_staging_made_for_it(make_daemon) -> None:
    """kill -9 of a producer whose 160 MiB save streams through the 128 MiB made on the
    spot for it (the producer's session is renewed with it, and the daemon unmaps the
    32 MiB it replaces): the daemon drops the unfinished step and unmaps the dead
    producer's arena, and serves the next producer."""
    d = make_daemon(write_rate="64MiB", chunk_size="4MiB")
    child = subprocess.Popen([sys.executable, "-c", STREAMING_PRODUCER, d.endpoint],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "saving"
        wait_for_files(d.root / "t" / "step-000000000002", 2)
        assert staging_maps(d.pid) == [128 * 2**20]  # the one made for step 2 only
    finally:
        child.kill()
        child.wait()
    with d.producer() as p:  # replaces the dead one's session, if its death was not noticed yet
        p.save({"w": torch.zeros(10)}, 3).wait(30)
        deadline = time.monotonic() + 10
        while (len(staging_maps(d.pid)) > 1 or (d.root / "t" / "step-000000000002").exists()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert staging_maps(d.pid) == [64 * 2**20]  # the live producer's arena only
    assert not (d.root / "t" / "step-000000000002").exists()
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [1, 3]
    referenced_files_only(d.root)
