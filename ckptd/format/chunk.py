"""The chunk format: each chunk file is a complete, valid safetensors file.

A safetensors file cannot be appended to (its header, with every offset, comes
first), so a chunk is written whole once its tensors are known: the header, padded
with spaces so the data starts page-aligned, then every tensor's bytes in order,
with no holes between them, as safetensors requires. A tensor too large to batch is
streamed into a chunk file of its own: its header first, then its bytes as they
arrive. An unchanged tensor of an earlier step is placed at the commit, once the
step's every unchanged tensor is known (``ckptd.daemon.reuse.place``).

This module is the only one that knows the safetensors layout: it writes the
header, and reads it back to check a file against its manifest.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Sequence

from .. import dtypes, layout
from ..errors import CheckpointCorrupt
from .fileio import pread_into
from .protocol import DataFile, Entry, Ref, WriteIO

if TYPE_CHECKING:
    from ..daemon.share import Share, Stream
    from ..manifest import TensorRecord

ALIGN = 4096
MAX_HEADER = 100_000_000  # safetensors' own limit
_METADATA = {"format": "pt", "writer": "ckptd"}


# -- the layout ---------------------------------------------------------------------------
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
    padded = -(-(8 + size) // ALIGN) * ALIGN - 8  # data then starts on an ALIGN boundary
    return padded.to_bytes(8, "little") + text + b" " * (padded - size)


def read_header(fd: int, size: int) -> tuple[dict[str, Any], int]:
    """The safetensors header of the file open as ``fd`` (``size`` bytes), and where its
    data starts; ``CheckpointCorrupt`` saying what is wrong with it."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise CheckpointCorrupt("the file is too short for a safetensors header")
    n = int.from_bytes(head, "little")
    if n > min(size - 8, MAX_HEADER):
        raise CheckpointCorrupt(f"its safetensors header claims {n} bytes; the file has {size}")
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

    def next_file(self, share: Share) -> str:
        return share.new_file()

    def link_name(self, share: Share, base_step: int, file: str) -> str:
        return share.new_file()

    # -- writing, on ckptd-writer (or its pool) -----------------------------------------------
    def write_batch(self, io: WriteIO, share: Share, name: str, entries: list[Entry], digests: dict[str, str],
                    *, listed: bool = False) -> int | None:
        """One chunk file. ``listed``: the file is in ``share.files`` already (the pool's case)."""
        try:
            entries = io.recognise(share, entries, digests)
        except OSError as exc:
            io.fail(share, f"linking unchanged tensors into {share.dir}", exc)
            return None
        if not entries:  # every tensor of it is stored already
            return None
        head = header(entries)
        records = {}
        out: DataFile | None = None
        try:
            out = io.create(share, name, listed=listed)
            out.write([head])
            offset = len(head)
            for e in entries:
                records[e.name] = share.record(e, name, e.name, offset, digests[e.name])
                out.write(e.buffers)
                offset += e.nbytes
            fd = out.finish()
        except OSError as exc:
            if out is not None:
                out.close()
            io.fail(share, f"writing {share.dir / name}", exc)
            return None
        share.records.update(records)
        return fd

    def open_stream(self, io: WriteIO, stream: Stream) -> bool:
        head = header([stream.entry])
        try:
            stream.out = io.create(stream.share, stream.file)
            stream.out.write([head])
        except OSError as exc:
            self._close_stream(stream)
            io.fail(stream.share, f"writing {stream.share.dir / stream.file}", exc)
            return False
        stream.header_len = len(head)
        return True

    def stream_piece(self, io: WriteIO, stream: Stream, piece: Any, last: bool) -> None:
        share = stream.share
        try:
            if share.error is None and stream.out is not None:
                assert stream.hasher is not None
                stream.hasher.update(piece)
                stream.out.write([piece])
                if last:
                    fd = stream.out.finish()
                    share.records[stream.entry.name] = share.record(
                        stream.entry, stream.file, stream.entry.name, stream.header_len, stream.hasher.text())
                    io.sync(share, stream.file, fd)
                    stream.out = None
        except OSError as exc:
            self._close_stream(stream)
            io.fail(share, f"writing {share.dir / stream.file}", exc)
        finally:
            if share.error is not None:
                self._close_stream(stream)

    @staticmethod
    def _close_stream(stream: Stream) -> None:
        if stream.out is not None:
            stream.out.close()
            stream.out = None

    def refer(self, io: WriteIO, share: Share, base: Any, name: str, old: TensorRecord, received: bool) -> None:
        """Once the step's every unchanged tensor is known, at its commit (reuse.place), each
        base file is linked or its tensors copied; the file is checked to be there now."""
        ref = Ref(name, base, old, base.check(old.file))
        with share.lock:
            share.refs.append(ref)
            share.recognised += old.nbytes if received else 0

    def close(self, io: WriteIO, share: Share) -> None:
        """Nothing stays open between a share's chunk files."""

    # -- reading ----------------------------------------------------------------------------
    def open(self, fd: int, size: int) -> ChunkReader:
        return ChunkReader(fd, size)


class ChunkReader:
    """A chunk file open for reading: its header is only read when a record is checked."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self._header: dict[str, Any] | None = None
        self._data_start = 0
        self._error: CheckpointCorrupt | None = None  # the header is unreadable

    def check(self, name: str, rec: TensorRecord) -> None:
        header = self._read_header()
        entry = header.get(rec.key) if rec.key != "__metadata__" else None
        info = dtypes.lookup(rec.dtype)
        assert rec.offset is not None  # (the manifest's parser requires one in a chunk file)
        begin = rec.offset - self._data_start
        want = {"dtype": info.st_code, "shape": info.stored_shape(rec.shape),
                "data_offsets": [begin, begin + rec.nbytes]}
        if not isinstance(entry, dict) or {k: entry.get(k) for k in want} != want:
            raise CheckpointCorrupt(f"the file's safetensors header says {_short(entry)}, "
                                    f"the manifest {_short(want)}")

    def read_into(self, name: str, rec: TensorRecord, out: Any) -> None:
        raise CheckpointCorrupt("has no offset in its chunk file")  # (refused by the manifest's parser)

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
