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
