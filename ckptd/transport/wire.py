"""The wire protocol between a producer (DEALER) and the daemon (ROUTER).

Every message is one msgpack-encoded header frame; a ``tensor`` message carries
its bytes in a second frame, unless it names them by ``offset`` and ``length`` in
the producer's shared staging arena (``ckptd.transport.handoff``). Headers are maps with an ``op`` key. The full
message list, with field types, is ``SCHEMAS`` below and ``docs/format.md``.

Decoding trusts nothing: frame counts, header size, msgpack container sizes,
every field's type and range are checked, and any violation is a
``ProtocolError`` whose message names what was wrong. Declared sizes are
compared against the bytes that actually arrived.
"""

from __future__ import annotations

import reprlib
from typing import Any, Callable

import msgpack

from ..errors import CheckpointError, CheckpointNotFound, ProtocolError, TierUnavailable

VERSION = 1
MAX_HEADER_BYTES = 64 * 2**20  # a commit header carries the state's structure
_MAX_CONTAINER = 1_000_000
_MAX_DIMS = 64

# op -> {field: type}. "int" is a non-negative int that is not a bool; "shape" a
# list of such ints; "json" a str that holds JSON text; "maps" a list of maps;
# "any?" marks optional.
SCHEMAS: dict[str, dict[str, str]] = {
    # producer -> daemon
    "hello": {"v": "int", "run": "str", "rank": "int", "world_size": "int", "pid": "int",
              "host": "str", "retention": "map?", "format": "str?", "shm_token": "bin?", "shm_size": "int?",
              "attempt": "str?"},
    "tensor": {"seq": "int", "step": "int", "name": "str", "dtype": "str", "shape": "shape",
               "nbytes": "int", "start": "int", "numpy": "bool", "offset": "int?", "length": "int?",
               "shard": "map?", "frozen": "bool?"},
    # small tensors in one region of the shared arena: items are [name, dtype, shape,
    # nbytes, numpy, offset] (``batch_pieces``); shared memory only. ``frozen`` (on
    # ``tensor`` too): declared frozen, kept in chunk files of their own (daemon.reuse)
    "tensors": {"seq": "int", "step": "int", "items": "batch", "frozen": "bool?"},
    # tensors unchanged since step ``base`` (``save(frozen=...)``), sent without their
    # bytes: items are [name, dtype, shape, numpy, shard or None] (``SAME_ITEM``)
    "same": {"seq": "int", "step": "int", "base": "int", "items": "same"},
    "commit": {"seq": "int", "step": "int", "ntensors": "int", "state": "json",
               "metadata": "json", "replicas": "map?",
               # replica comparison (ckptd.replicas): this rank's digests of its replicated
               # pieces, and the producer's compare_replicas policy
               "digests": "map?", "compare": "str?",
               # what the save cost the training loop: stall_s, and restore_s (the loads before it)
               "timing": "map?",
               # the tiers rank 0's pick named this step due for (docs/advise.md); absent: all
               "tiers": "names?"},
    "abort": {"seq": "int", "step": "int", "reason": "str"},
    # the producer waits for staging: write out every chunk still gathered for it
    "drain": {"seq": "int", "through": "int?"},
    "ping": {"seq": "int"},
    "latest": {"seq": "int", "run": "str"},
    "list": {"seq": "int", "run": "str"},  # from `ckptd list --endpoint`, without a session
    "status": {"seq": "int"},  # also from `ckptd status`, without a session
    # a reader asks its node's daemon for a step held by the peers (docs/tiers.md, "Recovery"):
    # step None: the newest; ranks None: the step's manifests; else those ranks' shares
    # landed in ``root`` (the daemon's); ``memory``: the step's info if every rank's share is
    # in a peer's memory (wait_complete), else what lacks as ``progress``. Answered
    # ``recovered``, ``done`` false while under way; with ``seen`` (files already named to
    # this reader) it is answered as soon as more are ``landed``: in place, checked, to read.
    "recover": {"seq": "int", "run": "str", "step": "int?", "ranks": "ints?", "root": "str", "memory": "bool?",
                "seen": "int?"},
    # ``ranks``' shares of a step in bucket ``url`` landed in ``root`` by the daemon (docs/tiers.md)
    "fetch": {"seq": "int", "run": "str", "step": "int", "ranks": "ints", "root": "str", "url": "str"},
    "bye": {},
    # daemon -> producer
    # advice: the run's interval advice (docs/advise.md), for producer.should_save
    "welcome": {"v": "int", "max_frame": "int", "daemon_pid": "int", "shm": "bool?", "batch": "bool?",
                "advice": "map?"},
    "ack": {"seq": "int"},
    "committed": {"seq": "int", "step": "int", "info": "map", "advice": "map?"},
    "error": {"seq": "int?", "step": "int?", "message": "str", "code": "str?"},
    "pong": {"seq": "int"},
    "answer": {"seq": "int", "info": "map?"},
    # answer to list: each checkpoint's CheckpointInfo map with "pinned", oldest first
    "listing": {"seq": "int", "root": "str", "checkpoints": "maps"},
    "report": {"seq": "int", "status": "map"},  # answer to status
    "recovered": {"seq": "int", "done": "bool", "info": "map?", "manifests": "bins?", "progress": "str?",
                  "landed": "files?"},
    "fetched": {"seq": "int", "done": "bool", "progress": "str?"},
}
# error codes; an error without a code concerns one message or one step only
NO_SESSION = "no_session"  # the daemon does not know this producer (it restarted): say hello again
STOPPING = "stopping"  # the daemon is draining before it exits: no new producers or steps
NOT_FOUND = "not_found"  # what was asked is not complete anywhere the daemon looked (CheckpointNotFound)
UNAVAILABLE = "unavailable"  # a tier the answer needs did not answer the daemon (TierUnavailable)
_RAISED = {NOT_FOUND: CheckpointNotFound, UNAVAILABLE: TierUnavailable}


