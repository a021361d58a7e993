"""Tensors a step shares with an earlier one: a checkpoint costs what changed.

A frozen base model under LoRA, frozen embeddings, buffers that never change:
their bytes are the same at every step. The writer does not write them again.
It finds the *base* of a share (the newest earlier step of the run in which this
rank committed a share of the same world size and format), and where a tensor
there has the same name, dtype, shape, placement and checksum, the new record
refers to the stored bytes instead.

Every data file of a step folder holds only tensors of that step, with that
step's values: ``safetensors`` opened on the folder's files sees exactly the step.
So a chunk file is placed once the step's whole set of unchanged tensors is known,
at its commit (``place``), before the manifest:

- a base chunk file whose every tensor is unchanged in this step, under the same
  name, is **hard-linked** into the new step folder under a new data-file name of
  this rank (``r<rank>-<seq>.safetensors``), and the new records name that file
  with the base's offsets, keys and checksums;
- the unchanged tensors of a base file that also holds others (changed in this
  step, or not in it) are **copied** in the kernel (``copy_file_range``: a
  reflink where the filesystem shares blocks) into new chunk files of this step,
  of up to ``chunk_size``, which hold only such tensors: the next step that leaves
  them unchanged links them whole. Declared frozen tensors come in chunk files of their
  own (``save(frozen=)`` sends them first, marked ``frozen``), so under LoRA every
  file of the frozen base is linked.

HDF5 steps link the base's whole file (``r<rank>-<step>.h5``, named for the step
that wrote it, beside the share's own ``r<rank>.h5``) as soon as a tensor is
recognised, and ``r<rank>.h5`` shows exactly the step through HDF5 external links
to the datasets of this step: that file is what HDF5 tools open.

So every step folder holds every byte its manifests name, and nothing else
changes: readers, ``verify``, ``export``, the uploader and ``safetensors.safe_open``
see ordinary files; deleting the base step (retention, ``ckptd delete``, an
earlier attempt replaced) removes only its names, never data that a kept step
refers to; a crash before the new manifest leaves links and copies that no
manifest names, which start-up removes like any orphan, and the base untouched.
Where the filesystem refuses hard links, the file is copied in the kernel
instead: correct, not cheaper.

Two ways in:
- the daemon **recognises** unchanged tensors of a chunk by checksum (``[daemon]
  reuse_unchanged``); a tensor large enough to be streamed into a file of its own
  is written as it arrives, before its checksum is known, so only ``frozen=``
  saves its write;
- the producer **declares** them (``save(..., frozen=[globs])``): it sends their
  descriptions without their bytes, naming the step it last committed them in
  (``same`` message), and the writer refers to that step's copy or fails the step.

A checksum is 64 bits of xxh3: two different tensors of the same name, dtype and
shape in consecutive steps collide with probability 2**-64.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from .. import dtypes, format as formats, layout, manifestcache
from ..durable import write_all
from ..errors import CheckpointCorrupt
from ..format import Entry, Ref, chunk
from ..manifest import Manifest, TensorRecord

log = logging.getLogger("ckptd.writer")


class Base:
    """This rank's committed share of an earlier step, which a new share refers to."""

    def __init__(self, step: int, path: Path, dir_fd: int, manifest: Manifest) -> None:
        self.step = step
        self.path = path
        self.manifest = manifest
        self._dir_fd = dir_fd
        self._links: dict[str, str] = {}  # base file -> its name in the new step folder
        self._idents: dict[str, tuple[int, int]] = {}  # base file -> (device, inode), checked
        self._lock = threading.Lock()  # pool threads link files of the same share

    @classmethod
    def find(cls, root: Path, run: str, rank: int, step: int, world_size: int, fmt: str,
             at: int | None = None) -> "Base | None":
        """The newest step before ``step`` (or exactly step ``at``) holding this rank's
        committed share of the same world size and format; None if there is none."""
        run_dir = root / run
        if at is not None:
            candidates = [at]
        else:
            try:
                names = os.listdir(run_dir)
            except OSError:
                return None
            candidates = sorted((s for n in names if (s := layout.parse_step_dir(n)) is not None and s < step),
                                reverse=True)
        for s in candidates:
            path = layout.step_dir(root, run, s)
            try:
                fd = layout.open_step_dir(path)
            except OSError:
                continue
            try:
                manifest = manifestcache.read(layout.manifest_name(rank), fd, str(path / layout.manifest_name(rank)))
            except (OSError, CheckpointCorrupt):  # no share of this rank there (or a damaged one)
                os.close(fd)
                continue
            if manifest.world_size != world_size or manifest.format != fmt:
                os.close(fd)
                return None  # the job changed shape or format: nothing older is its base either
            return cls(s, path, fd, manifest)
        return None

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def record(self, name: str, dtype: str, shape: list[int], numpy: bool, shard: Any) -> TensorRecord | None:
        """The base's record of tensor ``name`` if it is the same kind of tensor, else None."""
        r = self.manifest.tensors.get(name)
        if r is None or r.dtype != dtype or r.shape != shape or r.numpy != numpy:
            return None
        if r.shard is None or shard is None:
            return r if r.shard is shard else None  # both whole, or one a piece: not the same
        return r if r.shard.to_dict() == shard.to_dict() else None

    def match(self, e: Entry) -> TensorRecord | None:
        return self.record(e.name, e.dtype.name, e.shape, e.numpy, e.shard)

    def link(self, share: Any, record: TensorRecord) -> TensorRecord:
        """``record`` of the base, as a record of ``share``: its data file linked (once
        per share) into the share's folder. Raises OSError naming what failed."""
        return replace(record, file=self.link_file(share, record.file))

    def link_file(self, share: Any, file: str) -> str:
        """The name of the base's data file ``file`` in the share's folder, linked there
        (once per share). Raises OSError naming what failed."""
        with self._lock:
            name = self._links.get(file)
            if name is None:
                name = formats.get(self.manifest.format).link_name(share, self.step, file)
                if self._place(file, share, name):
                    share.files.append(name)
                self._links[file] = name
        return name

    def check(self, file: str) -> tuple[int, int]:
        """The identity (device, inode) of the base's data file ``file``, which is there
        as its manifest recorded it; else an OSError that says why."""
        with self._lock:
            ident = self._idents.get(file)
            if ident is None:
                try:
                    st = os.stat(file, dir_fd=self._dir_fd, follow_symlinks=False)
                except OSError as exc:
                    raise OSError(exc.errno, f"{self.path / file}: {exc.strerror}") from None
                want = self.manifest.files.get(file)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EIO, f"{self.path / file} is not a regular file")
                if want is not None and st.st_size != want:
                    raise OSError(errno.EIO, f"{self.path / file} is {st.st_size} bytes, not the {want} its "
                                             "manifest records")
                ident = self._idents[file] = (st.st_dev, st.st_ino)
        return ident

    def keys(self, file: str) -> set[str]:
        """The tensor keys the chunk file ``file`` holds, as its own header lists them."""
        fd = layout.open_regular(file, dir_fd=self._dir_fd)
        try:
            keys, _ = chunk.read_header(fd, os.fstat(fd).st_size)
        except CheckpointCorrupt as exc:
            raise OSError(errno.EIO, f"{self.path / file} has no readable safetensors header ({exc})") from None
        finally:
            os.close(fd)
        return set(keys) - {"__metadata__"}

    def _place(self, file: str, share: Any, name: str) -> bool:
        """Link (or copy) ``file`` as ``name``; False if it was there already (the same
        HDF5 file, linked for another base of the same share)."""
        want = self.manifest.files.get(file)
        try:
            os.link(file, name, src_dir_fd=self._dir_fd, dst_dir_fd=share.dir_fd, follow_symlinks=False)
        except FileExistsError:
            src = os.stat(file, dir_fd=self._dir_fd, follow_symlinks=False)
            dst = os.stat(name, dir_fd=share.dir_fd, follow_symlinks=False)
            if (src.st_dev, src.st_ino) != (dst.st_dev, dst.st_ino):
                raise OSError(errno.EEXIST, f"{share.dir / name} exists and is not {self.path / file}") from None
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV, errno.ENOSYS):
                raise OSError(exc.errno, f"linking {self.path / file} into {share.dir}: {exc.strerror}") from None
            log.info("cannot hard-link %s (%s): copying it", self.path / file, exc.strerror)
            self._copy(file, share, name)
        st = os.stat(name, dir_fd=share.dir_fd, follow_symlinks=False)
        why = None
        if not stat.S_ISREG(st.st_mode):  # a symlink planted in the base: linked as itself, never followed
            why = "is not a regular file"
        elif want is not None and st.st_size != want:  # truncated since its commit: never refer to it
            why = f"is {st.st_size} bytes, not the {want} its manifest records"
        if why is not None:
            os.unlink(name, dir_fd=share.dir_fd)
            raise OSError(errno.EIO, f"{self.path / file} {why}")
        return True

    def _copy(self, file: str, share: Any, name: str) -> None:
        src = layout.open_regular(file, dir_fd=self._dir_fd)
        try:
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                          dir_fd=share.dir_fd)
            try:
                left = os.fstat(src).st_size
                while left > 0:
                    n = os.copy_file_range(src, dst, left)
                    if n == 0:
                        break
                    left -= n
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)


