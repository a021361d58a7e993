"""The peer port's transport: messages of one header and at most one payload, over TCP
(AF_UNIX for ``ipc://``), cut into records of at most ``RECORD`` bytes. With keys each
record is its own libsodium box under CurveZMQ's handshake (RFC 26 without cookies: the
server holds each connection's state) and the same key files; without, the records go
in plaintext. Every length is checked before anything is allocated for it, so an
unfinished message holds at most one message's bound (docs/tiers.md, "No message stops
it"). The asking end is ``ckptd.transport.sealed_client``, the listening end
``ckptd.transport.sealed_server``.

On the wire each end first sends ``MAGIC`` and its mode (``CURVE`` or ``PLAIN``). With
keys (C, S: the client's and the port's long-term keys; C', S': each end's ephemeral
key for this connection) the client sends HELLO: C', Box[64 zeros](C'->S); the port
WELCOME: a 16-byte nonce, Box[S'](S->C'); the client INITIATE: Box[C, a vouch's
16-byte nonce, Box[C', S](C->S')](C'->S'); the port READY: Box[](S'->C'), once C is
admitted. Then records in both directions: a 4-byte length, and the record, a box
under the session key (``crypto_box_beforenm``) whose nonce is the direction's prefix
and an 8-byte count of the records sent that way. A message's first record opens with
``PREAMBLE`` (the header's length; the payload's plus 1, or 0 for none) and the header's
first bytes; the rest of the header and then the payload follow, no record spanning
the header's end.
"""

from __future__ import annotations

import mmap
import socket
import struct
from collections import deque
from typing import Any, Callable, Iterator

from nacl._sodium import ffi, lib
from zmq.utils import z85

from ..config import split_host_port
from ..errors import SealBroken

RECORD = 1 << 20
LARGE = 16 << 20
MAC = 16
LENGTH = struct.Struct("!I")
PREAMBLE = struct.Struct("!IQ")  # header bytes; payload bytes + 1, or 0 for none
MAGIC = b"ckptd-peer\x01"
CURVE, PLAIN = b"C", b"P"
GREETING = len(MAGIC) + 1
HELLO = 32 + 64 + MAC
WELCOME = 16 + 32 + MAC
INITIATE = 32 + 16 + 64 + MAC + MAC
READY = MAC
HELLO_NONCE = b"CurveZMQHELLO---" + bytes(8)
INITIATE_NONCE = b"CurveZMQINITIATE" + bytes(8)
READY_NONCE = b"CurveZMQREADY---" + bytes(8)
TO_SERVER, TO_CLIENT = b"CurveZMQMESSAGEC", b"CurveZMQMESSAGES"

Message = tuple[Any, Any]
Sink = Callable[[Any, int], Any]


def raw_key(text: bytes) -> bytes:
    """A Z85 key (as the key files hold it) as its 32 bytes."""
    return z85.decode(text)


def user_id(public: bytes) -> str:
    """The asker's name as ``keys.may_write`` reads it: its long-term public key, Z85."""
    return z85.encode(public).decode()


class Boxes:
    """One session's records: a key made once (``crypto_box_beforenm``), and a nonce per
    direction that counts records, so that a replayed, dropped or reordered record
    fails to open."""

    def __init__(self, key: bytes, mine: bytes, theirs: bytes) -> None:
        self._key = key
        self._mine, self._theirs = mine, theirs
        self._sent = self._opened = 0

    def seal(self, out: memoryview, plain: memoryview) -> None:
        self._sent += 1
        nonce = self._mine + self._sent.to_bytes(8, "big")
        lib.crypto_box_easy_afternm(ffi.from_buffer(out, require_writable=True), ffi.from_buffer(plain),
                                    len(plain), nonce, self._key)

    def open(self, out: memoryview, box: memoryview) -> None:
        self._opened += 1
        nonce = self._theirs + self._opened.to_bytes(8, "big")
        if lib.crypto_box_open_easy_afternm(ffi.from_buffer(out, require_writable=True), ffi.from_buffer(box),
                                            len(box), nonce, self._key) != 0:
            raise SealBroken("a record whose box does not open (tampered, replayed or out of order)")


_SCRATCH = LENGTH.size + PREAMBLE.size + RECORD + MAC
_FREE: list[bytearray] = []


def scratch(n: int) -> memoryview:
    """A buffer for one record of ``n`` bytes: one used before when there is one (neither
    made nor zeroed again for each record; ``release`` gives it back)."""
    if n > _SCRATCH:
        return memoryview(bytearray(n))
    try:
        buf = _FREE.pop()
    except IndexError:
        buf = bytearray(_SCRATCH)
    return memoryview(buf)[:n]


