"""The daemon's I/O: two threads that turn received tensors into durable files.

    main loop --jobs--> ckptd-writer --fds, commits--> ckptd-syncer
        ^                     |                              |
        +------- results (bytes freed, failures, commits) ---+

The writer checksums and writes (to the page cache); the syncer fsyncs and, last,
writes the manifest. Both queues are FIFO, so a commit runs only after every write
of its step has been fsynced, and writing chunk k+1 overlaps the fsync of chunk k.
Nothing here touches sockets; results go back through ``notify``.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import chunkfile, layout
from ..chunkfile import Entry
from ..durable import atomic_write, fsync_dir, write_all
from ..manifest import CheckpointInfo, Manifest, TensorRecord, checksum
from ..index import read_manifests

log = logging.getLogger("ckptd.writer")
HOST = socket.gethostname()


@dataclass(eq=False)
class Share:
    """One rank's part of one step. Main thread creates it; the I/O threads fill it."""

    root: Path
    run: str
    rank: int
    world_size: int
    step: int
    records: dict[str, TensorRecord] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    error: str | None = None
    reported: bool = False  # the producer was told of ``error``
    next_file: int = 0  # chunk sequence numbers, assigned by the main thread
    started: float = field(default_factory=time.monotonic)
    dir_ready: bool = False

    @property
    def dir(self) -> Path:
        return layout.step_dir(self.root, self.run, self.step)

    def new_file(self) -> str:
        name = layout.chunk_name(self.rank, self.next_file)
        self.next_file += 1
        return name


@dataclass
class Result:
    kind: str  # "freed" | "failed" | "committed" | "commit_failed" | "discarded"
    share: Share
    nbytes: int = 0
    info: CheckpointInfo | None = None
    message: str = ""
    token: Any = None  # the caller's, passed back with commit results


@dataclass
class Stream:
    """A tensor too large to batch: it gets a chunk file of its own, written as it arrives."""

    share: Share
    entry: Entry
    file: str
    fd: int = -1
    hasher: Any = None
    header_len: int = 0
    written: int = 0


