"""The service's life: the process, signals, the drain on SIGTERM, and what it tells.

Signal handlers only queue the signal (``Lifecycle.take_signals`` hands them to the
loop, as gunicorn's arbiter does). ``Lifecycle`` keeps the drain's deadline, the
watchdog's pings, ``STATUS=`` and ``EXTEND_TIMEOUT_USEC`` (docs/service.md), the
metrics endpoint and the lock on the root; ``Reporter`` reads the parts for
``STATUS=``, ``ckptd status`` and the metrics.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import math
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..version import __version__
from .notify import Notifier, status_line

if TYPE_CHECKING:
    from ..config import Config
    from .ledger import Ledger
    from .metrics import MetricsServer
    from .bucket_relay import BucketFetch
    from .relay import Relay
    from .sessions import Sessions
    from .upkeep import Upkeep

log = logging.getLogger("ckptd.daemon")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXTEND_S = 10.0  # each housekeeping tick of a drain asks systemd for this much more time
STALL_S = 60.0  # a drain that has not moved for this long stops asking
HOUSEKEEPING_S = 1.0


def lower_priority(nice: int | str) -> None:
    """Lower the calling thread, and the threads it starts, to ``[daemon] nice``. "idle"
    adds SCHED_IDLE to nice 19: a training thread that wakes then takes the core at once,
    where at nice 19 alone it may wait out the daemon's time slice."""
    level = 19 if nice == "idle" else int(nice)
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if level > current:
        os.nice(level - current)
    if nice == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as exc:
            log.warning("[daemon] nice = \"idle\": SCHED_IDLE not set (%s); running at nice 19", exc)


