"""Bucket shares landed once a node for this node's readers (``fetch`` on the producer
socket, docs/tiers.md "Read once"): local ranks restoring from the bucket ask their
daemon, which lands each share its root lacks once however many ask at once
(``ckptd.tiers.landing``); the ranks then read the root, the page cache serving all but
the first. With ``[peer]``, each share is read from the bucket once a cluster, by its
fetcher (``ckptd.tiers.peer_pull``), and copied from there. Start at ``BucketFetch.ask``.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import failpoints, inflight, layout
from ..config import Config
from ..errors import CheckpointError
from ..manifest import Manifest
from ..remote import fetch as remote_fetch
from ..remote.store import Store
from ..tiers import bucket, landing
from ..tiers.peer_pull import FAILED, PeerPull
from ..transport import wire
from .landing_jobs import Ask, Job, Jobs

if TYPE_CHECKING:
    from .replies import Replies

log = logging.getLogger("ckptd.daemon")

THREADS = 4
PIECE_BYTES = 2**20  # a file's bytes land, and become readable to the peers pulling it, this many at a time
PAUSE_S = 30.0

ShareKey = tuple[str, int, int]


class BucketFetch:
    """The daemon's ``fetch`` jobs, one per share however many readers wait on it, run on
    ``ckptd-landing`` threads with the daemon's own bucket credentials; ``answer(now)``, on
    the main loop, tells each reader once its shares are in the root."""

    def __init__(self, config: Config, replies: Replies, wake: Callable[[], None]) -> None:
        assert config.remote.url, "BucketFetch needs [remote] url"
        self.store = Store(config.remote.url, part_bytes=min(config.remote.part_bytes, PIECE_BYTES),
                           concurrency=config.remote.concurrency)
        self.root = config.root
        self.peers = PeerPull(config) if config.peer.enabled else None
        self.replies = replies
        # downloads never wait on a peer, so a peer's pull is never stuck behind copies that wait on peers
        self._bucket_pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ckptd-landing")
        self._peer_pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ckptd-landing-peer")
        self.jobs: Jobs[ShareKey] = Jobs(wake)
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
        what = f"run {run!r} step {step} rank(s) {sorted(set(ranks))}"
        self.jobs.wait(Ask(identity, seq, jobs, lambda a: self._finish(a, what),
                           lambda a, now, _: self._progress(a, now, what)))

    def _job(self, key: ShareKey, *, peers: bool = True) -> Job[ShareKey]:
        """The landing of share ``key`` under way, or a new one (``peers``: from its fetcher
        where another daemon is, else from the bucket); one already done if it is in the root."""
        fetcher = self.peers.fetcher(*key) if peers and self.peers is not None else None
        pool = self._bucket_pool if fetcher is None else self._peer_pool
        landed = landing.read_share(layout.step_dir(self.root, key[0], key[1]), key[2]) is not None
        job, joined = self.jobs.job(key, lambda _: _done() if landed else pool.submit(self._land, *key, fetcher))
        if joined:
            with self._lock:
                self.counts["joined"] += 1
        return job

    def pull(self, run: str, step: int, rank: int) -> bool:
        """A peer's ``pull`` (on the peer port's thread): whether the share is in the root;
        else its download from the bucket is started, or joined. A failed one's error is
        the answer (the peer then reads the bucket itself)."""
        with self._lock:
            self.counts["pulls"] += 1
        done = self._job((run, step, rank), peers=False).future
        if done.done() and done.exception() is not None:
            raise CheckpointError(f"run {run!r} step {step} rank {rank} from {self.store.url}: {done.exception()}")
        return done.done()

    def deadline(self) -> float | None:
        return self.jobs.deadline()

    def answer(self, now: float) -> None:
        self.jobs.answer(now)

    def _progress(self, a: Ask[ShareKey], now: float, what: str) -> None:
        left = sum(not j.future.done() for j in a.jobs)
        self.replies.send(a.identity, "fetched", seq=a.seq, done=False,
                          progress=f"{what}: {left} share(s) still downloading after {now - a.started:.0f} s")

    def _finish(self, a: Ask[ShareKey], what: str) -> None:
        exc = next((j.future.exception() for j in a.jobs if j.future.exception() is not None), None)
        if exc is None:
            self.replies.send(a.identity, "fetched", seq=a.seq, done=True, progress=None)
            return
        if not isinstance(exc, CheckpointError):
            log.error("fetch: %s failed: %s: %s", what, type(exc).__name__, exc)
        self.replies.send(a.identity, "error", seq=a.seq, step=None, message=f"fetch: {what}: {exc}",
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
        """Downloaded in order, each file readable by the peers that pull it up to its mark
        as it lands (``ckptd.inflight``)."""
        got = 0

        def download(share: inflight.Landing, store: Store, manifest: Manifest, file: str, path: Path) -> None:
            nonlocal got
            remote_fetch.download_file(store, manifest, file, path, functools.partial(_landed, share, file, path))
            got += path.stat().st_size

        with inflight.track(layout.step_dir(self.root, run, step), rank) as share:
            bucket.fetch_share(self.store, run, step, rank, self.root, download=functools.partial(download, share))
        with self._lock:
            self.counts["bytes"] += got
        if got:
            log.info("fetch: run %r step %d rank %d landed from %s (%d bytes)", run, step, rank, self.store.url, got)

    def figures(self) -> dict[str, Any]:
        """``asks`` received, ``joined`` to a download under way, ``shares`` landed (or
        found landed by another process), ``bytes`` from the bucket, ``peer_bytes`` from fetcher peers,
        ``pulls`` answered for peers, ``failed``; ``running`` now; ``streamed``: bytes
        peers copied of shares still landing."""
        with self._lock:
            return {**self.counts, "running": len(self.jobs.running()), "streamed": inflight.streamed()}

    def close(self) -> None:
        if self.peers is not None:
            self.peers.closing.set()
        for pool in (self._peer_pool, self._bucket_pool):
            pool.shutdown(wait=True, cancel_futures=True)


def _landed(share: inflight.Landing, file: str, path: Path, nbytes: int) -> None:
    """The failpoint ``fetch.piece``: after each piece, the download waits (up to
    ``PAUSE_S``) until a peer has read all that landed, so that a test sees a pull stream."""
    share.landed(file, path, nbytes)
    try:
        failpoints.hit("fetch.piece")
    except failpoints.Failpoint:
        if not share.wait_read(file, nbytes, PAUSE_S):
            log.warning("failpoint fetch.piece: no peer read %s up to %d within %g s", file, nbytes, PAUSE_S)


def _done() -> Future[None]:
    done: Future[None] = Future()
    done.set_result(None)
    return done


def _same_dir(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False
