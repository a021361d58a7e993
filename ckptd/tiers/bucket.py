"""The bucket (``[remote]``): an object store every node's daemon uploads its shares
to, and that a fresh node resumes from. ``BucketTier`` and ``BucketHolding`` are the
readers', ``BucketTarget`` the daemon's; the store, catalog, reads and uploads
themselves are ``ckptd.remote``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .. import layout, picks
from ..config import Config, load as load_config
from ..errors import CheckpointNotFound, RemoteAuthError, RemoteError
from ..manifest import CheckpointInfo, Manifest, TensorRecord
from ..remote import catalog, codec, fetch
from ..remote.store import Store
from ..remote.uploader import Uploader
from ..units import duration, rate, size
from . import landing
from .bucket_daemon import DaemonLanding
from ..errors import TierUnavailable
from .base import missing_manifests
from .files import bytes_of, read_tensors

NAME = catalog.TIER
FOUND_S = 5.0  # the manifests ``latest`` read serve an ``open`` of its step this long after
TABLE = "remote"

log = logging.getLogger("ckptd.remote")


def open_store(remote: str | None, config: Config | None = None) -> Store | None:
    """The bucket ``remote`` names (None: ``config``'s, by default the discovered one's),
    or None."""
    cfg = (config or load_config()).remote
    url = cfg.url if remote is None else remote.rstrip("/")
    if not url:
        return None
    return Store(url, part_bytes=cfg.part_bytes, concurrency=cfg.concurrency)


def open_tier(config: Config, base: Path, remote: str | None) -> BucketTier | None:
    store = open_store(remote, config)
    if store is None:
        return None
    return BucketTier(store, base, config.remote.poll_interval, DaemonLanding(config, base, store.url))


def find(store: Store, run: str, step: int | None) -> tuple[CheckpointInfo, list[Manifest]]:
    """A step complete in the bucket (None: the newest) and its manifests, or CheckpointNotFound."""
    objects = catalog.run_objects(store, run)
    if step is None:
        info = catalog.latest(store, run)
        if info is None:
            raise CheckpointNotFound(f"run {run!r} has no complete checkpoint in {store.url}")
        step = info.step
    found = catalog.manifests(store, run, step, objects.get(step, {}))
    if found is None:
        have = sorted(s for s, objs in objects.items() if catalog.step_info(store, run, s, objs))[-10:]
        raise CheckpointNotFound(f"run {run!r} has no complete checkpoint at step {step} in {store.url}; "
                                 f"complete steps there: {', '.join(map(str, have)) or 'none'}")
    path = store.where(catalog.step_prefix(run, step)).rstrip("/")
    return CheckpointInfo.from_manifests(path, found, tiers=(NAME,)), found


def fetch_share(store: Store, run: str, step: int, rank: int, root: Path, *,
                download: Callable[[Store, Manifest, str, Path], None] = fetch.download_file) -> Manifest:
    """Rank ``rank``'s share of ``step`` downloaded into ``root`` (``landing``: data files,
    each checked, then the manifest); files already there at their full size are kept.
    ``download(store, manifest, file, path)`` writes one data file."""
    def files(folder: Path) -> Manifest:
        manifest = catalog.read_manifest(store, run, step, rank)
        for file in fetch.missing_files(manifest, folder):
            landing.write_file(folder / file, functools.partial(download, store, manifest, file))
        return manifest.unpacked()

    landed = landing.land(root, run, step, rank, files)
    assert landed is not None
    return landed


@contextlib.contextmanager
def _reached(store: Store) -> Iterator[None]:
    """The store's failures to answer as ``TierUnavailable``; refused credentials stay
    a ``RemoteAuthError``: waiting cannot mend them."""
    try:
        yield
    except RemoteAuthError:
        raise
    except (OSError, RemoteError) as exc:
        raise TierUnavailable(f"the bucket {store.url} is out of reach: {exc}") from exc


class BucketTier:
    name = NAME
    durable = True

    def __init__(self, store: Store, base: Path, poll_interval: float, daemon: DaemonLanding | None = None) -> None:
        self.store, self.base, self.daemon = store, base, daemon
        self.where = f"in {store.url}"
        self.poll_interval = poll_interval
        self._newest: tuple[str, int, list[Manifest], float] | None = None

    def latest(self, run: str) -> CheckpointInfo | None:
        """The newest step; its manifests kept for an ``open`` of it that follows."""
        with _reached(self.store):
            found = catalog.newest(self.store, run)
        self._newest = None if found is None else (run, found[0].step, found[1], time.monotonic() + FOUND_S)
        return None if found is None else found[0]

    def steps(self, run: str) -> list[CheckpointInfo]:
        with _reached(self.store):
            return catalog.list_checkpoints(self.store, run)

    def open(self, run: str, step: int) -> BucketHolding | None:
        """The step as the bucket holds it: as the ``latest`` just before found it (the
        lookup a load makes first, within ``FOUND_S``), else listed and read anew."""
        newest, self._newest = self._newest, None
        if newest is not None and newest[:2] == (run, step) and time.monotonic() < newest[3]:
            return BucketHolding(self.store, run, step, newest[2], self.base, self.daemon)
        with _reached(self.store):
            found = catalog.manifests(self.store, run, step, catalog.run_objects(self.store, run).get(step, {}))
        return None if found is None else BucketHolding(self.store, run, step, found, self.base, self.daemon)

    def completion(self, run: str, step: int,
                   world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        prefix = catalog.step_prefix(run, step)
        with _reached(self.store):
            objects = {k[len(prefix):]: v for k, v in self.store.list(prefix).items()}
            info = catalog.step_info(self.store, run, step, objects, world_size=world_size)
        return info, lambda timeout: missing_manifests(run, step, self.store.url, objects, timeout)


class BucketHolding:
    """A step complete in the bucket. Where this node's daemon serves the bucket, it lands
    the shares read in the root, once a node, and they are read there; else one rank's
    tensors are read straight into memory or the caller's tensors (a share this node
    wrote is read from its root), and files land in the root for mapped reads and the
    ranks asked."""

    def __init__(self, store: Store, run: str, step: int, manifests: list[Manifest], base: Path,
                 daemon: DaemonLanding | None = None) -> None:
        self.store, self.run, self.step, self.base, self.daemon = store, run, step, base, daemon
        self.manifests = manifests
        self.where = store.url
        self.path = layout.step_dir(base, run, step)

    def read(self, manifest: Manifest, records: dict[str, TensorRecord], into: dict[str, Any] | None = None, *,
             verify: bool = False, mapped: bool = False,
             convert: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
        writers = {layout.file_rank(r.file) for r in records.values()}
        missing = sorted(w for w in writers if w is not None and not self._written_here(w))
        if missing and not (self.daemon is not None and self.daemon.land(self.run, self.step, missing)) and mapped:
            self.materialize(missing)
        if all(w is not None and self._written_here(w) for w in writers):
            return read_tensors(self.path, records, verify=verify, into=into, mapped=mapped, convert=convert)
        views = None if into is None else {n: bytes_of(into[n]) for n in records if n in into}
        tensors = fetch.read_tensors(self.store, manifest, records, views)
        tensors.update({n: into[n] for n in views or ()})  # type: ignore[index]
        return tensors if convert is None else {n: convert(n, t) for n, t in tensors.items()}

    def materialize(self, ranks: Iterable[int] | None = None) -> None:
        """The shares of ``ranks`` in the root, landed by this node's daemon where it serves
        the bucket, else downloaded by this process; a whole step is refused without the
        daemon: one rank's share is read straight into memory instead."""
        wanted = range(len(self.manifests)) if ranks is None else sorted(set(ranks))
        if self.daemon is not None and self.daemon.land(self.run, self.step, list(wanted)):
            return
        if ranks is None:
            raise ValueError(f"step {self.step} of run {self.run!r} is complete only in {self.where}: load one "
                             "rank's share there with rank= (or set RANK), or fetch the step into the local root "
                             "first (ckptd.tiers.bucket.fetch_share) to load the whole state")
        for r in sorted(set(ranks)):
            fetch_share(self.store, self.run, self.step, r, self.base)

    def _written_here(self, rank: int) -> bool:
        """Rank ``rank``'s share is in the root with the bucket's manifest (the node that wrote it)."""
        here = landing.read_share(self.path, rank)
        return here is not None and here.time == self.manifests[rank].time


