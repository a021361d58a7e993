"""Preemption notices: a scheduler's signal, or ``Producer.preempt()``, and the save after it.

``Notices.install`` hears ``[producer] preempt_signals`` on a thread of its own
(``Wakeup``), so a notice counts, and the grace ends the process, while the main thread
waits in C. ``Notices.due`` tells ``should_save``, agreed over the ranks by ``any_rank``;
``Notices.commit`` makes the save after it durable within ``[producer] preempt_grace``,
then hands the signal on as the process would have taken it. Read ``Notices`` top to
bottom.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..completion import wait_complete
from . import pacing
from .steps import CommitHandle

log = logging.getLogger("ckptd.producer")


class Notices:
    """One producer's preemption notices. ``signum``: the signal that gave notice (None:
    ``preempt()``), at monotonic time ``at``; ``saving``: ``should_save`` answered True
    for it and the next commit settles it; ``_due``: a notice ``should_save`` has not
    answered yet; ``_passing``: settled or closed, signals go on to the dispositions
    found at ``install`` (``_previous``); ``resume_from``: ``resume_tier``'s answer."""

    def __init__(self, signals: tuple[str, ...], grace_s: float, resume_from: tuple[str | None, str]) -> None:
        self.signals = tuple(signal.Signals[name] for name in signals)
        self.grace_s, self.resume_from = grace_s, resume_from
        self.preempted = self.saving = self._due = self._passing = False
        self.signum: int | None = None
        self.at: float | None = None
        self._previous: dict[int, Any] = {}
        self._found: dict[int, Any] = {}
        self._wakeup: Wakeup | None = None
        self._heard_count = {"main": 0, "thread": 0}
        self._settled = threading.Event()
        self._heard = threading.Event()
        self._closing = threading.Lock()
        self._closed = False
        self._watcher: threading.Thread | None = None

    def install(self) -> None:
        """Hear the signals, once, from the main thread (where Python runs signal handlers)."""
        if self._previous or self._passing or not self.signals \
                or threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        self._found = dict(self._previous)
        self._wakeup = Wakeup(self._heard_signal)
        self._watcher = threading.Thread(target=self._watch, name="ckptd-preempt", daemon=True)
        self._watcher.start()

    def preempt(self) -> None:
        """A notice from the user's own code (a cloud's metadata poll, a file)."""
        if not self.preempted:
            self.preempted, self.at, self._due = True, time.monotonic(), True

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Python's handler, in the main thread once it runs Python again."""
        if self._passing:
            self._pass_on(signum, frame)
        else:
            self._notice(signum, "main")

    def _heard_signal(self, signum: int) -> None:
        """On the ``ckptd-signals`` thread, as the signal arrives, whatever the main thread does.
        Once closed, a byte still on its way is a signal the main thread took already."""
        with self._closing:
            if signum not in self.signals or self._closed:
                return
            if self._passing:
                if self._found.get(signum) in (signal.SIG_DFL, None):
                    die_of(signum)
            else:
                self._notice(signum, "thread")

    def _notice(self, signum: int, hearer: str) -> None:
        """Both hearers take the notice, whichever comes first (the thread's wakeup fd may
        be replaced, asyncio's); each hears a signal once, so its second is a second signal,
        which ends the process now, as the signal's default."""
        self._heard_count[hearer] += 1
        if self._heard_count[hearer] > 1:
            die_of(signum)
        elif self.signum is None:
            self.signum, self.at, self.preempted = signum, time.monotonic(), True
            self._due = True
            self._heard.set()

    def due(self, any_rank: Callable[[bool], bool]) -> bool:
        """Whether ``should_save`` answers True for a notice (this rank's or another's)."""
        if not any_rank(self._due):
            return False
        if not self.preempted:
            self.preempted, self.at = True, time.monotonic()
        self._due, self.saving = False, True
        why = signal.Signals(self.signum).name if self.signum is not None else "a notice"
        log.warning("preemption (%s): saving now, %.1f s of the %.0f s grace left", why, self.left(), self.grace_s)
        return True

    def left(self) -> float:
        return max(0.0, self.grace_s - (time.monotonic() - (self.at or time.monotonic())))

    def commit(self, step: int, send: Callable[[], CommitHandle], run: str, world_size: int) -> CommitHandle:
        """The save after a notice: ``send()`` commits ``step``; it returns once every rank's
        share is durable where the job resumes from, or the grace is over; then the signal
        is handed on."""
        self.saving = False
        try:
            handle = send()
            info = handle.wait(self.left())
            tier, where = self.resume_from
            # the daemon's root (<root>/<run>/step-N), which this process's environment may not name
            wait_complete(run, step, timeout=self.left(), root=Path(info.path).parent.parent,
                          world_size=world_size, tier=tier)
            log.warning("preemption: step %d is durable in %s, %.1f s of the grace left", step, where, self.left())
            return handle
        except Exception as exc:
            log.error("preemption: step %d is not known durable within the %.0f s grace: %s", step, self.grace_s, exc)
            raise
        finally:
            self.hand_on()

    def hand_on(self) -> None:
        """The earlier dispositions back, and the notice's signal re-delivered to them
        (from the main thread; from another, the handler passes the signal on). A notice
        of ``preempt()`` has no signal: the loop goes on, and still hears one."""
        if self.signum is None:
            return
        self._passing = True
        self._settled.set()
        if threading.current_thread() is threading.main_thread():
            self.restore()
        os.kill(os.getpid(), self.signum)

    def restore(self) -> None:
        """Put back the dispositions found at ``install`` (main thread only)."""
        self._passing = True
        previous, self._previous = self._previous, {}
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        else:
            self._previous = previous

    def close(self) -> None:
        with self._closing:
            self._closed = True
        self.restore()
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            self._wakeup.close()
            self._wakeup = None
        self._settled.set()
        self._heard.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()

    def _pass_on(self, signum: int, frame: Any) -> None:
        handler = self._previous.get(signum, signal.SIG_DFL)
        if callable(handler):
            handler(signum, frame)
        elif handler != signal.SIG_IGN:
            self.restore()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _watch(self) -> None:
        """A loop that saves no more (stuck in a step, or ending without a save) still
        ends at the grace, as the signal meant."""
        self._heard.wait()
        if not self._settled.wait(self.grace_s) and not self._passing:
            log.error("preemption: no save within the %.0f s grace; the signal goes on", self.grace_s)
            self.hand_on()


