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

from typing import Any

import msgpack

from ..errors import ProtocolError

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
               "timing": "map?"},
    "abort": {"seq": "int", "step": "int", "reason": "str"},
    # the producer waits for staging: write out every chunk still gathered for it
    "drain": {"seq": "int"},
    "ping": {"seq": "int"},
    "latest": {"seq": "int", "run": "str"},
    "list": {"seq": "int", "run": "str"},  # from `ckptd list --endpoint`, without a session
    "status": {"seq": "int"},  # also from `ckptd status`, without a session
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
}
# error codes; an error without a code concerns one message or one step only
NO_SESSION = "no_session"  # the daemon does not know this producer (it restarted): say hello again
STOPPING = "stopping"  # the daemon is draining before it exits: no new producers or steps


def encode(op: str, **fields: Any) -> bytes:
    """Pack one header. Callers pass exactly the schema's fields."""
    return msgpack.packb({"op": op, **fields}, use_bin_type=True)


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
    raw = _buffer(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True,
            max_str_len=MAX_HEADER_BYTES, max_bin_len=MAX_HEADER_BYTES,
            max_array_len=_MAX_CONTAINER, max_map_len=_MAX_CONTAINER, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map")
    op = header.get("op")
    schema = SCHEMAS.get(op) if isinstance(op, str) else None
    if schema is None:
        raise ProtocolError(f"unknown op {op!r}")
    for key, kind in schema.items():
        _check_field(op, header, key, kind)
    # a tensor's bytes come in a second frame, or are named in shared memory
    want = 2 if op == "tensor" and header["offset"] is None else 1
    if len(frames) != want:
        raise ProtocolError(f"{op!r} message has {len(frames)} frames, expected {want}")
    if op == "tensor" and (header["offset"] is None) != (header["length"] is None):
        raise ProtocolError("'tensor' message has only one of 'offset' and 'length'")
    extra = set(header) - set(schema) - {"op"}
    if extra:
        raise ProtocolError(f"{op!r} message has unknown fields {sorted(extra)}")
    return header, (frames[1] if want == 2 else None)


def _buffer(frame: Any) -> Any:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame -> memoryview
    try:
        return memoryview(buf)
    except TypeError:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not bytes") from None


def _check_field(op: str, header: dict[str, Any], key: str, kind: str) -> None:
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if key not in header or (optional and header[key] is None):
        if optional:
            header.setdefault(key, None)
            return
        raise ProtocolError(f"{op!r} message lacks field {key!r}")
    value = header[key]
    ok = {
        "int": _is_uint,
        "batch": _is_batch,
        "same": _is_same,
        "str": lambda v: isinstance(v, str),
        "bin": lambda v: isinstance(v, bytes),
        "bool": lambda v: isinstance(v, bool),
        "json": lambda v: isinstance(v, str),
        "map": lambda v: isinstance(v, dict),
        "maps": lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v),
        "shape": _is_shape,
    }[kind](value)
    if not ok:
        raise ProtocolError(f"{op!r} message field {key!r} has a bad value {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
