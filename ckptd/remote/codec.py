"""Lossless compression of the data files bound for the bucket (``[remote] compression``).
Codec ``shuffle-zstd``: a file is cut into frames (each tensor's bytes, and the bytes
between tensors, in pieces of at most ``FRAME_BYTES``); a frame is split into byte
planes by the tensor's element size and each plane compressed with zstd on its own, or
kept as is where zstd does not shrink it. ``Packer`` encodes, ``decode_frame`` and
``Unpacker`` decode; the manifest records the frames (``records.Packed``).
"""

from __future__ import annotations

import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..errors import CheckpointCorrupt, ConfigError
from .. import dtypes
from ..records import CODECS, Packed, TensorRecord

CODEC = CODECS[0]
FRAME_BYTES = 4 << 20
LEVEL = 1
_PLANE = struct.Struct("<BI")  # per plane: 1 = zstd, 0 = stored as is; its stored length
_local = threading.local()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ConfigError("[remote] compression = \"shuffle-zstd\" needs the zstandard package: "
                          "pip install 'ckptd[remote]' (or pip install zstandard)") from None
    return zstandard


def check_available(codec: str) -> None:
    """ConfigError, naming the package, where ``codec`` cannot run on this host."""
    if codec != "none":
        _zstd()


def _coder() -> tuple[Any, Any]:
    """This thread's zstd compressor and decompressor (neither may be shared)."""
    if not hasattr(_local, "coder"):
        z = _zstd()
        _local.coder = (z.ZstdCompressor(level=LEVEL), z.ZstdDecompressor())
    return _local.coder


def file_frames(records: Iterable[TensorRecord], file: str, size: int) -> list[tuple[int, int, int]]:
    """The frames of data file ``file`` of ``size`` bytes that holds ``records``."""
    return segments(size, [(t.offset, t.nbytes, dtypes.lookup(t.dtype).itemsize)
                           for t in records if t.file == file and t.offset is not None])