def error_code(exc: BaseException) -> str | None:
    """The code of an ``error`` reply for ``exc``, for readers to raise as its class again."""
    return next((code for code, cls in _RAISED.items() if isinstance(exc, cls)), None)


def raised(code: str | None) -> type[CheckpointError]:
    """The class an ``error`` reply of ``code`` is raised as."""
    return _RAISED.get(code or "", CheckpointError)


def encode(op: str, **fields: Any) -> bytes:
    """Pack one header. Callers pass exactly the schema's fields."""
    return pack({"op": op, **fields})


def pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def pack_fields(**fields: Any) -> tuple[bytes, int]:
    """Some of a header's fields packed ahead of time, for ``encode_packed``: ``(bytes, count)``."""
    return b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in fields.items()), len(fields)


def encode_packed(op: str, packed: tuple[bytes, int], **fields: Any) -> bytes:
    """``encode(op, **fields, **rest)`` where ``packed`` is ``pack_fields(**rest)``: a message
    that repeats with only ``seq`` and ``step`` changed (a cached save plan's, describing
    thousands of tensors) packs the rest once, not on every save. The bytes are the same
    msgpack map that ``encode`` makes; the daemon cannot tell them apart."""
    body, count = packed
    head = msgpack.Packer().pack_map_header(1 + len(fields) + count)
    return b"".join((head, msgpack.packb("op"), msgpack.packb(op),
                     *(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items()), body))


# one tensor of a ``tensors`` message, a list in this order: its bytes are
# ``[offset, offset + nbytes)`` of the arena
BATCH_ITEM = ("name", "dtype", "shape", "nbytes", "numpy", "offset")


def batch_pieces(header: dict[str, Any]) -> list[dict[str, Any]]:
    """A decoded ``tensors`` message's items as ``tensor`` headers (each one whole piece,
    whole tensors only: a piece of a sharded tensor travels alone, with its ``shard``)."""
    step, frozen = header["step"], header["frozen"]
    return [{"step": step, "name": name, "dtype": dtype, "shape": shape, "nbytes": nbytes, "start": 0,
             "numpy": numpy, "offset": offset, "length": nbytes, "shard": None, "frozen": frozen}
            for name, dtype, shape, nbytes, numpy, offset in header["items"]]