def release(view: memoryview) -> None:
    """``view`` (from ``scratch``) is no longer read or written."""
    buf = view.obj
    if isinstance(buf, bytearray) and len(buf) == _SCRATCH and len(_FREE) < 16:
        _FREE.append(buf)


def records(header: bytes, payload: Any) -> Iterator[memoryview]:
    """A message's plaintext records: the preamble with the first header bytes, the rest
    of the header, then the payload; no record spans the header's end."""
    first = RECORD - PREAMBLE.size
    yield memoryview(PREAMBLE.pack(len(header), 0 if payload is None else len(payload) + 1) + header[:first])
    head = memoryview(header)
    for off in range(first, len(header), RECORD):
        yield head[off:off + RECORD]
    if payload is not None:
        body = memoryview(payload).cast("B")
        for off in range(0, len(body), RECORD):
            yield body[off:off + RECORD]


def size_of(payload: Any) -> int:
    return 0 if payload is None else memoryview(payload).nbytes


class Outbound:
    """Messages queued on one connection, sealed one record at a time as the socket takes
    them: what is held is the queued messages' own buffers and one sealed record.
    ``unwritten``: their bytes not yet in the socket; ``counted``: those of them that
    were made for this answer alone (not views of memory held anyway)."""

    def __init__(self, boxes: Boxes | None = None, *, open_: bool = True) -> None:
        self.boxes = boxes
        self.open = open_
        self.raw: deque[bytes] = deque()
        self._queue: deque[tuple[Iterator[memoryview], bool]] = deque()
        self._wire: list[memoryview] = []
        self._sealed: memoryview | None = None
        self.unwritten = self.counted = 0
        self.messages = 0

    def put(self, header: bytes, payload: Any, counted: bool) -> None:
        n = len(header) + size_of(payload)
        self._queue.append((records(header, payload), counted))
        self.unwritten += n
        self.counted += n if counted else 0
        self.messages += 1

    def pending(self) -> bool:
        return bool(self._wire or self.raw or (self.open and self._queue))

    def write(self, sock: socket.socket) -> bool:
        """Write what the socket takes without blocking; True once nothing is left."""
        while True:
            if not self._wire and self._sealed is not None:
                release(self._sealed)
                self._sealed = None
            if not self._wire and not self._next():
                return True
            try:
                n = sock.sendmsg(self._wire)
            except (BlockingIOError, InterruptedError):
                return False
            while n:
                if n >= len(self._wire[0]):
                    n -= len(self._wire.pop(0))
                else:
                    self._wire[0] = self._wire[0][n:]
                    n = 0

    def _next(self) -> bool:
        if self.raw:
            self._wire = [memoryview(self.raw.popleft())]
            return True
        while self.open and self._queue:
            chunks, counted = self._queue[0]
            plain = next(chunks, None)
            if plain is None:
                self._queue.popleft()
                self.messages -= 1
                continue
            self.unwritten -= len(plain)
            self.counted -= len(plain) if counted else 0
            self._wire = self._seal(plain)
            return True
        return False

    def _seal(self, plain: memoryview) -> list[memoryview]:
        if self.boxes is None:
            return [memoryview(LENGTH.pack(len(plain))), plain]
        out = self._sealed = scratch(LENGTH.size + len(plain) + MAC)
        LENGTH.pack_into(out, 0, len(plain) + MAC)
        self.boxes.seal(out[LENGTH.size:], plain)
        return [out]


