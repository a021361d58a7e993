"""Bucket shares landed once a node for this node's readers (``fetch`` on the producer
socket, docs/tiers.md "Read once"): local ranks restoring from the bucket ask their
daemon, which lands each share its root lacks once however many ask at once
(``ckptd.tiers.landing``); the ranks then read the root, the page cache serving all but
the first. With ``[peer]``, each share is read from the bucket once a cluster, by its
fetcher (``ckptd.tiers.peer_pull``), and copied from there. Start at ``BucketFetch.ask``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import layout
from ..config import Config
from ..errors import CheckpointError
from ..manifest import Manifest
from ..remote import fetch as remote_fetch
from ..remote.store import Store
from ..tiers import bucket, landing
from ..tiers.peer_pull import FAILED, PeerPull
from ..transport import wire

if TYPE_CHECKING:
    from .replies import Replies

log = logging.getLogger("ckptd.daemon")

WAIT_S = 2.0  # a reader's ask is answered at least this often, done or not
THREADS = 4

ShareKey = tuple[str, int, int]


@dataclass
class _Ask:
    identity: bytes
    seq: int
    jobs: list[Future[None]]
    what: str
    started: float
    deadline: float


class BucketFetch:
    """The daemon's ``fetch`` jobs, one per share however many readers wait on it, run on
    ``ckptd-landing`` threads with the daemon's own bucket credentials; ``answer(now)``, on
    the main loop, tells each reader once its shares are in the root."""

    def __init__(self, config: Config, replies: Replies, wake: Callable[[], None]) -> None:
        store = bucket.open_store(None, config)
        assert store is not None, "BucketFetch needs [remote] url"
        self.store: Store = store
        self.root = config.root
        self.peers = PeerPull(config) if config.peer.enabled else None
        self.replies, self._wake = replies, wake
        # downloads never wait on a peer, so a peer's pull is never stuck behind copies that wait on peers
        self._bucket_pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ckptd-landing")
        self._peer_pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ckptd-landing-peer")
        self._jobs: dict[ShareKey, Future[None]] = {}
        self._waiting: list[_Ask] = []
        self._lock = threading.Lock()
        self.counts = {"asks": 0, "joined": 0, "shares": 0, "failed": 0, "bytes": 0, "peer_bytes": 0, "pulls": 0}

    def ask(self, identity: bytes, seq: int, run: str, step: int, ranks: list[int], root: str, url: str) -> None:
        """Start (or join) the landing of ``ranks``' shares of ``step``; answered by ``answer``."""
        if not _same_dir(root, self.root):
            raise CheckpointError(f"fetch: this daemon lands the bucket's shares in its root {self.root}, not in "
                                  f"{root}: read without root= (or with root={str(self.root)!r})")
        if url.rstrip("/") != self.store.url:
            raise CheckpointError(f"fetch: this daemon's bucket is {self.store.url}, not {url}; read with "
                                  "remote= naming it, or read the bucket yourself (remote= another URL does)")
        self.counts["asks"] += 1
        jobs = [self._job((run, step, r)) for r in sorted(set(ranks))]
        now = time.monotonic()
        what = f"run {run!r} step {step} rank(s) {sorted(set(ranks))}"
        self._waiting.append(_Ask(identity, seq, jobs, what, now, now + WAIT_S))
        if all(j.done() for j in jobs):
            self._wake()

    def _job(self, key: ShareKey, *, peers: bool = True) -> Future[None]:
        """The landing of share ``key`` under way, or a new one (``peers``: from its fetcher
        where another daemon is, else from the bucket)."""
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not job.done():
                self.counts["joined"] += 1
                return job
            fetcher = self.peers.fetcher(*key) if peers and self.peers is not None else None
            job = self._jobs[key] = (self._bucket_pool.submit(self._land, *key, None) if fetcher is None
                                     else self._peer_pool.submit(self._land, *key, fetcher))
        job.add_done_callback(lambda _: self._wake())
        return job

    def pull(self, run: str, step: int, rank: int) -> bool:
        """A peer's ``pull`` (on the peer port's thread): whether the share is in the root;
        else its download from the bucket is started, or joined. A failed one's error is
        the answer (the peer then reads the bucket itself)."""
        with self._lock:
            self.counts["pulls"] += 1
        if landing.read_share(layout.step_dir(self.root, run, step), rank) is not None:
            return True
        job = self._job((run, step, rank), peers=False)
        if job.done() and job.exception() is not None:
            raise CheckpointError(f"run {run!r} step {step} rank {rank} from {self.store.url}: {job.exception()}")
        return job.done()

    def deadline(self) -> float | None:
        """When the first waiting reader is told how far its shares got."""
        return min(a.deadline for a in self._waiting) if self._waiting else None

    def answer(self, now: float) -> None:
        """Answer each reader whose shares are landed (or failed), or who has waited ``WAIT_S``."""
        waiting = []
        for a in self._waiting:
            if all(j.done() for j in a.jobs):
                self._finish(a)
            elif now >= a.deadline:
                left = sum(not j.done() for j in a.jobs)
                self.replies.send(a.identity, "fetched", seq=a.seq, done=False,
                                  progress=f"{a.what}: {left} share(s) still downloading after "
                                           f"{now - a.started:.0f} s")
            else:
                waiting.append(a)
        self._waiting = waiting
        busy = {id(j) for a in waiting for j in a.jobs}
        with self._lock:
            for key, job in list(self._jobs.items()):
                if job.done() and id(job) not in busy:
                    del self._jobs[key]

    def _finish(self, a: _Ask) -> None:
        exc = next((j.exception() for j in a.jobs if j.exception() is not None), None)
        if exc is None:
            self.replies.send(a.identity, "fetched", seq=a.seq, done=True, progress=None)
            return
        if not isinstance(exc, CheckpointError):
            log.error("fetch: %s failed: %s: %s", a.what, type(exc).__name__, exc)
        self.replies.send(a.identity, "error", seq=a.seq, step=None, message=f"fetch: {a.what}: {exc}",
                          code=wire.error_code(exc))

    def _land(self, run: str, step: int, rank: int, fetcher: str | None) -> None:
        """One share landed in the root, each file checked, the manifest last: from the
        daemon ``fetcher`` (None: none), else from the bucket."""
        try:
            if fetcher is None or not self._from_peer(fetcher, run, step, rank):
                self._from_bucket(run, step, rank)
        except Exception:
            with self._lock:
                self.counts["failed"] += 1
            raise
        with self._lock:
            self.counts["shares"] += 1

    def _from_peer(self, fetcher: str, run: str, step: int, rank: int) -> bool:
        assert self.peers is not None
        try:
            got = self.peers.land(fetcher, self.store, self.root, run, step, rank)
        except FAILED as exc:
            if self.peers.closing.is_set():
                raise CheckpointError("fetch: this daemon is stopping") from None
            log.warning("fetch: run %r step %d rank %d not from its fetcher %s (%s); from %s instead", run, step,
                        rank, fetcher, exc, self.store.url)
            return False
        with self._lock:
            self.counts["peer_bytes"] += got
        log.info("fetch: run %r step %d rank %d landed from %s (%d bytes)", run, step, rank, fetcher, got)
        return True

    def _from_bucket(self, run: str, step: int, rank: int) -> None:
        got = 0

        def download(store: Store, manifest: Manifest, file: str, path: Path) -> None:
            nonlocal got
            remote_fetch.download_file(store, manifest, file, path)
            got += path.stat().st_size

        bucket.fetch_share(self.store, run, step, rank, self.root, download=download)
        with self._lock:
            self.counts["bytes"] += got
        if got:
            log.info("fetch: run %r step %d rank %d landed from %s (%d bytes)", run, step, rank, self.store.url, got)

    def figures(self) -> dict[str, Any]:
        """``asks`` received, ``joined`` to a download under way, ``shares`` landed (or
        found landed), ``bytes`` from the bucket, ``peer_bytes`` from fetcher peers,
        ``pulls`` answered for peers, ``failed``; ``running`` now."""
        with self._lock:
            return {**self.counts, "running": sum(not j.done() for j in self._jobs.values())}

    def close(self) -> None:
        if self.peers is not None:
            self.peers.closing.set()
        for pool in (self._peer_pool, self._bucket_pool):
            pool.shutdown(wait=True, cancel_futures=True)


def _same_dir(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False
