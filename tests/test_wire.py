"""The decoder trusts nothing: every malformed header is a ProtocolError naming the problem."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from ckptd.transport import wire
from ckptd.errors import ProtocolError

GOOD_TENSOR = dict(seq=1, step=1, name="w", dtype="float32", shape=[2], nbytes=8, start=0, numpy=False)


def test_good_messages_decode() -> None:
    h, payload = wire.decode([wire.encode("tensor", **GOOD_TENSOR), b"12345678"])
    assert h["name"] == "w" and payload == b"12345678"
    h, _ = wire.decode([wire.encode("error", seq=None, step=None, message="m")])
    assert h["code"] is None


@pytest.mark.parametrize(
    "frames, message",
    [
        ([], "empty message"),
        ([b"\xc1"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "not a map"),
        ([msgpack.packb({"op": "launch"})], "unknown op 'launch'"),
        ([msgpack.packb({"op": 5})], "unknown op 5"),
        ([wire.encode("tensor", **GOOD_TENSOR)], "has 1 frames, expected 2"),
        ([wire.encode("ping", seq=1), b"extra"], "has 2 frames, expected 1"),
        ([wire.encode("ping", seq=-1)], "field 'seq' has a bad value"),
        ([wire.encode("ping", seq=True)], "field 'seq' has a bad value"),
        ([wire.encode("ping")], "lacks field 'seq'"),
        ([wire.encode("ping", seq=1, evil=1)], "unknown fields"),
        ([wire.encode("tensor", **{**GOOD_TENSOR, "shape": [1] * 65}), b""], "'shape' has a bad value"),
        ([wire.encode("tensor", **{**GOOD_TENSOR, "shape": [-1]}), b""], "'shape' has a bad value"),
        ([msgpack.packb({"op": "ping", 1: 2})], "not valid msgpack"),  # non-str keys
    ],
)
def test_malformed(frames, message) -> None:
    with pytest.raises(ProtocolError, match=message):
        wire.decode(frames)


def test_deep_nesting_is_refused_not_a_crash() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested arrays
    with pytest.raises(ProtocolError):
        wire.decode([deep])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=256), min_size=0, max_size=3))
def test_random_frames_never_escape_as_other_errors(frames) -> None:
    try:
        wire.decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["op", "seq", "step", "name", "shape", "nbytes", "v", "run", "x"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.text(max_size=5),
                                 st.lists(st.integers(-2**63, 2**64 - 1), max_size=3), st.sampled_from(list(wire.SCHEMAS)))))
def test_random_maps_never_escape_as_other_errors(header) -> None:
    try:
        wire.decode([msgpack.packb(header), b""])
    except ProtocolError:
        pass
