"""The daemon's I/O: threads that turn received tensors into durable files.

    main loop --jobs--> ckptd-writer (chunk files) --fds, commits--> ckptd-syncer
        ^       \\-jobs--> ckptd-hdf5 (HDF5 files) --fds, commits--/      |
        +------- results (bytes freed, failures, commits) --------------+

What is written, and how, is the share's storage format's (``ckptd.format``): this
module keeps the threads, the queues, the unchanged tensors' bookkeeping and the
commit, and asks the format to write a batch, a streamed piece or a reference, and
to finish its files before the commit; it never tests which format a share is in.
A format sees a share only through a ``ShareIO`` (where to write, and the writer's
services) and returns what it wrote (placements, records, references), which the
writer applies to the share here.

The writers write (O_DIRECT, or to the page cache); the syncer fsyncs and, last,
writes the manifest. A chunk of small tensors is checksummed as soon as the main
loop hands it over, on ``ckptd-hash``, so that its checksums are computed while
the writer writes the chunk before it (and are known before the chunk is written,
which recognising unchanged tensors needs: ckptd.daemon.reuse); a streamed tensor
is checksummed piece by piece as it is written. The queues are FIFO, so a commit runs only after every write
of its step has been fsynced, and writing chunk k+1 overlaps the fsync of chunk k.
With ``[daemon] writer_threads`` > 1, ckptd-writer hands each whole chunk file to a
pool (``ckptd-writer-N``) that checksums, writes and fsyncs it, and queues the
job's future for the syncer instead of the descriptor: chunk files are written
side by side (the checksum of one overlaps the write of another; a fast device
sees several writes in flight), and the syncer still commits only after every
one of its share's futures is done.
A share goes to the writer thread its format names. HDF5 has its own thread, which does
nothing else, so that a slow file (gzip) never delays chunk files, and h5py's
global lock is only ever taken there (docs/design.md says why a thread, not a
process). Nothing here touches sockets; results go back through ``notify``.
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
from typing import Any, Callable

from .. import format as formats, layout, manifestcache, replicas
from . import failpoints, reuse
from ..config import Hdf5Config
from ..durable import atomic_write, fsync_dir, write_all
from ..errors import CheckpointCorrupt
from ..format import Entry, Format, Ref, Stored, Written
from ..index import read_manifests
from ..manifest import Checksum, CheckpointInfo, Manifest, TensorRecord, checksum
from .attempts import read_manifest
from .datafile import Bounce, DataFile, Throttle
from .share import Result, Share, Stream

log = logging.getLogger("ckptd.writer")
HOST = socket.gethostname()


class Writer:
    def __init__(self, notify: Callable[[Result], None], *, fsync: bool = True,
                 after_commit: Callable[[Share, bool], None] = lambda share, complete: None,
                 hdf5: Hdf5Config = Hdf5Config(), direct_io: bool = True, write_rate: int = 0,
                 threads: int = 1, reuse_unchanged: bool = True) -> None:
        self._notify = notify
        self._reuse = reuse_unchanged  # recognise tensors unchanged since the base step (reuse)
        self._committing: dict[tuple[str, int], Share] = {}  # (run, rank) -> its share committed last
        self._committing_lock = threading.Lock()  # the main loop sets, the syncer clears
        self._after_commit = after_commit  # (share, step now complete), on the syncer thread
        self.fsync = fsync  # (format.WriteIO)
        self.hdf5_options = hdf5  # (format.WriteIO)
        self.direct_io = direct_io
        self._bounces = threading.local()  # each writing thread's bounce buffer, for O_DIRECT writes
        self._dirs_lock = threading.Lock()  # a step folder is made, or removed once empty, by one thread at a time
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptd-writer") if threads > 1 else None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckptd-hash")
        self._throttle = Throttle(write_rate) if write_rate else None
        # one thread per name a format gives (format.Format.thread), all started now
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
        return formats.get(share.format)

    def _jobs(self, share: Share) -> queue.SimpleQueue:
        """The queue of the thread that writes ``share``."""
        return self._queues[self._format(share).thread]

    # -- called by the main loop -------------------------------------------------
    def _io(self, share: Share) -> ShareIO:
        return ShareIO(self, share)

    def write_chunk(self, share: Share, entries: list[Entry], held: int, seqs: list[int]) -> None:
        """Write ``entries``; ``held`` bytes of them are the daemon's own memory, ``seqs``
        name the shared-memory pieces among them. Both are reported freed after."""
        # Checksummed ahead, on ckptd-hash, while the writer writes the chunk before it:
        # the checksum of one chunk overlaps the write of another (both release the GIL).
        # (entries is cleared only once the job is done: _settled)
        ahead = self._hasher.submit(_checksums, entries) if share.error is None else None
        if share.before is None:
            before = self._committing.get((share.run, share.rank))
            share.before = before if before is not share else None
        name = self._format(share).next_file(self._io(share))  # named here, in the order they came
        self._jobs(share).put((self._do_batch, (share, name, entries, held, seqs, ahead)))

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

    def commit(self, share: Share, state: Any, metadata: dict, token: Any) -> None:
        with self._committing_lock:
            self._committing[(share.run, share.rank)] = share  # a base for the next step (_base)
        # via the share's writer queue, so it follows every write of this share
        self._after_writes(share, (self._syncs.put, ((self._do_commit, (share, state, metadata, token)),)))

    def replace_earlier(self, share: Share) -> None:
        """Before any write of ``share``: remove its rank's share of the step that an earlier
        attempt of the job committed (``ckptd.daemon.attempts``), on the thread that writes it."""
        self._jobs(share).put((self._do_replace, (share,)))

    def discard(self, share: Share) -> None:
        # On the writer thread itself, not the syncer: a step aborted and at once sent
        # again reuses the same file names, and its new files are written by this
        # thread; removing the old ones later, from the syncer, removed the new ones.
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
            self._pool.shutdown()  # idle by now: the syncer has awaited every job
        self._hasher.shutdown()

    # -- the threads ---------------------------------------------------------------
    def _loop(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except Exception as exc:  # a bug here must not kill the daemon's I/O ...
                # ... nor let the share commit without what the job was writing: its
                # commit, queued behind this job, fails naming the error
                share = next((a if isinstance(a, Share) else a.share for a in args
                              if isinstance(a, (Share, Stream))), None)
                _internal_error(share, exc)

    def _report_freed(self, share: Share, held: int, seqs: list[int]) -> None:
        """Received bytes are let go of: written, or dropped because the share failed."""
        kind = "freed" if share.error is None else "failed"
        self._notify(Result(kind, share, held, seqs, message=share.error or ""))

    # -- what the formats ask of the writer (through ShareIO), on its threads ----------------
    def fail(self, share: Share, what: str, exc: OSError) -> None:
        if share.error is None:
            share.error = f"{what}: {exc.strerror or exc}"
            log.error("run=%s step=%d rank=%d failed: %s", share.run, share.step, share.rank, share.error)

    def ensure_dir(self, share: Share) -> None:
        if share.dir_ready:
            return
        # Under the lock a failed share's clean-up takes to remove the folder once empty
        # (_remove_files): between this making (or finding) the folder and writing the
        # marker below into it, that rmdir could succeed, and this rank's files then had
        # no folder ("No such file or directory" for a rank whose own share was fine).
        with self._dirs_lock:
            self._make_dir(share)

    def _make_dir(self, share: Share) -> None:
        if not share.dir_ready:
            layout.ensure_real_dir(share.dir, share.root)
            share.dir_fd = layout.open_step_dir(share.dir)  # from now on, files are made through it
            # Claims this rank's files for this host until the commit or discard, so
            # that another node's daemon starting on shared storage leaves them alone.
            marker = layout.writing_marker(share.rank)
            fd = os.open(share.at(marker), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            share.files.append(marker)  # now: a full disk fails the write below, and the
            try:                              # failed step's clean-up must still remove it
                write_all(fd, f"{HOST}\n{os.getpid()}\n".encode())
            finally:
                os.close(fd)
            share.dir_ready = True

    def create(self, share: Share, name: str, *, listed: bool = False) -> DataFile:
        """A new data file of ``share`` (O_DIRECT where it can be). ``listed``: it is in
        ``share.files`` already, in a folder made already (the pool's case)."""
        if not listed:
            self.ensure_dir(share)
            share.files.append(name)
        return DataFile.create(share.at(name), direct=self.direct_io, bounce=self._bounce(),
                               throttle=self._throttle)

    def sync(self, share: Share, name: str, fd: int) -> None:
        self._syncs.put((self._do_sync, (share, name, fd)))

    def throttled(self, nbytes: int) -> None:
        if self._throttle is not None:
            self._throttle.take(nbytes)

    def _bounce(self) -> Bounce:
        bounce = getattr(self._bounces, "buffer", None)
        if bounce is None:
            bounce = self._bounces.buffer = Bounce()
        return bounce

    # -- the threads' jobs -----------------------------------------------------------------
    def _do_batch(self, share: Share, name: str, entries: list[Entry], held: int, seqs: list[int],
                  ahead: Future | None = None) -> None:
        if self._pool is not None and share.error is None and self._format(share).parallel:
            try:
                self.ensure_dir(share)  # here, once: the pool's threads only make files in it
                share.files.append(name)  # (in order, before any pool thread appends)
            except OSError as exc:
                self.fail(share, f"writing {share.dir / name}", exc)
            else:
                future = self._pool.submit(self._pooled_batch, share, name, entries, held, seqs, ahead)
                share.inflight.append(future)
                self._syncs.put((self._await, (share, future)))
                return
        try:
            if share.error is None:
                fd = self._write_batch(share, name, entries, ahead=ahead)
                if fd is not None:
                    self.sync(share, name, fd)
        finally:
            _settled(ahead)  # ckptd-hash is done with the buffers too
            entries.clear()  # drop the received buffers before reporting them freed
            self._report_freed(share, held, seqs)

    def _pooled_batch(self, share: Share, name: str, entries: list[Entry], held: int, seqs: list[int],
                      ahead: Future | None) -> None:
        """On a pool thread: the whole file, fsync included (after its buffers are
        reported free: the producer may reuse them while the disk syncs)."""
        fd = None
        try:
            if share.error is None:
                fd = self._write_batch(share, name, entries, listed=True, ahead=ahead)
        except Exception as exc:  # a bug: named as on the writer's own threads (_loop), before the report
            _internal_error(share, exc)
            raise  # the syncer's _await sees the job failed: the share does not commit
        finally:
            _settled(ahead)
            entries.clear()
            self._report_freed(share, held, seqs)
        if fd is not None:
            self._do_sync(share, name, fd)

    @staticmethod
    def _await(share: Share, future: Future) -> None:
        """On the syncer: a pooled chunk file is written and fsynced (or failed)."""
        try:
            future.result()
        except Exception as exc:  # a bug in the job (logged and named there); the share must not commit
            if share.error is None:
                _internal_error(share, exc)
        finally:
            share.inflight.remove(future)

    def _write_batch(self, share: Share, name: str, entries: list[Entry], *, listed: bool = False,
                     ahead: Future | None = None) -> int | None:
        """Have the share's format write ``entries`` into file ``name``; a descriptor to
        fsync and close, or None. ``listed``: the file is in ``share.files`` already (the
        pool's case); ``ahead``: the entries' checksums, being computed on ckptd-hash (a
        share that had failed when its batch came has none, and is not written)."""
        assert ahead is not None
        digests = ahead.result()
        fmt = self._format(share)
        failpoints.hit(f"writer.{fmt.name}")
        written = fmt.write_batch(self._io(share), name, entries, digests, listed=listed)
        self._apply(share, name, written, digests)
        return written.fd

    @staticmethod
    def _apply(share: Share, name: str, written: Written, digests: dict[str, str]) -> None:
        """The records of what a format wrote into file ``name``, in the share's."""
        records = {e.name: TensorRecord(dtype=e.dtype.name, shape=e.shape, file=name, key=key, offset=offset,
                                        nbytes=e.nbytes, checksum=digests[e.name], numpy=e.numpy, shard=e.shard)
                   for e, key, offset in written.placed}
        with share.lock:
            share.records.update(records)

    # -- reuse: tensors stored already, in the base step ---------------------------------
    def _base(self, share: Share, at: int | None = None) -> Any:
        """The share's base (reuse.Base): found once, on first need. A step saved right
        after the one before may arrive while that one commits: its base is that step,
        so wait for the commit (it is queued on the syncer already, ahead of this)."""
        with share._seeking:
            if not share.base_sought:
                share.base_sought = True
                before, share.before = share.before, None  # (no chain of shares kept alive)
                if before is not None and before.step < share.step \
                        and not before.settled.wait(SETTLE_TIMEOUT_S):
                    log.warning("run=%s step=%d rank=%d: step %d is still committing after %.0f s; not waiting "
                                "to refer to it", share.run, share.step, share.rank, before.step, SETTLE_TIMEOUT_S)
                self.ensure_dir(share)
                share.base = reuse.Base.find(share.root, share.run, share.rank, share.step, share.world_size,
                                             share.format, at=at)
            return share.base

    def recognise(self, share: Share, entries: list[Entry], digests: dict[str, str]) -> list[Entry]:
        """Refer to the base's copy of each entry unchanged since it (``digests``: their
        checksums); return the others, to write."""
        if not self._reuse:
            return entries
        base = self._base(share)
        if base is None:
            return entries
        left = []
        for e in entries:
            old = base.match(e)
            if old is not None and digests[e.name] == old.checksum:
                try:
                    self._refer(share, base, e.name, old, received=True)
                    continue
                except OSError as exc:  # the base went away meanwhile: the bytes are here
                    log.warning("run=%s step=%d rank=%d: writing %r again: %s", share.run, share.step,
                                share.rank, e.name, exc)
            left.append(e)
        return left

    def _refer(self, share: Share, base: Any, name: str, old: TensorRecord, received: bool = False) -> None:
        """Tensor ``name`` is ``old``, stored in ``base``: the share's format links or
        copies it, now (a record) or at the commit (a reference: ``_place_refs``)."""
        referred = self._format(share).refer(self._io(share), base, name, old)
        with share.lock:
            share.recognised += old.nbytes if received else 0
            if isinstance(referred, Ref):
                share.refs.append(referred)
            else:
                share.records[name] = referred
                share.reused += referred.nbytes

    def _place_refs(self, share: Share) -> None:
        """On the syncer, before the manifest: the share's stored copies, linked or copied
        into its folder by its format (``Format.place``)."""
        refs, share.refs = share.refs, []
        records, linked, copied = self._format(share).place(self._io(share), refs)
        share.records.update(records)
        share.reused += linked
        share.copied += copied

    def _do_same(self, share: Share, base_step: int, items: list[Entry]) -> None:
        if share.error is not None:
            return
        own = None  # a base of their own, where the share's (recognition's) is another step
        try:
            base = self._base(share, at=base_step)
            if base is None or base.step != base_step:
                base = own = reuse.Base.find(share.root, share.run, share.rank, share.step, share.world_size,
                                             share.format, at=base_step)
            if base is None:
                raise _NotThere(f"step {base_step}, where the producer last committed them, holds no share "
                                f"of rank {share.rank} in {share.format} format (deleted?)")
            if own is not None:  # its tensors refer to it until the commit
                share.bases.append(own)
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
                if where is not None:  # the last piece: the tensor is whole
                    stream.out = None
                    e = stream.entry
                    share.records[e.name] = TensorRecord(
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

    def _do_commit(self, share: Share, state: Any, metadata: dict, token: Any) -> None:
        share.before = None
        key = (share.run, share.rank)
        with self._committing_lock:
            if self._committing.get(key) is share:  # settled below: nobody need wait for it
                del self._committing[key]
        if share.error is None and share.refs:
            try:
                self._place_refs(share)
            except OSError as exc:
                self.fail(share, f"placing unchanged tensors in {share.dir}", exc)
        if share.error is None:
            try:
                info = self._write_manifest(share, state, metadata)
            except OSError as exc:
                self.fail(share, f"writing the manifest in {share.dir}", exc)
            except Exception as exc:  # a bug: the commit must still be answered, as failed
                log.exception("committing run=%s step=%d rank=%d", share.run, share.step, share.rank)
                share.error = share.error or f"internal error while committing: {type(exc).__name__}: {exc}"
            else:
                share.close_dir()
                share.settled.set()
                self._notify(Result("committed", share, info=info, token=token))
                return
        self._remove_files(share)
        share.settled.set()
        self._notify(Result("commit_failed", share, message=share.error or "", token=token))

    def _write_manifest(self, share: Share, state: Any, metadata: dict) -> CheckpointInfo:
        self.ensure_dir(share)  # a step with no tensors has no data files
        data_files = {r.file for r in share.records.values()}
        manifest = Manifest(
            run=share.run, step=share.step, rank=share.rank, world_size=share.world_size,
            time=time.time(), tensors=share.records, state=state, metadata=metadata,
            format=share.format, files={f: os.stat(share.at(f)).st_size for f in sorted(data_files)},
            attempt=share.attempt,
            replicas=share.replicas, replica_digests=share.replica_digests, host=share.host,
            compare_replicas=share.compare_replicas,
        )
        atomic_write(share.at(layout.manifest_name(share.rank)), manifest.to_json(), fsync=self.fsync)
        manifestcache.remember(share.at(layout.manifest_name(share.rank)), manifest)  # read back below
        try:  # committed: the claim is over (a leftover is harmless and removed at start-up)
            os.unlink(share.at(layout.writing_marker(share.rank)))
        except FileNotFoundError:
            pass
        if self.fsync:  # the step folder's own entry, and the run folder's
            fsync_dir(share.dir.parent)
            fsync_dir(share.root)
        try:
            complete = read_manifests(share.dir)
        except CheckpointCorrupt as exc:  # another rank's manifest is damaged; this commit stands
            log.warning("run=%s step=%d is not complete: %s", share.run, share.step, exc)
            complete = None
        info = CheckpointInfo.from_manifests(str(share.dir), complete or [manifest])
        if info.diverged and complete and manifest.time >= info.time:  # reported once: by the last share
            share.mismatches = replicas.report(complete, info)
        # Only now, with the manifest durable: the index and the latest pointer, then
        # retention, which may delete older checkpoints.
        try:
            self._after_commit(share, complete is not None)
        except Exception:  # the commit stands; a failed clean-up must not hide it
            log.exception("after committing run=%s step=%d", share.run, share.step)
        return info

    def _do_replace(self, share: Share) -> None:
        name = layout.manifest_name(share.rank)
        try:
            old = read_manifest(share.dir, name)
            if old is None or old.attempt == share.attempt:
                return
            fd = layout.open_step_dir(share.dir)
            try:
                os.unlink(name, dir_fd=fd)  # first: from now on no manifest names the old files
                if self.fsync:
                    os.fsync(fd)
                for file in sorted({t.file for t in old.tensors.values()} | set(old.files)):
                    try:
                        os.unlink(file, dir_fd=fd)  # this rank's own files: the manifest's parser checked
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
                 "replaced by attempt %s's", share.run, share.step, share.rank, old.attempt, share.attempt)

    def _do_discard(self, share: Share) -> None:
        for future in list(share.inflight):  # its files still being written by the pool
            future.exception()
        self._remove_files(share)
        self._notify(Result("discarded", share))

    def _remove_files(self, share: Share) -> None:
        # Relative to the run and step folders, each opened without following a symlink:
        # one planted in the root is never removed through (docs/reliability.md).
        try:
            run_fd = layout.open_real_dir(share.dir.parent)
        except OSError:  # never made, or not a real folder: nothing of ours is in it
            share.files.clear()
            share.close_dir()
            return
        try:
            step_fd = layout.open_real_dir(share.dir.name, dir_fd=run_fd)
        except OSError:
            step_fd = -1
        for name in share.files if step_fd >= 0 else ():
            try:
                os.unlink(name, dir_fd=step_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", share.dir / name, exc.strerror)
        share.files.clear()
        share.close_dir()
        if step_fd >= 0:
            os.close(step_fd)
            try:
                with self._dirs_lock:  # never between another share's making it and its first file
                    os.rmdir(share.dir.name, dir_fd=run_fd)  # only if nothing else (another rank) is in it
            except OSError:
                pass
        os.close(run_fd)


class ShareIO:
    """One share as its format sees it (``format.WriteIO``): where it is written, and the
    writer's services for it. Made for each call; the format keeps none of it but ``kept``."""

    __slots__ = ("_writer", "_share", "run", "step", "rank", "chunk_size", "direct_io", "fsync", "hdf5_options")

    def __init__(self, writer: Writer, share: Share) -> None:
        self._writer, self._share = writer, share
        self.run, self.step, self.rank, self.chunk_size = share.run, share.step, share.rank, share.chunk_size
        self.direct_io, self.fsync, self.hdf5_options = writer.direct_io, writer.fsync, writer.hdf5_options

    @property
    def dir(self) -> Path:
        return self._share.dir

    @property
    def kept(self) -> Any:
        return self._share.kept

    @kept.setter
    def kept(self, value: Any) -> None:
        self._share.kept = value

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

    def create_plain(self, name: str) -> int:
        self.listed(name)  # before it exists: a failed step removes it
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                       dir_fd=self._share.dir_fd)

    def listed(self, name: str) -> None:
        with self._share.lock:
            self._share.files.append(name)

    def link(self, base: Stored, file: str) -> str:
        fmt = self._writer._format(self._share)
        assert isinstance(base, reuse.Base)
        return base.link_file(self._share, file, lambda: fmt.link_name(self, base.step, file))

    def recognise(self, entries: list[Entry], digests: dict[str, str]) -> list[Entry]:
        return self._writer.recognise(self._share, entries, digests)

    def throttled(self, nbytes: int) -> None:
        self._writer.throttled(nbytes)

    def sync(self, name: str, fd: int) -> None:
        self._writer.sync(self._share, name, fd)

    def fail(self, what: str, exc: OSError) -> None:
        self._writer.fail(self._share, what, exc)


SETTLE_TIMEOUT_S = 60.0  # the longest a share's first write waits for the step before to commit


def _checksums(entries: list[Entry]) -> dict[str, str]:
    """On ckptd-hash: each entry's checksum."""
    return {e.name: checksum(e.buffers) for e in entries}


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
