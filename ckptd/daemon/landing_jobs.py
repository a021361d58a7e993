"""Landing jobs for this node's readers, however many ask at once (``recover`` in
``relay``, ``fetch`` in ``bucket_relay``): one job per key, joined while it runs, and
the readers waiting on jobs. A job's thread wakes the main loop as it finishes and as
each file lands, so a reader is answered at once, not on a timer; one still waiting
after ``WAIT_S`` is told how far its jobs got. Start at ``Jobs.job``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, TypeVar

WAIT_S = 2.0  # a waiting reader hears at least this often that its jobs still run

K = TypeVar("K", bound=Hashable)


@dataclass(eq=False)
class Job(Generic[K]):
    """``landed``: the data files in place and checked, in order; ``users``: whoever asked."""

    key: K
    future: Future[Any] = field(init=False)
    started: float = field(default_factory=time.monotonic)
    landed: list[str] = field(default_factory=list)
    users: set[str | None] = field(default_factory=set)


@dataclass(eq=False)
class Ask(Generic[K]):
    """A reader waiting on ``jobs``; ``seen``: how many of their landed files it was told
    of (None: it is answered once they are done). ``finish(ask)`` answers it once every
    job is done, ``progress(ask, now, landed)`` before."""

    identity: bytes
    seq: int
    jobs: list[Job[K]]
    finish: Callable[[Ask[K]], None]
    progress: Callable[[Ask[K], float, list[str] | None], None]
    user: str | None = None
    seen: int | None = None
    started: float = field(default_factory=time.monotonic)
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = self.started + WAIT_S

    def landed(self) -> list[str]:
        return [f for j in self.jobs for f in j.landed]


class Jobs(Generic[K]):
    """The jobs under way by key, and the asks waiting; ``answer`` runs on the main loop,
    ``job`` and ``placed`` on any thread."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._jobs: dict[K, Job[K]] = {}
        self.waiting: list[Ask[K]] = []
        self._lock = threading.Lock()

    def job(self, key: K, start: Callable[[Job[K]], Future[Any]], user: str | None = None) -> tuple[Job[K], bool]:
        """The job of ``key`` under way, else a new one ``start(job)`` runs; and whether
        it was joined."""
        with self._lock:
            job = self._jobs.get(key)
            joined = job is not None and not job.future.done()
            if job is None or not joined:
                job = self._jobs[key] = Job(key)
                job.future = start(job)
            job.users.add(user)
        if not joined:
            job.future.add_done_callback(lambda _: self._wake())
        return job, joined

    def placed(self, job: Job[K], file: str) -> None:
        """A file of ``job`` in place: its waiting readers are told now."""
        job.landed.append(file)
        self._wake()

    def running(self) -> list[Job[K]]:
        with self._lock:
            return [j for j in self._jobs.values() if not j.future.done()]

    def wait(self, ask: Ask[K]) -> None:
        self.waiting.append(ask)
        if all(j.future.done() for j in ask.jobs):
            self._wake()

    def deadline(self) -> float | None:
        """When the first waiting reader is told how far its jobs got."""
        return min(a.deadline for a in self.waiting) if self.waiting else None

    def answer(self, now: float) -> None:
        """Answer each reader whose jobs are done, that has files landed it was not told
        of, or that has waited ``WAIT_S``; then forget the jobs done that none waits on."""
        waiting = []
        for a in self.waiting:
            landed = a.landed()
            if all(j.future.done() for j in a.jobs):
                a.finish(a)
            elif a.seen is not None and len(landed) > a.seen:
                a.progress(a, now, landed[a.seen:])
            elif now >= a.deadline:
                a.progress(a, now, None if a.seen is None else [])
            else:
                waiting.append(a)
        self.waiting = waiting
        busy = {id(j) for a in waiting for j in a.jobs}
        with self._lock:
            for key, job in list(self._jobs.items()):
                if job.future.done() and id(job) not in busy:
                    del self._jobs[key]
