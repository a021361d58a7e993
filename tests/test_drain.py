"""Stopping loses nothing already handed over: SIGTERM drains, then the daemon exits 0.

Steps the daemon has begun to receive are finished (within ``drain_timeout``);
commits it has received always are; new steps and new producers are refused
with an error that says why; a step that cannot be finished fails loudly.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
import torch

import ckptd
from ckptd import CheckpointError
from test_notify import Listener


def tensors(seed: int, mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(2**18, generator=g) for i in range(mib)}


def drain_line(log: str) -> tuple[int, int]:
    m = re.search(r"stopping on SIGTERM: finishing (\d+) commit\(s\) in progress; "
                  r"waiting up to \S+ s for (\d+) open step\(s\)", log)
    assert m, log
    return int(m.group(1)), int(m.group(2))


def test_sigterm_mid_checkpoint_completes_it(make_daemon) -> None:
    d = make_daemon()
    state = tensors(1, 48)
    with d.producer(staging_size="16MiB") as p:
        handle = p.save(state, 1)  # returns once copied: 48 MiB through 16 MiB, so still arriving
        d.proc.send_signal(signal.SIGTERM)
        assert handle.wait(60).step == 1
        assert d.proc.wait(60) == 0
    committing, open_steps = drain_line(d.log_text())
    assert committing + open_steps == 1  # the checkpoint was in flight at SIGTERM
    assert "drained: every commit received is durable (newest: t step 1)" in d.log_text()
    loaded = ckptd.load("t", 1, root=d.root, verify=True)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_drain_finishes_open_steps_and_refuses_new_work(make_daemon, tmp_path, monkeypatch) -> None:
    notify = Listener(str(tmp_path / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", notify.address)
    d = make_daemon(start=False).start(wait=False)  # its READY=1 goes to this test's socket
    notify.wait_for("READY")
    a = d.producer("a")
    try:
        a.emit("x", torch.arange(1000.0), step=1)
        a.latest()  # answered after the tensor before it was received: step 1 is open
        d.proc.send_signal(signal.SIGTERM)
        assert notify.wait_for("STOPPING")["STATUS"].startswith("stopping: 0 commit(s) in progress, 1 open step(s)")

        with pytest.raises(CheckpointError, match=r"the daemon is stopping: step 2 of run 'a' was refused"):
            a.save({"y": torch.ones(3)}, 2).wait(30)
        b = d.producer("b")
        with pytest.raises(CheckpointError, match="refused this producer: the daemon is stopping"):
            b.save({"y": torch.ones(3)}, 1)
        b.close()

        # while it waits for step 1, the daemon asks systemd for more time
        extend = notify.wait_for("EXTEND_TIMEOUT_USEC", timeout=10)
        assert int(extend["EXTEND_TIMEOUT_USEC"]) >= 5_000_000 and extend.pid == d.proc.pid
        assert d.proc.poll() is None
        assert a.commit(1).wait(30).step == 1
    finally:
        a.close()
        notify.close()
    assert d.proc.wait(30) == 0
    assert torch.equal(ckptd.load("a", 1, root=d.root, verify=True)["x"], torch.arange(1000.0))
    assert [i.step for i in ckptd.list_checkpoints("a", root=d.root)] == [1]
    assert not (d.root / "a/step-000000000002").exists()
    assert ckptd.latest("b", root=d.root) is None


def test_a_step_left_open_fails_after_drain_timeout(make_daemon) -> None:
    d = make_daemon(drain_timeout="1s")
    with d.producer() as p:
        p.emit("x", torch.ones(100), step=4)
        p.latest()  # step 4 is open
        start = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        assert time.monotonic() - start >= 0.9  # it did wait for the step
        with pytest.raises(CheckpointError, match=r"stopped waiting for step 4 to be committed "
                                                  r"\(drain_timeout \(1 s\) passed\); it was not saved"):
            p.commit(4).wait(30)
    assert drain_line(d.log_text()) == (0, 1)
    assert not (d.root / "t/step-000000000004").exists()


def test_a_second_sigterm_stops_waiting_for_open_steps(make_daemon) -> None:
    d = make_daemon()  # drain_timeout: 60 s
    with d.producer() as p:
        p.emit("x", torch.ones(100), step=5)
        p.latest()
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(15) == 0
        with pytest.raises(CheckpointError, match=r"\(a second SIGTERM came\); it was not saved"):
            p.commit(5).wait(30)