def place(share: Any, refs: list[Ref], fsync: bool, written: Callable[[int], None]) -> tuple[
        dict[str, TensorRecord], int, int]:
    """Put the stored copies ``refs`` into the share's folder: each base file whose every
    tensor is among them is linked; the tensors of the others are copied into new chunk
    files of the share (each of at most ``share.chunk_size`` bytes, save one tensor
    larger). Return their records, the bytes linked and the bytes copied (``written(n)``
    is told of each copy first: the write throttle). Raises OSError naming what failed."""
    by_file: dict[tuple[int, int], list[Ref]] = {}
    for ref in refs:
        by_file.setdefault(ref.ident, []).append(ref)
    records: dict[str, TensorRecord] = {}
    linked = copied = 0
    batch: list[list[Ref]] = []  # whole groups, each a base file's tensors in its order
    size = 0
    for group in by_file.values():
        first = group[0]
        if first.base.keys(first.record.file) == {r.record.key for r in group}:
            name = first.base.link_file(share, first.record.file)
            for r in group:
                records[r.name] = replace(r.record, file=name)
                linked += r.record.nbytes
            continue
        group.sort(key=lambda r: r.record.offset or 0)
        nbytes = sum(r.record.nbytes for r in group)
        if batch and size + nbytes > share.chunk_size:
            records.update(_copy(share, batch, fsync, written))
            batch, size = [], 0
        batch.append(group)
        size += nbytes
        copied += nbytes
    if batch:
        records.update(_copy(share, batch, fsync, written))
    log.debug("run=%s step=%d rank=%d: %d bytes unchanged linked, %d copied into files of the step",
              share.run, share.step, share.rank, linked, copied)
    return records, linked, copied