class Writer:
    def __init__(self, notify: Callable[[Result], None], *, fsync: bool = True,
                 after_commit: Callable[[Share, bool], None] = lambda share, complete: None) -> None:
        self._notify = notify
        self._after_commit = after_commit  # (share, step now complete), on the syncer thread
        self._fsync = fsync
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._syncs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._loop, args=(self._jobs,), name="ckptd-writer", daemon=True),
            threading.Thread(target=self._loop, args=(self._syncs,), name="ckptd-syncer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- called by the main loop -------------------------------------------------
    def write_chunk(self, share: Share, entries: list[Entry], nbytes: int) -> None:
        self._jobs.put((self._do_chunk, (share, share.new_file(), entries, nbytes)))

    def open_stream(self, share: Share, entry: Entry) -> Stream:
        stream = Stream(share, entry, share.new_file())
        self._jobs.put((self._do_stream_open, (stream,)))
        return stream

    def stream_piece(self, stream: Stream, piece: Any, last: bool) -> None:
        self._jobs.put((self._do_stream_piece, (stream, piece, last)))

    def commit(self, share: Share, state: Any, metadata: dict, token: Any) -> None:
        # via the writer queue, so it follows every write of this share
        self._jobs.put((self._syncs.put, ((self._do_commit, (share, state, metadata, token)),)))

    def discard(self, share: Share) -> None:
        self._jobs.put((self._syncs.put, ((self._do_discard, (share,)),)))

    def close(self) -> None:
        """Finish every queued job, then stop both threads."""
        self._jobs.put(None)
        self._threads[0].join()
        self._syncs.put(None)
        self._threads[1].join()

    # -- the threads ---------------------------------------------------------------
    def _loop(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except Exception:  # a bug here must not kill the daemon's I/O
                log.exception("internal error in %s", threading.current_thread().name)

    def _fail(self, share: Share, what: str, exc: OSError) -> None:
        if share.error is None:
            share.error = f"{what}: {exc.strerror or exc}"
            log.error("run=%s step=%d rank=%d failed: %s", share.run, share.step, share.rank, share.error)

    def _ensure_dir(self, share: Share) -> None:
        if not share.dir_ready:
            layout.ensure_real_dir(share.dir, share.root)
            # Claims this rank's files for this host until the commit or discard, so
            # that another node's daemon starting on shared storage leaves them alone.
            marker = share.dir / layout.writing_marker(share.rank)
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                write_all(fd, f"{HOST}\n{os.getpid()}\n".encode())
            finally:
                os.close(fd)
            share.files.append(marker.name)
            share.dir_ready = True

    def _open(self, share: Share, name: str) -> int:
        self._ensure_dir(share)
        share.files.append(name)
        return os.open(share.dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)

    def _do_chunk(self, share: Share, name: str, entries: list[Entry], nbytes: int) -> None:
        try:
            if share.error is None:
                self._write_chunk(share, name, entries)
        finally:
            entries.clear()  # drop the received buffers before reporting them freed
            self._notify(Result("freed" if share.error is None else "failed", share, nbytes,
                                message=share.error or ""))

    def _write_chunk(self, share: Share, name: str, entries: list[Entry]) -> None:
        head = chunkfile.header(entries)
        records = {}
        fd = -1
        try:
            fd = self._open(share, name)
            chunkfile.write_buffers(fd, [head])
            offset = len(head)
            for e in entries:
                # hash each tensor just before writing it, while its bytes are in cache
                records[e.name] = TensorRecord(
                    dtype=e.dtype.name, shape=e.shape, file=name, key=e.name, offset=offset,
                    nbytes=e.nbytes, checksum=checksum(e.buffers), numpy=e.numpy,
                )
                chunkfile.write_buffers(fd, e.buffers)
                offset += e.nbytes
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            self._fail(share, f"writing {share.dir / name}", exc)
            return
        share.records.update(records)
        self._syncs.put((self._do_sync, (share, name, fd)))

    def _do_stream_open(self, stream: Stream) -> None:
        if stream.share.error is not None:
            return
        head = chunkfile.header([stream.entry])
        try:
            stream.fd = self._open(stream.share, stream.file)
            write_all(stream.fd, head)
        except OSError as exc:
            self._close_stream(stream)
            self._fail(stream.share, f"writing {stream.share.dir / stream.file}", exc)
            return
        stream.header_len = len(head)
        import xxhash

        stream.hasher = xxhash.xxh3_64()

    def _do_stream_piece(self, stream: Stream, piece: Any, last: bool) -> None:
        share, nbytes = stream.share, len(memoryview(piece))
        try:
            if share.error is None and stream.fd >= 0:
                stream.hasher.update(piece)
                chunkfile.write_buffers(stream.fd, [piece])
                stream.written += nbytes
                if last:
                    e = stream.entry
                    share.records[e.name] = TensorRecord(
                        dtype=e.dtype.name, shape=e.shape, file=stream.file, key=e.name,
                        offset=stream.header_len, nbytes=e.nbytes,
                        checksum=f"xxh3_64:{stream.hasher.hexdigest()}", numpy=e.numpy,
                    )
                    self._syncs.put((self._do_sync, (share, stream.file, stream.fd)))
                    stream.fd = -1
        except OSError as exc:
            self._close_stream(stream)
            self._fail(share, f"writing {share.dir / stream.file}", exc)
        finally:
            del piece
            if share.error is not None:
                self._close_stream(stream)
            self._notify(Result("freed" if share.error is None else "failed", share, nbytes,
                                message=share.error or ""))

    @staticmethod
    def _close_stream(stream: Stream) -> None:
        if stream.fd >= 0:
            os.close(stream.fd)
            stream.fd = -1

    def _do_sync(self, share: Share, name: str, fd: int) -> None:
        try:
            if self._fsync and share.error is None:
                os.fsync(fd)
        except OSError as exc:
            self._fail(share, f"fsync of {share.dir / name}", exc)
        finally:
            os.close(fd)

    def _do_commit(self, share: Share, state: Any, metadata: dict, token: Any) -> None:
        if share.error is None:
            try:
                info = self._write_manifest(share, state, metadata)
            except OSError as exc:
                self._fail(share, f"writing the manifest in {share.dir}", exc)
            else:
                self._notify(Result("committed", share, info=info, token=token))
                return
        self._remove_files(share)
        self._notify(Result("commit_failed", share, message=share.error or "", token=token))

    def _write_manifest(self, share: Share, state: Any, metadata: dict) -> CheckpointInfo:
        self._ensure_dir(share)  # a step with no tensors has no chunk files
        manifest = Manifest(
            run=share.run, step=share.step, rank=share.rank, world_size=share.world_size,
            time=time.time(), tensors=share.records, state=state, metadata=metadata,
        )
        path = share.dir / layout.manifest_name(share.rank)
        atomic_write(path, manifest.to_json(), fsync=self._fsync)
        try:  # committed: the claim is over (a leftover is harmless and removed at start-up)
            os.unlink(share.dir / layout.writing_marker(share.rank))
        except FileNotFoundError:
            pass
        if self._fsync:  # the step folder's own entry, and the run folder's
            fsync_dir(share.dir.parent)
            fsync_dir(share.root)
        complete = read_manifests(share.dir)
        info = CheckpointInfo.from_manifests(str(share.dir), complete or [manifest])
        # Only now, with the manifest durable: the index and the latest pointer, then
        # retention, which may delete older checkpoints.
        try:
            self._after_commit(share, complete is not None)
        except Exception:  # the commit stands; a failed clean-up must not hide it
            log.exception("after committing run=%s step=%d", share.run, share.step)
        return info

    def _do_discard(self, share: Share) -> None:
        self._remove_files(share)
        self._notify(Result("discarded", share))

    def _remove_files(self, share: Share) -> None:
        for name in share.files:
            try:
                os.unlink(share.dir / name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", share.dir / name, exc.strerror)
        share.files.clear()
        try:
            os.rmdir(share.dir)  # only if nothing else (another rank) is in it
        except OSError:
            pass
