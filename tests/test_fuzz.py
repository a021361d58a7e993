"""Hostile wire input: a property-based fuzzer for ``wire.decode`` that knows
the schema (``tests/test_wire.py`` throws unstructured bytes and maps at it), a live
fuzz of a running daemon beside a good producer, and the hostile inputs that once
stopped the daemon, each pinned by a test of its own."""

from __future__ import annotations

import itertools
import socket
import sys
import time
import tracemalloc
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

import ckptd
from ckptd.transport import wire
from ckptd.errors import ProtocolError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import stress  # noqa: E402  (benchmarks/stress.py: the live fuzz, the daemon with limits)

# -- an independent reading of the schema: what decode must accept, and nothing else ------------------
VALUES = {
    "int": st.integers(0, 2**63 - 1),
    "str": st.text(max_size=12),
    "bin": st.binary(max_size=24),
    "bool": st.booleans(),
    "json": st.text(max_size=12),
    "map": st.dictionaries(st.text(max_size=4), st.integers(-5, 5) | st.text(max_size=3), max_size=3),
    "shape": st.lists(st.integers(0, 2**63 - 1), max_size=64),
    # a ``listing``'s checkpoints: a list of maps
    "maps": st.lists(st.dictionaries(st.text(max_size=4), st.integers(-5, 5) | st.text(max_size=3), max_size=3),
                     max_size=3),
    # a commit's tiers: at most 16 names of at most 64 characters
    "names": st.lists(st.text(max_size=64), max_size=16),
    # a ``recover``'s ranks, a ``recovered``'s manifests
    "ints": st.lists(st.integers(0, 2**63 - 1), max_size=4),
    "bins": st.lists(st.binary(max_size=8), max_size=3),
    # a ``recovered``'s files landed: names of at most 255 characters
    "files": st.lists(st.text(max_size=12) | st.text(min_size=250, max_size=255), max_size=3),
    # a ``tensors`` batch: [name, dtype, shape, nbytes, numpy, offset] items
    "batch": st.lists(st.tuples(st.text(max_size=6), st.text(max_size=6), st.lists(st.integers(0, 2**63 - 1), max_size=4),
                                st.integers(0, 2**63 - 1), st.booleans(), st.integers(0, 2**63 - 1)).map(list),
                      max_size=3),
    # a ``same`` message's items: [name, dtype, shape, numpy, shard map or None]
    "same": st.lists(st.tuples(st.text(max_size=6), st.text(max_size=6), st.lists(st.integers(0, 2**63 - 1), max_size=4),
                               st.booleans(), st.none() | st.dictionaries(st.text(max_size=3), st.integers(0, 9),
                                                                          max_size=2)).map(list),
                     max_size=3),
}
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=5),
    st.binary(max_size=5), st.lists(st.integers(-3, 3), max_size=3),
    st.lists(st.integers(0, 9), min_size=65, max_size=66),  # a shape one dimension too long
    st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**64 - 1), max_size=2),
)


def conforms(kind: str, v: object) -> bool:
    if kind == "int":
        return type(v) is int and 0 <= v < 2**63
    if kind in ("str", "json"):
        return type(v) is str
    if kind == "bin":
        return type(v) is bytes
    if kind == "bool":
        return type(v) is bool
    if kind == "map":
        return type(v) is dict
    if kind == "maps":
        return type(v) is list and all(type(m) is dict for m in v)
    if kind == "names":
        return type(v) is list and len(v) <= 16 and all(type(n) is str and len(n) <= 64 for n in v)
    if kind == "ints":
        return type(v) is list and all(conforms("int", i) for i in v)
    if kind == "bins":
        return type(v) is list and all(type(b) is bytes for b in v)
    if kind == "files":
        return type(v) is list and all(type(f) is str and len(f) <= 255 for f in v)
    if kind == "shape":
        return type(v) is list and len(v) <= 64 and all(type(d) is int and 0 <= d < 2**63 for d in v)
    if kind == "batch":
        return type(v) is list and all(
            type(it) is list and len(it) == 6 and type(it[0]) is str and type(it[1]) is str
            and conforms("shape", it[2]) and conforms("int", it[3]) and type(it[4]) is bool and conforms("int", it[5])
            for it in v)
    if kind == "same":
        return type(v) is list and all(
            type(it) is list and len(it) == 5 and type(it[0]) is str and type(it[1]) is str
            and conforms("shape", it[2]) and type(it[3]) is bool and (it[4] is None or type(it[4]) is dict)
            for it in v)
    raise AssertionError(f"the schema has a field kind {kind!r} this test does not know: teach it")


def frames_wanted(h: dict) -> int:
    """A tensor's bytes come as a second frame, unless the header names them in shared memory."""
    return 2 if h["op"] == "tensor" and h.get("offset") is None else 1