def _copy(share: Any, groups: list[list[Ref]], fsync: bool, written: Callable[[int], None]) -> dict[
        str, TensorRecord]:
    """The tensors of ``groups`` (each group's in one base file) copied into a new chunk
    file of the share, which holds only them."""
    refs = [r for group in groups for r in group]
    head = chunk.header([Entry(r.record.key, dtypes.lookup(r.record.dtype), r.record.shape, r.record.nbytes,
                                   []) for r in refs])
    name = share.new_file()
    share.files.append(name)  # before it exists: a failed step removes it
    dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                  dir_fd=share.dir_fd)
    records = {}
    try:
        write_all(dst, head)
        at = len(head)
        for group in groups:
            first = group[0]
            src = layout.open_regular(first.record.file, dir_fd=first.base._dir_fd)
            try:
                st = os.fstat(src)
                if (st.st_dev, st.st_ino) != first.ident:
                    raise OSError(errno.ESTALE, f"{first.base.path / first.record.file} was replaced while step "
                                                f"{share.step} was written")
                for r in group:
                    assert r.record.offset is not None  # (a chunk file's tensors all have one)
                    written(r.record.nbytes)
                    _copy_range(src, dst, r.record.offset, at, r.record.nbytes)
                    records[r.name] = replace(r.record, file=name, offset=at)
                    at += r.record.nbytes
            except OSError as exc:
                raise OSError(exc.errno, f"copying unchanged tensors of {first.base.path / first.record.file} "
                                         f"into {share.dir / name}: {exc.strerror or exc}") from None
            finally:
                os.close(src)
        if fsync:
            os.fsync(dst)
    finally:
        os.close(dst)
    return records


def _copy_range(src: int, dst: int, src_at: int, dst_at: int, n: int) -> None:
    """Bytes ``[src_at, src_at + n)`` of ``src`` to ``dst_at`` of ``dst``, in the kernel
    where it can (``copy_file_range``), else through a buffer."""
    while n > 0:
        try:
            done = os.copy_file_range(src, dst, n, src_at, dst_at)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            done = 0
        if done == 0:  # not in the kernel (or past the end: then pread says so)
            data = os.pread(src, min(n, 8 * 2**20), src_at)
            if not data:
                raise OSError(errno.EIO, f"the file ends {n} bytes early")
            done = os.pwrite(dst, data, dst_at)
        src_at, dst_at, n = src_at + done, dst_at + done, n - done
