"""Bytes of a share from one peer (``PeerTransfer``): ranges asked in ``frame``-sized
parts with ``window`` in flight, each landing in its place, every tensor hashed as its
bytes land and compared once its last byte is in. Start at ``read_files`` (whole files, to land in a root).
"""

from __future__ import annotations

import mmap
from collections import deque
from typing import Any, Callable


from ..config import PeerConfig
from ..errors import CheckpointCorrupt, ProtocolError
from ..manifest import Checksum, Manifest
from ..peer import messages
from ..peer.holder import check_headers
from ..peer.pages import Prefault


Span = tuple[str, int, int, str]
Write = Callable[[int, memoryview], None]
Readable = Callable[[str, int, bool], int]


class PeerTransfer:
    def __init__(self, cfg: PeerConfig, keys: Any) -> None:
        self.cfg, self.keys = cfg, keys

    def read_files(self, endpoint: str, m: Manifest, into: dict[str, memoryview] | None = None,
                   done: Callable[[str], None] | None = None, write: dict[str, Write] | None = None, *,
                   readable: Readable | None = None) -> dict[str, memoryview]:
        """The files of ``m``'s share read from ``endpoint`` and checked: every tensor
        against its checksum, each chunk file's header against the manifest. ``into``:
        memory for each file (``share_files``' sizes), else fresh; ``done(file)`` is
        called as each file is in and checked, in turn. ``write``: for each file, where
        its parts go instead (``write(offset, bytes)``, a file's ``pwrite``: the kernel
        copies them into the page cache, with no page fault per page as a mapping
        takes); ``into`` then only reads its header back. ``readable(file, need, wait)``:
        how far ``file`` may be read now (a share its peer still lands), ``wait``: once
        that reaches ``need``; every byte when None."""
        out = into if into is not None else {f: _fresh(n) for f, n in share_files(m).items()}
        where = f"run {m.run!r} step {m.step} rank {m.rank} from {endpoint}"

        def checked(file: str) -> None:
            check_headers(m, {file: out[file]}, where)
            if done is not None:
                done(file)

        ranges = [_Range(file, 0, buf, _tensor_spans(m, file, len(buf)), done=checked,
                         write=write.get(file) if write else None) for file, buf in out.items()]
        self._read_ranges(endpoint, m, ranges, [] if write else list(out.values()), readable)
        return out

    def _read_ranges(self, endpoint: str, m: Manifest, ranges: list[_Range], fresh: list[memoryview],
                     readable: Readable | None = None) -> None:
        """Each range's memory filled from ``endpoint``, the next parts asked for before one
        is hashed; ``fresh``: memory allocated for this read, whose pages a thread faults
        in ahead of the bytes; ``readable`` as ``read_files``."""
        where = f"run {m.run!r} step {m.step} rank {m.rank} from {endpoint}"
        for r in ranges:
            r.check_empty(where)
            if r.size == 0 and r.done is not None:
                r.done(r.file)
        parts = _Parts(ranges, self.cfg.frame, readable)
        link = messages.Link(endpoint, self.keys, hwm=self.cfg.window * 2 + 4,
                             max_message=max(messages.MAX_HEADER_BYTES, self.cfg.frame))
        prefault = Prefault(fresh, self.cfg.frame)
        in_flight: deque[tuple[int, _Range, int, int]] = deque()

        def ask() -> None:
            """Parts asked for up to ``window`` in flight, as far as they are readable; at least one while any is left."""
            while len(in_flight) < self.cfg.window and (part := parts.next(wait=not in_flight)) is not None:
                r, off, n = part
                req = {"op": "read", "run": m.run, "step": m.step, "rank": m.rank, "file": r.file,
                       "offset": r.offset + off, "length": n}
                in_flight.append((link.send(req, timeout=self.cfg.stall), r, off, n))

        try:
            ask()
            while in_flight:
                rid, r, off, n = in_flight.popleft()
                if r.write is not None:
                    data = link.recv_bytes(rid, n, timeout=self.cfg.stall)
                    ask()
                    r.take(off, data, where)
                else:
                    link.recv_into(rid, r.view[off:off + n], timeout=self.cfg.stall)
                    ask()
                    r.landed(off, off + n, where)
                if off + n == r.size and r.done is not None:
                    r.done(r.file)
        finally:
            prefault.close()
            link.close()