def acceptable(h: dict, nframes: int) -> bool:
    schema = wire.SCHEMAS[h["op"]]
    for key, kind in schema.items():
        optional, kind = kind.endswith("?"), kind.rstrip("?")
        if key not in h or (optional and h[key] is None):
            if not optional:
                return False
        elif not conforms(kind, h[key]):
            return False
    if set(h) - set(schema) - {"op"}:
        return False
    if h["op"] == "tensor" and "offset" in schema and (h.get("offset") is None) != (h.get("length") is None):
        return False
    return nframes == frames_wanted(h)


@st.composite
def headers(draw, *, well_formed: bool = False) -> tuple[dict, int]:
    """A header of a random op whose fields are valid, of the wrong type, missing, nil or
    extra; and a frame count. ``well_formed``: one decode must accept."""
    op = draw(st.sampled_from(sorted(wire.SCHEMAS)))
    h: dict = {"op": op}
    for key, kind in wire.SCHEMAS[op].items():
        optional, base = kind.endswith("?"), kind.rstrip("?")
        how = "valid" if well_formed and not optional else draw(
            st.sampled_from(["valid", "valid", "valid", "absent", "nil"] + ([] if well_formed else ["junk"])))
        if how == "valid":
            h[key] = draw(VALUES[base])
        elif how == "nil":
            h[key] = None
        elif how == "junk":
            h[key] = draw(JUNK)
    if op == "tensor" and well_formed and (h.get("offset") is None) != (h.get("length") is None):
        h.pop("offset", None), h.pop("length", None)
    if not well_formed and draw(st.integers(0, 5)) == 0:
        h[draw(st.sampled_from(["x", "evil", "shm", "path", "op "]))] = draw(JUNK)
    n = frames_wanted(h) if well_formed else draw(st.integers(1, 3))
    return h, n


def frames_of(h: dict, n: int) -> list[bytes]:
    return [msgpack.packb(h, use_bin_type=True)] + [b"payload"] * (n - 1)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers())
def test_decode_accepts_exactly_what_the_schema_allows(hn) -> None:
    h, n = hn
    frames = frames_of(h, n)
    try:
        got, payload = wire.decode(frames)
    except ProtocolError:
        assert not acceptable(h, n), f"refused a valid message {h} in {n} frame(s)"
        return
    assert acceptable(h, n), f"accepted {h} in {n} frame(s)"
    defaults = {k: None for k, kind in wire.SCHEMAS[h["op"]].items() if kind.endswith("?")}
    assert got == {**defaults, **h}
    assert payload == (frames[1] if n == 2 else None)


@settings(max_examples=300, deadline=None)
@given(headers(well_formed=True), st.data())
def test_every_truncation_of_a_good_header_is_refused(hn, data) -> None:
    h, n = hn
    frames = frames_of(h, n)
    wire.decode(frames)  # whole, it is good
    cut = data.draw(st.integers(0, len(frames[0]) - 1))
    with pytest.raises(ProtocolError):
        wire.decode([frames[0][:cut], *frames[1:]])


@settings(max_examples=300, deadline=None)
@given(headers(well_formed=True), st.integers(0, 2**16), st.data())
def test_flipped_bits_give_a_protocol_error_or_a_conforming_header(hn, seed, data) -> None:
    h, n = hn
    head = bytearray(frames_of(h, n)[0])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(head) - 1))
        head[i] ^= 1 << data.draw(st.integers(0, 7))
    try:
        got, _ = wire.decode([bytes(head), b"payload"][:n])
    except ProtocolError:
        return
    schema = wire.SCHEMAS[got["op"]]
    given_fields = {k: v for k, v in got.items() if v is not None or not schema.get(k, "").endswith("?")}
    assert acceptable(given_fields, n)  # whatever got through is a message the schema allows


@pytest.mark.parametrize("marker", [b"\xdf", b"\xdd", b"\xdb", b"\xc6", b"\xc9"])  # map32 array32 str32 bin32 ext32
@pytest.mark.parametrize("where", ["alone", "in a field"])
def test_huge_declared_lengths_are_refused_without_allocating_them(marker, where) -> None:
    inner = marker + (2**32 - 1).to_bytes(4, "big") + b"\x00" * 8
    raw = inner if where == "alone" else b"\x82\xa2op\xa6tensor\xa5shape" + inner
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            wire.decode([raw, b""])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # the declared 4 GiB were never allocated


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20_000), st.sampled_from([b"\x81\xa1a", b"\x91"]))
def test_deep_nesting_inside_a_field_is_a_protocol_error_or_a_map(depth, level) -> None:
    nested = level * depth + b"\xc0"
    raw = (b"\x88\xa2op\xa5hello\xa1v\x01\xa3run\xa1r\xa4rank\x00\xaaworld_size\x01\xa3pid\x01"
           b"\xa4host\xa1h\xa9retention" + nested)
    try:
        h, _ = wire.decode([raw])
    except ProtocolError:
        return
    assert isinstance(h["retention"], dict)  # a map, however deep, for the daemon to refuse


