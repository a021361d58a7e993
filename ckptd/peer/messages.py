"""Messages between peers: a msgpack header frame (a map with ``op``), and for
``part`` requests and ``read`` answers a second frame of raw bytes. ``REQUESTS`` is
the schema of every request (what each op asks and answers: docs/tiers.md), checked
by ``ckptd.transport.wire``'s decoder before anything reads a field; ``Link`` is the
asking end. Every request and answer carries ``v``, the peer protocol version.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError, PeerDown, PeerRefused, PeerRequestRefused as Refused, PeerVersion, ProtocolError
from ..transport import sealed_client, wire

VERSION = 2
OLDEST_VERSION = 1
MAX_HEADER_BYTES = 64 * 2**20  # a ``manifests`` answer carries manifests
MAX_MANIFEST_BYTES = 48 * 2**20
MAX_STEPS_ANSWERED = 64
MAX_SHARES_ANSWERED = 4096
MAX_RANKS_ASKED = 4096
MAX_SHARES_ASKED = 100_000
MAX_STEPS_DROPPED = 100_000
MAX_FILES_OFFERED = 100_000
MAX_NAME = 1024
MAX_CONTAINERS = 2 * MAX_SHARES_ASKED + 64


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _name(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_NAME


def _uints(limit: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and len(v) <= limit and all(_uint(i) for i in v)


def _share(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 3 and _name(v[0]) and _uint(v[1]) and _uint(v[2])


def _runs(v: Any) -> bool:
    return (isinstance(v, dict) and all(_name(k) and _uints(MAX_STEPS_DROPPED)(s) for k, s in v.items())
            and sum(len(s) for s in v.values()) <= MAX_STEPS_DROPPED)


KINDS: dict[str, Callable[[Any], bool]] = {
    **wire.KINDS,
    "int": _uint,
    "str": _name,
    "sizes": lambda v: (isinstance(v, dict) and len(v) <= MAX_FILES_OFFERED
                        and all(_name(k) and _uint(n) for k, n in v.items())),
    "shares": lambda v: isinstance(v, list) and len(v) <= MAX_SHARES_ASKED and all(_share(s) for s in v),
    "ranks": _uints(MAX_RANKS_ASKED),
    "steps": _uints(MAX_STEPS_DROPPED),
    "runs": _runs,
}

SAID = {
    "int": "an integer from 0 to 2**63 - 1",
    "str": f"a string of at most {MAX_NAME} characters",
    "sizes": f"a map of at most {MAX_FILES_OFFERED} file names to sizes",
    "shares": f"a list of at most {MAX_SHARES_ASKED} [run, step, rank]",
    "ranks": f"a list of at most {MAX_RANKS_ASKED} integers",
    "steps": f"a list of at most {MAX_STEPS_DROPPED} integers",
    "runs": f"a map of run names to lists of steps, at most {MAX_STEPS_DROPPED} steps in all",
}

# op -> {field: kind}, kinds as in ``KINDS`` ("?": optional). What each answers: ping
# {node, listen}; offer {xfer} (room reserved); part {}; done {} once verified; cancel
# {freed}; holds {held: [bool]}; drop {dropped}; steps {steps: [{step, shares: [{rank,
# attempt, world_size, where}]}], more}; manifests {manifests: [{rank, where, manifest}],
# left}; read {} + the bytes; pull {landed, readable?} (a bucket share in the root, else
# its download started, each file readable up to its mark: docs/tiers.md, "Read once";
# with wait_ms, answered once a mark passes have, or within that time).
# An error is {ok: false, error, code?}.
REQUESTS: dict[str, dict[str, str]] = {
    "ping": {},
    "offer": {"manifest": "bin", "files": "sizes", "keep_last": "int"},
    "part": {"xfer": "int", "file": "str", "offset": "int"},
    "done": {"xfer": "int"},
    "cancel": {"xfer": "int"},
    "holds": {"shares": "shares"},
    "drop": {"runs": "runs?", "run": "str?", "steps": "steps?"},
    "steps": {"run": "str", "limit": "int", "step": "int?"},
    "manifests": {"run": "str", "step": "int", "ranks": "ranks"},
    "read": {"run": "str", "step": "int", "rank": "int", "file": "str", "offset": "int", "length": "int"},
    "pull": {"run": "str", "step": "int", "rank": "int", "have": "sizes?", "wait_ms": "int?"},
}
TOO_NEW = "version"
RECONNECT_S = 0.1  # as libzmq's reconnect interval


@dataclass(frozen=True)
class Request:
    op: str
    fields: dict[str, Any]
    payload: Any
    rid: int | None
    version: int


def decode_request(frames: list[Any]) -> Request:
    """A request's frames (after the asker's identity) checked against ``REQUESTS``:
    bounded in bytes, containers, names and counts; fields the op does not know are
    left out unread. ProtocolError naming what is wrong (``rid`` on it when known)."""
    if not frames or len(frames) > 2:
        raise ProtocolError(f"a peer request of {len(frames)} frames, not 1 or 2")
    header = wire.unpack_map(_buffer(frames[0]), "a peer header", max_bytes=MAX_HEADER_BYTES,
                             max_containers=MAX_CONTAINERS)
    rid = header.get("id")
    rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    op, version = header.get("op"), header.get("v", OLDEST_VERSION)
    try:
        if not _uint(version) or version > VERSION:
            raise Refused(f"a request of peer protocol version {wire.short(version)}; this node speaks "
                          f"{OLDEST_VERSION} to {VERSION}: upgrade it (docs/runbook.md)", TOO_NEW)
        if not isinstance(op, str) or op not in REQUESTS:
            raise ProtocolError(f"unknown peer request {wire.short(op)}")
        schema = REQUESTS[op]
        fields = {k: header[k] for k in schema if k in header}
        wire.check_fields(op, fields, schema, KINDS, SAID)
    except ProtocolError as exc:
        exc.rid = rid  # type: ignore[attr-defined]
        raise
    return Request(op, fields, frames[1] if len(frames) > 1 else None, rid, version)


def _buffer(frame: Any) -> Any:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


def pack(header: dict[str, Any]) -> bytes:
    return wire.pack(header)


def unpack(frame: Any) -> dict[str, Any]:
    return wire.unpack_map(_buffer(frame), "a peer header", max_bytes=MAX_HEADER_BYTES,
                           max_containers=MAX_CONTAINERS)


def field(header: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``header[key]``, checked to be a ``kind`` (ints non-negative, never a bool)."""
    value = header.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool \
            or isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ProtocolError(f"peer message {wire.short(header.get('op'))}: field {key!r} is {wire.short(value)}, "
                            f"not a {kind}")
    return value


