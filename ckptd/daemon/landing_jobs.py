"""Landing jobs for this node's readers, however many ask at once (``recover`` in
``relay``, ``fetch`` in ``bucket_relay``): one job per key, joined while it runs, and
the readers waiting on jobs; ``ShareJobs``, the one job per share that brings it here.
A job's thread wakes the main loop as it finishes and as each file lands, so a reader
is answered at once, not on a timer; one still waiting after ``WAIT_S`` is told how far
its jobs got. Start at ``Jobs.job``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

from .. import inflight, layout
from ..manifest import Manifest
from ..tiers import landing
from ..tiers.landing import Source

WAIT_S = 2.0  # a waiting reader hears at least this often that its jobs still run
THREADS = 4
PEER_THREADS = 16

K = TypeVar("K", bound=Hashable)


@dataclass(eq=False)
class Job(Generic[K]):
    """``landed``: the data files in place and checked, in order; ``users``: whoever asked."""

    key: K
    future: Future[Any] = field(init=False)
    started: float = field(default_factory=time.monotonic)
    landed: list[str] = field(default_factory=list)
    users: set[str | None] = field(default_factory=set)
    watchers: list[Callable[[str], None]] = field(default_factory=list)


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
        """A file of ``job`` in place: its waiting readers and watchers are told now."""
        with self._lock:
            job.landed.append(file)
            watchers = list(job.watchers)
        for watch in watchers:
            watch(file)
        self._wake()

    def watch(self, job: Job[K], placed: Callable[[str], None]) -> None:
        """``placed(file)`` told of each file of ``job`` in place, those already first."""
        with self._lock:
            landed = list(job.landed)
            job.watchers.append(placed)
        for file in landed:
            placed(file)

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


ShareKey = tuple[str, int, int]


class ShareJobs:
    """The one owner of "bring this share onto this node": one job per share (run, step,
    rank) that lands it in the root from the first of its sources that serves it whole
    (``landing.land_from``: a peer's copy, the share's fetcher as it lands it, the bucket,
    in the order the asker gives). A reader's ``recover`` (``relay``), its ``fetch`` and a
    peer's ``pull`` (``bucket_relay``) all join the job under way. A copy from a fetcher
    goes at its download's pace: ``PEER_THREADS`` at once keep the link busy."""

    def __init__(self, root: Path, wake: Callable[[], None]) -> None:
        self.root = root
        self.jobs: Jobs[ShareKey] = Jobs(wake)
        self.closing = threading.Event()
        # downloads never wait on a peer, so a peer's pull is never stuck behind copies that wait on peers
        self._pools = {near: ThreadPoolExecutor(n, thread_name_prefix=f"ckptd-landing{near}")
                       for near, n in (("", THREADS), ("-peer", PEER_THREADS))}

    def land(self, key: ShareKey, sources: Callable[[], Sequence[Source]], failed: tuple[type[Exception], ...], *,
             from_peer: bool, user: str | None = None) -> tuple[Job[ShareKey], bool]:
        """The job landing share ``key`` under way, else a new one from ``sources()`` (on
        the peers' threads when ``from_peer``: its first source waits on a peer); one
        already done if the share is in the root. And whether it was joined."""
        run, step, rank = key
        there = landing.read_share(layout.step_dir(self.root, run, step), rank) is not None
        pool = self._pools["-peer" if from_peer else ""]
        return self.jobs.job(key, lambda job: _done() if there else pool.submit(self._run, job, sources, failed), user)

    def _run(self, job: Job[ShareKey], sources: Callable[[], Sequence[Source]],
             failed: tuple[type[Exception], ...]) -> Manifest:
        run, step, rank = job.key
        with inflight.track(layout.step_dir(self.root, run, step), rank):
            return landing.land_from(self.root, run, step, rank, sources(), failed, lambda f: self.jobs.placed(job, f))

    def close(self) -> None:
        """Jobs under way finish (each source bounded in time), those not started are dropped."""
        self.closing.set()
        for pool in self._pools.values():
            pool.shutdown(wait=True, cancel_futures=True)


def _done() -> Future[None]:
    done: Future[None] = Future()
    done.set_result(None)
    return done
