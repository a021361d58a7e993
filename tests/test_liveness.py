"""A local producer's death is noticed at once (ckptd.daemon.liveness): its open steps are
discarded within a second or two, not after session_timeout, and a SIGTERM right after
does not wait for them. What it sent before dying is still committed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

import ckptd
from conftest import cli, start_tcp

CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from ckptd import Producer
    endpoint, mode = sys.argv[1], sys.argv[2]
    keys = dict(curve_server_key=sys.argv[3], curve_secret_key=sys.argv[4]) if len(sys.argv) > 3 else {}
    if mode == "open":  # step 1 begun, never committed
        p = Producer(endpoint, "t", staging_size="16MiB", timeout=5, **keys)
        p.emit("w", torch.arange(2.0**20), step=1)  # 4 MiB = chunk_size: a file of its own, written now
        p.latest()  # answered after the tensor before it: the step is open in the daemon
        print("emitted", flush=True)
        time.sleep(600)
    elif mode == "gil":  # a step open while the training thread holds the GIL in one long C call
        p = Producer(endpoint, "t", staging_size="16MiB", timeout=30, heartbeat=0.2)
        p.emit("w", torch.arange(1000.0), step=1)
        p.latest()  # answered after the tensor before it: the step is open in the daemon
        n, t0 = 10**6, time.monotonic()
        sum(range(n))
        n = int(n * 3.0 / max(time.monotonic() - t0, 1e-6))  # about 3 s, three session timeouts
        print("holding", flush=True)
        sum(range(n))  # builtin sum over a range: no bytecode, so the GIL is never handed over
        print(p.commit(1).wait(30).step, flush=True)
        p.emit("w", torch.arange(1000.0), step=2)
        p.latest()
        print("emitted", flush=True)
        time.sleep(600)
    elif mode == "commit-and-die":  # a raw DEALER sends a whole step and exits before any answer
        import socket, zmq
        from ckptd.transport import wire
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send(wire.encode("hello", v=wire.VERSION, run="t", rank=0, world_size=1, pid=os.getpid(),
                              host=socket.gethostname(), retention=None, format=None, shm_token=None, shm_size=None))
        assert wire.decode([sock.recv()])[0]["op"] == "welcome"
        data = torch.arange(2.0**16).numpy().tobytes()
        sock.send_multipart([wire.encode("tensor", seq=1, step=7, name="w", dtype="float32", shape=[2**16],
                                         nbytes=len(data), start=0, numpy=False, offset=None, length=None), data])
        sock.send(wire.encode("commit", seq=2, step=7, ntensors=1, state="null", metadata="{}"))
        sock.close(linger=10_000)
        zmq.Context.instance().term()  # returns once libzmq has handed every byte to the kernel
        os._exit(0)
""")


def status(d) -> dict:
    out = cli("status", "--json", "--endpoint", d.endpoint)  # ckptd.cli.main in this process
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def status_tcp(endpoint: str, keys: dict, folder) -> dict:
    """`ckptd status --json` over tcp://, with alice's keys from a config file."""
    cfg = folder / "alice.toml"
    cfg.write_text(f'[daemon]\nendpoint = "{endpoint}"\n[producer]\n'
                   f'curve_server_key = "{keys["server"]}"\ncurve_secret_key = "{keys["alice"]}"\n')
    out = cli("status", "--json", "-c", str(cfg))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_killed_producer_step_discarded_at_once_and_sigterm_is_prompt(make_daemon) -> None:
    d = make_daemon(session_timeout="60s", drain_timeout="60s")
    child = subprocess.Popen([sys.executable, "-c", CHILD, d.endpoint, "open"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "emitted"
        mine = [p for p in status(d)["producers"] if p["pid"] == child.pid]
        assert [p["open_steps"] for p in mine] == [[1]]
        deadline = time.monotonic() + 20
        while not (d.root / "t" / "step-000000000001").exists():  # its bytes are being written
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.02)
        child.kill()
        child.wait()
        killed = time.monotonic()
        while any(p["pid"] == child.pid for p in status(d)["producers"]):
            assert time.monotonic() - killed < 2.0, d.log_text()
            time.sleep(0.05)
        assert time.monotonic() - killed < 2.0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert f"pid={child.pid} died (process {child.pid} exited); discarding 1 unfinished step(s)" in d.log_text()
    stopping = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    assert time.monotonic() - stopping < 5.0  # not drain_timeout nor session_timeout (60 s)
    assert not (d.root / "t" / "step-000000000001").exists()  # discarded, its files removed
    assert "stopping on SIGTERM: finishing 0 commit(s) in progress; waiting up to 60 s for 0 open step(s)" \
        in d.log_text()


def test_commit_sent_just_before_death_is_still_committed(make_daemon) -> None:
    d = make_daemon(session_timeout="60s")
    child = subprocess.run([sys.executable, "-c", CHILD, d.endpoint, "commit-and-die"], timeout=60)
    assert child.returncode == 0
    deadline = time.monotonic() + 20
    while ckptd.latest("t", root=d.root) is None:
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.05)
    out = ckptd.load("t", 7, root=d.root, verify=True)
    assert torch.equal(out["w"], torch.arange(2.0**16))
    while "died (process" not in d.log_text():  # and the session still ends
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.05)
    assert os.path.exists(d.root / "t" / "step-000000000007" / "manifest-r00000.json")