class Link:
    """One connection to one peer's ``listen`` endpoint (``ckptd.transport.sealed_client``):
    requests sent without waiting for their answers, answers matched by id. Used from
    one thread; ``close`` it after a stall (a new link starts clean, with no stale
    answers queued). A connection that breaks is made again by the next ``send``.
    ``version``: the peer protocol version of the peer's last answer (an answer without
    ``v`` is version 1's)."""

    _ids = itertools.count(1)

    def __init__(self, endpoint: str, keys: Any = None, *, hwm: int = 64,
                 max_message: int = MAX_HEADER_BYTES) -> None:
        """``max_message``: the largest
        payload an answer may carry (a peer that answers more is cut off, not buffered)."""
        self.endpoint = endpoint
        if hasattr(keys, "for_endpoint"):
            try:
                keys = keys.for_endpoint(endpoint)
            except ConfigError as exc:
                raise PeerRefused(f"{endpoint}: {exc}") from None
        self._keys, self._hwm, self._max = keys, hwm, max_message + 65536
        self._chan = self._connect()
        self.version: int | None = None

    @property
    def sock(self) -> int:
        """The file descriptor to poll (``zmq.Poller``, ``select``) for its answers."""
        return self._chan.sock.fileno()

    def _connect(self) -> sealed_client.Channel:
        try:
            return sealed_client.Channel(self.endpoint, self._keys, max_header=MAX_HEADER_BYTES,
                                         max_payload=self._max, hwm=self._hwm)
        except (OSError, ValueError) as exc:
            raise PeerDown(f"{self.endpoint}: cannot connect: {exc}") from None

    def send(self, header: dict[str, Any], payload: Any = None, *, timeout: float) -> int:
        """Send a request; its id. PeerDown when it cannot leave within ``timeout`` (a
        connection that broke, or was refused, is made again every ``RECONNECT_S``)."""
        rid = next(self._ids)
        deadline = time.monotonic() + timeout
        while True:
            if self._chan.broken is not None and time.monotonic() - self._chan.began >= RECONNECT_S:
                self._chan.close()
                self._chan = self._connect()
            try:
                self._chan.send(pack(dict(header, id=rid, v=VERSION)), payload, deadline)
                return rid
            except PeerDown:
                if self._chan.broken is None or time.monotonic() + RECONNECT_S >= deadline:
                    raise
            time.sleep(max(0.0, self._chan.began + RECONNECT_S - time.monotonic()))

    def recv(self, rid: int, *, timeout: float) -> tuple[dict[str, Any], Any]:
        """The answer to request ``rid`` (older answers are skipped): (header, payload
        or None). PeerDown after ``timeout`` s of silence, PeerRefused for an error."""
        deadline = time.monotonic() + timeout
        while True:
            head, payload = self._chan.recv(deadline)
            header = unpack(head)
            if self._mine(header, rid):
                self._answered(header)
                return header, payload

    def _mine(self, header: dict[str, Any], rid: int) -> bool:
        got = header.get("id")
        if got != rid and isinstance(got, int) and got > rid:
            raise ProtocolError(f"{self.endpoint}: answers out of order")
        return got == rid

    def recv_into(self, rid: int, dst: memoryview, *, timeout: float) -> dict[str, Any]:
        """The answer to request ``rid``, its bytes opened straight into ``dst``, record
        by record: exactly ``len(dst)`` of them, else ProtocolError. PeerDown and
        PeerRefused as ``recv``."""
        deadline = time.monotonic() + timeout
        view = memoryview(dst).cast("B")

        def sink(head: bytearray, n: int) -> Any:
            header = unpack(head)
            return view if n == len(view) and header.get("id") == rid and header.get("ok") is True else None

        while True:
            head, payload = self._chan.recv(deadline, sink)
            header = unpack(head)
            if self._mine(header, rid):
                self._answered(header)
                if payload is not view:
                    n = 0 if payload is None else memoryview(payload).nbytes
                    raise ProtocolError(f"{self.endpoint}: a part of {n} bytes, not {len(view)}")
                return header

    def recv_bytes(self, rid: int, n: int, *, timeout: float) -> memoryview:
        """The bytes answering request ``rid``: exactly ``n`` of them, else ProtocolError;
        memory of their own, writable. PeerDown and PeerRefused as ``recv``."""
        _, payload = self.recv(rid, timeout=timeout)
        if payload is None or len(payload) != n:
            raise ProtocolError(f"{self.endpoint}: an answer of {0 if payload is None else len(payload)} bytes, "
                                f"not {n}")
        return memoryview(payload)

    def _answered(self, header: dict[str, Any]) -> None:
        """Note the answer's version; PeerVersion or PeerRefused for an error answer."""
        v = header.get("v", OLDEST_VERSION)
        self.version = v if _uint(v) else None
        if header.get("ok") is True:
            return
        error = header.get("error")
        error = error[:4096] if isinstance(error, str) else "refused"
        if header.get("code") == TOO_NEW:
            raise PeerVersion(f"{self.endpoint} speaks peer protocol version {wire.short(v)}, this node "
                              f"{VERSION}: {error}")
        raise PeerRefused(f"{self.endpoint}: {error}")

    def request(self, header: dict[str, Any], payload: Any = None, *, timeout: float) -> tuple[dict[str, Any], Any]:
        return self.recv(self.send(header, payload, timeout=timeout), timeout=timeout)

    def close(self) -> None:
        self._chan.close()
