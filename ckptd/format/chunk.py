"""The chunk format: each chunk file is a complete, valid safetensors file.

A chunk is written whole once its tensors are known (header padded so the data starts
page-aligned, then every tensor's bytes in order); a tensor too large to batch streams
into a file of its own. Unchanged tensors of an earlier step are placed at the commit
(``place``): a base file unchanged throughout is linked whole, others' tensors copied.
The only module that knows the safetensors layout; start at ``ChunkFormat``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .. import dtypes, layout
from ..durable import write_all
from ..errors import CheckpointCorrupt
from .fileio import pread_into
from .protocol import DataFile, Entry, PieceFile, Ref, Stored, WriteIO, Written

if TYPE_CHECKING:
    from ..records import TensorRecord

log = logging.getLogger("ckptd.writer")

ALIGN = 4096
MAX_HEADER = 100_000_000  # safetensors' own limit
_METADATA = {"format": "pt", "writer": "ckptd"}


def header(entries: Sequence[Entry]) -> bytes:
    """The safetensors header (8-byte length + JSON) for ``entries`` in order."""
    body: dict[str, Any] = {"__metadata__": _METADATA}
    begin = 0
    for e in entries:
        body[e.name] = {
            "dtype": e.dtype.st_code,
            "shape": e.dtype.stored_shape(e.shape),
            "data_offsets": [begin, begin + e.nbytes],
        }
        begin += e.nbytes
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    size = len(text)
    padded = -(-(8 + size) // ALIGN) * ALIGN - 8
    return padded.to_bytes(8, "little") + text + b" " * (padded - size)


def read_header(fd: int, size: int) -> tuple[dict[str, Any], int]:
    """The safetensors header of the file open as ``fd`` (``size`` bytes), and where its
    data starts; ``CheckpointCorrupt`` saying what is wrong with it."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise CheckpointCorrupt("the file is too short for a safetensors header: it was truncated after the "
                                "commit; load another step (`ckptd latest RUN --verify` names the newest "
                                "undamaged one)")
    n = int.from_bytes(head, "little")
    if n > min(size - 8, MAX_HEADER):
        raise CheckpointCorrupt(f"its safetensors header claims {n} bytes; the file has {size}: it was truncated "
                                "or overwritten after the commit; load another step (`ckptd latest RUN "
                                "--verify` names the newest undamaged one)")
    view = memoryview(bytearray(n))
    if pread_into(fd, view, 8) != n:
        raise CheckpointCorrupt("its safetensors header is truncated")
    try:
        parsed = json.loads(bytes(view), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorrupt(f"its safetensors header is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise CheckpointCorrupt("its safetensors header is not a JSON object")
    return parsed, 8 + n


class ChunkFormat:
    """Chunk files (``r<rank>-<seq>.safetensors``): one file per batch or streamed tensor."""

    name = "chunk"
    thread = "ckptd-writer"
    parallel = True

    def owns(self, file: str) -> bool:
        return bool(layout.CHUNK.fullmatch(file))

    def record_problem(self, name: str, key: str, offset: int | None) -> str | None:
        if key != name:
            return f"key {_short(key)} is not the tensor's name (a chunk file's key is)"
        if offset is None:
            return "has no offset in its chunk file"
        return None

    def next_file(self, io: WriteIO) -> str:
        return layout.chunk_name(io.rank, io.next_seq())

    def link_name(self, io: WriteIO, base_step: int, file: str) -> str:
        return self.next_file(io)

    def write_batch(self, io: WriteIO, name: str, entries: list[Entry], digests: Mapping[str, str],
                    *, listed: bool = False) -> Written:
        """One chunk file. ``listed``: the writer listed the file already (the pool's case)."""
        try:
            entries = io.recognise(entries, digests)
        except OSError as exc:
            io.fail(f"linking unchanged tensors into {io.dir}", exc)
            return Written([])
        if not entries:
            return Written([])
        # sizes of whole blocks first: after an odd size, every later byte goes through the bounce buffer
        entries = sorted(entries, key=lambda e: e.nbytes % ALIGN != 0)
        head = header(entries)
        placed: list[tuple[Entry, str, int | None]] = []
        out: DataFile | None = None
        try:
            out = io.create(name, listed=listed)
            offset = len(head)
            for e in entries:
                placed.append((e, e.name, offset))
                offset += e.nbytes
            # in one call: the file's requests are all in flight at once (DataFile.write)
            out.write([head, *(b for e in entries for b in e.buffers)])
            fd = out.finish()
        except OSError as exc:
            if out is not None:
                out.close()
            io.fail(f"writing {io.dir / name}", exc)
            return Written([])
        return Written(placed, fd)

    def open_stream(self, io: WriteIO, entry: Entry, file: str) -> _Streamed | None:
        head = header([entry])
        out: DataFile | None = None
        try:
            out = io.create(file)
            out.write([head])
        except OSError as exc:
            if out is not None:
                out.close()
            io.fail(f"writing {io.dir / file}", exc)
            return None
        return _Streamed(out, entry.name, file, len(head))

    def split(self, io: WriteIO, entry: Entry, file: str) -> tuple[PieceFile, str, int] | None:
        head = header([entry])
        out: PieceFile | None = None
        try:
            out = io.create_pieces(file)
            out.write_at(head, 0)
        except OSError as exc:
            if out is not None:
                out.close()
            io.fail(f"writing {io.dir / file}", exc)
            return None
        return out, entry.name, len(head)

    def stream_piece(self, io: WriteIO, out: _Streamed, piece: Any, last: bool) -> tuple[str, int | None] | None:
        out.file.write([piece])
        if not last:
            return None
        fd = out.file.finish()
        io.sync(out.name, fd)
        return out.key, out.header_len

    def drop_stream(self, out: _Streamed) -> None:
        out.file.close()

    def refer(self, io: WriteIO, base: Stored, name: str, old: TensorRecord) -> Ref:
        """Once the step's every unchanged tensor is known, at its commit (``place``), each
        base file is linked or its tensors copied; the file is checked to be there now."""
        return Ref(name, base, old, base.check(old.file))

    def place(self, io: WriteIO, refs: list[Ref]) -> tuple[dict[str, TensorRecord], int, int]:
        return place(io, refs)

    def close(self, io: WriteIO) -> None:
        """Nothing stays open between a share's chunk files."""

    def open(self, fd: int, size: int) -> ChunkReader:
        return ChunkReader(fd, size)


@dataclass(eq=False)
class _Streamed:
    """A tensor streamed into a chunk file of its own, being written.

    ``name``: the file's
    ``header_len``: bytes before its data"""

    file: DataFile
    key: str
    name: str
    header_len: int


def place(io: WriteIO, refs: list[Ref]) -> tuple[dict[str, TensorRecord], int, int]:
    """Put the stored copies ``refs`` into the share's folder: each base file whose every
    tensor is among them is linked; the tensors of the others are copied into new chunk
    files of the share (each of at most ``io.chunk_size`` bytes, save one tensor
    larger). Return their records, the bytes linked and the bytes copied (the write
    throttle is told of each copy first). Raises OSError naming what failed."""
    by_file: dict[tuple[int, int], list[Ref]] = {}
    for ref in refs:
        by_file.setdefault(ref.ident, []).append(ref)
    records: dict[str, TensorRecord] = {}
    linked = copied = 0
    batch: list[list[Ref]] = []
    size = 0
    for group in by_file.values():
        first = group[0]
        if _keys(first.base, first.record.file) == {r.record.key for r in group}:
            name = io.link(first.base, first.record.file)
            for r in group:
                records[r.name] = replace(r.record, file=name)
                linked += r.record.nbytes
            continue
        group.sort(key=lambda r: r.record.offset or 0)
        nbytes = sum(r.record.nbytes for r in group)
        if batch and size + nbytes > io.chunk_size:
            records.update(_copy(io, batch))
            batch, size = [], 0
        batch.append(group)
        size += nbytes
        copied += nbytes
    if batch:
        records.update(_copy(io, batch))
    log.debug("run=%s step=%d rank=%d: %d bytes unchanged linked, %d copied into files of the step",
              io.run, io.step, io.rank, linked, copied)
    return records, linked, copied


def _copy(io: WriteIO, groups: list[list[Ref]]) -> dict[str, TensorRecord]:
    """The tensors of ``groups`` (each group's in one base file) copied into a new chunk
    file of the share, which holds only them."""
    refs = [r for group in groups for r in group]
    head = header([Entry(r.record.key, dtypes.lookup(r.record.dtype), r.record.shape, r.record.nbytes, [])
                   for r in refs])
    name = layout.chunk_name(io.rank, io.next_seq())
    dst = io.create_plain(name)
    records = {}
    try:
        write_all(dst, head)
        at = len(head)
        for group in groups:
            first = group[0]
            src = first.base.open(first.record.file)
            try:
                st = os.fstat(src)
                if (st.st_dev, st.st_ino) != first.ident:
                    raise OSError(errno.ESTALE, f"{first.base.path / first.record.file} was replaced while step "
                                                f"{io.step} was written")
                for r in group:
                    assert r.record.offset is not None
                    io.throttled(r.record.nbytes)
                    _copy_range(src, dst, r.record.offset, at, r.record.nbytes)
                    records[r.name] = replace(r.record, file=name, offset=at)
                    at += r.record.nbytes
            except OSError as exc:
                raise OSError(exc.errno, f"copying unchanged tensors of {first.base.path / first.record.file} "
                                         f"into {io.dir / name}: {exc.strerror or exc}") from None
            finally:
                os.close(src)
        if io.fsync:
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
        if done == 0:
            data = os.pread(src, min(n, 8 * 2**20), src_at)
            if not data:
                raise OSError(errno.EIO, f"the file ends {n} bytes early")
            done = os.pwrite(dst, data, dst_at)
        src_at, dst_at, n = src_at + done, dst_at + done, n - done


def _keys(base: Stored, file: str) -> set[str]:
    """The tensor keys chunk file ``file`` of ``base`` holds, as its own header lists them."""
    fd = base.open(file)
    try:
        keys, _ = read_header(fd, os.fstat(fd).st_size)
    except CheckpointCorrupt as exc:
        raise OSError(errno.EIO, f"{base.path / file} has no readable safetensors header ({exc})") from None
    finally:
        os.close(fd)
    return set(keys) - {"__metadata__"}


class ChunkReader:
    """A chunk file open for reading: its header is only read when a record is checked."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self._header: dict[str, Any] | None = None
        self._data_start = 0
        self._error: CheckpointCorrupt | None = None

    def check(self, name: str, rec: TensorRecord) -> None:
        header = self._read_header()
        entry = header.get(rec.key) if rec.key != "__metadata__" else None
        info = dtypes.lookup(rec.dtype)
        assert rec.offset is not None
        begin = rec.offset - self._data_start
        want = {"dtype": info.st_code, "shape": info.stored_shape(rec.shape),
                "data_offsets": [begin, begin + rec.nbytes]}
        if not isinstance(entry, dict) or {k: entry.get(k) for k in want} != want:
            raise CheckpointCorrupt(f"the file's safetensors header says {_short(entry)}, "
                                    f"the manifest {_short(want)}: the file was replaced after the commit; load "
                                    "another step (`ckptd latest RUN --verify` names the newest undamaged one)")

    def read_into(self, name: str, rec: TensorRecord, out: Any) -> None:
        raise CheckpointCorrupt("has no offset in its chunk file: the manifest is damaged; load another step "
                                "(`ckptd latest RUN --verify` names the newest undamaged one)")

    def close(self) -> None:
        self._header = None

    def _read_header(self) -> dict[str, Any]:
        if self._header is None:
            if self._error is None:
                try:
                    self._header, self._data_start = read_header(self.fd, self.size)
                except CheckpointCorrupt as exc:
                    self._error = exc
            if self._error is not None:
                raise CheckpointCorrupt(str(self._error))
        assert self._header is not None
        return self._header


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


FORMAT = ChunkFormat()
