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
at its commit (``ckptd.format.chunk``'s ``place``), before the manifest:

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
from pathlib import Path
from typing import Any, Callable

from .. import layout, manifestcache
from ..errors import CheckpointCorrupt
from ..format import Entry
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

    def link_file(self, share: Any, file: str, name_for: Callable[[], str]) -> str:
        """The name of the base's data file ``file`` in the share's folder, linked there
        (once per share) under the name ``name_for()`` gives (the share's format's
        ``link_name``). Raises OSError naming what failed."""
        with self._lock:
            name = self._links.get(file)
            if name is None:
                name = name_for()
                if self._place(file, share, name):
                    with share.lock:
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

    def open(self, file: str) -> int:
        """The base's data file ``file``, opened without following a symlink (the caller
        closes it)."""
        return layout.open_regular(file, dir_fd=self._dir_fd)

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