# -- a live daemon under fire --------------------------------------------------------------------------------
def test_live_fuzz_beside_a_good_producer(tmp_path) -> None:
    """Thousands of malformed messages from many identities (and the shared-memory handoff
    socket), with a good producer checkpointing beside them: the daemon lives, its memory
    stays bounded, the good producer loses and fails nothing."""
    r = stress.live_fuzz(tmp_path, messages=5000, seed=11, say=lambda _: None)
    assert r["violations"] == []
    assert r["malformed"] >= 5000 and r["frames"] >= 5000 and r["identities"] > 48
    assert r["error_replies"] > 1000  # the daemon answered them, it did not just drop them
    assert r["good_commits_acked"] > 0 and r["good_commits_failed"] == 0 and r["bytes_lost"] == 0
    assert r["peak_rss"] < r["memory_budget"] + stress.RSS_SLACK


def _ask(sock: zmq.Socket, header: bytes) -> dict:
    sock.send(header)
    assert sock.poll(10_000), "the daemon did not answer"
    return msgpack.unpackb(sock.recv(), raw=False)


_RUNS = itertools.count()


@pytest.fixture
def dealer(shared_daemon):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(shared_daemon.endpoint)
    yield sock
    sock.close(0)


@pytest.mark.parametrize("retention", [
    {"max_bytes": "9" * 400 + "MiB"},  # a float overflow: OverflowError killed the daemon
    {"max_bytes": "9" * 400},
    {"keep_last": [1]}, {"keep_within": {"a": 1}}, {"mode": 5}, {"bogus": 1},
])
def test_hostile_retention_in_hello_is_refused_and_the_daemon_serves_on(shared_daemon, dealer, retention) -> None:
    """One daemon for all of them: it serves on after each, and after those before it."""
    daemon = shared_daemon
    hello = msgpack.packb({"op": "hello", "v": 1, "run": "r", "rank": 0, "world_size": 1, "pid": 1,
                           "host": "h", "retention": retention})
    reply = _ask(dealer, hello)
    assert reply["op"] == "error" and "retention" in reply["message"]
    assert daemon.proc.poll() is None
    with daemon.producer(f"serves-on-{next(_RUNS)}") as p:
        assert p.save({"w": torch.ones(4)}, 1).wait(30).step == 1


@pytest.mark.parametrize("field, text", [
    ("state", "NaN"), ("state", "[Infinity]"), ("state", "[1e999]"), ("metadata", '{"a": -Infinity}'),
    ("metadata", '{"a": "\\ud800"}'),  # a lone surrogate: valid JSON text, not encodable UTF-8
])
def test_commit_json_a_manifest_cannot_hold_fails_that_step_only(make_daemon, field, text) -> None:
    """json.loads takes these; the manifest's json.dumps then failed on the syncer thread,
    the commit was never answered, and the daemon could no longer drain and stop."""
    d = make_daemon()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    try:
        assert _ask(sock, wire.encode("hello", v=1, run="h", rank=0, world_size=1, pid=1, host="h"))["op"] == "welcome"
        fields = {"state": "null", "metadata": "{}", field: text}
        reply = _ask(sock, wire.encode("commit", seq=1, step=1, ntensors=0, **fields))
        assert reply["op"] == "error" and reply["step"] == 1 and "not valid JSON" in reply["message"]
    finally:
        sock.close(0)
    with d.producer() as p:
        assert p.save({"w": torch.ones(4)}, 1).wait(30).step == 1
    assert ckptd.list_checkpoints("h", root=d.root) == []
    assert d.stop(timeout=30) == 0  # nothing is stuck: the drain finishes


def test_silent_handoff_connections_cannot_exhaust_the_daemon(tmp_path) -> None:
    """Connections to the shared-memory handoff socket that never say a word: ~1000 of them
    took every descriptor of a daemon under systemd's default LimitNOFILE (1024) and it
    died of EMFILE. Now it refuses those beyond a few, and producers send inline."""
    d = stress.Daemon(tmp_path / "d", nofile=1024).start()
    conns: list[socket.socket] = []
    try:
        first = ckptd.Producer(d.endpoint, "a", staging_size="8MiB", timeout=10)
        assert first.save({"w": torch.ones(8)}, 1).wait(30).step == 1
        for _ in range(1100):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.connect(d.endpoint[len("ipc://"):] + ".shm")
            conns.append(c)
        time.sleep(0.5)  # let the daemon accept what it will
        assert d.alive()
        assert first.save({"w": torch.ones(8)}, 2).wait(30).step == 2  # its session is untouched
        with ckptd.Producer(d.endpoint, "b", staging_size="8MiB", timeout=10) as second:
            assert second.save({"w": torch.ones(8)}, 1).wait(30).step == 1  # refused shm: inline
            assert second.stats()["transport"] == "inline"
        first.close()
        assert d.alive()
    finally:
        for c in conns:
            c.close()
        d.cleanup()
