"""Noticing at once that the process at the other end of an ``ipc://`` socket exited.

The kernel names that process (SO_PEERCRED, libzmq's ``Peer-Address``): a pid neither
side can forge. ``ProcessWatch`` holds its pidfd (else compares its start time in
``/proc``); the daemon ends a dead producer's session, a producer fails its steps in
flight. ``Silence`` tells a hung process from one starved of CPU by the scheduler's
accounts, so a running but silent daemon is waited for longer.
"""

from __future__ import annotations

import errno
import os
import select
from typing import Any


def peer_pid(frame: Any) -> int | None:
    """The pid of the process that sent ``frame`` over ipc://, or None."""
    try:
        pid = int(frame.get("Peer-Address").split(":")[-1])
    except Exception:  # no such property (an older libzmq, another transport)
        return None
    return pid if pid > 0 else None


class ProcessWatch:
    """One process, watched for its exit.

    ``fd`` is its pidfd (poll it for readability), or -1 where there is none: then
    ``exited()`` reads /proc. ``watchable`` is False where neither works (a hidden
    /proc, ``ProtectProc=invisible``): no death is ever guessed then."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = -1
        self.start: str | None = None
        self.gone_at_start = False
        try:
            self.fd = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                self.gone_at_start = True
            else:  # ENOSYS, EPERM (a seccomp filter): /proc it is
                self.start = start_time(pid)
        self.why = "" if self.fd >= 0 or self.gone_at_start or self.start is not None else \
            "no pidfd, and /proc does not show it"

    @property
    def watchable(self) -> bool:
        return not self.why

    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts as exited)."""
        if self.gone_at_start:
            return True
        if self.fd >= 0:
            return bool(select.select([self.fd], [], [], 0)[0])
        return self.start is not None and start_time(self.pid) != self.start

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def activity(pid: int) -> tuple[int, bool] | None:
    """Nanoseconds the process's threads have spent on a CPU or waiting in a run queue
    (``schedstat``, summed), and whether one of them is runnable right now (state R: the
    wait of a thread still in the queue is counted only once it runs); None where the
    kernel does not show them."""
    total, runnable, seen = 0, False, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
            total += int(fields[0]) + int(fields[1])
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
            runnable = runnable or stat[stat.rfind(b")") + 2:][:1] == b"R"
            seen = True
        except (OSError, ValueError, IndexError):
            continue
    return (total, runnable) if seen else None


class Silence:
    """How long a watched process may stay silent: ``timeout`` if it made no progress
    meanwhile (stopped, hung), up to ``limit`` while it keeps running or waiting for a
    CPU (busy, or starved by a loaded host)."""

    LOOK_S = 0.5

    def __init__(self, pid: int, timeout: float, limit: float) -> None:
        self.pid, self.timeout, self.limit = pid, timeout, max(limit, timeout)
        self._last: int | None = None
        self._looked = 0.0
        self._ran = True

    def gone(self, silent_for: float, now: float) -> bool:
        """Whether a silence of ``silent_for`` seconds means the process is lost (call it
        often: the accounts are read from half the timeout on, every ``LOOK_S``)."""
        if silent_for < self.timeout / 2:
            self._last = None  # heard from lately: the next silence starts a fresh account
            return False
        if now - self._looked >= self.LOOK_S:
            now_seen = activity(self.pid)
            current = now_seen[0] if now_seen is not None else None
            self._ran = now_seen is not None and (now_seen[1] or self._last is None or now_seen[0] > self._last)
            self._last, self._looked = current, now
        return silent_for > self.limit or silent_for > self.timeout and not self._ran


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None