def segments(size: int, spans: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``[0, size)`` as frames ``(start, end, element size)``: each span ``(offset,
    nbytes, element size)`` of a tensor with its element size, the rest with 1."""
    out: list[tuple[int, int, int]] = []
    at = 0
    for offset, nbytes, item in sorted(s for s in spans if s[1]):
        if offset < at or offset + nbytes > size:
            raise ValueError(f"tensor bytes {offset}..{offset + nbytes} overlap or pass the file's {size} bytes")
        out += _split(at, offset, 1) + _split(offset, offset + nbytes, item)
        at = offset + nbytes
    return out + _split(at, size, 1)


def _split(start: int, end: int, item: int) -> list[tuple[int, int, int]]:
    step = max(item, FRAME_BYTES // item * item)
    return [(s, min(s + step, end), item) for s in range(start, end, step)]


def encode_frame(data: Any, item: int) -> bytes:
    """One frame: its byte planes, each compressed or stored, behind their headers."""
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) // item * item
    planes = [raw] if item == 1 else list(np.ascontiguousarray(raw[:whole].reshape(-1, item).T))
    zc = _coder()[0]
    heads, bodies = [], []
    for plane in planes:
        packed = zc.compress(plane)
        kept = len(packed) < len(plane)
        heads.append(_PLANE.pack(int(kept), len(packed) if kept else len(plane)))
        bodies.append(packed if kept else plane.tobytes())
    tail = raw[whole:].tobytes() if item > 1 else b""
    return b"".join(heads + bodies) + tail


def decode_frame(data: Any, item: int, out: memoryview, where: str) -> None:
    """Frame ``data`` decoded into ``out`` (its raw length), each plane written straight
    to its strided place; CheckpointCorrupt names ``where`` when it does not decode to
    exactly that."""
    dst = np.frombuffer(out, dtype=np.uint8)
    whole = len(dst) // item * item
    n_planes, plane_len = (1, len(dst)) if item == 1 else (item, whole // item)
    grid = dst[:whole].reshape(-1, item)
    src = memoryview(data)
    at = _PLANE.size * n_planes
    try:
        heads = [_PLANE.unpack_from(src, i * _PLANE.size) for i in range(n_planes)]
        for i, (kept, length) in enumerate(heads):
            body = src[at:at + length]
            at += length
            plane = _coder()[1].decompress(body, max_output_size=plane_len) if kept else body
            if len(plane) != plane_len:
                raise ValueError(f"a plane holds {len(plane)} bytes, not {plane_len}")
            if item == 1:
                dst[:] = np.frombuffer(plane, dtype=np.uint8)
            else:
                grid[:, i] = np.frombuffer(plane, dtype=np.uint8)
        if len(src) - at != len(dst) - whole if item > 1 else at != len(src):
            raise ValueError("its length disagrees with its planes")
    except (struct.error, ValueError, _zstd().ZstdError) as exc:
        raise CheckpointCorrupt(f"{where}: a compressed frame does not decode ({exc}); load another step "
                                "(`ckptd list RUN --remote` lists the bucket's)") from None
    if item > 1:
        dst[whole:] = np.frombuffer(src[at:], dtype=np.uint8)


class Packer:
    """A file's frames encoded on ``workers`` threads, in order: iterate for the stored
    bytes; ``packed()`` afterwards gives the manifest's record. ``read(n)`` returns the
    file's next ``n`` bytes."""

    def __init__(self, read: Callable[[int], bytes], frames: list[tuple[int, int, int]], workers: int) -> None:
        self._read, self._frames, self._workers = read, frames, max(1, workers)
        self._done: list[tuple[int, int, int]] = []

    def __iter__(self) -> Iterator[bytes]:
        ahead: deque[tuple[int, int, Future[bytes]]] = deque()
        with ThreadPoolExecutor(self._workers, thread_name_prefix="ckptd-compress") as pool:
            for start, end, item in self._frames:
                data = self._read(end - start)
                if len(data) != end - start:
                    raise OSError(f"the file ended at {start + len(data)} bytes, before {end}")
                ahead.append((end - start, item, pool.submit(encode_frame, data, item)))
                while len(ahead) > 2 * self._workers:
                    yield self._finish(*ahead.popleft())
            while ahead:
                yield self._finish(*ahead.popleft())

    def _finish(self, raw: int, item: int, fut: Future[bytes]) -> bytes:
        out = fut.result()
        self._done.append((raw, len(out), item))
        return out

    def packed(self) -> Packed:
        return Packed(codec=CODEC, size=sum(f[1] for f in self._done), frames=tuple(self._done))


def covering(packed: Packed, offset: int, nbytes: int) -> list[tuple[int, int, int, int, int]]:
    """The frames (``Packed.spans``) that hold raw bytes ``offset .. offset + nbytes``."""
    return [s for s in packed.spans() if s[0] < offset + nbytes and s[1] > offset]


def unpack_range(fetch: Callable[[int, int], Any], packed: Packed, offset: int, out: memoryview, where: str) -> None:
    """Raw bytes ``offset .. offset + len(out)`` of a packed file into ``out``:
    ``fetch(start, end)`` returns stored bytes of the object."""
    frames = covering(packed, offset, len(out))
    if not frames:
        return
    stored = memoryview(fetch(frames[0][2], frames[-1][3]))
    base = frames[0][2]
    for r0, r1, s0, s1, item in frames:
        whole = r0 >= offset and r1 <= offset + len(out)
        target = out[r0 - offset:r1 - offset] if whole else memoryview(bytearray(r1 - r0))
        decode_frame(stored[s0 - base:s1 - base], item, target, where)
        if not whole:
            lo, hi = max(r0, offset), min(r1, offset + len(out))
            out[lo - offset:hi - offset] = target[lo - r0:hi - r0]


class Unpacker:
    """A packed object's stored bytes, fed in pieces of any size (``feed``), decoded
    frame by frame to ``write``; ``close`` checks that all of them came."""

    def __init__(self, packed: Packed, write: Callable[[memoryview], object], where: str) -> None:
        self._frames = deque(packed.frames)
        self._write, self._where = write, where
        self._buf = bytearray()

    def feed(self, piece: Any) -> None:
        self._buf += piece
        at = 0
        while self._frames and len(self._buf) - at >= self._frames[0][1]:
            raw, stored, item = self._frames.popleft()
            out = memoryview(bytearray(raw))
            decode_frame(memoryview(self._buf)[at:at + stored], item, out, self._where)
            self._write(out)
            at += stored
        del self._buf[:at]

    def close(self) -> None:
        if self._frames or self._buf:
            raise CheckpointCorrupt(f"{self._where}: the compressed object is {'shorter' if self._frames else 'longer'} "
                                    "than its manifest says; load another step")