def keep_freed_memory() -> None:
    """Ask glibc to keep freed receive buffers instead of unmapping them.

    libzmq mallocs a buffer per received message; by default glibc returns
    buffers over 32 MiB (and trims the heap) to the kernel on free, and the next
    checkpoint faults every page back in, which costs more than receiving the
    bytes. Memory the daemon holds stays bounded by ``memory_budget``.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    libc.mallopt(m_mmap_threshold, 32 * 2**20)
    libc.mallopt(m_trim_threshold, 2**31 - 1)
    libc.mallopt(m_arena_max, 2)


def lock_root(root: Path) -> int:
    """Lock ``root`` for this host's daemon; return the lock's descriptor (held until exit)."""
    # One daemon per root and host: a second one here would take the first's files
    # for a crash's leftovers. Daemons of other hosts (shared storage) coexist.
    path = root / f".ckptd-{socket.gethostname()}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise CheckpointError(
            f"another ckptd daemon (pid {other or '?'}) is already serving {root}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class Lifecycle:
    def __init__(self, drain_timeout: float) -> None:
        self.notifier = Notifier()
        self.metrics: MetricsServer | None = None
        self.stopping = False
        self.why = ""
        self._drain_timeout = drain_timeout
        self._deadline = math.inf
        self._last_progress = 0.0
        self._signals: list[int] = []
        self._status = ""
        self._next_ping = self._next_housekeeping = 0.0
        self._lock_fd = -1

    def lock(self, root: Path) -> None:
        self._lock_fd = lock_root(root)

    def install(self, wake_fd: int) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(wake_fd, warn_on_full_buffer=False)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)

    def take_signals(self) -> list[int]:
        taken = []
        while self._signals:
            taken.append(self._signals.pop(0))
        return taken

    def begin_drain(self, now: float) -> None:
        self.stopping = True
        self._deadline = now + self._drain_timeout
        self.why = f"drain_timeout ({self._drain_timeout:g} s) passed"
        self._last_progress = now

    def stop_waiting(self, signum: int, now: float) -> None:
        """A second signal while draining: open steps are waited for no longer."""
        if self._deadline > now:
            self.why = f"a second {signal.Signals(signum).name} came"
            log.warning("%s: no longer waiting for open steps", self.why)
            self._deadline = now

    def deadline_passed(self, now: float) -> bool:
        return now >= self._deadline

    def moved(self, now: float) -> None:
        """The drain moved: bytes arrived, or the I/O threads finished something."""
        self._last_progress = now

    def extend_stop_timeout(self, now: float) -> None:
        """Keep systemd from killing a drain that is moving, beyond TimeoutStopSec; a
        drain stalled for STALL_S (a hung disk) stops asking, and the timeout applies."""
        if now < self._deadline or now - self._last_progress < STALL_S:
            self.notifier.send(f"EXTEND_TIMEOUT_USEC={int(EXTEND_S * 1e6)}")

    def ping(self, now: float) -> float:
        """Send WATCHDOG=1 when due; the seconds until the next one (at most one)."""
        watchdog = self.notifier.watchdog_s
        if watchdog is None:
            return 1.0
        if now >= self._next_ping:
            self.notifier.send("WATCHDOG=1")
            self._next_ping = now + watchdog / 2
        return min(1.0, self._next_ping - now)

    def housekeeping_due(self, now: float) -> bool:
        if now < self._next_housekeeping:
            return False
        self._next_housekeeping = now + HOUSEKEEPING_S
        return True

    def notify(self, text: str, *lines: str) -> None:
        """Send ``lines`` (READY=1, ...) with STATUS=``text``; alone, only a changed STATUS=."""
        if lines or text != self._status:
            self._status = text
            self.notifier.send(*lines, status_line(text))

    @property
    def metrics_url(self) -> str | None:
        return self.metrics.url if self.metrics else None

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.notifier.close()


class Reporter:
    def __init__(self, config: Config, lifecycle: Lifecycle, sessions: Sessions, ledger: Ledger,
                 upkeep: Upkeep) -> None:
        self._config = config
        self._lifecycle = lifecycle
        self._sessions = sessions
        self._ledger = ledger
        self._upkeep = upkeep
        self.relay: Relay | None = None  # the peer tier's recoveries for this node's readers
        self.fetch: BucketFetch | None = None

    def line(self) -> str:
        """The one line systemd shows (``systemctl status``)."""
        sessions, ledger = self._sessions, self._ledger
        if self._lifecycle.stopping:
            return (f"stopping: {ledger.commits} commit(s) in progress, {len(sessions.open_steps())} "
                    "open step(s); new steps are refused")
        runs = sorted({s.run for s in sessions})
        text = f"{len(sessions)} producer(s)"
        if runs:
            text += f" of run(s) {', '.join(runs[:4])}{', ...' if len(runs) > 4 else ''}"
        text += f"; {ledger.queued / 2**20:.1f} MiB queued"
        last = ledger.figures.last_commit
        if last is None:
            return text + "; no commit yet"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["time"]))
        return text + f"; last commit: run {last['run']} step {last['step']} at {when}"

    def live_figures(self) -> dict[str, Any]:
        """Figures of the moment, for the metrics thread: plain reads, no iteration."""
        ledger = self._ledger
        return {"queued_bytes": ledger.queued, "memory_budget": ledger.memory_budget,
                "producers": len(self._sessions), "commits_in_progress": ledger.commits,
                "draining": self._lifecycle.stopping, **self._upkeep.tier_figures(),
                "advice": ledger.measuring.all_advice()}

    def report(self) -> dict[str, Any]:
        """What `ckptd status` prints (the wire's ``report``)."""
        ledger, config = self._ledger, self._config
        snap, now = ledger.figures.snapshot(), time.time()
        return {
            "version": __version__, "pid": os.getpid(),
            "state": "stopping" if self._lifecycle.stopping else "serving",
            "endpoint": config.endpoint, "root": str(config.root), "time": now, "started": snap["started"],
            "metrics": self._lifecycle.metrics_url,
            "queued_bytes": ledger.queued, "memory_budget": ledger.memory_budget,
            "commits_in_progress": ledger.commits,
            "producers": [
                {"run": s.run, "rank": s.rank, "world_size": s.world_size, "pid": s.pid, "host": s.host,
                 "transport": "shm" if s.shm is not None else "inline",
                 "open_steps": sorted(k for k, st in s.steps.items() if st.share.error is None)}
                for s in self._sessions
            ],
            "commits": snap["commits"], "bytes_written": snap["bytes_written"], "bytes_reused": snap["bytes_reused"],
            "errors": snap["errors"], "replica_mismatches": snap["replica_mismatches"],
            "commit_seconds": {"sum": snap["latency"]["sum"], "count": snap["latency"]["count"]},
            "last_commit": snap["last_commit"], "recent_commits": snap["recent"],
            "runs": snap["runs"],
            **self._upkeep.tier_figures(),
            "recovered": self.relay.figures() if self.relay is not None else None,
            "fetched": self.fetch.figures() if self.fetch is not None else None,
            "advice": ledger.measuring.all_advice(),
        }