class Inbound:
    """One connection's records read back into messages. Each length is checked against
    what may come next (``RECORD``, the rest of the header or payload, ``max_header``,
    ``max_payload``) before its bytes are read, and a record is opened straight into the
    message's buffer, made once at its declared size (pages of large ones are touched
    only as bytes arrive). ``held``: bytes allocated for the message being read;
    ``sink(header, n)``: where its payload of ``n`` bytes goes (a buffer of that
    length, or None for one made here)."""

    def __init__(self, boxes: Boxes | None, max_header: int, max_payload: int, sink: Sink | None = None) -> None:
        self.boxes = boxes
        self.max_header, self.max_payload = max_header, max_payload
        self.sink = sink
        self._len = bytearray(LENGTH.size)
        self._len_got = 0
        self._rec: memoryview | None = None
        self._into: memoryview | None = None
        self._reset()

    def _reset(self) -> None:
        self.head: Any = None
        self._hlen = self._hgot = self._plen = self._paid = 0
        self._dst: Any = None
        self.held = 0

    @property
    def mid(self) -> bool:
        """Whether a message has begun and not ended (its sender owes bytes)."""
        return self.head is not None or self._len_got > 0 or self._rec is not None

    def buffer(self) -> memoryview:
        """Where the next bytes read from the socket go."""
        if self._rec is None:
            return memoryview(self._len)[self._len_got:]
        return self._rec[self._rec_got:]

    def received(self, n: int) -> Message | None:
        """``n`` bytes were read into ``buffer()``; the message they end, if any."""
        if self._rec is None:
            self._len_got += n
            if self._len_got == LENGTH.size:
                self._len_got = 0
                self._begin(LENGTH.unpack(self._len)[0])
            return None
        self._rec_got += n
        if self._rec_got < len(self._rec):
            return None
        return self._end()

    def _target(self) -> memoryview | None:
        """The rest of the header or payload that the next record fills; None: a new message."""
        if self.head is None:
            return None
        if self._hgot < self._hlen:
            return memoryview(self.head)[self._hgot:self._hlen]
        return memoryview(self._dst).cast("B")[self._paid:self._plen]

    def _begin(self, wire: int) -> None:
        mac = MAC if self.boxes is not None else 0
        into = self._target()
        room = PREAMBLE.size + RECORD if into is None else min(RECORD, len(into))
        if not 1 <= wire - mac <= room:
            raise SealBroken(f"a record of {wire} bytes where {mac + 1} to {mac + room} may come")
        self._into = None if into is None else into[:wire - mac]
        if self.boxes is None and self._into is not None:
            self._rec = self._into
        else:
            self._rec = scratch(wire)
            self.held += wire
        self._rec_got = 0

    def _end(self) -> Message | None:
        rec, into, self._rec, self._into = self._rec, self._into, None, None
        assert rec is not None
        if into is None:
            self._start(self._open(rec))
        elif self.boxes is not None:
            self.boxes.open(into, rec)
        if rec is not into:
            self.held -= len(rec)
            release(rec)
        n = 0 if into is None else len(into)
        if self._hgot < self._hlen:
            self._hgot += n
        else:
            self._paid += n
        return self._complete()

    def _open(self, rec: memoryview) -> memoryview:
        if self.boxes is None:
            return rec
        out = memoryview(bytearray(len(rec) - MAC))
        self.boxes.open(out, rec)
        return out

    def _start(self, plain: memoryview) -> None:
        if len(plain) < PREAMBLE.size:
            raise SealBroken(f"a message's first record of {len(plain)} bytes, shorter than its preamble")
        hlen, pcode = PREAMBLE.unpack_from(plain)
        if hlen > self.max_header or len(plain) - PREAMBLE.size > hlen:
            raise SealBroken(f"a header of {hlen} bytes (at most {self.max_header})")
        if pcode - 1 > self.max_payload:
            raise SealBroken(f"a payload of {pcode - 1} bytes (at most {self.max_payload})")
        self._hlen, self._plen = hlen, pcode - 1
        self.head = allocate(hlen)
        self._hgot = len(plain) - PREAMBLE.size
        self.head[:self._hgot] = plain[PREAMBLE.size:]
        self.held += hlen

    def _complete(self) -> Message | None:
        if self._hgot < self._hlen:
            return None
        if self._plen >= 0 and self._dst is None:
            dst = self.sink(self.head, self._plen) if self.sink is not None else None
            self.held += 0 if dst is not None else self._plen
            self._dst = dst if dst is not None else allocate(self._plen)
        if self._dst is not None and self._paid < self._plen:
            return None
        message = self.head, self._dst
        self._reset()
        return message


def allocate(n: int) -> Any:
    """A writable buffer of ``n`` bytes; one larger than a payload of the default frame,
    of untouched pages (an anonymous map), so that what a large declared size costs is
    what its sender sent."""
    return bytearray(n) if n <= LARGE else mmap.mmap(-1, n)


def address(endpoint: str) -> tuple[int, Any]:
    """(socket family, address) of a ``tcp://HOST:PORT`` or ``ipc://PATH`` endpoint."""
    if endpoint.startswith("ipc://"):
        return socket.AF_UNIX, endpoint[len("ipc://"):]
    host, port = split_host_port(endpoint.removeprefix("tcp://"))
    host = "0.0.0.0" if host == "*" else host
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return family, addr


def stream(family: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    if family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