def test_remote_producer_keeps_the_session_timeout(make_daemon, keys, tmp_path) -> None:
    """Over tcp:// the daemon has no pid to watch: a killed producer's step stays open
    until session_timeout (the default, 60 s: still open 3 s after the kill)."""
    d, endpoint = start_tcp(make_daemon, keys)
    child = subprocess.Popen([sys.executable, "-c", CHILD, endpoint, "open", str(keys["server"]), str(keys["alice"])],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "emitted"
        status_of = lambda: [p for p in status_tcp(endpoint, keys, tmp_path)["producers"]  # noqa: E731
                             if p["pid"] == child.pid]
        assert [p["open_steps"] for p in status_of()] == [[1]]
        child.kill()
        child.wait()
        time.sleep(3.0)
        assert [p["open_steps"] for p in status_of()] == [[1]]
        assert "died (process" not in d.log_text()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _starve(pid: int, hogs: list[subprocess.Popen]) -> None:
    """Every thread of ``pid`` onto the hogs' CPU at SCHED_IDLE: it runs only where they
    leave time, as a daemon on a node whose cores the data loaders fill."""
    cpu = {min(os.sched_getaffinity(0))}
    for h in hogs:
        os.sched_setaffinity(h.pid, cpu)
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpu)
        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def _feed(pid: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        os.sched_setaffinity(int(tid), os.sched_getaffinity(0) | os.sched_getaffinity(pid))


def test_a_daemon_starved_of_cpu_is_waited_for_and_a_stopped_one_is_not(make_daemon) -> None:
    """Over ipc:// the producer reads the daemon's scheduler accounts: silent for longer
    than ``timeout`` while it runs or waits for a CPU, it is only slow, and the save goes
    through once it gets the CPU back; stopped (SIGSTOP), it is lost after ``timeout``."""
    if len(os.sched_getaffinity(0)) < 2:
        raise AssertionError("this test starves the daemon on one CPU while the producer runs on another: "
                             "it needs two CPUs")
    d = make_daemon()
    p = d.producer(timeout=1.0, heartbeat=0.2)
    p.save({"w": torch.arange(1000.0)}, 1).wait(30)  # connected: the daemon's pid is watched
    own = os.sched_getaffinity(0)
    hog_cmd = ["sh", "-c", "while :; do :; done"]
    hogs = [subprocess.Popen(hog_cmd) for _ in range(3)]
    try:
        _starve(d.proc.pid, hogs)
        os.sched_setaffinity(0, own - {min(own)})  # the producer keeps a CPU of its own
        t0 = time.monotonic()
        handle = p.save({"w": torch.arange(1000.0) + 1}, 2)
        time.sleep(4.0)  # four timeouts of starvation
        silent = time.monotonic() - t0
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        _feed(d.proc.pid)
        os.sched_setaffinity(0, own)
    assert silent >= 4.0
    assert handle.wait(60).step == 2, "a starved daemon was taken for dead"

    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        handle = p.save({"w": torch.arange(1000.0)}, 3)
        try:
            handle.wait(30)
        except ckptd.CheckpointError as exc:
            assert "no answer for" in str(exc)
        else:
            raise AssertionError("a stopped daemon was waited for")
        assert time.monotonic() - t0 < 10.0
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    p.close()


def test_a_producer_holding_the_gil_keeps_its_session_and_a_stopped_one_loses_it(make_daemon) -> None:
    """A local producer silent past session_timeout whose process keeps running (its
    training thread in one long C call that never releases the GIL) keeps its open
    step; one stopped (SIGSTOP) for as long loses its session."""
    d = make_daemon(session_timeout="1s")
    child = subprocess.Popen([sys.executable, "-c", CHILD, d.endpoint, "gil"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        assert child.stdout.readline().strip() == "1", d.log_text()
        assert "was silent" not in d.log_text()
        assert child.stdout.readline().strip() == "emitted"  # step 2 open
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while f"pid={child.pid} was silent for" not in d.log_text():
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()
