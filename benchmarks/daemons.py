"""Real ``ckptd serve`` subprocesses for the report, each with its own config, root and log.

One daemon per measured ckptd variant (transport x format): a daemon's peak RSS
then belongs to that variant alone, and a shared-memory producer's arena, which
its daemon maps, is counted in no other variant's daemon.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ckptd.daemon.launcher import ServeProcess

# Variables that would make a producer or daemon read another config or run id; the
# report configures everything explicitly and must not pick them up.
ENV_ISOLATE = ("CKPTD_CONFIG", "CKPTD_ENDPOINT", "CKPTD_RUN", "CKPTD_ROOT", "RANK", "WORLD_SIZE", "NOTIFY_SOCKET")


def isolated_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a daemon or CLI this process starts: the variables above left
    out, and the same ckptd as this process's, whatever the current folder (``python -m``
    would otherwise put that folder first on ``sys.path``)."""
    import ckptd

    env = {k: v for k, v in os.environ.items() if k not in ENV_ISOLATE}
    tree = str(Path(ckptd.__file__).resolve().parent.parent)
    env.update(PYTHONPATH=os.pathsep.join([tree, *filter(None, [env.get("PYTHONPATH")])]), PYTHONSAFEPATH="1")
    env.update(extra or {}, PYTHONUNBUFFERED="1")
    return env


def free_tcp_port() -> int:
    """A port free on the loopback now (the daemon binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess(ServeProcess):
    """``python -m ckptd serve`` with its own config and root under ``base`` (or
    ``base/name``), started by ckptd's launcher (ckptd/daemon/launcher.py: ready means
    READY=1). The endpoint is a short ipc socket path under /tmp (sun_path holds 107
    bytes) unless ``endpoint`` says otherwise (``tcp://127.0.0.1:PORT``). ``keys``: more
    ``[daemon]`` keys; ``tables``: other tables, {"producer": {...}}. Always stopped and
    cleaned up by ``close`` (SIGTERM, then SIGKILL)."""

    def __init__(self, base: Path, chunk_size: str | None, log_level: str = "info", *,
                 nice: int = 0, extra_env: dict[str, str] | None = None, name: str | None = None,
                 endpoint: str | None = None, keys: dict[str, Any] | None = None,
                 tables: dict[str, dict[str, Any]] | None = None) -> None:
        self.name = name or "daemon"
        self.nice = nice
        self.extra_env = extra_env or {}
        daemon_keys: dict[str, Any] = {"log_level": log_level}
        if endpoint is not None:
            daemon_keys["endpoint"] = endpoint
        if chunk_size is not None:  # otherwise the daemon's own default applies
            daemon_keys["chunk_size"] = chunk_size
        daemon_keys.update(keys or {})
        super().__init__(base / name if name else base, {"daemon": daemon_keys, **(tables or {})})

    def settings(self) -> Any:
        """The daemon's config as ckptd parses it (memory_budget etc. with defaults filled in)."""
        from ckptd.config import load

        return load(self.config).daemon

    def start(self, timeout: float = 60.0, *, wait: bool = True) -> "DaemonProcess":  # type: ignore[override]
        """Start it; with ``wait``, return once it serves (READY=1)."""
        nice = self.nice
        # a niced daemon shows what emit costs when the writer yields the CPU to training
        super().start(wait=wait, timeout=timeout, env=isolated_env(self.extra_env),
                      preexec_fn=(lambda: os.nice(nice)) if nice else None)
        return self

    def commit_seconds(self) -> dict[tuple[str, int], float]:
        """(run, step) -> seconds the daemon itself took, first byte received to manifest
        durable (its ``committed ... seconds=`` log line)."""
        return {(m[1], int(m[2])): float(m[3]) for m in
                re.finditer(r"committed run=(\S+) step=(\d+) .*?seconds=([\d.]+)", self.log_text())}

    def problems(self) -> list[str]:
        """Warnings, errors and tracebacks the daemon logged: a benchmark of a failing
        daemon is no benchmark."""
        return [line for line in self.log_text().splitlines() if re.match(r"(WARNING|ERROR|CRITICAL|Traceback)", line)]


# -- tcp:// endpoints and their CurveZMQ keys ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CurveSetup:
    """What a tcp:// daemon and its producer need: extra [daemon] keys and Producer options."""

    daemon_keys: dict[str, Any]
    producer_options: dict[str, Any]


def tcp_setup(folder: Path) -> CurveSetup:
    """Key files for a tcp:// daemon and its producers, made with ``ckptd keygen`` under
    ``folder`` as docs/security.md says; RuntimeError saying why where this ckptd has no
    tcp:// (the report then notes it and goes on without)."""
    from ckptd import config as cfg

    try:
        cfg.resolve_endpoint("tcp://127.0.0.1:5555", Path.cwd())
    except ValueError as exc:
        raise RuntimeError(f"this ckptd refuses tcp:// endpoints: {exc}") from None
    daemon_fields = {f.name for f in dataclasses.fields(cfg.DaemonConfig)}
    producer_fields = {f.name for f in dataclasses.fields(cfg.ProducerConfig)}
    missing = (sorted(f"[daemon] {k}" for k in {"curve_secret_key", "curve_clients"} - daemon_fields)
               + sorted(f"[producer] {k}" for k in {"curve_server_key", "curve_secret_key"} - producer_fields))
    if missing:
        raise RuntimeError(f"this ckptd has no CurveZMQ config keys {', '.join(missing)}")
    clients = folder / "clients"  # the daemon's allowlist: public keys only
    clients.mkdir(parents=True)
    for name in ("daemon", "producer"):
        done = subprocess.run([sys.executable, "-m", "ckptd", "keygen", name, "--dir", str(folder)],
                              capture_output=True, text=True, env=isolated_env())
        if done.returncode != 0:
            raise RuntimeError(f"`ckptd keygen {name}` failed: {(done.stderr or done.stdout).strip()}")
    shutil.copy(folder / "producer.key", clients / "producer.key")
    return CurveSetup(
        daemon_keys={"curve_secret_key": str(folder / "daemon.key_secret"), "curve_clients": str(clients)},
        producer_options={"curve_server_key": str(folder / "daemon.key"),
                          "curve_secret_key": str(folder / "producer.key_secret")},
    )


class PySpy:
    """Optional: ``py-spy record`` attached to a daemon, written when the daemon exits."""

    def __init__(self, pid: int, out: Path, idle: bool) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        fmt = {".svg": "flamegraph", ".json": "speedscope"}.get(out.suffix, "raw")
        cmd = [exe, "record", "--pid", str(pid), "--output", str(out), "--format", fmt,
               "--rate", "200", "--threads", "--nonblocking"] + (["--idle"] if idle else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # let it attach before the measured work starts

    def wait(self) -> None:
        try:
            self.proc.wait(30)  # py-spy writes its output and exits when the target exits
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(30)
