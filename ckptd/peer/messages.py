"""Messages between peers: a msgpack header frame (a map with ``op``), and for
``part`` requests and ``read`` answers a second frame of raw bytes. Nothing is
pickled; every field a receiver uses is checked (``field``).

Requests (DEALER -> the holder's ROUTER), each with an ``id`` echoed in its answer:

- ``ping`` -> ``{node}``: the answering daemon's id (a daemon told to replicate
  to itself finds out so).
- ``offer`` ``{run, step, rank, manifest, files: {name: size}, keep_last}`` ->
  ``{xfer}`` or an error (``full``): room is reserved for the share's files.
- ``part`` ``{xfer, file, offset}`` + bytes -> ``{}``: bytes of one file.
- ``done`` ``{xfer}`` -> ``{}`` once every byte arrived and every tensor matched
  its checksum; only then does the holder serve the share.
- ``holds`` ``{shares: [[run, step, rank], ...]}`` -> ``{held: [bool, ...]}``: which of
  these shares this daemon holds in memory (a sender's liveness check of its partners).
- ``drop`` ``{runs: {run: [step, ...]}}`` (or one run: ``{run, steps}``) -> ``{dropped}``:
  the sender's retention deleted these steps (a sender batches them: one message per
  heartbeat, at most ``MAX_STEPS_DROPPED`` steps in all).
- ``steps`` ``{run, limit, step?}`` -> ``{steps: [{step, shares: [{rank, attempt,
  world_size, where}]}], more}``: the newest ``limit`` (at most ``MAX_STEPS_ANSWERED``)
  steps of a run of which this daemon can serve a share, newest first (``step``: that
  step alone), each share ``where`` it is: ``memory`` (a replica) or ``disk`` (its own
  root), one entry a rank, memory first; at most ``MAX_SHARES_ANSWERED`` shares in all;
  ``more``: older steps were left out. No manifest: a reader learns which step is
  complete across the peers from these, then asks for the manifests it lacks.
- ``manifests`` ``{run, step, ranks}`` -> ``{manifests: [{rank, where, manifest}],
  left}``: the manifests of those of ``ranks`` (at most ``MAX_RANKS_ASKED``) whose
  shares of ``step`` this daemon can serve, memory before disk; ranks it does not hold
  are left out; ``left``: ranks it holds but left out to keep the manifests of one
  answer under ``MAX_MANIFEST_BYTES`` (ask again for them).
- ``read`` ``{run, step, rank, file, offset, length}`` -> ``{}`` + the bytes: of a
  share held in memory, any range within the file (a view of that memory, sent without
  a copy: a plaintext reader asks for a tensor of up to 64 MiB in one message, which
  becomes the tensor's memory on its side); of a share on disk, at most ``frame`` bytes
  (+ 64 KiB).

An answer is ``{id, ok: true, ...}`` or ``{id, ok: false, error}``. Every field is
bounded before use: counts by the ``MAX_*`` limits below, offsets and lengths by the
file's size (and, read from disk, the frame size); a request that breaks a bound, or any other request
the holder cannot handle, is answered with an error (never a dead thread).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgpack
import zmq

from ..errors import ConfigError, PeerDown, PeerRefused, ProtocolError  # PeerDown, PeerRefused: re-exported

MAX_HEADER_BYTES = 64 * 2**20  # a ``manifests`` answer carries manifests
MAX_MANIFEST_BYTES = 48 * 2**20  # manifests in one ``manifests`` answer (one larger one is answered alone)
MAX_STEPS_ANSWERED = 64  # steps in one ``steps`` answer
MAX_SHARES_ANSWERED = 4096  # shares in one ``steps`` answer
MAX_RANKS_ASKED = 4096  # ranks in one ``manifests`` request
MAX_SHARES_ASKED = 100_000  # shares in one ``holds``
MAX_STEPS_DROPPED = 100_000  # steps in one ``drop``, over all its runs
MAX_FILES_OFFERED = 100_000  # files in one ``offer``


def pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack(frame: Any) -> dict[str, Any]:
    raw = frame.buffer if hasattr(frame, "buffer") else frame
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"a peer header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=MAX_HEADER_BYTES,
                                 max_bin_len=MAX_HEADER_BYTES)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"a peer header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("a peer header is not a map")
    return header


def field(header: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``header[key]``, checked to be a ``kind`` (ints non-negative, never a bool)."""
    value = header.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool \
            or isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ProtocolError(f"peer message {header.get('op')!r}: field {key!r} is {value!r}, not a {kind}")
    return value


