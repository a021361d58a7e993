"""The daemon's message handlers (``ckptd.daemon.handlers``): each message a producer
sends reaches its own ``on_<op>`` method; any other message gets an error reply naming
it (never an AttributeError that the loop would have to survive), and the daemon serves on."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch
import zmq

from ckptd.transport import wire
from ckptd.daemon import handlers


def _fields(op: str) -> dict[str, Any]:
    """A well-formed message of ``op``: each required field with a value of its type."""
    value = {"int": 1, "str": "x", "map": {}, "maps": [], "bool": False, "json": "{}", "shape": [],
             "bin": b"", "batch": [], "same": []}
    return {k: value[kind] for k, kind in wire.SCHEMAS[op].items() if not kind.endswith("?")}


def _ask(sock: zmq.Socket, header: bytes) -> dict[str, Any]:
    sock.send(header)
    assert sock.poll(10_000), "the daemon did not answer"
    return msgpack.unpackb(sock.recv(), raw=False)


@pytest.fixture
def dealer(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    yield sock
    sock.close(0)


def test_every_message_a_producer_sends_has_its_handler() -> None:
    ops = handlers.SESSIONLESS | handlers.IN_SESSION
    assert ops <= set(wire.SCHEMAS)
    assert not handlers.SESSIONLESS & handlers.IN_SESSION
    for op in ops:
        assert callable(getattr(handlers.Handlers, "on_" + op)), op


def test_a_message_no_producer_sends_gets_an_error_naming_it(daemon, dealer) -> None:
    welcome = _ask(dealer, wire.encode("hello", v=wire.VERSION, run="h", rank=0, world_size=1, pid=1, host="h"))
    assert welcome["op"] == "welcome"
    # what the daemon sends: each is in the wire's schemas, and none is a producer's
    for op in sorted(set(wire.SCHEMAS) - handlers.SESSIONLESS - handlers.IN_SESSION):
        reply = _ask(dealer, wire.encode(op, **_fields(op)))
        assert reply["op"] == "error" and reply["message"] == f"{op!r} is not a message a producer sends", op
        assert _ask(dealer, wire.encode("ping", seq=7)) == {"op": "pong", "seq": 7}  # the session lives on
    assert daemon.proc.poll() is None


def test_a_handlers_other_methods_cannot_be_named(daemon, dealer) -> None:
    for op in ("dispatch", "open_step", "on_result", "on_hello", "__init__"):
        reply = _ask(dealer, msgpack.packb({"op": op, "seq": 1}))
        assert reply["op"] == "error" and reply["message"] == f"protocol error: unknown op {op!r}"
    with daemon.producer() as p:
        assert p.save({"w": torch.ones(4)}, 1).wait(30).step == 1


def test_list_needs_no_session_and_names_a_bad_run(daemon, dealer) -> None:
    with daemon.producer("r") as p:
        p.save({"w": torch.ones(4)}, 3).wait(30)
    reply = _ask(dealer, wire.encode("list", seq=1, run="r"))
    assert reply["op"] == "listing" and reply["root"] == str(daemon.root)
    assert [(c["step"], c["pinned"], c["tiers"]) for c in reply["checkpoints"]] == [(3, False, ["local"])]
    reply = _ask(dealer, wire.encode("list", seq=2, run="../r"))
    assert reply["op"] == "error" and reply["message"].startswith("list: ") and "'../r'" in reply["message"]
