"""The bucket (``[remote]``, docs/tiers.md): an object store every node's daemon uploads
its committed shares to, and that a fresh node resumes from. Its internals stay in
``ckptd.remote``: ``store`` (the client), ``catalog`` (what the bucket holds), ``fetch``
(reading shares back), ``uploader`` (the ``ckptd-uploader`` thread), ``retention``.

``remote=`` on ``ckptd.latest``, ``list_checkpoints`` and ``load``: a URL, ``""`` for
the local root only, or None for the ``[remote] url`` of the discovered config.
"""

from __future__ import annotations

import builtins
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from ..config import Config, load as load_config
from ..errors import CheckpointNotFound
from ..manifest import CheckpointInfo, Manifest, TensorRecord
from ..remote import catalog, fetch
from ..remote.store import RemoteError, Store
from ..remote.uploader import Uploader
from ..units import duration, rate, size
from .base import missing_manifests

NAME = catalog.TIER
TABLE = "remote"  # its table in config.toml

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
    return BucketTier(store, base, config.remote.poll_interval) if store is not None else None


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


class BucketTier:
    name = NAME
    durable = True
    unreachable: tuple[type[BaseException], ...] = (OSError, RemoteError)  # out of reach: `latest` may do without it

    def __init__(self, store: Store, base: Path, poll_interval: float) -> None:
        self.store, self.base = store, base
        self.where = f"in {store.url}"
        self.poll_interval = poll_interval

    def latest(self, run: str) -> CheckpointInfo | None:
        return catalog.latest(self.store, run)

    def list(self, run: str) -> builtins.list[CheckpointInfo]:
        return catalog.list_checkpoints(self.store, run)

    def find(self, run: str, step: int) -> BucketHolding:
        """The step's copy in the bucket; CheckpointNotFound naming the steps complete
        there when it is not."""
        _, manifests = find(self.store, run, step)
        return BucketHolding(self.store, run, step, manifests, self.base)

    def complete(self, run: str, step: int,
                 world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        prefix = catalog.step_prefix(run, step)
        objects = {k[len(prefix):]: v for k, v in self.store.list(prefix).items()}
        info = catalog.step_info(self.store, run, step, objects, world_size=world_size)
        return info, lambda timeout: missing_manifests(run, step, self.store.url, objects, timeout)


class BucketHolding:
    """A step complete in the bucket: one rank's tensors read into memory, or shares
    downloaded into the root."""

    fills_root = False  # a whole step out of a bucket is not near: loads that need files say so
    reads_into = False  # load(out=) reads local files: refused for a step only in the bucket

    def __init__(self, store: Store, run: str, step: int, manifests: list[Manifest], base: Path) -> None:
        self.store, self.run, self.step, self.base = store, run, step, base
        self.manifests = manifests
        self.url = store.url

    def fill(self, ranks: Iterable[int] | None = None) -> None:
        for r in sorted(range(len(self.manifests)) if ranks is None else ranks):
            fetch.fetch_share(self.store, self.run, self.step, r, self.base)

    def read_tensors(self, manifest: Manifest, records: dict[str, TensorRecord],
                     local: Callable[[dict[str, TensorRecord]], dict[str, Any]],
                     into: dict[str, Any] | None = None) -> dict[str, Any]:
        if into is not None:
            raise ValueError("load(out=) of a step only in the bucket: load without out=, or fetch it first")
        return fetch.read_tensors(self.store, manifest, records)  # checksums always checked


def open_replica(config: Config, keep_last: Callable[[str], int],
                 on_complete: Callable[[str, list[CheckpointInfo]], None]) -> BucketReplica | None:
    """The daemon's uploads with ``[remote]``, else None."""
    return BucketReplica(config, on_complete) if config.remote.enabled else None


class BucketReplica:
    """The daemon's side: each committed share queued for the ``ckptd-uploader`` thread;
    local retention keeps a step until every share of it is uploaded."""

    name = NAME

    def __init__(self, config: Config, on_complete: Callable[[str, list[CheckpointInfo]], None]) -> None:
        # on_complete: a step became complete in the bucket (where each node has its own
        # root, local retention counts those steps)
        self.uploader = Uploader(config.root, config.remote, on_remote_complete=on_complete)

    def start(self) -> None:
        self.uploader.start()
        log.info("remote tier: %s (uploads after each commit)", self.uploader.config.url)

    def close(self) -> None:
        self.uploader.close()

    def committed(self, run: str, step: int, rank: int, nbytes: int) -> None:
        self.uploader.enqueue(run, step, rank, time.time(), nbytes)

    def dropped(self, run: str, steps: list[int]) -> None:
        """Nothing: the bucket keeps its own steps ([remote.retention])."""

    def pending(self, run: str) -> set[int]:
        return self.uploader.pending_steps(run)

    def received(self) -> None:
        self.uploader.received()  # uploads hold off while a snapshot is under way

    def yield_to(self, busy: Callable[[], bool]) -> None:
        """Nothing: uploads hold off on ``received`` instead."""

    def on_persisted(self, callback: Callable[[str, int, int, float], None]) -> None:
        self.uploader.on_uploaded = callback

    def figures(self) -> dict[str, Any]:
        return self.uploader.figures()


def status_lines(r: dict[str, Any]) -> list[str]:
    """The bucket's line of ``ckptd status``, from its figures (``BucketReplica.figures``)."""
    speed = f", {rate(r['bytes_uploaded'], r['upload_seconds'])}" if r["upload_seconds"] else ""
    copied = f", {size(r['bytes_copied'])} copied in the bucket" if r.get("bytes_copied") else ""
    return [f"remote:       {r['url']}: {r['shares_uploaded']} share(s) uploaded ({size(r['bytes_uploaded'])}"
            f"{speed}{copied}); {r['pending_shares']} pending ({size(r['pending_bytes'])}), lag "
            f"{duration(r['lag_seconds'])}; {r['failures']} failure(s)"
            + (f"; last error: {r['last_error']}" if r["failures"] and r["last_error"] else "")]
