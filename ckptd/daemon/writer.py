"""The daemon's I/O: threads that turn received tensors into durable files.

``Writer`` takes jobs from the main loop (``write_chunk``, ``open_stream``,
``commit``, ``discard``) onto one thread per storage format (``ckptd-writer``,
``ckptd-hdf5``) and an optional pool; ``ckptd-syncer`` fsyncs and writes each manifest
last; results go back through ``notify``. A format sees a share only through a
``ShareIO`` and never touches sockets; the writer never asks which format it writes.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .. import failpoints, format as formats, layout, manifestcache, replicas
from . import reuse
from ..config import Hdf5Config
from ..durable import atomic_write, fsync_dir, write_all
from ..errors import CheckpointCorrupt
from ..format import Entry, Format, Ref, Stored, Written
from ..format.fileio import BLOCK
from ..format.protocol import PieceFile
from ..index import read_manifests
from ..manifest import Checksum, CheckpointInfo, Manifest, TensorRecord, checksum
from .attempts import read_manifest
from .owners import manifest_owner
from .datafile import Bounce, DataFile, OffsetFile, Throttle
from .share import CommitToken, Result, ResultKind, Share, Stream
from .stagehold import StagingHolds

log = logging.getLogger("ckptd.writer")
HOST = socket.gethostname()


class Writer:
    def __init__(self, notify: Callable[[Result], None], *, fsync: bool = True,
                 after_commit: Callable[[Share, bool], None] = lambda share, complete: None,
                 hdf5: Hdf5Config = Hdf5Config(), direct_io: bool = True, write_rate: int = 0,
                 threads: int = 1, reuse_unchanged: bool = True, holds: StagingHolds | None = None) -> None:
        self._notify = notify
        self.holds = holds or StagingHolds()
        self._reuse = reuse_unchanged
        self._changing = reuse.Changing()
        self._committing: dict[tuple[str, int], Share] = {}
        self._committing_lock = threading.Lock()
        self._after_commit = after_commit
        self.fsync = fsync
        self.hdf5_options = hdf5
        self.direct_io = direct_io
        self._bounces = threading.local()
        self._dirs_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptd-writer") if threads > 1 else None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckptd-hash")
        self._throttle = Throttle(write_rate) if write_rate else None
        self._queues: dict[str, queue.SimpleQueue] = {f.thread: queue.SimpleQueue()
                                                      for f in formats.BY_NAME.values()}
        self._syncs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [  # closed in this order: the writers feed the syncer
            *(threading.Thread(target=self._loop, args=(jobs,), name=name, daemon=True)
              for name, jobs in self._queues.items()),
            threading.Thread(target=self._loop, args=(self._syncs,), name="ckptd-syncer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _format(share: Share) -> Format:
        return formats.get(share.id.format)

    def _jobs(self, share: Share) -> queue.SimpleQueue:
        """The queue of the thread that writes ``share``."""
        return self._queues[self._format(share).thread]

    def _io(self, share: Share) -> ShareIO:
        return ShareIO(self, share)

    def write_chunk(self, share: Share, entries: list[Entry], held: int, seqs: list[int]) -> None:
        """Write ``entries``; ``held`` bytes of them are the daemon's own memory, ``seqs``
        name the shared-memory pieces among them. Both are reported freed after.
        Their checksums are computed ahead, on ckptd-hash, while the writer writes the
        chunk before: the checksum of one chunk overlaps the write of another."""
        ahead = self._hasher.submit(_checksums, entries) if share.error is None else None
        if share.search.before is None:
            before = self._committing.get((share.run, share.rank))
            share.search.before = before if before is not share else None
        name = self._format(share).next_file(self._io(share))
        self._jobs(share).put((self._do_batch, (share, name, entries, held, seqs, ahead)))

    def splits(self, share: Share) -> bool:
        """Whether a large tensor that arrives whole goes to ``write_whole`` (else it streams)."""
        return self._pool is not None and self._format(share).parallel

    def write_whole(self, share: Share, entry: Entry, held: int, seqs: list[int]) -> None:
        """A tensor of ``chunk_size`` or more that arrived whole: a file of its own whose
        pieces the pool writes side by side (``_do_whole``), its checksum computed ahead,
        on ckptd-hash; ``held`` and ``seqs`` as ``write_chunk``'s."""
        ahead = self._hasher.submit(_checksums, [entry]) if share.error is None else None
        name = self._format(share).next_file(self._io(share))
        self._jobs(share).put((self._do_whole, (share, name, entry, held, seqs, ahead)))

    def open_stream(self, share: Share, entry: Entry) -> Stream:
        stream = Stream(share, entry, self._format(share).next_file(self._io(share)))
        self._jobs(share).put((self._do_stream_open, (stream,)))
        return stream

    def stream_piece(self, stream: Stream, piece: Any, last: bool, held: int, seqs: list[int]) -> None:
        self._jobs(stream.share).put((self._do_stream_piece, (stream, piece, last, held, seqs)))

    def link_same(self, share: Share, base_step: int, items: list[Entry]) -> None:
        """Tensors the producer declared unchanged since ``base_step`` (``frozen=``):
        refer to that step's stored copies (reuse), on the thread that writes the share."""
        self._jobs(share).put((self._do_same, (share, base_step, items)))

    def commit(self, share: Share, state: Any, metadata: dict, token: CommitToken | None) -> None:
        with self._committing_lock:
            self._committing[(share.run, share.rank)] = share
        self._after_writes(share, (self._syncs.put, ((self._do_commit, (share, state, metadata, token)),)))

    def replace_earlier(self, share: Share) -> None:
        """Before any write of ``share``: remove its rank's share of the step that an earlier
        attempt of the job committed (``ckptd.daemon.attempts``), on the thread that writes it."""
        self._jobs(share).put((self._do_replace, (share,)))

    def discard(self, share: Share) -> None:
        """Remove what was written of ``share``, on its writer thread, not the syncer: a
        step aborted and at once sent again reuses the same file names, and this thread
        writes the new files after removing the old ones."""
        self._after_writes(share, (self._do_discard, (share,)))

    def _after_writes(self, share: Share, job: tuple) -> None:
        """Queue ``job`` on the share's writer thread, after every write of the share (and
        once its format has closed its files and queued them for fsync)."""
        jobs = self._jobs(share)
        jobs.put((self._do_close, (share,)))
        jobs.put(job)

    def close(self) -> None:
        """Finish every queued job, then stop the threads."""
        for jobs, thread in zip((*self._queues.values(), self._syncs), self._threads):
            jobs.put(None)
            thread.join()
        if self._pool is not None:
            self._pool.shutdown()
        self._hasher.shutdown()

    def _loop(self, jobs: queue.SimpleQueue) -> None:
        """Run jobs until None. A bug in a job neither kills the daemon's I/O nor lets its
        share commit without what the job was writing: the commit fails, naming it."""
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except Exception as exc:
                share = next((a if isinstance(a, Share) else a.share for a in args
                              if isinstance(a, (Share, Stream))), None)
                _internal_error(share, exc)

    def _report_freed(self, share: Share, held: int, seqs: list[int]) -> None:
        """Received bytes are let go of: written, or dropped because the share failed."""
        kind = ResultKind.FREED if share.error is None else ResultKind.FAILED
        self._notify(Result(kind, share, held, seqs, message=share.error or ""))

    def fail(self, share: Share, what: str, exc: OSError) -> None:
        if share.error is None:
            share.error = f"{what}: {exc.strerror or exc}"
            log.error("run=%s step=%d rank=%d failed: %s", share.run, share.step, share.rank, share.error)

    def ensure_dir(self, share: Share) -> None:
        """Make the step folder and this rank's marker in it, under the lock that a failed
        share's clean-up takes to remove the folder once empty (``_remove_files``):
        otherwise that rmdir could come between the two and leave this rank no folder."""
        if share.written.dir_ready:
            return
        with self._dirs_lock:
            self._make_dir(share)

    def _make_dir(self, share: Share) -> None:
        """The marker claims this rank's files for this host until the commit or discard:
        another node's daemon starting on shared storage leaves them alone."""
        if not share.written.dir_ready:
            layout.ensure_real_dir(share.dir, share.id.root)
            share.written.dir_fd = layout.open_step_dir(share.dir)
            marker = layout.writing_marker(share.rank)
            fd = os.open(share.at(marker), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            share.written.files.append(marker)  # before the write: a failed step's clean-up removes it
            try:
                write_all(fd, f"{HOST}\n{os.getpid()}\n".encode())
            finally:
                os.close(fd)
            share.written.dir_ready = True

    def create_pieces(self, share: Share, name: str) -> PieceFile:
        """A new data file of ``share`` written at offsets (its folder made already)."""
        with share.written.lock:
            share.written.files.append(name)
        return OffsetFile(share.at(name), direct=self.direct_io, throttle=self._throttle)

    def create(self, share: Share, name: str, *, listed: bool = False) -> DataFile:
        """A new data file of ``share`` (O_DIRECT where it can be). ``listed``: it is in
        ``share.written.files`` already, in a folder made already (the pool's case)."""
        if not listed:
            self.ensure_dir(share)
            share.written.files.append(name)
        return DataFile.create(share.at(name), direct=self.direct_io, bounce=self._bounce(),
                               throttle=self._throttle)

    def sync(self, share: Share, name: str, fd: int) -> None:
        self._syncs.put((self._do_sync, (share, name, fd)))

    def throttled(self, nbytes: int) -> None:
        if self._throttle is not None:
            self._throttle.take(nbytes)

    def submit(self, fn: Callable[..., None], *args: Any) -> Future:
        """``fn(*args)`` on the pool, or now where there is none (``WriteIO.submit``)."""
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future = Future()
        try:
            fn(*args)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)
        return done

    def _bounce(self) -> Bounce:
        bounce = getattr(self._bounces, "buffer", None)
        if bounce is None:
            bounce = self._bounces.buffer = Bounce()
        return bounce

    def _do_batch(self, share: Share, name: str, entries: list[Entry], held: int, seqs: list[int],
                  ahead: Future | None = None) -> None:
        if self._pool is not None and share.error is None and self._format(share).parallel:
            try:
                self.ensure_dir(share)
                share.written.files.append(name)
            except OSError as exc:
                self.fail(share, f"writing {share.dir / name}", exc)
            else:
                future = self._pool.submit(self._pooled_batch, share, name, entries, held, seqs, ahead)
                share.written.inflight.append(future)
                self._syncs.put((self._await, (share, future)))
                return
        try:
            if share.error is None:
                fd = self._write_batch(share, name, entries, ahead=ahead, staged=_staged(held, seqs))
                if fd is not None:
                    self.sync(share, name, fd)
        finally:
            _settled(ahead)
            entries.clear()
            self._report_freed(share, held, seqs)

    def _pooled_batch(self, share: Share, name: str, entries: list[Entry], held: int, seqs: list[int],
                      ahead: Future | None) -> None:
        """On a pool thread: the whole file, fsync included (after its buffers are
        reported free: the producer may reuse them while the disk syncs)."""
        fd = None
        try:
            if share.error is None:
                fd = self._write_batch(share, name, entries, listed=True, ahead=ahead, staged=_staged(held, seqs))
        except Exception as exc:
            _internal_error(share, exc)
            raise
        finally:
            _settled(ahead)
            entries.clear()
            self._report_freed(share, held, seqs)
        if fd is not None:
            self._do_sync(share, name, fd)

    def _do_whole(self, share: Share, name: str, entry: Entry, held: int, seqs: list[int],
                  ahead: Future | None) -> None:
        """On the share's writer thread: the file made and its header written; its pieces
        of ``chunk_size`` go to the pool, and the syncer finishes it (``_finish_whole``)."""
        split = None
        if share.error is None:
            try:
                self.ensure_dir(share)
            except OSError as exc:
                self.fail(share, f"writing {share.dir / name}", exc)
            else:
                split = self._format(share).split(self._io(share), entry, name)
        if split is None or self._pool is None:
            _settled(ahead)
            entry.buffers.clear()
            self._report_freed(share, held, seqs)
            return
        out, key, at = split
        data = memoryview(entry.buffers[0]).cast("B") if len(entry.buffers) == 1 else \
            memoryview(b"".join(entry.buffers))
        step = max(BLOCK, share.id.chunk_size - share.id.chunk_size % BLOCK)
        futures = [self._pool.submit(self._write_piece, share, out, data[i:i + step], at + i)
                   for i in range(0, len(data), step)]
        share.written.inflight.extend(futures)
        self._syncs.put((self._finish_whole, (share, name, entry, (out, key, at), futures, held, seqs, ahead)))

    def _write_piece(self, share: Share, out: PieceFile, piece: memoryview, at: int) -> None:
        if share.error is None:
            out.write_at(piece, at)

    def _finish_whole(self, share: Share, name: str, entry: Entry, split: tuple[PieceFile, str, int],
                      futures: list[Future], held: int, seqs: list[int], ahead: Future | None) -> None:
        """On the syncer: every piece of ``_do_whole``'s file written, its record made,
        its buffers reported freed, then the file fsynced."""
        out, key, at = split
        fd = None
        try:
            for future in futures:
                exc = future.exception()
                if isinstance(exc, OSError):
                    self.fail(share, f"writing {share.dir / name}", exc)
                elif isinstance(exc, Exception):
                    _internal_error(share, exc)
            assert ahead is not None
            digests = ahead.result()
            if share.error is None:
                fd = out.finish()
                self._apply(share, name, Written([(entry, key, at)]), digests)
                if _staged(held, seqs):
                    self.holds.add(share, name, list(_at(at, entry.buffers)))
        finally:
            for future in futures:
                share.written.inflight.remove(future)
            if fd is None:
                out.close()
            _settled(ahead)
            entry.buffers.clear()
            self._report_freed(share, held, seqs)
        if fd is not None:
            self._do_sync(share, name, fd)

    @staticmethod
    def _await(share: Share, future: Future) -> None:
        """On the syncer: a pooled chunk file is written and fsynced (or failed)."""
        try:
            future.result()
        except Exception as exc:
            if share.error is None:
                _internal_error(share, exc)
        finally:
            share.written.inflight.remove(future)

    def _write_batch(self, share: Share, name: str, entries: list[Entry], *, listed: bool = False,
                     ahead: Future | None = None, staged: bool = False) -> int | None:
        """Have the share's format write ``entries`` into file ``name``; a descriptor to
        fsync and close, or None. ``listed``: the file is in ``share.written.files`` already (the
        pool's case); ``ahead``: the entries' checksums, being computed on ckptd-hash (a
        share that had failed when its batch came has none, and is not written); ``staged``:
        every buffer is a view of the producer's shared staging, which replication may send."""
        assert ahead is not None
        digests = _Ahead(ahead)
        fmt = self._format(share)
        failpoints.hit(f"writer.{fmt.name}")
        written = fmt.write_batch(self._io(share), name, entries, digests, listed=listed)
        self._apply(share, name, written, digests)
        self._learn(share, [e for e, _, _ in written.placed], digests)
        if staged and written.fd is not None:
            self.holds.add(share, name, [(at, b) for e, _, offset in written.placed if offset is not None
                                         for at, b in _at(offset, e.buffers)])
        return written.fd

    @staticmethod
    def _apply(share: Share, name: str, written: Written, digests: Mapping[str, str]) -> None:
        """The records of what a format wrote into file ``name``, in the share's."""
        records = {e.name: TensorRecord(dtype=e.dtype.name, shape=e.shape, file=name, key=key, offset=offset,
                                        nbytes=e.nbytes, checksum=digests[e.name], numpy=e.numpy, shard=e.shard)
                   for e, key, offset in written.placed}
        with share.written.lock:
            share.written.records.update(records)

    def _base(self, share: Share, at: int | None = None) -> Any:
        """The share's base (reuse.Base): found once, on first need. A step saved right
        after the one before may arrive while that one commits: its base is that step,
        so wait for the commit (it is queued on the syncer already, ahead of this)."""
        with share.search.lock:
            if not share.search.sought:
                share.search.sought = True
                before, share.search.before = share.search.before, None
                if before is not None and before.step < share.step \
                        and not before.settled.wait(SETTLE_TIMEOUT_S):
                    log.warning("run=%s step=%d rank=%d: step %d is still committing after %.0f s; not waiting "
                                "to refer to it", share.run, share.step, share.rank, before.step, SETTLE_TIMEOUT_S)
                self.ensure_dir(share)
                share.search.base = reuse.Base.find(share.id.root, share.run, share.rank, share.step, share.id.world_size,
                                             share.id.format, at=at)
            return share.search.base

    def recognise(self, share: Share, entries: list[Entry], digests: Mapping[str, str]) -> list[Entry]:
        """Refer to the base's copy of each entry unchanged since it (``digests``: their
        checksums); return the others, to write."""
        if not self._reuse:
            return entries
        ask, left = self._changing.split(share, entries)
        if not ask:
            return entries
        base = self._base(share)
        if base is None:
            return entries
        for e in ask:
            old = base.match(e)
            if old is not None and digests[e.name] == old.checksum:
                try:
                    self._refer(share, base, e.name, old, received=True)
                    continue
                except OSError as exc:
                    log.warning("run=%s step=%d rank=%d: writing %r again: %s", share.run, share.step,
                                share.rank, e.name, exc)
            left.append(e)
        return left

    def _learn(self, share: Share, written: list[Entry], digests: Mapping[str, str]) -> None:
        """Which of the tensors just written changed since the base (``reuse.Changing``)."""
        if self._reuse and written and (base := self._base(share)) is not None:
            self._changing.learn(base, share, written, digests)

    def _refer(self, share: Share, base: Any, name: str, old: TensorRecord, received: bool = False) -> None:
        """Tensor ``name`` is ``old``, stored in ``base``: the share's format links or
        copies it, now (a record) or at the commit (a reference: ``_place_refs``)."""
        referred = self._format(share).refer(self._io(share), base, name, old)
        with share.written.lock:
            share.written.recognised += old.nbytes if received else 0
            if isinstance(referred, Ref):
                share.written.refs.append(referred)
            else:
                share.written.records[name] = referred
                share.written.reused += referred.nbytes

    def _place_refs(self, share: Share) -> None:
        """On the syncer, before the manifest: the share's stored copies, linked or copied
        into its folder by its format (``Format.place``)."""
        refs, share.written.refs = share.written.refs, []
        records, linked, copied = self._format(share).place(self._io(share), refs)
        share.written.records.update(records)
        share.written.reused += linked
        share.written.copied += copied

    def _do_same(self, share: Share, base_step: int, items: list[Entry]) -> None:
        if share.error is not None:
            return
        own = None
        try:
            base = self._base(share, at=base_step)
            if base is None or base.step != base_step:
                base = own = reuse.Base.find(share.id.root, share.run, share.rank, share.step, share.id.world_size,
                                             share.id.format, at=base_step)
            if base is None:
                raise _NotThere(f"step {base_step}, where the producer last committed them, holds no share "
                                f"of rank {share.rank} in {share.id.format} format (deleted?)")
            if own is not None:
                share.search.bases.append(own)
                own = None
            for e in items:
                old = base.match(e)
                if old is None:
                    raise _NotThere(f"tensor {e.name!r} ({e.dtype.name}{e.shape}) is not in step {base_step} "
                                    "as the same kind of tensor")
                self._refer(share, base, e.name, old)
        except _NotThere as exc:
            share.error = (f"frozen tensors cannot refer to their stored copy: {exc}; the producer sends "
                           "them again with its next save")
            log.error("run=%s step=%d rank=%d failed: %s", share.run, share.step, share.rank, share.error)
        except OSError as exc:
            self.fail(share, f"linking frozen tensors into {share.dir}", exc)
        finally:
            if own is not None:
                own.close()

    def _do_stream_open(self, stream: Stream) -> None:
        if stream.share.error is not None:
            return
        stream.out = self._format(stream.share).open_stream(self._io(stream.share), stream.entry, stream.file)
        if stream.out is not None:
            stream.hasher = Checksum()

    def _do_stream_piece(self, stream: Stream, piece: Any, last: bool, held: int, seqs: list[int]) -> None:
        share, fmt = stream.share, self._format(stream.share)
        try:
            if share.error is None and stream.out is not None:
                assert stream.hasher is not None
                stream.hasher.update(piece)
                where = fmt.stream_piece(self._io(share), stream.out, piece, last)
                if stream.note(piece, staged=_staged(held, seqs)):
                    self.holds.add(share, stream.file, [])
                if where is not None:
                    stream.out = None
                    if where[1] is not None and stream.pieces is not None:
                        self.holds.add(share, stream.file, list(_at(where[1], stream.pieces)))
                    e = stream.entry
                    share.written.records[e.name] = TensorRecord(
                        dtype=e.dtype.name, shape=e.shape, file=stream.file, key=where[0], offset=where[1],
                        nbytes=e.nbytes, checksum=stream.hasher.text(), numpy=e.numpy, shard=e.shard)
        except OSError as exc:
            self.fail(share, f"writing {share.dir / stream.file}", exc)
        finally:
            if share.error is not None and stream.out is not None:
                out, stream.out = stream.out, None
                fmt.drop_stream(out)
            del piece
            self._report_freed(share, held, seqs)

    def _do_close(self, share: Share) -> None:
        """Before a commit or discard: the format finishes the share's open files."""
        self._format(share).close(self._io(share))

    def _do_sync(self, share: Share, name: str, fd: int) -> None:
        try:
            if self.fsync and share.error is None:
                os.fsync(fd)
        except OSError as exc:
            self.fail(share, f"fsync of {share.dir / name}", exc)
        finally:
            os.close(fd)

    def _do_commit(self, share: Share, state: Any, metadata: dict, token: CommitToken | None) -> None:
        share.search.before = None
        key = (share.run, share.rank)
        with self._committing_lock:
            if self._committing.get(key) is share:
                del self._committing[key]
        if share.error is None and share.written.refs:
            try:
                self._place_refs(share)
            except OSError as exc:
                self.fail(share, f"placing unchanged tensors in {share.dir}", exc)
        if share.error is None:
            try:
                info = self._write_manifest(share, state, metadata)
            except OSError as exc:
                self.fail(share, f"writing the manifest in {share.dir}", exc)
            except Exception as exc:
                log.exception("committing run=%s step=%d rank=%d", share.run, share.step, share.rank)
                share.error = share.error or f"internal error while committing: {type(exc).__name__}: {exc}"
            else:
                share.close_dir()
                share.settled.set()
                self._notify(Result(ResultKind.COMMITTED, share, info=info, token=token))
                return
        self._remove_files(share)
        share.settled.set()
        self._notify(Result(ResultKind.COMMIT_FAILED, share, message=share.error or "", token=token))

    def _write_manifest(self, share: Share, state: Any, metadata: dict) -> CheckpointInfo:
        self.ensure_dir(share)
        data_files = {r.file for r in share.written.records.values()}
        manifest = Manifest(
            run=share.run, step=share.step, rank=share.rank, world_size=share.id.world_size,
            time=time.time(), tensors=share.written.records, state=state, metadata=metadata,
            format=share.id.format, files={f: os.stat(share.at(f)).st_size for f in sorted(data_files)},
            attempt=share.id.attempt,
            written_by=share.declared.written_by, replica_digests=share.declared.digests, host=share.id.host,
            compare_replicas=share.declared.compare, due=share.declared.due,
            owner=manifest_owner(share.id.root, share.run),
        )
        atomic_write(share.at(layout.manifest_name(share.rank)), manifest.to_json(), fsync=self.fsync)
        manifestcache.remember(share.at(layout.manifest_name(share.rank)), manifest)
        try:
            os.unlink(share.at(layout.writing_marker(share.rank)))
        except FileNotFoundError:
            pass
        if self.fsync:
            fsync_dir(share.dir.parent)
            fsync_dir(share.id.root)
        try:
            complete = read_manifests(share.dir)
        except CheckpointCorrupt as exc:
            log.warning("run=%s step=%d is not complete: %s", share.run, share.step, exc)
            complete = None
        info = CheckpointInfo.from_manifests(str(share.dir), complete or [manifest])
        if info.diverged and complete and manifest.time >= info.time:
            share.mismatches = replicas.report(complete, info)
        self.holds.committed(share)  # before the tiers hear of it: replication finds its staging
        # Only now, with the manifest durable: the index and the latest pointer, then
        # retention, which may delete older checkpoints.
        try:
            self._after_commit(share, complete is not None)
        except Exception:
            log.exception("after committing run=%s step=%d", share.run, share.step)
        return info

    def _do_replace(self, share: Share) -> None:
        name = layout.manifest_name(share.rank)
        try:
            old = read_manifest(share.dir, name)
            if old is None or old.attempt == share.id.attempt:
                return
            fd = layout.open_step_dir(share.dir)
            try:
                os.unlink(name, dir_fd=fd)  # first: from now on no manifest names the old files
                if self.fsync:
                    os.fsync(fd)
                for file in sorted({t.file for t in old.tensors.values()} | set(old.files)):
                    try:
                        os.unlink(file, dir_fd=fd)
                    except FileNotFoundError:
                        pass
            finally:
                os.close(fd)
        except (OSError, CheckpointCorrupt) as exc:
            if share.error is None:
                share.error = f"replacing the share of an earlier attempt in {share.dir}: {exc}"
                log.error("run=%s step=%d rank=%d failed: %s", share.run, share.step, share.rank, share.error)
            return
        log.info("run=%s step=%d rank=%d: the share of attempt %s (the step never became complete) is "
                 "replaced by attempt %s's", share.run, share.step, share.rank, old.attempt, share.id.attempt)

    def _do_discard(self, share: Share) -> None:
        for future in list(share.written.inflight):
            future.exception()
        self._remove_files(share)
        self._notify(Result(ResultKind.DISCARDED, share))

    def _remove_files(self, share: Share) -> None:
        """Remove the share's files relative to the run and step folders, each opened
        without following a symlink: one planted in the root is never removed through."""
        try:
            run_fd = layout.open_real_dir(share.dir.parent)
        except OSError:
            share.written.files.clear()
            share.close_dir()
            return
        try:
            step_fd = layout.open_real_dir(share.dir.name, dir_fd=run_fd)
        except OSError:
            step_fd = -1
        for name in share.written.files if step_fd >= 0 else ():
            try:
                os.unlink(name, dir_fd=step_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", share.dir / name, exc.strerror)
        share.written.files.clear()
        share.close_dir()
        if step_fd >= 0:
            os.close(step_fd)
            try:
                with self._dirs_lock:
                    os.rmdir(share.dir.name, dir_fd=run_fd)
            except OSError:
                pass
        os.close(run_fd)


class ShareIO:
    """One share as its format sees it (``format.WriteIO``): where it is written, and the
    writer's services for it. Made for each call; the format keeps none of it but ``kept``."""

    __slots__ = ("_writer", "_share", "run", "step", "rank", "chunk_size", "direct_io", "fsync", "hdf5_options")

    def __init__(self, writer: Writer, share: Share) -> None:
        self._writer, self._share = writer, share
        self.run, self.step, self.rank, self.chunk_size = share.run, share.step, share.rank, share.id.chunk_size
        self.direct_io, self.fsync, self.hdf5_options = writer.direct_io, writer.fsync, writer.hdf5_options

    @property
    def dir(self) -> Path:
        return self._share.dir

    @property
    def kept(self) -> Any:
        return self._share.written.kept

    @kept.setter
    def kept(self, value: Any) -> None:
        self._share.written.kept = value

    @property
    def failed(self) -> bool:
        return self._share.error is not None

    def at(self, name: str) -> str:
        return self._share.at(name)

    def next_seq(self) -> int:
        return self._share.next_seq()

    def ensure_dir(self) -> None:
        self._writer.ensure_dir(self._share)

    def create(self, name: str, *, listed: bool = False) -> DataFile:
        return self._writer.create(self._share, name, listed=listed)

    def create_pieces(self, name: str) -> PieceFile:
        return self._writer.create_pieces(self._share, name)

    def create_plain(self, name: str) -> int:
        self.listed(name)
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                       dir_fd=self._share.written.dir_fd)

    def listed(self, name: str) -> None:
        with self._share.written.lock:
            self._share.written.files.append(name)

    def link(self, base: Stored, file: str) -> str:
        fmt = self._writer._format(self._share)
        assert isinstance(base, reuse.Base)
        return base.link_file(self._share, file, lambda: fmt.link_name(self, base.step, file))

    def recognise(self, entries: list[Entry], digests: Mapping[str, str]) -> list[Entry]:
        return self._writer.recognise(self._share, entries, digests)

    def throttled(self, nbytes: int) -> None:
        self._writer.throttled(nbytes)

    def submit(self, fn: Callable[..., None], *args: Any) -> Future:
        return self._writer.submit(fn, *args)

    def sync(self, name: str, fd: int) -> None:
        self._writer.sync(self._share, name, fd)

    def fail(self, what: str, exc: OSError) -> None:
        self._writer.fail(self._share, what, exc)


