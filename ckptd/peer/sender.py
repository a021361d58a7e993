"""One partner's transfers, on its own ``ckptd-peer-send-N`` thread: each share the
``Copier`` gives it is an ``offer``, the files in ``frame``-sized parts with ``window``
in flight, and ``done`` (or ``cancel``, once the ``Copier`` lets a superseded share go
rather than read its files). A partner that does not answer holds up only its own thread;
its failure hands its shares back to the ``Copier`` for the next peers. All partners'
threads share one ``Pacer``: ``[peer] rate`` caps the node's total.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


from .. import layout
from ..config import PeerConfig
from ..format.fileio import BLOCK
from ..errors import CheckpointCorrupt, PeerDown, PeerRefused, ProtocolError
from ..manifest import Manifest
from . import messages, supervise

log = logging.getLogger("ckptd.peer")

Key = tuple[str, int, int]
YIELD_AFTER_S = 0.2


@dataclass(frozen=True)
class Job:
    """A share to send to one partner: its manifest as committed here, read once by the
    ``Copier``, and its run's retention (the partner holds no more steps than that)."""

    key: Key
    manifest: Manifest
    manifest_json: bytes
    keep_last: int


# A job's outcome, as ``on_done(peer, job, outcome, nbytes, seconds)`` receives it: held by the
# partner; refused by it (full, or a bug here); it is down; handed back untried (queued behind a
# failed transfer to it); the share is gone here; not wanted (before its offer; after: cancelled)
HELD, REFUSED, DOWN, RETURNED, GONE, DROPPED, CANCELLED = (
    "held", "refused", "down", "returned", "gone", "dropped", "cancelled")


class _Cancelled(Exception):
    """The transfer under way was given up (``cancel``): its share is superseded."""