class _Parts:
    """The parts to ask for, file after file, each at most ``frame`` bytes and within what
    ``readable`` says may be read of it."""

    def __init__(self, ranges: list[_Range], frame: int, readable: Readable | None) -> None:
        self.todo = deque(r for r in ranges if r.size)
        self.frame, self.readable, self.at = frame, readable, 0

    def next(self, *, wait: bool) -> tuple[_Range, int, int] | None:
        """The next part; None when none is left, or (unless ``wait``) none is readable yet."""
        if not self.todo:
            return None
        r, off = self.todo[0], self.at
        end = r.size if self.readable is None else min(r.size, self.readable(r.file, r.offset + off + 1, wait) - r.offset)
        n = min(self.frame, end - off)
        if n <= 0 and wait:
            raise ProtocolError(f"{r.file} is readable to {end + r.offset} bytes, not past {off + r.offset}")
        if n <= 0:
            return None
        self.at += n
        if self.at == r.size:
            self.todo.popleft()
            self.at = 0
        return r, off, n


class _Range:
    """Bytes of one file (from ``offset``) into ``view``, and the tensors among them
    (``spans``, relative to ``view``), hashed part by part as they land, in order;
    ``write``: each part goes there instead of into ``view``, hashed on its way;
    ``done(file)``: called once its last byte is in and hashed."""

    def __init__(self, file: str, offset: int, view: memoryview, spans: list[Span], *,
                 done: Callable[[str], None] | None = None, write: Write | None = None) -> None:
        self.file, self.offset, self.view, self.done, self.write = file, offset, view, done, write
        self.size = len(view)
        self.spans = spans
        self._todo = deque(sorted(spans, key=lambda s: s[1]))
        self._open: list[tuple[str, int, int, str, Checksum]] = []

    def check_empty(self, where: str) -> None:
        """Tensors of no bytes: their checksum is the empty string's, compared now."""
        for name, start, end, want in [s for s in self._todo if s[1] == s[2]]:
            self._todo.remove((name, start, end, want))
            _compare(where, name, Checksum(), want)

    def take(self, begin: int, data: memoryview, where: str) -> None:
        """``data``, the bytes from ``begin``: hashed, then written (``write``)."""
        assert self.write is not None
        self.landed(begin, begin + len(data), where, data)
        self.write(self.offset + begin, data)

    def landed(self, begin: int, end: int, where: str, data: memoryview | None = None) -> None:
        """Bytes ``begin``..``end`` are in: in ``view``, or ``data`` holds them."""
        src, base = (self.view, 0) if data is None else (data, begin)
        while self._todo and self._todo[0][1] < end:
            self._open.append((*self._todo.popleft(), Checksum()))
        for span in list(self._open):
            name, start, stop, want, h = span
            if max(begin, start) < min(end, stop):
                h.update(src[max(begin, start) - base:min(end, stop) - base])  # type: ignore[index]
            if stop <= end:
                self._open.remove(span)
                _compare(where, name, h, want)


def _compare(where: str, name: str, h: Checksum, want: str) -> None:
    if h.text() != want:
        raise CheckpointCorrupt(f"{where}: tensor {name!r} does not match its checksum")


def _fresh(n: int) -> memoryview:
    """``n`` bytes of new anonymous memory. Not torch's: the daemon lands shares through
    here and never imports torch, whose import would hold up the recovery that needs it."""
    return memoryview(mmap.mmap(-1, n) if n else bytearray())


def share_files(m: Manifest) -> dict[str, int]:
    """The data files of ``m``'s share and their sizes."""
    sizes = {f: m.files.get(f) for f in sorted(set(m.files) | {t.file for t in m.tensors.values()})}
    if any(n is None for n in sizes.values()):
        raise CheckpointCorrupt("its manifest does not list its files' sizes")
    return sizes  # type: ignore[return-value]


def _tensor_spans(m: Manifest, file: str, size: int) -> list[Span]:
    out = []
    for name, t in m.tensors.items():
        if t.file != file:
            continue
        if t.offset is None:
            raise CheckpointCorrupt(f"tensor {name!r} is a chunked (compressed) HDF5 dataset, whose bytes the peer "
                                    "tier cannot check")
        if t.offset + t.nbytes > size:
            raise CheckpointCorrupt(f"tensor {name!r} lies beyond the end of {file}")
        out.append((name, t.offset, t.offset + t.nbytes, t.checksum))
    return out
