"""Tensors a step shares with an earlier one: a checkpoint costs what changed.

``Base`` is this rank's committed share of an earlier step (``Base.find``). A tensor
unchanged since it (same name, dtype, shape, placement and checksum: recognised by
the writer, or declared by ``save(frozen=...)``) refers to its stored bytes: a base
file whose every tensor is unchanged is hard-linked into the new step folder, the
rest copied in the kernel, so every step folder holds every byte its manifests name.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from .. import layout, manifestcache
from ..errors import CheckpointCorrupt
from ..format import Entry
from ..manifest import Manifest, TensorRecord

log = logging.getLogger("ckptd.writer")


class Changing:
    """The tensors of each (root, run, rank) found changed at their last comparison with
    a base. Checking a tensor against its base waits for its checksum; one that changed
    last time most likely changed again, so it is written while its checksum is
    computed, and compared after (``learn``): a tensor that stopped changing is written
    once more, then recognised. Only a hint: either way the step holds every byte."""

    KEPT = 256  # (root, run, rank)s remembered, the least recently saved forgotten first

    def __init__(self) -> None:
        self._names: OrderedDict[tuple[str, str, int], set[str]] = OrderedDict()
        self._lock = threading.Lock()

    def split(self, share: Any, entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """``entries`` as (to compare with the base, to write at once)."""
        with self._lock:
            names = self._names.get(_key(share), set())
            if not names:
                return entries, []
            ask = [e for e in entries if e.name not in names]
            return ask, [e for e in entries if e.name in names]

    def learn(self, base: "Base", share: Any, written: list[Entry], digests: Any) -> None:
        """``written`` (with their ``digests``) against ``base``: remember those that changed."""
        changed = {e.name for e in written if (old := base.match(e)) is not None and digests[e.name] != old.checksum}
        key = _key(share)
        with self._lock:
            names = self._names.pop(key, set())
            names.difference_update(e.name for e in written)
            names |= changed
            if names:
                self._names[key] = names
                while len(self._names) > self.KEPT:
                    self._names.popitem(last=False)


def _key(share: Any) -> tuple[str, str, int]:
    return str(share.id.root), share.run, share.rank


class Base:
    """This rank's committed share of an earlier step, which a new share refers to."""

    def __init__(self, step: int, path: Path, dir_fd: int, manifest: Manifest) -> None:
        self.step = step
        self.path = path
        self.manifest = manifest
        self._dir_fd = dir_fd
        self._links: dict[str, str] = {}
        self._idents: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

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
            except (OSError, CheckpointCorrupt):
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
            return r if r.shard is shard else None
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
                    with share.written.lock:
                        share.written.files.append(name)
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
        """The base's data file ``file``, opened without following a symlink (the caller closes it)."""
        return layout.open_regular(file, dir_fd=self._dir_fd)

    def _place(self, file: str, share: Any, name: str) -> bool:
        """Link (or copy) ``file`` as ``name``; False if it was there already (the same
        HDF5 file, linked for another base of the same share)."""
        want = self.manifest.files.get(file)
        try:
            os.link(file, name, src_dir_fd=self._dir_fd, dst_dir_fd=share.written.dir_fd, follow_symlinks=False)
        except FileExistsError:
            src = os.stat(file, dir_fd=self._dir_fd, follow_symlinks=False)
            dst = os.stat(name, dir_fd=share.written.dir_fd, follow_symlinks=False)
            if (src.st_dev, src.st_ino) != (dst.st_dev, dst.st_ino):
                raise OSError(errno.EEXIST, f"{share.dir / name} exists and is not {self.path / file}") from None
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV, errno.ENOSYS):
                raise OSError(exc.errno, f"linking {self.path / file} into {share.dir}: {exc.strerror}") from None
            log.info("cannot hard-link %s (%s): copying it", self.path / file, exc.strerror)
            self._copy(file, share, name)
        st = os.stat(name, dir_fd=share.written.dir_fd, follow_symlinks=False)
        why = None
        if not stat.S_ISREG(st.st_mode):  # a symlink planted in the base: linked as itself, never followed
            why = "is not a regular file"
        elif want is not None and st.st_size != want:
            why = f"is {st.st_size} bytes, not the {want} its manifest records"
        if why is not None:
            os.unlink(name, dir_fd=share.written.dir_fd)
            raise OSError(errno.EIO, f"{self.path / file} {why}")
        return True

    def _copy(self, file: str, share: Any, name: str) -> None:
        src = layout.open_regular(file, dir_fd=self._dir_fd)
        try:
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                          dir_fd=share.written.dir_fd)
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
