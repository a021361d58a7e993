"""The daemon's uploads to the bucket, on the ``ckptd-uploader`` thread: ``enqueue``
(from the syncer, a dict insert) queues a committed share; the thread uploads its data
files, multipart and read from disk, then its manifest, retrying with backoff forever
while local retention keeps the share (``owed_steps``), newest first. Nothing of the queue is
stored: ``resume`` compares the root with the bucket at start. Start at ``_loop``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, NamedTuple

import xxhash

from .. import index, layout, picks
from ..config import RemoteConfig
from ..errors import CheckpointCorrupt
from ..manifest import MAX_MANIFEST_BYTES, CheckpointInfo, Manifest
from ..records import Packed
from ..retention import PIN_FILE
from . import catalog, codec, expiry as remote_retention
from .store import RemoteAuthError, RemoteError, Store

log = logging.getLogger("ckptd.remote")

ShareKey = tuple[str, int, int]
QUIET_S = 0.25  # no new part until producers are quiet this long: the trainer's copy comes first
MAX_HOLD_S = 5.0  # ... and no part waits longer, so that uploads progress whatever comes
# each look at the step sent last is a LIST request; other nodes' uploads complete it within seconds
WATCH_FIRST_S, WATCH_FOR_S = 0.25, 30.0


class Watch(NamedTuple):
    """The step this node sent last, while it is not complete in the bucket: ``_watch``
    looks at it again at ``due`` (monotonic), waiting twice as long each time until ``until``."""

    run: str
    step: int
    due: float
    every: float
    until: float


OnRemoteComplete = Callable[[str, list[CheckpointInfo]], None]


class Uploader:
    def __init__(self, root: Path, config: RemoteConfig, *,
                 on_remote_complete: OnRemoteComplete | None = None) -> None:
        self.root = root
        self.config = config
        self.store = Store(config.url, part_bytes=config.part_bytes, concurrency=config.concurrency)
        self._on_remote_complete = on_remote_complete
        self._cond = threading.Condition()
        self._pending: OrderedDict[ShareKey, tuple[float, int]] = OrderedDict()
        self._stop = False
        self._resumed = False
        self._last_received = 0.0
        self._watching: Watch | None = None
        self._thread = threading.Thread(target=self._loop, name="ckptd-uploader", daemon=True)
        self.shares_uploaded = 0
        self.bytes_uploaded = 0
        self.bytes_skipped = 0
        self.bytes_copied = 0
        # a later step's file of the same inode (hard-linked by daemon.reuse) is copied in the bucket
        self._uploaded: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._packings: dict[tuple[int, ...], Packed] = {}  # ... and the frames of those compressed
        self.upload_seconds = 0.0
        self.failures = 0
        self.last_error = ""
        self.last_upload: dict | None = None
        # (run, step, rank, lag_s) after each share: the persist time for the interval advice
        self.on_uploaded: Callable[[str, int, int, float], None] | None = None
        self.picks = picks.Picks(catalog.TIER)
        self._holding: set[str] = set()  # runs with a step complete in the bucket or queued for it

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop after the file in flight; what is left is resumed by the next start."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def enqueue(self, run: str, step: int, rank: int, committed: float, nbytes: int,
                due: tuple[str, ...] | None = None) -> None:
        """A share committed locally: upload it if its step is due for the bucket
        (``ckptd.picks``; called on the syncer thread)."""
        with self._cond:
            if not self.picks.decide(run, step, due, run in self._holding):
                return
            self._holding.add(run)
            self._pending[(run, step, rank)] = (committed, nbytes)
            self._cond.notify_all()

    def received(self) -> None:
        """A producer sent tensor bytes just now (the main loop, per piece: one store)."""
        self._last_received = time.monotonic()

    def _parts(self, fh: BinaryIO) -> Iterator[bytes]:
        """The file in parts, each read once no snapshot is under way (or MAX_HOLD_S)."""
        while True:
            part = self._quiet_read(fh, self.config.part_bytes)
            if not part:
                return
            yield part

    def _quiet_read(self, fh: BinaryIO, n: int) -> bytes:
        held = time.monotonic()
        while (time.monotonic() - self._last_received < QUIET_S and time.monotonic() - held < MAX_HOLD_S
               and not self._stop):
            time.sleep(0.02)
        return fh.read(n)

    def pending_steps(self, run: str) -> set[int]:
        """Steps of ``run`` with a share not yet uploaded (or, before the first comparison
        with the bucket is done, every step: nothing is known to be uploaded yet)."""
        with self._cond:
            if not self._resumed:
                return {s for s, _ in index.step_dirs(self.root / run)}
            return {s for (r, s, _) in self._pending if r == run}

    def owed_steps(self, run: str) -> set[int]:
        """The pending steps local retention must keep for the bucket: those the bucket's
        own policy keeps whatever newer steps come (every step where it sets no rule,
        ``keep_every``'s). Any other step is owed only while local retention keeps it."""
        policy = self.config.retention
        return {s for s in self.pending_steps(run)
                if policy.keeps_all or policy.keep_every and s % policy.keep_every == 0}

    def forget(self, run: str, steps: list[int]) -> None:
        """Local retention removed these steps: their shares are no longer uploaded."""
        gone = set(steps)
        with self._cond:
            for key in [k for k in self._pending if k[0] == run and k[1] in gone]:
                del self._pending[key]
                log.info("run=%s step=%d rank=%d: removed by local retention before its upload; no longer owed "
                         "to %s", *key, self.config.url)

    def _next_share(self) -> ShareKey:
        """The share to upload next: the newest committed (a lagging bucket catches up on
        the step a recovery would load first)."""
        return max(self._pending, key=lambda k: self._pending[k][0])

    def figures(self) -> dict:
        with self._cond:
            pending = list(self._pending.values())
            resumed = self._resumed
        now = time.time()
        return {
            "url": self.config.url, "resumed": resumed,
            "pending_shares": len(pending), "pending_bytes": sum(b for _, b in pending),
            "lag_seconds": max((now - t for t, _ in pending), default=0.0),
            "shares_uploaded": self.shares_uploaded, "bytes_uploaded": self.bytes_uploaded,
            "bytes_skipped": self.bytes_skipped, "bytes_copied": self.bytes_copied,
            "upload_seconds": self.upload_seconds,
            "failures": self.failures, "last_error": self.last_error, "last_upload": self.last_upload,
            **self.picks.figures(),
        }

    def _loop(self) -> None:
        backoff, streak = 0.0, 0
        while True:
            with self._cond:
                if backoff:
                    self._cond.wait_for(lambda: self._stop, timeout=backoff)
                if self._stop:
                    return
            try:
                if not self._resumed:
                    self._resume()
                    with self._cond:
                        self._resumed = True
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or bool(self._pending),
                                        timeout=self._watch_wait())
                    if self._stop:
                        return
                    share = self._next_share() if self._pending else None
                if share is None:
                    self._watch()
                    continue
                self._upload(*share)
                with self._cond:
                    self._pending.pop(share, None)
                backoff, streak = 0.0, 0
            except RemoteError as exc:
                self.failures += 1
                streak += 1
                self.last_error = str(exc)
                backoff = min(max(backoff * 2, 0.5), self.config.max_retry_s)
                (log.error if isinstance(exc, RemoteAuthError) else log.warning)(
                    "upload to %s failed (attempt %d in a row), retrying in %.1f s: %s",
                    self.config.url, streak, backoff, exc)
            except Exception:  # a bug: keep the daemon's other work going, retry later
                self.failures += 1
                log.exception("uploader")
                backoff = self.config.max_retry_s

    def _resume(self) -> None:
        """Queue every local share whose manifest the bucket lacks. A step older than the
        newest one complete in the bucket, of which the bucket has nothing, is not sent
        (remote retention removed it, or it can no longer matter), nor one not due for
        the bucket while it holds a step of the run."""
        queued = 0
        for run_dir in index.run_dirs(self.root):
            run = run_dir.name
            local = [(s, p) for s, p in sorted(index.step_dirs(run_dir))
                     if any(layout.MANIFEST.fullmatch(n) for n in _names(p))]
            if not local:
                continue
            remote = catalog.run_objects(self.store, run)
            newest = max((s for s, objs in remote.items() if catalog.step_info(self.store, run, s, objs)),
                         default=-1)
            for step, path in local:
                objects = remote.get(step, {})
                if step < newest and not objects:
                    continue
                # a step not complete there may hold an abandoned attempt's share in place of ours
                incomplete = objects and catalog.step_info(self.store, run, step, objects) is None
                for name in sorted(_names(path)):
                    m = layout.MANIFEST.fullmatch(name)
                    if m and (name not in objects or incomplete):
                        rank = int(m.group(1))
                        try:
                            manifest = _read_local_manifest(path, rank)
                        except (OSError, CheckpointCorrupt) as exc:
                            log.warning("not uploading %s: %s", path / name, exc)
                            continue
                        with self._cond:
                            if not picks.takes(catalog.TIER, manifest.due, newest >= 0 or run in self._holding):
                                continue
                            self._holding.add(run)
                            self._pending.setdefault((run, step, rank), (manifest.time, manifest.nbytes))
                        queued += 1
        if queued:
            log.info("uploads to resume: %d share(s) committed locally are not complete in %s",
                     queued, self.config.url)

    def _upload(self, run: str, step: int, rank: int) -> None:
        path = layout.step_dir(self.root, run, step)
        t0 = time.monotonic()
        try:
            dir_fd = layout.open_step_dir(path)
        except FileNotFoundError:
            log.warning("run=%s step=%d rank=%d was removed locally before its upload; not uploaded", run, step, rank)
            return
        try:
            name = layout.manifest_name(rank)
            data = layout.read_small(name, MAX_MANIFEST_BYTES, dir_fd=dir_fd)
            manifest = Manifest.from_json(data, str(path / name))
            prefix = catalog.step_prefix(run, step)
            objects = {k[len(prefix):]: v for k, v in self.store.list(prefix).items()}
            if name in objects and not self._replace_remote_share(run, step, rank, data, objects):
                return
            packed: dict[str, Packed] = {}
            sent, skipped, copied = self._upload_files(manifest, dir_fd, prefix, objects,
                                                       xxhash.xxh3_64_hexdigest(data), packed)
            if PIN_FILE in _names(path):
                self.store.put_bytes(prefix + PIN_FILE, b"pinned\n")
            self.store.put_bytes(prefix + name, replace(manifest, compression=packed).to_json() if packed else data)
        except (OSError, CheckpointCorrupt) as exc:
            if isinstance(exc, FileNotFoundError):
                log.warning("run=%s step=%d rank=%d lost a file locally before its upload (%s); not uploaded",
                            run, step, rank, exc)
                return
            raise RemoteError(f"cannot read run={run} step={step} rank={rank} to upload it: {exc}") from None
        finally:
            os.close(dir_fd)
        secs = time.monotonic() - t0
        self.shares_uploaded += 1
        self.bytes_skipped += skipped
        self.bytes_copied += copied
        self.upload_seconds += secs
        self.last_upload = {"run": run, "step": step, "rank": rank, "bytes": sent, "seconds": secs,
                            "time": time.time(), "lag_seconds": time.time() - manifest.time}
        log.info("uploaded run=%s step=%d rank=%d bytes=%d skipped=%d copied=%d seconds=%.3f MB/s=%.1f lag=%.1fs "
                 "to %s", run, step, rank, sent, skipped, copied, secs, sent / max(secs, 1e-9) / 1e6,
                 self.last_upload["lag_seconds"], self.config.url)
        if self.on_uploaded is not None:
            self.on_uploaded(run, step, rank, self.last_upload["lag_seconds"])
        complete = self._after_upload(run, step)
        now = time.monotonic()
        self._watching = None if complete else Watch(run, step, now + WATCH_FIRST_S, WATCH_FIRST_S, now + WATCH_FOR_S)

    def _watch_wait(self) -> float | None:
        """How long the loop may sleep before ``_watch`` is due; None if nothing is watched."""
        return None if self._watching is None else max(0.0, self._watching.due - time.monotonic())

    def _watch(self) -> None:
        """The step this node sent last, not complete in the bucket then, looked at again
        while nothing is to upload: once another node's upload completes it, local
        retention counts it, rather than at this node's next commit."""
        w = self._watching
        assert w is not None
        now = time.monotonic()
        if now < w.due:
            return
        if self._after_upload(w.run, w.step) or now > w.until:
            self._watching = None
        else:
            self._watching = Watch(w.run, w.step, now + 2 * w.every, 2 * w.every, w.until)

    def _upload_files(self, manifest: Manifest, dir_fd: int, prefix: str, objects: dict[str, int], tag: str,
                      packed: dict[str, Packed]) -> tuple[int, int, int]:
        """The share's data files uploaded (or skipped: there already; or copied in the
        bucket); the frames of those compressed go to ``packed``. Bytes sent, skipped, copied."""
        sent = skipped = copied = 0
        for file in sorted(set(manifest.files) | {t.file for t in manifest.tensors.values()}):
            with os.fdopen(layout.open_regular(file, dir_fd=dir_fd), "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                compress = self.config.compression != "none" and manifest.files.get(file) == size
                if not compress and objects.get(file) == size and self.store.tag_of(prefix + file) == tag:
                    skipped += size
                    continue
                same = _identity(os.fstat(fh.fileno()))
                if self._copy_uploaded(same, prefix + file, packed if compress else None, file):
                    copied += size
                    continue
                frames = codec.file_frames(manifest.tensors.values(), file, size) if compress else None
                size = self._send(fh, prefix + file, tag, frames)
                if frames is not None:
                    packed[file] = self._packings[same]
                self._remember(same, prefix + file)
            sent += size
            self.bytes_uploaded += size
        return sent, skipped, copied

    def _send(self, fh: BinaryIO, key: str, tag: str, frames: list[tuple[int, int, int]] | None) -> int:
        """Upload a data file, compressed into ``frames`` unless None; the bytes sent.
        What it was compressed into is kept for the manifest (``_packings``)."""
        same = _identity(os.fstat(fh.fileno()))
        if frames is None:
            self.store.put_file(key, self._parts(fh), tag)
            self._packings.pop(same, None)
            return os.fstat(fh.fileno()).st_size
        packer = codec.Packer(lambda n: self._quiet_read(fh, n), frames, COMPRESS_THREADS)
        self.store.put_file(key, iter(packer), tag)
        self._packings[same] = packer.packed()
        return self._packings[same].size

    def _copy_uploaded(self, same: tuple[int, ...], key: str, packed: dict[str, Packed] | None = None,
                       file: str = "") -> bool:
        """Copy the object uploaded from the same local file to ``key``, inside the bucket;
        False if there is none (or it is gone: remote retention): then it is uploaded.
        ``packed``: compression is on; the copy's frames are added to it under ``file``."""
        src = self._uploaded.get(same)
        if src is None or src == key or (packed is not None) != (self._packings.get(same) is not None):
            return False
        try:
            self.store.copy(src, key)
        except (FileNotFoundError, RemoteError) as exc:
            log.info("cannot copy %s to %s in the bucket (%s); uploading it", src, key, exc)
            del self._uploaded[same]
            return False
        self._remember(same, key)
        if packed is not None:
            packed[file] = self._packings[same]
        return True

    def _remember(self, same: tuple[int, ...], key: str) -> None:
        self._uploaded[same] = key
        self._uploaded.move_to_end(same)
        while len(self._uploaded) > MAX_REMEMBERED:
            self._packings.pop(self._uploaded.popitem(last=False)[0], None)

    def _replace_remote_share(self, run: str, step: int, rank: int, data: bytes, objects: dict[str, int]) -> bool:
        """The bucket already holds a manifest of this rank for this step: True if this share
        is to be uploaded (the one there was retracted), False if not (it is this very
        share, or the step is complete there: a complete checkpoint is never overwritten)."""
        prefix = catalog.step_prefix(run, step)
        name = layout.manifest_name(rank)
        there = self.store.get(prefix + name, MAX_MANIFEST_BYTES)
        if _same_share(there, data, self.store.where(prefix + name)):
            return False
        if catalog.step_info(self.store, run, step, objects) is not None:
            log.error("run=%s step=%d rank=%d is complete in %s with another copy of this share; "
                      "a complete checkpoint is never overwritten: this one stays local", run, step, rank, self.config.url)
            return False
        try:
            old = Manifest.from_json(there, self.store.where(prefix + name))
            files = set(old.files) | {t.file for t in old.tensors.values()}
        except CheckpointCorrupt:
            files = {n for n in objects if layout.file_rank(n) == rank and layout.is_data_file(n)}
        # its data first: the step stops looking complete at once
        self.store.delete(prefix + f for f in files if f in objects)
        self.store.delete([prefix + name])
        for f in files:
            objects.pop(f, None)
        log.warning("run=%s step=%d rank=%d: replaced the bucket's copy of an abandoned attempt", run, step, rank)
        return True

    def _after_upload(self, run: str, step: int) -> bool:
        """If the step is now complete in the bucket: apply the bucket's retention, then
        let the daemon's local retention count the bucket's complete steps; whether it is."""
        objects = self.store.list(catalog.step_prefix(run, step))
        prefix = catalog.step_prefix(run, step)
        mine = {k[len(prefix):]: v for k, v in objects.items()}
        if catalog.step_info(self.store, run, step, mine) is None:
            return False
        log.info("run=%s step=%d is complete in %s", run, step, self.config.url)
        infos = remote_retention.prune(self.store, run, self.config.retention,
                                       busy=self.pending_steps(run))
        if self._on_remote_complete is not None:
            self._on_remote_complete(run, infos)
        return True


MAX_REMEMBERED = 65536
COMPRESS_THREADS = 2


def _same_share(there: bytes, data: bytes, where: str) -> bool:
    """The bucket's manifest ``there`` is of the local share ``data`` (compressed or not)."""
    if there == data:
        return True
    try:
        theirs, ours = Manifest.from_json(there, where), Manifest.from_json(data, where)
    except CheckpointCorrupt:
        return False
    return bool(theirs.compression) and theirs.unpacked().to_json() == replace(ours, format_version=1).to_json()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """A data file's identity: ckptd never rewrites one, and a hard link keeps all four."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _names(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read_local_manifest(path: Path, rank: int) -> Manifest:
    name = layout.manifest_name(rank)
    dir_fd = layout.open_step_dir(path)
    try:
        return Manifest.from_json(layout.read_small(name, MAX_MANIFEST_BYTES, dir_fd=dir_fd), str(path / name))
    finally:
        os.close(dir_fd)

