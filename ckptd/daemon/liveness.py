"""Noticing at once that a local producer's process died (``Liveness``).

Over ipc:// the kernel names the producer's process; its pidfd sits in one epoll set
the main loop polls (or its start time is compared once a second). A dead producer's
session ends once it has been dead and silent for ``GRACE_S``, so that its last
messages are still read; tcp:// producers have the session timeout only.
"""

from __future__ import annotations

import logging
import select
import time
from dataclasses import dataclass
from typing import Callable

from ..transport.pidwatch import ProcessWatch, Silence

log = logging.getLogger("ckptd.daemon")
GRACE_S = 0.5  # dead, and nothing heard from it for this long: its messages have all been read
_PROC_CHECK_S = 1.0
BUSY_TIMEOUTS = 6  # a silent producer whose process keeps running: given up on after this many session timeouts


@dataclass
class _Watched:
    process: ProcessWatch
    silence: Silence
    died: float | None = None


class Liveness:
    """The pids of local producers, by session identity, and which of them died."""

    def __init__(self, session_timeout: float) -> None:
        self.session_timeout = session_timeout
        self._epoll = select.epoll()
        self._by_id: dict[bytes, _Watched] = {}
        self._by_fd: dict[int, bytes] = {}
        self._next_proc_check = 0.0

    def fileno(self) -> int:
        """Readable when a watched process has exited."""
        return self._epoll.fileno()

    def watch(self, identity: bytes, pid: int) -> None:
        self.forget(identity)
        process = ProcessWatch(pid)
        if not process.watchable:  # hidden (ProtectProc=invisible): no death is ever guessed
            log.debug("cannot watch pid %d (%s): session_timeout applies", pid, process.why)
            return
        w = _Watched(process, Silence(pid, self.session_timeout, BUSY_TIMEOUTS * self.session_timeout),
                     died=time.monotonic() if process.gone_at_start else None)
        if process.fd >= 0:
            self._epoll.register(process.fd, select.EPOLLIN)
            self._by_fd[process.fd] = identity
        self._by_id[identity] = w

    def forget(self, identity: bytes) -> None:
        w = self._by_id.pop(identity, None)
        if w is not None and w.process.fd >= 0:
            self._by_fd.pop(w.process.fd, None)
            self._epoll.unregister(w.process.fd)
        if w is not None:
            w.process.close()

    def pending(self) -> bool:
        """Whether a death was noticed whose session has not ended yet."""
        return any(w.died is not None for w in self._by_id.values())

    def ended(self, now: float, last_seen: Callable[[bytes], float]) -> list[tuple[bytes, int]]:
        """(identity, pid) of producers dead and silent for GRACE_S: end their sessions
        (then ``forget`` them). ``last_seen``: when a session's last message came."""
        self._notice(now)
        return [(identity, w.process.pid) for identity, w in self._by_id.items()
                if w.died is not None and now - max(w.died, last_seen(identity)) >= GRACE_S]

    def silent_too_long(self, identity: bytes, silent_for: float, now: float) -> bool:
        """Whether a producer silent for ``silent_for`` s has lost its session: after
        ``session_timeout``, or, for a watched one whose process keeps running, after
        ``BUSY_TIMEOUTS`` of them."""
        w = self._by_id.get(identity)
        if w is None:
            return silent_for > self.session_timeout
        return w.silence.gone(silent_for, now)

    def _notice(self, now: float) -> None:
        for fd, _ in self._epoll.poll(0):
            identity = self._by_fd.get(fd)
            if identity is not None and self._by_id[identity].died is None:
                self._by_id[identity].died = now
        if now >= self._next_proc_check:
            self._next_proc_check = now + _PROC_CHECK_S
            for w in self._by_id.values():
                if w.process.fd < 0 and w.died is None and w.process.exited():
                    w.died = now

    def close(self) -> None:
        for identity in list(self._by_id):
            self.forget(identity)
        self._epoll.close()