class Pacer:
    """``[peer] rate`` over every partner's thread: a part waits until the bytes sent
    before it are allowed; an idle second banks at most one second of sending."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._until = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._until = max(self._until, now - 1.0)
            wait = self._until - now
            self._until += n / self.rate
        if wait > 0:
            time.sleep(wait)


class PartnerSender(supervise.Queued[Job]):
    def __init__(self, index: int, peer: str, keys: Any, cfg: PeerConfig, root: Path,
                 pacer: Pacer, busy: Callable[[], bool], wanted: Callable[[Key], bool],
                 on_done: Callable[[str, Job, str, int, float], None], *, direct_io: bool = False,
                 staged: Callable[[Key], Any] = lambda key: None,
                 count: Callable[[int, int], None] = lambda staged, read: None,
                 cancellable: Callable[[Key], bool] = lambda key: False) -> None:
        self.peer = peer
        self.cancellable = cancellable
        self.staged, self.count = staged, count
        self.direct_io = direct_io
        self.keys, self.cfg, self.root = keys, cfg, root
        self.pacer = pacer
        self.busy = busy
        self.wanted = wanted
        self.on_done = on_done
        self._link: messages.Link | None = None
        self._busy_seen = 0.0
        super().__init__(f"ckptd-peer-send-{index}")

    def _closing(self) -> None:
        self._forget()
        with self._cv:
            left, self._jobs = list(self._jobs), deque()
        for job in left:
            self.on_done(self.peer, job, DROPPED, 0, 0.0)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError) as exc:
            log.debug("%s keeps the daemon's priority: %s", self.thread.name, exc)
        while (job := self._next()) is not None:
            try:
                self._one(job)
            except BaseException:  # a bug: the job is handed back before the thread restarts
                self.on_done(self.peer, job, REFUSED, 0, 0.0)
                raise

    def _one(self, job: Job) -> None:
        if not self.wanted(job.key):
            self.on_done(self.peer, job, DROPPED, 0, 0.0)
            return
        try:
            share = ShareFiles.open(layout.step_dir(self.root, job.key[0], job.key[1]), job.manifest,
                                    direct=self.direct_io, frame=self.cfg.frame, slots=self.cfg.window + 1)
        except OSError as exc:
            log.warning("cannot replicate run %r step %d rank %d: %s", *job.key, exc)
            share = None
        if share is None:
            self.on_done(self.peer, job, GONE, 0, 0.0)
            return
        share.staged = self.staged(job.key)
        t0 = time.monotonic()
        try:
            self._send(job, share)
        except _Cancelled:
            self.on_done(self.peer, job, CANCELLED, 0, time.monotonic() - t0)
            return
        except CheckpointCorrupt as exc:
            self._forget()
            log.warning("run %r step %d rank %d is not replicated: %s", *job.key, exc)
            self.on_done(self.peer, job, GONE, 0, time.monotonic() - t0)
            return
        except (PeerDown, PeerRefused, ProtocolError) as exc:
            self._forget()
            run, step, rank = job.key
            log.warning("peer %s did not take run %r step %d rank %d (%s); trying the next peer",
                        self.peer, run, step, rank, exc)
            if isinstance(exc, PeerRefused):
                self.on_done(self.peer, job, REFUSED, 0, time.monotonic() - t0)
                return
            with self._cv:
                left, self._jobs = list(self._jobs), deque()
            self.on_done(self.peer, job, DOWN, 0, time.monotonic() - t0)
            for other in left:
                self.on_done(self.peer, other, RETURNED, 0, 0.0)
            return
        finally:
            share.close()
            self.count(share.staged_bytes, share.file_bytes)
        self.on_done(self.peer, job, HELD, sum(share.sizes.values()), time.monotonic() - t0)

    def _send(self, job: Job, share: "ShareFiles") -> None:
        if self._link is None:
            self._link = messages.Link(self.peer, self.keys, hwm=self.cfg.window * 2 + 4)
        link, stall = self._link, self.cfg.stall
        run, step, rank = job.key
        offer = {"op": "offer", "run": run, "step": step, "rank": rank, "manifest": job.manifest_json,
                 "files": share.sizes, "keep_last": job.keep_last}
        # not connected (IMMEDIATE), hung or dead: found out within `timeout`, not `stall`
        answer, _ = link.request(offer, timeout=self.cfg.timeout)
        xfer = messages.field(answer, "xfer", int)
        in_flight: deque[int] = deque()
        for file, size in share.sizes.items():
            for off in range(0, size, self.cfg.frame):
                if len(in_flight) >= self.cfg.window:
                    link.recv(in_flight.popleft(), timeout=stall)
                self._yield()
                if share.from_files() and self.cancellable(job.key):
                    self._cancel(link, xfer)
                data = share.read(file, off, self.cfg.frame)
                self.pacer.take(len(data))
                part = {"op": "part", "xfer": xfer, "file": file, "offset": off}
                in_flight.append(link.send(part, data, timeout=stall))
        while in_flight:
            link.recv(in_flight.popleft(), timeout=stall)
        link.request({"op": "done", "xfer": xfer}, timeout=stall)

    def _cancel(self, link: messages.Link, xfer: int) -> None:
        """Give transfer ``xfer`` up: the partner frees its room (one that does not know
        ``cancel``, or does not answer, frees it after ``stall`` without a part)."""
        try:
            link.request({"op": "cancel", "xfer": xfer}, timeout=self.cfg.timeout)
        except PeerRefused as exc:
            log.info("peer %s did not take the cancel of transfer %d: %s", self.peer, xfer, exc)
        except (PeerDown, ProtocolError) as exc:
            log.info("peer %s did not answer the cancel of transfer %d: %s", self.peer, xfer, exc)
            self._forget()
        raise _Cancelled

    def _yield(self) -> None:
        """Wait while the daemon is busy with a step (and a moment after: the gaps between
        a save's tensors), at most ``stall``/4, so that the partner never gives up a
        transfer that is only waiting its turn."""
        deadline = time.monotonic() + self.cfg.stall / 4
        while time.monotonic() < deadline and not self._stop:
            now = time.monotonic()
            if self.busy():
                self._busy_seen = now
            elif now - self._busy_seen > YIELD_AFTER_S:
                return
            time.sleep(0.02)

    def _forget(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None


class ShareFiles:
    """A committed share's data files, open for reading parts; the holder checks every
    byte against the manifest. Where ``staged`` (a ``ckptd.daemon.stagehold.Hold``) still
    holds them in the producer's staging, their bytes are copied from there into the
    slots instead, and only what it lacks (a file's header) is read from the file.

    With ``direct`` (``[daemon] direct_io``: the files were written with O_DIRECT, so their
    bytes are not in the page cache) each part is read with O_DIRECT into one of
    ``slots`` page-aligned buffers of ``frame`` bytes, used in turn: no copy through the
    page cache, and the share's bytes do not push training's pages out of it. A slot
    is read into again only ``slots`` parts later, once the part it held was answered
    (the sender keeps at most ``slots - 1`` parts unanswered: ``window``). A file the
    filesystem refuses O_DIRECT for (tmpfs), or a ``frame`` not a multiple of the
    block, is read through the page cache."""

    def __init__(self, path: Path, fds: dict[str, int], direct: set[str], frame: int, slots: int) -> None:
        self.path = path
        self.fds = fds
        self.sizes = {f: os.fstat(fd).st_size for f, fd in fds.items()}
        self.direct = direct
        self._slots: list[mmap.mmap] = []
        self._frame, self._nslots, self._next = frame, slots, 0
        self.staged: Any = None
        self.staged_bytes = self.file_bytes = 0

    @classmethod
    def open(cls, path: Path, m: Manifest, *, direct: bool = False, frame: int = 0,
             slots: int = 1) -> "ShareFiles | None":
        """None when a file is gone (retention deleted the step meanwhile)."""
        fds: dict[str, int] = {}
        try:
            dir_fd = layout.open_step_dir(path)
        except FileNotFoundError:
            return None
        try:
            for file in sorted(set(m.files) | {t.file for t in m.tensors.values()}):
                try:
                    fds[file] = layout.open_regular(file, dir_fd=dir_fd)
                except FileNotFoundError:
                    for fd in fds.values():
                        os.close(fd)
                    return None
        finally:
            os.close(dir_fd)
        aligned = direct and frame > 0 and frame % BLOCK == 0
        return cls(path, fds, {f for f, fd in fds.items() if aligned and _set_direct(fd)}, frame, slots)

    def from_files(self) -> bool:
        """Whether the next part is read from the files (the staging went back, or was never held)."""
        return self.staged is None or not self.staged.live

    def read(self, file: str, offset: int, length: int) -> Any:
        """``length`` bytes of ``file`` at ``offset`` (fewer at its end): bytes, or a
        view of a slot that stays valid for the next ``slots - 1`` reads."""
        want = min(length, self.sizes[file] - offset)
        if self.staged is not None and 0 < want <= self._frame:
            out = memoryview(self._slot())[:want]
            gaps = self.staged.fill(file, offset, out)
            if gaps is not None:
                self.staged_bytes += want - sum(b - a for a, b in gaps)
                for a, b in gaps:
                    self._read_range(file, offset + a, out[a:b])
                return out
            self.staged = None  # the producer took its staging back: the files from here on
        if file in self.direct and length == self._frame and offset % BLOCK == 0:
            try:
                data: Any = self._read_direct(file, offset, want)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct.discard(file)
                _clear_direct(self.fds[file])
                data = os.pread(self.fds[file], length, offset)
        else:
            data = os.pread(self.fds[file], length, offset)
        self.file_bytes += len(data)
        if len(data) != want:
            raise CheckpointCorrupt(f"{self.path / file} shrank while being replicated")
        return data

    def _slot(self) -> mmap.mmap:
        if len(self._slots) < self._nslots:
            self._slots.append(mmap.mmap(-1, self._frame))  # page-aligned, as O_DIRECT needs
        slot = self._slots[self._next % len(self._slots)]
        self._next += 1
        return slot

    def _read_direct(self, file: str, offset: int, want: int) -> memoryview:
        n = os.preadv(self.fds[file], [slot := self._slot()], offset)
        return memoryview(slot)[:min(n, want)]

    def _read_range(self, file: str, offset: int, out: memoryview) -> None:
        """Exactly ``len(out)`` bytes of ``file`` at ``offset`` into ``out``: with O_DIRECT,
        the whole blocks around them, through a page-aligned buffer."""
        fd, first = self.fds[file], offset - offset % BLOCK
        if file in self.direct:
            buf = mmap.mmap(-1, -(-(offset + len(out) - first) // BLOCK) * BLOCK)
            try:
                n = os.preadv(fd, [buf], first)
                self.file_bytes += n
                if n < offset - first + len(out):
                    raise CheckpointCorrupt(f"{self.path / file} shrank while being replicated")
                out[:] = memoryview(buf)[offset - first:offset - first + len(out)]
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct.discard(file)  # refused here: through the page cache from now on
                _clear_direct(fd)
            finally:
                buf.close()
        n = os.preadv(fd, [out], offset)
        self.file_bytes += n
        if n != len(out):
            raise CheckpointCorrupt(f"{self.path / file} shrank while being replicated")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        # the slots are left to the garbage collector: ZeroMQ may still hold a view of
        # one (a part in flight when the transfer failed), and frees it once sent or dropped


def _set_direct(fd: int) -> bool:
    """Read ``fd`` with O_DIRECT from now on, where its filesystem allows it."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True


def _clear_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