SETTLE_TIMEOUT_S = 60.0  # the longest a share's first write waits for the step before to commit


def _staged(held: int, seqs: list[int]) -> bool:
    """Whether a write's buffers are all views of shared staging (none the daemon's own)."""
    return held == 0 and bool(seqs)


def _at(offset: int, buffers: list[Any]) -> Iterator[tuple[int, Any]]:
    """Each of ``buffers``, written one after another from ``offset``, with its offset."""
    for b in buffers:
        yield offset, b
        offset += memoryview(b).nbytes


def _checksums(entries: list[Entry]) -> dict[str, str]:
    """On ckptd-hash: each entry's checksum."""
    failpoints.hit("writer.hash")
    return {e.name: checksum(e.buffers) for e in entries}


class _Ahead(Mapping[str, str]):
    """The checksums of a batch, being computed on ckptd-hash, waited for when one is
    read: a batch that nothing can be recognised in is written while they are computed."""

    def __init__(self, ahead: Future) -> None:
        self._ahead = ahead

    def __getitem__(self, name: str) -> str:
        return self._ahead.result()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ahead.result())

    def __len__(self) -> int:
        return len(self._ahead.result())


def _settled(ahead: Future | None) -> None:
    """Wait until ``ahead`` has finished with the buffers it reads (its outcome aside)."""
    if ahead is not None:
        ahead.exception()


class _NotThere(Exception):
    """A tensor declared unchanged has no stored copy to refer to."""


def _internal_error(share: Share | None, exc: Exception) -> None:
    """A bug on one of the writer's threads: log it with its traceback, and fail
    ``share`` (unless it failed already) naming the thread and the exception."""
    thread = threading.current_thread().name
    log.exception("internal error in %s", thread)
    if share is not None and share.error is None:
        share.error = (f"internal error in the daemon's {thread} thread: {type(exc).__name__}: {exc} "
                       "(its log has the traceback)")