def open_target(config: Config, keep_last: Callable[[str], int],
                on_complete: Callable[[str, list[CheckpointInfo]], None]) -> BucketTarget | None:
    """The daemon's uploads with ``[remote]``, else None."""
    return BucketTarget(config, on_complete) if config.remote.enabled else None


class BucketTarget:
    """The daemon's side: each committed share queued for the ``ckptd-uploader`` thread,
    newest first; local retention keeps a step until uploaded where the bucket's policy
    keeps it whatever comes (``Uploader.owed_steps``)."""

    name = NAME

    def __init__(self, config: Config, on_complete: Callable[[str, list[CheckpointInfo]], None]) -> None:
        # where each node has its own root, local retention counts the steps complete in the bucket
        codec.check_available(config.remote.compression)
        self.uploader = Uploader(config.root, config.remote, on_remote_complete=on_complete)

    def start(self) -> None:
        self.uploader.start()
        log.info("remote tier: %s (uploads after each commit)", self.uploader.config.url)

    def close(self) -> None:
        self.uploader.close()

    def committed(self, run: str, step: int, rank: int, nbytes: int, due: tuple[str, ...] | None) -> None:
        self.uploader.enqueue(run, step, rank, time.time(), nbytes, due)

    def pending(self, run: str) -> set[int]:
        return self.uploader.owed_steps(run)

    def dropped(self, run: str, steps: list[int]) -> None:
        self.uploader.forget(run, steps)

    def received(self) -> None:
        self.uploader.received()  # uploads hold off while a snapshot is under way

    def on_persisted(self, callback: Callable[[str, int, int, float], None]) -> None:
        self.uploader.on_uploaded = callback

    def figures(self) -> dict[str, Any]:
        return self.uploader.figures()


def status_lines(r: dict[str, Any]) -> list[str]:
    """The bucket's line of ``ckptd status``, from its figures (``BucketTarget.figures``)."""
    speed = f", {rate(r['bytes_uploaded'], r['upload_seconds'])}" if r["upload_seconds"] else ""
    copied = f", {size(r['bytes_copied'])} copied in the bucket" if r.get("bytes_copied") else ""
    return [f"remote:       {r['url']}: {r['shares_uploaded']} share(s) uploaded ({size(r['bytes_uploaded'])}"
            f"{speed}{copied}); {r['pending_shares']} pending ({size(r['pending_bytes'])}), lag "
            f"{duration(r['lag_seconds'])}; {r['failures']} failure(s)"
            + (f"; last error: {r['last_error']}" if r["failures"] and r["last_error"] else "")] + picks.status_line(r)
