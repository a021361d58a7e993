"""The peer port's transport against hostile connections (ckptd/transport/sealed.py):
garbage before and inside the handshake, a length over the bound, a message that stops
mid-record, a record with a bad or replayed box, connections that never finish their
handshake, an unfinished message of the largest size; and the handshake's refusals
(another server key, a key not admitted, no key). Each is closed by a real daemon,
which serves on; an unfinished message grows it by at most one message's bound."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import msgpack
import pytest

from ckptd.errors import PeerDown
from ckptd.peer import messages
from ckptd.peer.keys import PeerCurveServer, key_name
from ckptd.transport import curve, sealed, sealed_client
from ckptd.transport.sealed_server import Server
from conftest import Daemon, free_port
from test_peer import _status
from test_peer_fuzz import _memory, keyed_node, node_keys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from peer_fuzz import MESSAGE_BOUND, Asker, closed, plain, still_open, unfinished_message  # noqa: E402


def _connect(listen: str) -> socket.socket:
    host, port = listen.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)))


def _ping(listen: str, keys: object = None) -> dict:
    link = messages.Link(listen, keys)
    try:
        return link.request({"op": "ping"}, timeout=10)[0]
    finally:
        link.close()


def _keys(secret: Path, server_public: Path) -> curve.ClientKeys:
    public, private = curve.load_secret(secret, "a test's key")
    return curve.ClientKeys(curve.load_public(server_public, "a test's server key"), public, private, secret)


@contextlib.contextmanager
def _plain_node(tmp_path: Path, stall: str) -> Iterator[tuple[Daemon, str]]:
    """A started daemon whose peer port listens in plaintext on loopback: (it, its endpoint)."""
    listen = f"tcp://127.0.0.1:{free_port()}"
    node = Daemon(tmp_path / "n", tables={"peer": {"listen": listen, "peers": [f"tcp://127.0.0.1:{free_port()}"],
                                                   "stall": stall}})
    try:
        node.start()
        yield node, listen
    finally:
        node.cleanup()


def test_hostile_connections_to_a_plaintext_port_are_closed_and_it_serves_on(tmp_path) -> None:
    with _plain_node(tmp_path, "2s") as (node, listen):
        garbage = _connect(listen)
        garbage.sendall(random.Random(2).randbytes(4096))
        assert closed(garbage), "garbage before the handshake was not closed"
        over = plain(listen)
        over.sendall(sealed.LENGTH.pack(2**32 - 1))
        assert closed(over), "a record length over the bound was not closed"
        header_over = plain(listen)
        header_over.sendall(sealed.LENGTH.pack(sealed.PREAMBLE.size) + sealed.PREAMBLE.pack(2**31, 0))
        assert closed(header_over), "a header over MAX_HEADER_BYTES was not closed"
        stops = plain(listen)
        stops.sendall(sealed.LENGTH.pack(4096) + sealed.PREAMBLE.pack(10, 0) + bytes(100))
        began = time.monotonic()
        assert closed(stops, timeout=20), "a message that stopped mid-record was not closed"
        assert time.monotonic() - began >= 1.0  # given [peer] stall, not closed at once
        log = node.log_text()
        assert "broke the protocol" in log and "in the middle of a message" in log, log[-2000:]
        assert _ping(listen)["ok"] is True
        assert _status(node)["peer"]["thread_restarts"] == 0


def test_connections_that_never_finish_their_handshake_are_capped_then_closed(tmp_path) -> None:
    with _plain_node(tmp_path, "2s") as (node, listen):
        idle = [_connect(listen) for _ in range(300)]
        assert closed(idle[-1], timeout=5), "a connection past the cap was let in"
        assert all(closed(s, timeout=20) for s in idle[:-1]), "a handshake never finished was kept"
        assert "refused a connection" in node.log_text()
        assert "did not finish its handshake within 2 s" in node.log_text()
        assert _ping(listen)["ok"] is True


def test_an_unfinished_message_holds_at_most_one_messages_bound(tmp_path) -> None:
    with _plain_node(tmp_path, "600s") as (node, listen):
        assert _ping(listen)["ok"] is True
        for n, bound in ((1, MESSAGE_BOUND), (3, 3 * MESSAGE_BOUND)):  # past two, only the oldest is read on
            Path(f"/proc/{node.pid}/clear_refs").write_text("5")
            before, _ = _memory(node)
            raws = [unfinished_message(listen) for _ in range(n)]
            time.sleep(2)
            growth = _memory(node)[1] - before
            assert growth <= bound, (n, growth)
            assert all(still_open(raw) for raw in raws), "an unfinished message was taken for a broken one"
            if n == 1:
                assert _ping(listen)["ok"] is True  # others are served meanwhile
            for raw in raws:
                raw.close()


def test_a_keyed_port_closes_bad_handshakes_and_boxes_and_refuses_keys_it_does_not_admit(tmp_path) -> None:
    listen, other = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    secrets = node_keys(tmp_path / "keys", [listen, other])
    stranger, _ = curve.keygen("stranger", tmp_path / "strangers")
    stranger_secret = tmp_path / "strangers" / "stranger.key_secret"
    node = keyed_node(tmp_path / "n", listen, [other], secrets[listen], stall="2s")
    server_key = tmp_path / "keys" / f"{key_name(listen)}.key"
    try:
        node.start()
        assert _ping(listen, _keys(secrets[other], server_key))["ok"] is True
        inside = _connect(listen)
        inside.sendall(sealed.MAGIC + sealed.CURVE + os.urandom(sealed.HELLO))
        assert closed(inside), "a HELLO of garbage was not closed"
        with pytest.raises(PeerDown, match="does not admit this node's public key"):
            _ping(listen, _keys(stranger_secret, server_key))  # a key not in curve_peers
        with pytest.raises(PeerDown, match="is not that port's"):
            _ping(listen, _keys(secrets[other], stranger))  # dialled with another server's key
        with pytest.raises(PeerDown, match="runs with CurveZMQ keys"):
            _ping(listen)
        sock = Asker(listen, _keys(secrets[other], server_key))
        sock.send_multipart([msgpack.packb({"op": "ping", "id": 1})])
        assert sock.poll(10_000)
        sock.chan.sock.sendall(sealed.LENGTH.pack(100) + os.urandom(100))  # a box that does not open
        sock.send_multipart([msgpack.packb({"op": "ping", "id": 2})])
        sock.recv_multipart()
        assert not sock.poll(5_000), "a connection after a bad box was answered"
        sock.close()
        log = node.log_text()
        assert "refused a peer whose CurveZMQ public key" in log and "does not open" in log, log[-3000:]
        assert _ping(listen, _keys(secrets[other], server_key))["ok"] is True
        assert _status(node)["peer"]["thread_restarts"] == 0
    finally:
        node.cleanup()


def test_a_replayed_record_is_refused(tmp_path) -> None:
    """A record sent twice (its nonce counts records) does not open the second time."""
    listen = f"tcp://127.0.0.1:{free_port()}"
    public, secret = curve.keygen("port", tmp_path)
    client_public, client_secret = curve.keygen("client", tmp_path / "admitted")
    z_public, z_secret = curve.load_secret(secret, "port")
    port = Server(listen, PeerCurveServer(listen, z_public, z_secret, tmp_path / "admitted"), max_header=2**20,
                  max_payload=2**20, unread_cap=2**20)
    got: list[tuple] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for ident, frames, user in port.poll(0.05):
                got.append((bytes(frames[0]), user))
                port.send(ident, bytes(frames[0]), None, counted=False)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        chan = sealed_client.Channel(listen, _keys(client_secret, public), max_header=2**20, max_payload=2**20,
                                     hwm=4)
        deadline = time.monotonic() + 10
        chan.send(b"first", None, deadline)
        assert bytes(chan.recv(deadline)[0]) == b"first"
        assert got == [(b"first", curve.load_public(client_public, "client").decode())]
        boxes = sealed.Boxes(chan._out.boxes._key, sealed.TO_SERVER, sealed.TO_CLIENT)
        record = next(sealed.records(b"again", None))
        for counter in (1, 2):  # a record with the nonce of the first, then with the one due
            boxes._sent = counter - 1
            out = bytearray(sealed.LENGTH.size + len(record) + sealed.MAC)
            sealed.LENGTH.pack_into(out, 0, len(record) + sealed.MAC)
            boxes.seal(memoryview(out)[sealed.LENGTH.size:], record)
            chan.sock.sendall(out)
        with pytest.raises(PeerDown):
            chan.recv(time.monotonic() + 5)
        assert [g[0] for g in got] == [b"first"]
        chan.close()
    finally:
        stop.set()
        thread.join()
        port.close()
