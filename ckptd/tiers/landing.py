"""The one way a fetched share lands in a local root: under a per-share lock, its data
files through the durable path, its manifest last, from the first of its sources that
serves it whole (``land_from``; ``land`` for one way of fetching it). ``stream`` writes
a share's files in place as their bytes arrive, each readable as soon as it is checked,
all durable before the manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

from .. import index, layout
from ..durable import atomic_write, replacing, temp_path
from ..errors import CheckpointCorrupt, CheckpointNotFound
from ..manifest import Manifest

log = logging.getLogger("ckptd.tiers")

LOCK_WAIT_S = 600.0


def land(base: Path, run: str, step: int, rank: int, fetch: Callable[[Path], Manifest | None]) -> Manifest | None:
    """Rank ``rank``'s share of ``step`` landed in root ``base``, once a node: under the
    share's lock, and not again when another process landed it meanwhile. ``fetch(folder)``
    writes its data files there (``write_file``) and returns its manifest, None when it
    could not; the manifest is written last. The share's manifest, None if not landed."""
    folder = layout.step_dir(base, run, step)
    layout.ensure_real_dir(folder, base)
    with share_lock(folder, rank):
        there = read_share(folder, rank)
        if there is not None:
            log.info("run %r step %d rank %d is in the root: landed by another process", run, step, rank)
            return there
        manifest = fetch(folder)
        if manifest is not None:
            atomic_write(folder / layout.manifest_name(rank), manifest.to_json())
        return manifest


class Source(Protocol):
    """Where a share may come from (a peer's copy, its fetcher, the bucket): ``fill(folder,
    placed)`` writes its data files in the step folder (``placed(file)`` as each is in place
    and checked) and returns its manifest; a failure means the next source is asked."""

    what: str

    def fill(self, folder: Path, placed: Callable[[str], None]) -> Manifest: ...


def land_from(base: Path, run: str, step: int, rank: int, sources: Sequence[Source],
              failed: tuple[type[Exception], ...], placed: Callable[[str], None] | None = None) -> Manifest:
    """Rank ``rank``'s share landed in root ``base`` (``land``) from the first of ``sources``
    that serves it whole, each one that fails with one of ``failed`` logged and the next
    asked; the last one's failure is raised, the files placed meanwhile removed."""
    in_place: set[str] = set()

    def place(file: str) -> None:
        in_place.add(file)
        if placed is not None:
            placed(file)

    def files(folder: Path) -> Manifest:
        for i, source in enumerate(sources):
            try:
                return source.fill(folder, place)
            except failed as exc:
                rest = sources[i + 1:]
                log.warning("run %r step %d rank %d from %s not used: %s; %s", run, step, rank, source.what, exc,
                            f"from {rest[0].what} instead" if rest else "no other source is left")
                if not rest:
                    for file in in_place:
                        (folder / file).unlink(missing_ok=True)
                    raise
        raise CheckpointNotFound(f"run {run!r} step {step} rank {rank}: no source to land it from")

    manifest = land(base, run, step, rank, files)
    assert manifest is not None
    return manifest


def write_file(path: Path, write: Callable[[Path], None]) -> None:
    """A data file the manifest will vouch for, through the durable path: ``write(tmp)``
    fills a temporary file that is fsynced and renamed into place."""
    with replacing(path) as tmp:
        tmp.unlink(missing_ok=True)  # named for this host and pid: a crashed earlier self's
        write(tmp)


Write = Callable[[int, memoryview], None]
Fill = Callable[[dict[str, memoryview], Callable[[str], None], dict[str, Write]], object]


def stream(folder: Path, sizes: dict[str, int], fill: Fill, placed: Callable[[str], None] | None = None) -> None:
    """The data files ``sizes`` names (file -> bytes) written in ``folder`` as ``fill(views,
    done, write)`` fills each: ``write[file](offset, bytes)`` (a ``pwrite``), or its mapping
    ``views[file]``: once it calls ``done(file)`` (every byte in, checked) the file is
    renamed into place, ``placed(file)`` told, and fsynced behind on a thread of its own.
    All are durable when this returns; on a failure those not yet in place are removed
    (a reader told of the others may be reading them)."""
    files: dict[str, _Streamed] = {}
    synced: list[Future[int | None]] = []
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="ckptd-land-sync") as syncer:
            def done(file: str) -> None:
                files[file].place()
                synced.append(syncer.submit(os.fsync, files[file].fd))
                if placed is not None:
                    placed(file)

            try:
                for file, size in sizes.items():
                    files[file] = _Streamed(folder / file, size)
                fill({f: s.view for f, s in files.items()}, done, {f: s.write for f, s in files.items()})
                for future in synced:
                    future.result()
            except BaseException:
                for s in files.values():
                    s.discard()
                raise
    finally:
        for s in files.values():
            s.close()


class _Streamed:
    """A data file written through a mapping of a temporary file beside ``path`` (named
    for this host and pid: one there is a crashed earlier self's), its blocks allocated
    first: a full disk is an OSError here, never a SIGBUS in a write."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.tmp, self.placed = path, temp_path(path), False
        self.tmp.unlink(missing_ok=True)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if size:
                os.posix_fallocate(self.fd, 0, size)
            self.view = memoryview(mmap.mmap(self.fd, size) if size else bytearray())
        except BaseException:
            self.close()
            self.tmp.unlink(missing_ok=True)
            raise

    def write(self, offset: int, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def place(self) -> None:
        os.replace(self.tmp, self.path)
        self.placed = True

    def discard(self) -> None:
        if not self.placed:
            self.tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """The mapping goes with the last view of it; the bytes stay in the page cache."""
        self.view = memoryview(b"")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_share(folder: Path, rank: int) -> Manifest | None:
    """Rank ``rank``'s manifest in step folder ``folder``, None if absent or unreadable."""
    try:
        return index.read_share(folder, rank)
    except (CheckpointCorrupt, OSError):
        return None


@contextlib.contextmanager
def share_lock(folder: Path, rank: int) -> Iterator[None]:
    """An flock on ``.fetch-rNNNNN.lock`` in ``folder`` (a name the index, retention and
    recovery leave alone). Its holder removes it before letting go, and a process that
    then finds the file it locked gone takes a new one, so none is left behind and no
    two hold it. After ``LOCK_WAIT_S`` the share lands without it: the durable path
    keeps it whole."""
    name = folder / f".fetch-r{rank:05d}.lock"
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if not _flock(fd, deadline):
                log.warning("%s is still locked after %g s; landing without it", name, LOCK_WAIT_S)
                yield
                return
            try:
                same = os.stat(name, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield
                finally:
                    name.unlink(missing_ok=True)  # while still locked: the next one in takes a new file
                return
        finally:
            os.close(fd)


def _flock(fd: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
