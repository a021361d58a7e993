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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import failpoints, inflight
from ..config import Config
from ..errors import CheckpointError
from ..manifest import Manifest
from ..remote import catalog, fetch as remote_fetch
from ..remote.store import Store
from ..tiers import landing
from ..tiers.peer_pull import FAILED, PeerPull
from ..transport import wire
from .landing_jobs import Ask, Job, ShareJobs, ShareKey

if TYPE_CHECKING:
    from .replies import Replies

log = logging.getLogger("ckptd.daemon")

PIECE_BYTES = 2**17  # a file's mark moves this often: a peer copies each piece one piece behind the download
PAUSE_S = 30.0


class BucketFetch:
    """The daemon's ``fetch`` asks, each waiting on the one job per share (``ShareJobs``)
    however many readers and peers wait on it, run with the daemon's own bucket
    credentials; ``answer(now)``, on the main loop, tells each reader once its shares
    are in the root."""

    def __init__(self, config: Config, replies: Replies, wake: Callable[[], None],
                 shares: ShareJobs | None = None) -> None:
        assert config.remote.url, "BucketFetch needs [remote] url"
        self.store = Store(config.remote.url, part_bytes=min(config.remote.part_bytes, PIECE_BYTES),
                           concurrency=config.remote.concurrency)
        self.root = config.root
        self.shares = shares or ShareJobs(config.root, wake)
        self.jobs = self.shares.jobs
        self.peers = PeerPull(config) if config.peer.enabled else None
        if self.peers is not None:
            self.peers.closing = self.shares.closing
        self.replies = replies
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
        """The landing of share ``key`` under way, or a new one: from its fetcher where
        another daemon is (``peers``), else (or when that fails) from the bucket."""
        fetcher = self.peers.fetcher(*key) if peers and self.peers is not None else None

        def sources() -> list[landing.Source]:
            bucket = BucketCopy(self, key)
            if fetcher is None or self.peers is None:
                return [bucket]
            return [self.peers.source(fetcher, self.store, *key, functools.partial(self._count, "peer_bytes")), bucket]

        job, joined = self.shares.land(key, sources, FAILED, from_peer=fetcher is not None)
        if joined:
            self._count("joined", 1)
        elif not job.future.done():
            job.future.add_done_callback(lambda f: self._count("shares" if f.exception() is None else "failed", 1))
        return job

    def _count(self, what: str, n: int) -> None:
        with self._lock:
            self.counts[what] += n

    def pull(self, run: str, step: int, rank: int, *, asked: bool = True) -> bool:
        """A peer's ``pull`` (on the peer port's thread): whether the share is in the root;
        else its download from the bucket is started, or joined. A failed one's error is
        the answer (the peer then reads the bucket itself). ``asked``: counted as a
        pull answered (not when a waiting pull is looked at again)."""
        if asked:
            self._count("pulls", 1)
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

    def figures(self) -> dict[str, Any]:
        """``asks`` received, ``joined`` to a landing under way, ``shares`` landed (or
        found landed by another process), ``bytes`` from the bucket, ``peer_bytes`` from fetcher peers,
        ``pulls`` answered for peers, ``failed``; ``running`` now; ``streamed``: bytes
        peers copied of shares still landing."""
        with self._lock:
            return {**self.counts, "running": len(self.jobs.running()), "streamed": inflight.streamed()}

    def close(self) -> None:
        self.shares.close()


class BucketCopy:
    """A share downloaded from the bucket, in order and ``PIECE_BYTES`` at a time, each
    file readable by the peers that pull it up to its mark as it lands
    (``ckptd.inflight``) and checked once whole."""

    def __init__(self, fetch: BucketFetch, key: ShareKey) -> None:
        self.fetch, self.key = fetch, key
        self.what = fetch.store.url

    def fill(self, folder: Path, placed: Callable[[str], None]) -> Manifest:
        run, step, rank = self.key
        store = self.fetch.store
        manifest = catalog.read_manifest(store, run, step, rank)
        got = 0
        share = inflight.tracked(folder, rank)
        for file in remote_fetch.missing_files(manifest, folder):
            landing.write_file(folder / file, functools.partial(self._download, share, manifest, file))
            got += (folder / file).stat().st_size
            placed(file)
        self.fetch._count("bytes", got)
        if got:
            log.info("fetch: run %r step %d rank %d landed from %s (%d bytes)", run, step, rank, store.url, got)
        return manifest.unpacked()

    def _download(self, share: inflight.Landing, manifest: Manifest, file: str, path: Path) -> None:
        remote_fetch.download_file(self.fetch.store, manifest, file, path,
                                   functools.partial(_landed, share, file, path))


def _landed(share: inflight.Landing, file: str, path: Path, nbytes: int) -> None:
    """The failpoints: ``fetch.piece``, after each piece the download waits (up to
    ``PAUSE_S``) until a peer has read all that landed, so that a test sees a pull stream;
    ``fetch.hold``, once a peer has read the first piece it lands nothing more for
    ``PAUSE_S``, so that a test stops the fetcher mid-share."""
    share.landed(file, path, nbytes)
    for point in ("fetch.piece", "fetch.hold"):
        try:
            failpoints.hit(point)
        except failpoints.Failpoint:
            if not share.wait_read(file, nbytes, PAUSE_S):
                log.warning("failpoint %s: no peer read %s up to %d within %g s", point, file, nbytes, PAUSE_S)
            elif point == "fetch.hold":
                share.wait_read(file, nbytes + 1, PAUSE_S)  # none reads past what landed: the full pause


def _same_dir(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False
