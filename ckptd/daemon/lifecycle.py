"""The service's life: signals, the drain on SIGTERM, and what systemd is told.

Signal handlers only queue the signal (``take_signals`` hands them to the loop, as
gunicorn's arbiter does). ``Lifecycle`` keeps the drain's deadline, the watchdog's
pings, ``STATUS=`` and ``EXTEND_TIMEOUT_USEC`` (docs/service.md), the metrics
endpoint and the lock on the root.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from pathlib import Path
from typing import Any

from .metrics import MetricsServer
from .notify import Notifier, status_line
from .process import lock_root

log = logging.getLogger("ckptd.daemon")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXTEND_S = 10.0  # each housekeeping tick of a drain asks systemd for this much more time
STALL_S = 60.0  # a drain that has not moved for this long stops asking
HOUSEKEEPING_S = 1.0


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
