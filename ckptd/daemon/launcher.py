"""A real ``ckptd serve`` as a child process (``ServeProcess``), from config sections.

    with ServeProcess("work", {"daemon": {"chunk_size": "4MiB"}}) as daemon:
        with ckptd.Producer(daemon.endpoint, "run") as p:
            p.save(model.state_dict(), step=1).wait()

Ready means READY=1 on the notify socket it gave the daemon; stop is SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

Sections = Mapping[str, Mapping[str, Any]]


def toml_text(sections: Sections) -> str:
    """``{"daemon": {"root": "/x"}, "retention": {"keep_last": 3}}`` as a TOML config file."""
    lines: list[str] = []
    for table, values in sections.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml_value(value, f'[{table}] {key}')}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, os.PathLike):
        return json.dumps(os.fspath(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise TypeError(f"config value {where} = {value!r}: a {type(value).__name__} has no TOML spelling here; "
                    "give a bool, number, string, path or list of them")


class ServeProcess:
    """``python -m ckptd serve -c FOLDER/config.toml``, not yet started.

    ``sections``: the config's tables, ``{"daemon": {...}, "retention": {...}}``. Where
    ``[daemon]`` names no ``endpoint``, the daemon listens on ``ipc://`` in a short folder
    of its own under /tmp (a socket path holds at most 107 bytes: ``sock_dir``, removed by
    ``close``); where it names no ``root``, the root is ``FOLDER/ckpt`` (a relative one is
    read from ``FOLDER``, as every path in a config file is).
    """

    def __init__(self, folder: str | os.PathLike[str], sections: Sections | None = None) -> None:
        self.folder = Path(folder).absolute()
        self.folder.mkdir(parents=True, exist_ok=True)
        tables = {table: dict(values) for table, values in (sections or {}).items()}
        daemon = tables.setdefault("daemon", {})
        self.sock_dir = Path(tempfile.mkdtemp(prefix="ckd", dir="/tmp"))
        daemon.setdefault("endpoint", f"ipc://{self.sock_dir}/d.sock")
        daemon.setdefault("root", str(self.folder / "ckpt"))
        tables = {"daemon": tables.pop("daemon"), **tables}
        self.endpoint: str = str(daemon["endpoint"])
        self.root = self.folder / daemon["root"]
        self.config = self.folder / "config.toml"
        self.config.write_text(toml_text(tables))
        self.log = self.folder / "daemon.log"
        self.wrap: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._notify: _NotifySocket | None = None

    @property
    def command(self) -> list[str]:
        return [*self.wrap, sys.executable, "-m", "ckptd", "serve", "-c", str(self.config)]

    def start(self, *, wait: bool = True, timeout: float = 60.0, env: Mapping[str, str] | None = None,
              preexec_fn: Callable[[], Any] | None = None) -> "ServeProcess":
        """Start it (``env``: its whole environment; by default this process's); with
        ``wait``, return once it is ready (``wait_ready``).

        A ``NOTIFY_SOCKET`` already in ``env`` is the caller's own service manager: the
        daemon reports to it, and the caller waits for its ``READY=1`` (``wait=False``)."""
        if self.alive():
            raise RuntimeError(f"the daemon of {self.config} is running already (pid {self.pid})")
        child_env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self._close_notify()
        if "NOTIFY_SOCKET" in child_env:
            if wait:
                raise ValueError("the environment names a NOTIFY_SOCKET of its own, so the daemon's READY=1 goes "
                                 "there: start(wait=False) and wait for it on that socket")
        else:
            self._notify = _NotifySocket(self.sock_dir / "notify")
            child_env["NOTIFY_SOCKET"] = str(self._notify.path)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=child_env, preexec_fn=preexec_fn)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the daemon sends READY=1; RuntimeError with its log if it exits or ``timeout`` seconds pass first."""
        if self.proc is None or self._notify is None:
            raise RuntimeError("wait_ready() needs a daemon started by start() without a NOTIFY_SOCKET of the caller's")
        deadline = time.monotonic() + timeout
        while not self._notify.ready.wait(0.02):
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not ready (no READY=1) after {timeout:g} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the daemon was not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the daemon drains and exits 0), SIGKILL if it has not exited after
        ``timeout`` seconds; its exit status (-9 after SIGKILL)."""
        if self.proc is None:
            raise RuntimeError("the daemon was not started")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_notify()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would; a crash's leftovers (the socket file) stay."""
        if self.proc is None:
            raise RuntimeError("the daemon was not started")
        self.proc.kill()
        self.proc.wait()
        self._close_notify()

    def close(self, timeout: float = 30.0) -> None:
        """Stop it if it runs (as ``stop``) and remove the socket folder made for it."""
        try:
            if self.alive():
                self.stop(timeout)
        finally:
            self._close_notify()
            shutil.rmtree(self.sock_dir, ignore_errors=True)

    def __enter__(self) -> "ServeProcess":
        return self if self.alive() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def status(self, timeout: float = 10.0, curve_keys: Any = None) -> dict[str, Any]:
        """The daemon's status report, as ``ckptd status --json`` prints it
        (``curve_keys``: a tcp:// endpoint's, ``ckptd.transport.curve.ClientKeys``)."""
        from ..transport import wire
        from ..transport.oneshot import request

        return request(self.endpoint, wire.encode("status", seq=1), timeout, curve_keys)["status"]

    def _close_notify(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None


class _NotifySocket:
    """The service manager's end of NOTIFY_SOCKET for one daemon: notes READY=1 and
    reads (and drops) every later message on a thread, so that the daemon's sends never
    fill the socket's queue and never fail (which it would log as a warning). The thread
    sleeps in ``recv`` until a message or ``close`` (a shutdown of the socket): it lives in
    the caller's process, often a training loop, which a timed wake-up would take the GIL
    from ten times a second for every daemon it started."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self.ready = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._read, name=f"notify-{path}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closing.is_set():
            try:
                data = self._sock.recv(4096)
            except OSError:
                return
            if b"READY=1" in data.split(b"\n"):
                self.ready.set()

    def close(self) -> None:
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join()
        self._sock.close()
        self.path.unlink(missing_ok=True)