class Link:
    """One DEALER to one peer's ``listen`` endpoint: requests sent without blocking,
    answers matched by id. Used from one thread; ``close`` it after a stall (a new
    link starts clean, with no stale answers queued)."""

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: Any = None, *, hwm: int = 64,
                 max_message: int = MAX_HEADER_BYTES) -> None:
        from ..transport.curve import secure_client

        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a peer that answers more than was asked is cut off by libzmq, not buffered
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message + 65536)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a peer not (yet) connected
        if hasattr(keys, "for_endpoint"):  # one key pair per node: this peer's public key
            try:
                keys = keys.for_endpoint(endpoint)
            except ConfigError as exc:
                self.sock.close(linger=0)
                raise PeerRefused(f"{endpoint}: {exc}") from None
        self._handshake = secure_client(self.sock, keys)
        self.sock.connect(endpoint)

    def send(self, header: dict[str, Any], payload: Any = None, *, timeout: float) -> int:
        """Send a request; its id. PeerDown when it cannot leave within ``timeout``."""
        rid = next(self._ids)
        frames = [pack(dict(header, id=rid))] + ([payload] if payload is not None else [])
        if not self.sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise PeerDown(f"{self.endpoint}: not connected or not taking requests after {timeout:g} s")
        self.sock.send_multipart(frames, copy=payload is None or len(payload) < 65536, flags=zmq.NOBLOCK)
        return rid

    def recv(self, rid: int, *, timeout: float) -> tuple[dict[str, Any], Any]:
        """The answer to request ``rid`` (older answers are skipped): (header, payload
        frame or None). PeerDown after ``timeout`` s of silence, PeerRefused for an error."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise PeerDown(f"{self.endpoint}: no answer in {timeout:g} s")
            frames = self.sock.recv_multipart(copy=False)
            header = unpack(frames[0])
            if header.get("id") != rid:
                if isinstance(header.get("id"), int) and header["id"] > rid:
                    raise ProtocolError(f"{self.endpoint}: answers out of order")
                continue
            if not header.get("ok"):
                raise PeerRefused(f"{self.endpoint}: {header.get('error', 'refused')}")
            return header, frames[1] if len(frames) > 1 else None

    def recv_into(self, rid: int, dst: memoryview, *, timeout: float) -> dict[str, Any]:
        """The answer to request ``rid``, its bytes received straight into ``dst`` by
        libzmq (no frame allocated, no copy under the GIL): exactly ``len(dst)`` of them,
        else ProtocolError. PeerDown and PeerRefused as ``recv``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise PeerDown(f"{self.endpoint}: no answer in {timeout:g} s")
            header = unpack(self.sock.recv())
            if header.get("id") != rid or not header.get("ok"):
                self._discard_rest()
                if header.get("id") != rid:
                    if isinstance(header.get("id"), int) and header["id"] > rid:
                        raise ProtocolError(f"{self.endpoint}: answers out of order")
                    continue
                raise PeerRefused(f"{self.endpoint}: {header.get('error', 'refused')}")
            n = self.sock.recv_into(dst) if self.sock.getsockopt(zmq.RCVMORE) else -1
            if n != len(dst) or self.sock.getsockopt(zmq.RCVMORE):
                self._discard_rest()
                raise ProtocolError(f"{self.endpoint}: a part of {max(n, 0)} bytes, not {len(dst)}")
            return header

    def recv_bytes(self, rid: int, n: int, *, timeout: float) -> memoryview:
        """The bytes answering request ``rid``: exactly ``n`` of them, else ProtocolError;
        the message's own memory, writable (libzmq received it there: no copy made).
        PeerDown and PeerRefused as ``recv``."""
        _, frame = self.recv(rid, timeout=timeout)
        if frame is None or len(frame) != n:
            raise ProtocolError(f"{self.endpoint}: an answer of {0 if frame is None else len(frame)} bytes, not {n}")
        return frame.buffer

    def _discard_rest(self) -> None:
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv_into(bytearray())

    def request(self, header: dict[str, Any], payload: Any = None, *, timeout: float) -> tuple[dict[str, Any], Any]:
        return self.recv(self.send(header, payload, timeout=timeout), timeout=timeout)

    def close(self) -> None:
        self._handshake.close()
        self.sock.close(linger=0)