# one tensor of a ``same`` message, a list in this order
SAME_ITEM = ("name", "dtype", "shape", "numpy", "shard")


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _is_shape(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= _MAX_DIMS and all(_is_uint(d) for d in v)


def _is_batch(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(it, list) and len(it) == len(BATCH_ITEM) and isinstance(it[0], str) and isinstance(it[1], str)
        and _is_shape(it[2]) and _is_uint(it[3]) and isinstance(it[4], bool) and _is_uint(it[5])
        for it in v)


def _is_same(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(it, list) and len(it) == len(SAME_ITEM) and isinstance(it[0], str) and isinstance(it[1], str)
        and _is_shape(it[2]) and isinstance(it[3], bool) and (it[4] is None or isinstance(it[4], dict))
        for it in v)


def decode(frames: list[Any]) -> tuple[dict[str, Any], Any]:
    """Check and unpack a message's frames -> ``(header, payload or None)``.

    ``frames`` are bytes-like (or zmq Frames); the payload is returned as it came.
    """
    if not frames:
        raise ProtocolError("empty message")
    header = unpack_map(_buffer(frames[0]), "header", max_bytes=MAX_HEADER_BYTES)
    op = header.get("op")
    schema = SCHEMAS.get(op) if isinstance(op, str) else None
    if schema is None:
        raise ProtocolError(f"unknown op {short(op)}")
    check_fields(op, header, schema)
    # a tensor's bytes come in a second frame, or are named in shared memory
    want = 2 if op == "tensor" and header["offset"] is None else 1
    if len(frames) != want:
        raise ProtocolError(f"{op!r} message has {len(frames)} frames, expected {want}")
    if op == "tensor" and (header["offset"] is None) != (header["length"] is None):
        raise ProtocolError("'tensor' message has only one of 'offset' and 'length'")
    extra = set(header) - set(schema) - {"op"}
    if extra:
        raise ProtocolError(f"{op!r} message has unknown fields {short(sorted(extra))}")
    return header, (frames[1] if want == 2 else None)


class _TooMany(Exception):
    pass


def unpack_map(raw: Any, what: str, *, max_bytes: int, max_containers: int | None = None) -> dict[str, Any]:
    """One msgpack map of at most ``max_bytes``, its container sizes bounded by the
    bytes that arrived; ``max_containers``: at most that many maps and arrays in all,
    so that a frame of empty containers cannot grow into many times its size."""
    if len(raw) > max_bytes:
        raise ProtocolError(f"{what} of {len(raw)} bytes exceeds {max_bytes}")
    hooks: dict[str, Any] = {}
    if max_containers is not None:
        left = [max_containers]

        def count(obj: Any) -> Any:
            left[0] -= 1
            if left[0] < 0:
                raise _TooMany
            return obj
        hooks = {"object_hook": count, "list_hook": count}
    size = max(len(raw), 1)
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True, max_str_len=size, max_bin_len=size,
            max_array_len=min(size, _MAX_CONTAINER), max_map_len=min(size // 2 + 1, _MAX_CONTAINER), max_ext_len=0,
            **hooks)
    except _TooMany:
        raise ProtocolError(f"{what} holds more than {max_containers} maps and arrays") from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"{what} is not valid msgpack: {type(exc).__name__}: {short(str(exc))}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"{what} is a {type(header).__name__}, not a map")
    return header


def _buffer(frame: Any) -> Any:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame -> memoryview
    try:
        return memoryview(buf)
    except TypeError:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not bytes") from None


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


KINDS: dict[str, Callable[[Any], bool]] = {
    "int": _is_uint,
    "batch": _is_batch,
    "same": _is_same,
    "str": _is_str,
    "bin": lambda v: isinstance(v, bytes),
    "bool": lambda v: isinstance(v, bool),
    "json": _is_str,
    "map": lambda v: isinstance(v, dict),
    "maps": lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v),
    "shape": _is_shape,
    "names": lambda v: isinstance(v, list) and len(v) <= 16 and all(isinstance(n, str) and len(n) <= 64 for n in v),
    "ints": lambda v: isinstance(v, list) and len(v) <= _MAX_CONTAINER and all(_is_uint(i) for i in v),
    "bins": lambda v: isinstance(v, list) and all(isinstance(b, bytes) for b in v),
    "files": lambda v: isinstance(v, list) and len(v) <= _MAX_CONTAINER and all(
        isinstance(f, str) and len(f) <= 255 for f in v),
}


def check_fields(op: str, header: dict[str, Any], schema: dict[str, str],
                 kinds: dict[str, Callable[[Any], bool]] = KINDS, said: dict[str, str] | None = None) -> None:
    """Each of ``schema``'s fields of ``header`` checked to be of its kind (``kinds``:
    name -> test; ``said``: name -> what it must be, for the error); an optional one
    (``kind?``) absent or None is set to None."""
    for key, kind in schema.items():
        optional = kind.endswith("?")
        kind = kind.rstrip("?")
        if key not in header or (optional and header[key] is None):
            if optional:
                header[key] = None
                continue
            raise ProtocolError(f"{op!r} message lacks field {key!r}")
        if not kinds[kind](header[key]):
            must = f": it must be {said[kind]}" if said and kind in said else ""
            raise ProtocolError(f"{op!r} message field {key!r} has a bad value {short(header[key])}{must}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40


def short(value: Any) -> str:
    """``value`` for a message, at most about 80 characters and 3 levels deep whatever it holds."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a value whose repr fails still names its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
