"""Shared fixtures: a real daemon subprocess on a real socket, real files in a temp root."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from ckptd import Producer, curve

REPO = Path(__file__).resolve().parent.parent


class Daemon:
    """A ``ckptd serve`` subprocess with its own config, root and socket."""

    def __init__(self, base: Path, tables: dict[str, dict[str, object]] | None = None, **daemon_keys: object) -> None:
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.root = base / "ckpt"
        # ipc paths are limited to 107 bytes: keep the socket in a short temp folder
        self.sock_dir = Path(tempfile.mkdtemp(prefix="ckd", dir="/tmp"))
        self.endpoint = f"ipc://{self.sock_dir}/d.sock"
        keys = {"endpoint": self.endpoint, "root": str(self.root), "chunk_size": "4MiB",
                "log_level": "debug", **daemon_keys}
        lines = ["[daemon]"] + [f"{k} = {_toml(v)}" for k, v in keys.items()]
        for table, values in (tables or {}).items():  # e.g. {"index": {"observer": "polling"}}
            lines += [f"[{table}]"] + [f"{k} = {_toml(v)}" for k, v in values.items()]
        self.config = base / "config.toml"
        self.config.write_text("\n".join(lines) + "\n")
        self.log = base / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.wrap: list[str] = []  # a command the daemon runs under, e.g. unshare

    @property
    def command(self) -> list[str]:
        return [*self.wrap, sys.executable, "-m", "ckptd", "serve", "-c", str(self.config)]

    def start(self, wait: bool = True) -> "Daemon":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """The socket exists once the daemon has cleaned the root and bound."""
        sock = self.sock_dir / "d.sock"
        deadline = time.monotonic() + timeout
        while not sock.exists():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.log_text()}")
            time.sleep(0.02)

    def kill(self) -> None:
        """kill -9, as a crash would."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        (self.sock_dir / "d.sock").unlink(missing_ok=True)

    def stop(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def producer(self, run: str = "t", **options: object) -> Producer:
        options.setdefault("staging_size", "64MiB")
        options.setdefault("timeout", 5)
        return Producer(self.endpoint, run, **options)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):  # e.g. [peer] peers
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator:
    """``make_daemon(**daemon_keys)`` -> a started Daemon; all are killed at teardown."""
    made: list[Daemon] = []

    def make(start: bool = True, tables: dict | None = None, **keys: object) -> Daemon:
        d = Daemon(tmp_path / f"d{len(made)}", tables, **keys)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    return make_daemon()


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests never read the developer's own config or environment."""
    for var in ("CKPTD_ENDPOINT", "CKPTD_RUN", "CKPTD_ROOT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    # the built-in defaults, whatever ~/.config/ckptd or /etc/ckptd hold on this machine
    monkeypatch.setenv("CKPTD_CONFIG", "none")
    monkeypatch.chdir(tmp_path)


# -- tcp:// with CurveZMQ (docs/security.md) ---------------------------------------------------
@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A daemon key pair, a producer ('alice') whose public key the daemon admits, and a
    stranger ('mallory') whose key pair is as valid but not admitted."""
    k = tmp_path / "keys"
    server_public, server_secret = curve.keygen("daemon", k)
    alice_public, alice_secret = curve.keygen("alice", k)
    _, mallory_secret = curve.keygen("mallory", k)
    clients = k / "clients"
    clients.mkdir()
    os.link(alice_public, clients / "alice.key")
    return {"server": server_public, "server_secret": server_secret, "clients": clients,
            "alice": alice_secret, "mallory": mallory_secret}


def free_port() -> int:
    # The config needs the port itself (port 0 is refused), so borrow a free one.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tcp(make_daemon, keys: dict[str, Path]):
    """A real `ckptd serve` on 127.0.0.1 with CurveZMQ; returns (daemon, endpoint)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = make_daemon(start=False, endpoint=endpoint, curve_secret_key=str(keys["server_secret"]),
                    curve_clients=str(keys["clients"]))
    d.start(wait=False)
    deadline = time.monotonic() + 30
    while f"serving {endpoint}" not in d.log_text():  # no socket file to wait for, as with ipc://
        assert d.proc.poll() is None, d.log_text()
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.02)
    return d, endpoint


# -- the remote tier: a real S3 server (SeaweedFS) on 127.0.0.1 ------------------------------
@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """A started SeaweedFS S3 server with a bucket ``ckptd`` and the standard AWS variables
    pointing at it (daemons started by the test inherit them); stopped at teardown."""
    from seaweed import SeaweedS3, make_bucket

    server = SeaweedS3(tmp_path / "s3").start()
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        make_bucket(server, "ckptd")
        yield server
    finally:
        server.cleanup()
