"""Reading a step's data files in the local root: one rank's records into memory, into
the caller's tensors, or mapped (``read_tensors``); a byte range of one record
(``read_range``). One ``preadv`` per tensor by the manifest's offsets, each size
checked against its file's before memory is allocated; a file's own structure is its
format's (``ckptd.format``); files are opened relative to the step folder, never
through a symlink.
"""

from __future__ import annotations

import mmap as mmap_mod
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

from .. import dtypes, format as formats, layout
from ..errors import CheckpointCorrupt
from ..format import DataReader
from ..format.fileio import pread_into
from ..manifest import TensorRecord, checksum

# Files read at once: preadv releases the GIL, so the copies out of the page cache and the
# first touch of fresh memory run on several cores, and a cold read keeps the device busy.
READERS = max(2, min(4, (os.cpu_count() or 1) // 2))


def read_tensors(step_path: Path, records: dict[str, TensorRecord], *, verify: bool,
                 into: dict[str, Any] | None = None, mapped: bool = False,
                 progress: Callable[[int], None] | None = None,
                 convert: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
    """Read ``records`` (of one rank's manifest) from the step folder; the first problem
    is raised as CheckpointCorrupt naming the file and the tensor. ``into``: tensors
    (flat, by name) to read into instead of fresh memory (``destinations``);
    ``mapped``: map the files instead of reading them (``load(mmap=True)``).
    ``progress`` is called with each tensor's bytes once it is read; ``convert``
    (``devicecopy``) turns each tensor as it is read, before the next is kept."""
    out: dict[str, Any] = {}
    with closing(each_tensor(step_path, records, verify=verify, into=into, mapped=mapped)) as it:
        for name, tensor, error in it:
            if error is not None:
                raise error
            out[name] = tensor if convert is None else convert(name, tensor)
            if progress is not None:
                progress(records[name].nbytes)
    return out


def each_tensor(step_path: Path, records: dict[str, TensorRecord], *, verify: bool,
             into: dict[str, Any] | None = None,
             mapped: bool = False) -> Generator[tuple[str, Any, CheckpointCorrupt | None], None, None]:
    """``(name, tensor, None)`` for each record read, ``(name, None, error)`` for each
    that cannot be; grouped by file, in file order. Up to ``READERS`` files are read
    at once (checksums too); mapping reads nothing, so it runs on the calling thread."""
    try:
        dir_fd = layout.open_step_dir(step_path)
    except OSError as exc:
        raise CheckpointCorrupt(f"cannot open the step folder: {exc.strerror}") from None
    by_file: dict[str, list[tuple[str, TensorRecord]]] = {}
    for name, rec in records.items():
        by_file.setdefault(rec.file, []).append((name, rec))

    def one(file: str, items: list[tuple[str, TensorRecord]]) -> Iterator[tuple[str, Any, CheckpointCorrupt | None]]:
        return _DataFile(dir_fd, step_path, file, into=into, mapped=mapped).tensors(items, verify)

    def read_all(file: str, items: list[tuple[str, TensorRecord]]) -> list[tuple[str, Any, CheckpointCorrupt | None]]:
        return list(one(file, items))

    try:
        if mapped or len(by_file) < 2 or READERS < 2:
            for file, items in by_file.items():
                yield from one(file, items)
            return
        with ThreadPoolExecutor(READERS, thread_name_prefix="ckptd-read") as pool:
            pending: deque[Any] = deque()
            for file, items in by_file.items():  # at most READERS files read ahead: memory stays bounded
                pending.append(pool.submit(read_all, file, items))
                if len(pending) >= READERS:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
    finally:
        os.close(dir_fd)


class _DataFile:
    """One data file of a step, opened without following a symlink. A record with a
    byte offset is read here (``preadv``, or a mapping), whatever the format; the
    file's format (``ckptd.format``) checks its own structure and reads a record
    without one, and is only asked when needed."""

    def __init__(self, dir_fd: int, step_path: Path, file: str, *, into: dict[str, Any] | None = None,
                 mapped: bool = False) -> None:
        self.dir_fd = dir_fd
        self.into = into
        self.mapped = mapped
        self._map: Any = None
        self.path = step_path / file
        fmt = formats.for_file(file)
        assert fmt is not None
        self.format = fmt
        self.fd = -1
        self.size = 0
        self._reader: DataReader | None = None

    def tensors(self, items: list[tuple[str, TensorRecord]],
                verify: bool) -> Iterator[tuple[str, Any, CheckpointCorrupt | None]]:
        try:
            self.fd = layout.open_regular(self.path.name, dir_fd=self.dir_fd)
        except OSError as exc:
            for name, _ in items:
                yield name, None, self._corrupt(name, f"cannot open a file the manifest names: {exc.strerror}; "
                                                       "load another step (`ckptd latest RUN --verify` names "
                                                       "the newest undamaged one)")
            return
        try:
            self.size = os.fstat(self.fd).st_size
            for name, rec in sorted(items, key=lambda it: -1 if it[1].offset is None else it[1].offset):
                try:
                    yield name, self._read(name, rec, verify), None
                except CheckpointCorrupt as exc:
                    yield name, None, exc
        finally:
            self._close()

    def _corrupt(self, name: str, what: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{self.path}: tensor {name!r}: {what}")

    def _file(self) -> DataReader:
        if self._reader is None:
            self._reader = self.format.open(self.fd, self.size)
        return self._reader

    def _read(self, name: str, rec: TensorRecord, verify: bool) -> Any:
        import torch

        dst = self.into.get(name) if self.into is not None else None
        buf: Any
        if rec.offset is not None:
            end = rec.offset + rec.nbytes
            if end > self.size:  # checked before allocating: the manifest's sizes are untrusted
                raise self._corrupt(name, f"is truncated: the manifest puts it at bytes {rec.offset}..{end}, "
                                          f"but the file has {self.size} bytes; load another step (`ckptd latest "
                                          "RUN --verify` names the newest undamaged one)")
            if verify:
                self._check_structure(name, rec)
            if dst is None and self.mapped and rec.nbytes and rec.offset % dtypes.lookup(rec.dtype).itemsize == 0:
                buf = self._mapped(rec)
            else:
                buf = torch.empty(rec.nbytes, dtype=torch.uint8) if dst is None else None
                view = memoryview(buf.numpy()) if dst is None else bytes_of(dst)
                got = pread_into(self.fd, view, rec.offset) if rec.nbytes else 0
                if got != rec.nbytes:
                    raise self._corrupt(name, f"is truncated: {got} of {rec.nbytes} bytes at offset {rec.offset}; "
                                              "load another step (`ckptd latest RUN --verify` names the newest "
                                              "undamaged one)")
                if dst is not None:
                    if verify and checksum([view] if rec.nbytes else []) != rec.checksum:
                        raise self._corrupt(name, "does not match its checksum: its bytes changed after the "
                                                  "commit; load another step (`ckptd latest RUN --verify` names the "
                                                  "newest undamaged one)")
                    return dst
        else:
            import numpy as np

            self._check_structure(name, rec)  # its size against its storage, before allocating by it
            buf = torch.empty(rec.nbytes, dtype=torch.uint8) if dst is None else None
            target = buf.numpy() if dst is None else np.frombuffer(bytes_of(dst), dtype=np.uint8)
            try:
                self._file().read_into(name, rec, target)
            except CheckpointCorrupt as exc:
                raise self._corrupt(name, str(exc)) from None
            if dst is not None:
                if verify and checksum([_as_bytes(target)] if rec.nbytes else []) != rec.checksum:
                    raise self._corrupt(name, "does not match its checksum: its bytes changed after the "
                                              "commit; load another step (`ckptd latest RUN --verify` names the "
                                              "newest undamaged one)")
                return dst
        if verify and checksum([memoryview(buf.numpy())] if rec.nbytes else []) != rec.checksum:
            raise self._corrupt(name, "does not match its checksum: its bytes changed after the "
                                      "commit; load another step (`ckptd latest RUN --verify` names the "
                                      "newest undamaged one)")
        return rec.as_tensor(buf)

    def _check_structure(self, name: str, rec: TensorRecord) -> None:
        """The file's own structure agrees with the record: what a reader without ckptd sees."""
        try:
            self._file().check(name, rec)
        except CheckpointCorrupt as exc:
            raise self._corrupt(name, str(exc)) from None

    def _mapped(self, rec: TensorRecord) -> Any:
        """The record's bytes in a copy-on-write mapping of the file (kept alive by the
        tensors made from it, not by this object)."""
        import torch

        if self._map is None:
            self._map = mmap_mod.mmap(self.fd, 0, flags=mmap_mod.MAP_PRIVATE,
                                      prot=mmap_mod.PROT_READ | mmap_mod.PROT_WRITE)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=rec.nbytes, offset=rec.offset)

    def _close(self) -> None:
        self._map = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_range(fd: int, path: Path, name: str, rec: TensorRecord, start: int, dst: memoryview) -> None:
    """Read bytes ``[start, start + len(dst))`` of record ``rec`` from ``fd`` (its data
    file, ``path``) straight into ``dst``. The record must have an offset (chunk files,
    contiguous HDF5 datasets); its end is checked against the file's size first.
    Nothing is checksummed: a part of a record cannot be."""
    assert rec.offset is not None and 0 <= start and start + len(dst) <= rec.nbytes
    size = os.fstat(fd).st_size
    if rec.offset + rec.nbytes > size:
        raise CheckpointCorrupt(f"{path}: tensor {name!r}: is truncated: the manifest puts it at bytes "
                                f"{rec.offset}..{rec.offset + rec.nbytes}, but the file has {size} bytes; load another "
                                "step (`ckptd latest RUN --verify` names the newest undamaged one)")
    got = pread_into(fd, dst, rec.offset + start)
    if got != len(dst):
        raise CheckpointCorrupt(f"{path}: tensor {name!r}: is truncated: {got} of {len(dst)} bytes "
                                f"at offset {rec.offset + start}; load another step (`ckptd latest RUN --verify` names "
                                "the newest undamaged one)")


def bytes_of(t: Any) -> memoryview:
    """The memory of a contiguous CPU tensor or numpy array, as writable bytes."""
    import numpy as np

    arr = t if isinstance(t, np.ndarray) else t.detach().view(-1).view(dtypes.torch_dtype("uint8")).numpy()
    return _as_bytes(arr.reshape(-1).view(np.uint8))


def _as_bytes(arr: Any) -> memoryview:
    """A numpy array's memory (typed Any: numpy's stubs do not declare the buffer protocol)."""
    return memoryview(arr)