class Wakeup:
    """The ``ckptd-signals`` thread: it hears every signal Python catches as it arrives
    (``signal.set_wakeup_fd``), while the main thread, which alone runs Python's handlers,
    may wait in C for minutes (a collective whose peer is gone). The bytes go on to the
    wakeup fd set before (asyncio's), or are dropped where it is full, as Python does."""

    def __init__(self, hear: Callable[[int], None]) -> None:
        self._hear = hear
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._chained = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="ckptd-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while data := self._read.recv(512):
            if self._chained != -1:
                with contextlib.suppress(OSError):
                    os.write(self._chained, data)
            for signum in data:
                self._hear(signum)

    def close(self) -> None:
        """The earlier wakeup fd back (main thread only), unless another replaced ours."""
        now = signal.set_wakeup_fd(self._chained)
        if now != self._write.fileno():
            signal.set_wakeup_fd(now)
            return
        self._write.close()
        self._thread.join()
        self._read.close()


def die_of(signum: int) -> None:
    """End the process as ``signum``'s default disposition does, from any thread
    (``signal.signal`` works in the main thread only)."""
    set_disposition = ctypes.CDLL(None, use_errno=True).signal
    set_disposition.argtypes = [ctypes.c_int, ctypes.c_void_p]
    set_disposition.restype = ctypes.c_void_p
    set_disposition(signum, int(signal.SIG_DFL))
    os.kill(os.getpid(), signum)


def any_rank(world_size: int) -> Callable[[bool], bool]:
    """A function that answers, on every rank, whether any rank's value is True (one
    all-reduce)."""
    agree = pacing.collective(world_size, "int32", lambda dist, t: dist.all_reduce(t, op=dist.ReduceOp.MAX))
    return lambda value: bool(agree(1 if value else 0))


def resume_tier(remote_url: str, peers: bool) -> tuple[str | None, str]:
    """The tier a job resumes from, as ``wait_complete`` names it (None: the last durable
    one), and its name for the log: the bucket where there is one, else the peers, else
    the root."""
    if remote_url:
        return None, "the bucket"
    return ("peer", "the peers' memory") if peers else (None, "the root")
