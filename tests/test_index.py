"""The watched index: it sees what others do to the root, and repairs what it missed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import index as index_mod
from ckptd.config import IndexConfig


def eventually(fn, want, timeout: float = 1.0):
    """Poll ``fn()`` until it returns ``want``; return how long that took."""
    t0 = time.monotonic()
    while True:
        got = fn()
        if got == want:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"after {timeout} s: {got!r}, wanted {want!r}")
        time.sleep(0.01)


def clone_step(src: Path, dst: Path, *, run: str, step: int, via_cp: bool = True) -> None:
    """Copy a checkpoint folder as another step (cp -r to a temp name, then rename into place)."""
    tmp = dst.parent / f".incoming-{step}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    if via_cp:
        subprocess.run(["cp", "-r", str(src), str(tmp)], check=True)
    else:
        shutil.copytree(src, tmp)
    for m in tmp.glob("manifest-r*.json"):
        data = json.loads(m.read_text())
        data["run"], data["step"] = run, step
        m.write_text(json.dumps(data))
    os.rename(tmp, dst)


def latest_step(p, run):
    info = p.latest(run)  # the daemon answers from its index
    return info.step if info else None


@pytest.mark.parametrize("observer", ["inotify", "polling"])
def test_daemon_index_sees_other_writers_within_a_second(make_daemon, observer) -> None:
    tables = {"index": {"observer": observer, "poll_interval": "0.2s"}}
    d = make_daemon(tables=tables)
    node2 = make_daemon(start=False, root=str(d.root))  # another "node": same root, own host name
    node2.wrap = ["unshare", "-u", "sh", "-c", 'hostname node2 && exec "$0" "$@"']
    node2.start()
    with d.producer("t") as p, node2.producer("x") as q:
        p.save({"w": torch.ones(8)}, 1).wait(30)
        assert latest_step(p, "t") == 1

        q.save({"w": torch.zeros(8)}, 3).wait(30)  # written by the other node's daemon
        eventually(lambda: latest_step(p, "x"), 3)

        step1 = d.root / "t" / "step-000000000001"
        clone_step(step1, d.root / "t" / "step-000000000007", run="t", step=7)  # a person copies one in
        eventually(lambda: latest_step(p, "t"), 7)
        eventually(lambda: (d.root / "t" / "latest").read_text().strip(), "step-000000000007")

        shutil.rmtree(d.root / "t" / "step-000000000007")  # ... and removes it again
        eventually(lambda: latest_step(p, "t"), 1)
        eventually(lambda: (d.root / "t" / "latest").read_text().strip(), "step-000000000001")

        shutil.rmtree(d.root / "x")  # a whole run removed
        eventually(lambda: latest_step(p, "x"), None)
    assert "run=x rank=0" in node2.log_text() and "run=x rank=0" not in d.log_text()


def make_root(daemon) -> Path:
    with daemon.producer("t") as p:
        p.save({"w": torch.ones(4)}, 1).wait(30)
    return daemon.root


def test_rescan_repairs_an_index_that_missed_events(daemon) -> None:
    root = make_root(daemon)
    idx = index_mod.Index(root, IndexConfig(rescan_interval=3600))
    idx.start()
    try:
        assert [i.step for i in idx.list("t")] == [1]
        idx._observer.unschedule_all()  # events are now missed entirely (the thread lives on)
        clone_step(root / "t" / "step-000000000001", root / "t" / "step-000000000005", run="t", step=5)
        clone_step(root / "t" / "step-000000000001", root / "u" / "step-000000000002", run="u", step=2)
        shutil.rmtree(root / "t" / "step-000000000001")
        time.sleep(0.3)
        assert [i.step for i in idx.list("t")] == [1]  # stale, as expected without events
        before = idx.rescans
        # watchdog reports lost events (an inotify queue overflow) only in its log
        logging.getLogger("watchdog.observers.inotify_c").warning("Inotify queue overflowed; filesystem events were lost")
        # the rescan's count goes up after its last run is re-read: wait on the count
        eventually(lambda: idx.rescans > before, True, timeout=10.0)
        assert [i.step for i in idx.list("t")] == [5]
        assert idx.latest("u").step == 2 and idx.runs() == ["t", "u"]
    finally:
        idx.close()


def test_observer_death_is_noticed_and_repaired(daemon) -> None:
    root = make_root(daemon)
    idx = index_mod.Index(root, IndexConfig(rescan_interval=0.5))
    idx.start()
    try:
        idx._observer.stop()  # the observer thread dies
        idx._observer.join()
        clone_step(root / "t" / "step-000000000001", root / "t" / "step-000000000009", run="t", step=9)
        eventually(lambda: idx.latest("t").step, 9, timeout=3.0)  # periodic check restarts and rescans
        assert idx._observer.is_alive()
    finally:
        idx.close()


def test_latest_pointer_and_its_fallback(daemon) -> None:
    with daemon.producer("t") as p:
        for step in (1, 2, 3):
            p.save({"w": torch.full((4,), step)}, step).wait(30)
    run = daemon.root / "t"
    assert (run / "latest").read_text() == "step-000000000003\n"
    assert ckptd.latest("t", root=daemon.root).step == 3
    daemon.stop()  # no daemon keeps the pointer current from here on
    shutil.rmtree(run / "step-000000000003")  # stale: names a deleted step
    assert ckptd.latest("t", root=daemon.root).step == 2
    (run / "latest").write_text("garbage\n")
    assert ckptd.latest("t", root=daemon.root).step == 2
    (run / "latest").unlink()
    assert ckptd.latest("t", root=daemon.root).step == 2
    daemon.start()  # the start-up scan repairs the pointer
    assert (run / "latest").read_text() == "step-000000000002\n"


def test_a_misnamed_or_incomplete_folder_is_never_listed(daemon) -> None:
    with daemon.producer("t") as p:
        p.save({"w": torch.ones(4)}, 1).wait(30)
    run = daemon.root / "t"
    shutil.copytree(run / "step-000000000001", run / "step-000000000002")  # manifest says step 1
    shutil.copytree(run / "step-000000000001", run / ".x")
    chunk = next((run / ".x").glob("*.safetensors"))
    chunk.write_bytes(chunk.read_bytes()[:10])  # data shorter than the manifest says
    m = json.loads((run / ".x" / "manifest-r00000.json").read_text())
    m["step"] = 3
    (run / ".x" / "manifest-r00000.json").write_text(json.dumps(m))
    os.rename(run / ".x", run / "step-000000000003")
    assert [i.step for i in ckptd.list_checkpoints("t", root=daemon.root)] == [1]
    assert ckptd.latest("t", root=daemon.root).step == 1


def test_cli_latest_asks_the_daemon(daemon) -> None:
    with daemon.producer("t") as p:
        p.save({"w": torch.ones(4)}, 4).wait(30)
    r = subprocess.run([sys.executable, "-m", "ckptd", "latest", "t", "--endpoint", daemon.endpoint, "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 4
    r = subprocess.run([sys.executable, "-m", "ckptd", "latest", "t", "--endpoint", "ipc:///tmp/none.sock",
                        "--timeout", "0.3"], capture_output=True, text=True)
    assert r.returncode == 1 and "no ckptd daemon at ipc:///tmp/none.sock" in r.stderr, r.stderr


def test_latest_from_the_daemon_waits_for_the_commits_of_its_run_under_way(make_daemon) -> None:
    """A job restarted the moment its last save was handed over asks the daemon for the
    newest step: the answer comes once the commits the daemon already has for that run are
    on disk, so it names that step, not the one before (whose resume would train the step
    again, and have its save of it refused). Another run's question does not wait."""
    from conftest import cli
    from ckptd.daemon import handlers

    d = make_daemon(write_rate="4MiB", chunk_size="1MiB")
    with d.producer("r", staging_size="48MiB") as p, d.producer("q", staging_size="1MiB", timeout=20) as q:
        p.save({"w": torch.zeros(1024)}, 1).wait(30)
        handle = p.save({"w": torch.ones(2 << 20)}, 2)  # 8 MiB at 4 MiB/s: about 2 s to commit

        def under_way() -> int:
            return json.loads(cli("status", "-c", str(d.config), "--json").stdout)["commits_in_progress"]

        deadline = time.monotonic() + 10
        while under_way() == 0:  # the commit message has reached the daemon
            assert time.monotonic() < deadline, "step 2's commit never reached the daemon"
            time.sleep(0.02)
        assert not handle.done()
        assert q.latest("q") is None  # not held back by run r's commit
        assert q.latest("r").step == 2
        assert handle.wait(30).step == 2

        # a commit longer than the wait (SETTLE_S): the answer comes without it, in time
        handle = p.save({"w": torch.ones(8 << 20)}, 3)  # 32 MiB at 4 MiB/s: about 8 s
        deadline = time.monotonic() + 10
        while under_way() == 0:
            assert time.monotonic() < deadline, "step 3's commit never reached the daemon"
            time.sleep(0.02)
        t0 = time.monotonic()
        assert q.latest("r").step == 2  # step 3 was not waited for
        assert time.monotonic() - t0 > handlers.SETTLE_S - 0.5  # but its first seconds were
        assert handle.wait(30).step == 3
