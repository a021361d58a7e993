"""The peer tier's threads, kept alive: a thread whose loop raises (a bug, or memory
exhausted by a request) is logged, counted and started again, so that one message
never leaves a node unable to serve or replicate while ``status`` looks healthy.

The count is per process (a daemon has one peer tier) and shows as
``peer.thread_restarts`` in ``ckptd status --json`` and as
``ckptd_peer_thread_restarts_total``."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Callable, Generic, TypeVar

log = logging.getLogger("ckptd.peer")

RESTART_PAUSE_S = (0.05, 2.0)  # first and longest pause before a restart (a loop that fails at once)
_restarts: Counter[str] = Counter()
_lock = threading.Lock()


def restarts() -> dict[str, int]:
    """Thread name -> times it was restarted in this process."""
    with _lock:
        return dict(_restarts)


def run(name: str, loop: Callable[[], None], stopping: Callable[[], bool]) -> None:
    """Run ``loop`` until it returns or ``stopping()``; after each exception, log it,
    count a restart of ``name`` and run it again after a pause that doubles while the
    loop keeps failing at once."""
    pause = RESTART_PAUSE_S[0]
    while not stopping():
        began = time.monotonic()
        try:
            loop()
            return
        except Exception:
            with _lock:
                _restarts[name] += 1
                n = _restarts[name]
            log.exception("thread %s failed (restart %d); it starts again", name, n)
        pause = RESTART_PAUSE_S[0] if time.monotonic() - began > 10 else min(pause * 2, RESTART_PAUSE_S[1])
        time.sleep(pause)


class Supervised:
    """A peer-tier thread that waits on ``_cv`` for work or ``_stop``: ``_run`` is its
    loop, kept alive by ``run``; ``_closing`` runs on that thread once it ends."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self.thread.join()

    def _loop(self) -> None:
        run(self.thread.name, self._run, lambda: self._stop)
        self._closing()

    def _run(self) -> None:
        raise NotImplementedError

    def _closing(self) -> None:
        pass


J = TypeVar("J")


class Queued(Supervised, Generic[J]):
    """A ``Supervised`` thread that does the jobs ``put`` hands it, in turn: its ``_run``
    takes each from ``_next`` until that says it is stopping (None)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._jobs: deque[J] = deque()

    def put(self, job: J) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()

    def _next(self) -> J | None:
        with self._cv:
            while not (self._stop or self._jobs):
                self._cv.wait()
            return None if self._stop else self._jobs.popleft()
