"""The peer port read as a network service: every op with random and extreme fields,
and garbage frames, sent to a real daemon by a key admitted as a peer; the daemon
answers each with an error, keeps serving, and a lost node then recovers through it,
bit-exact. A serve thread that fails is restarted and counted."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

import ckptd
from ckptd.config import load as load_config
from ckptd.layout import manifest_name, step_dir
from ckptd.peer.keys import key_name
from ckptd.transport import curve
from conftest import Daemon, free_port
from test_peer import _held, _save, _status, _wait

FUZZ_MESSAGES = 600
FUZZ_SECONDS = 40.0
OPS = ["ping", "offer", "part", "done", "holds", "drop", "steps", "manifests", "read", "nonsense", None]
EXTREME_INTS = [0, 1, -1, 2**31, 2**62, 2**63 - 1, 2**64 - 1, -2**63]


def node_keys(folder: Path, listens: list[str]) -> dict[str, Path]:
    """One key pair per node, each public key in ``folder/peers`` named for its listen."""
    peers = folder / "peers"
    peers.mkdir(parents=True)
    secrets = {}
    for listen in listens:
        public, secret = curve.keygen(key_name(listen), folder)
        os.link(public, peers / public.name)
        secrets[listen] = secret
    return secrets


def keyed_node(base: Path, listen: str, peers: list[str], secret: Path, **peer: object) -> Daemon:
    return Daemon(base, tables={"peer": {"listen": listen, "peers": peers, "curve_peers": str(secret.parent / "peers"),
                                         **peer}}, curve_secret_key=str(secret))


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice(EXTREME_INTS)
    if kind == 1:
        return rng.randrange(-10, 1 << 20)
    if kind == 2:
        return rng.choice(["", "job", "../job", "x" * 300, "step-1", "chunk-r00000-00000.safetensors", "\x00"])
    if kind == 3:
        return rng.randbytes(rng.randrange(64))
    if kind == 4:
        return rng.choice([None, True, False, 1.5, float("nan")])
    if kind == 5:
        return b'{"run": "job", "step": 1}'
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 7:
        return {str(_value(rng, depth + 1)): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [[rng.choice(["job", "x"]), rng.choice(EXTREME_INTS), rng.choice(EXTREME_INTS)]] * rng.randrange(3)


def _request(rng: random.Random, i: int) -> list[bytes]:
    if rng.random() < 0.25:  # garbage frames
        return [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 4))]
    fields = ["run", "step", "rank", "file", "offset", "length", "xfer", "files", "manifest", "keep_last",
              "shares", "steps", "limit", "ranks"]
    header = {"op": rng.choice(OPS), "id": i}
    for name in rng.sample(fields, rng.randrange(len(fields))):
        header[name] = _value(rng)
    frames = [msgpack.packb(header, use_bin_type=True)]
    if rng.random() < 0.3:
        frames.append(rng.randbytes(rng.randrange(1, 5000)))
    return frames


def _client(ctx: zmq.Context, endpoint: str, secret: Path | None, server: Path | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None and server is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(secret)
        sock.curve_serverkey = zmq.auth.load_certificate(server)[0]
    sock.connect(endpoint)
    return sock


def _ask(sock: zmq.Socket, frames: list[bytes], timeout: float = 10.0) -> dict:
    sock.send_multipart(frames)
    assert sock.poll(int(timeout * 1000)), "the peer port stopped answering"
    answer = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    assert isinstance(answer, dict) and "ok" in answer, answer
    return answer


@pytest.mark.slow
def test_no_message_stops_the_peer_port_and_a_lost_node_then_recovers_through_it(tmp_path, monkeypatch) -> None:
    a_, b_, spy_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    secrets = node_keys(tmp_path / "keys", [a_, b_, spy_])  # spy: a key admitted as a peer, in hostile hands
    a = keyed_node(tmp_path / "a", a_, [b_], secrets[a_])
    b = keyed_node(tmp_path / "b", b_, [a_], secrets[b_], memory="64MiB")
    ctx = zmq.Context()
    try:
        a.start()
        b.start()
        saved = _save(a, range(1, 2))
        _wait(lambda: _held(b).get((1, 0)) == "memory", "A's share held by B")
        sock = _client(ctx, b_, secrets[spy_], tmp_path / "keys" / f"{key_name(b_)}.key")
        # targeted: the fields that used to stop the thread or reach other nodes' replicas
        manifest = (step_dir(a.root, "job", 1) / manifest_name(0)).read_bytes()
        data_file = next(n for n in os.listdir(step_dir(a.root, "job", 1)) if n.endswith(".safetensors"))
        read = {"op": "read", "id": 1, "run": "job", "step": 1, "rank": 0, "file": data_file, "offset": 0}
        for fields in ({"length": 2**62}, {"length": 1024, "offset": 2**64 - 1}, {"length": 2**20, "offset": 2**20}):
            answer = _ask(sock, [msgpack.packb(dict(read, **fields))])
            assert answer["ok"] is False and answer["id"] == 1, answer
        answer = _ask(sock, [msgpack.packb({"op": "drop", "id": 2, "run": "job", "steps": [1]})])
        assert answer == {"ok": True, "id": 2, "dropped": 0}, answer  # not the spy's to drop
        files = {data_file: os.path.getsize(step_dir(a.root, "job", 1) / data_file)}
        offer = {"op": "offer", "id": 3, "manifest": manifest, "files": files, "keep_last": 1}
        answer = _ask(sock, [msgpack.packb(offer, use_bin_type=True)])
        assert answer["ok"] is False and "only the node whose share it is" in answer["error"], answer
        # random and extreme fields, garbage frames: each answered, bounded in count and time
        rng = random.Random(30)
        deadline = time.monotonic() + FUZZ_SECONDS
        sent = 0
        for i in range(FUZZ_MESSAGES):
            if time.monotonic() > deadline:
                break
            answer = _ask(sock, _request(rng, 100 + i))
            assert answer["id"] in (None, 100 + i), answer
            sent += 1
        assert sent >= 100, sent
        assert _ask(sock, [msgpack.packb({"op": "ping", "id": 7})])["ok"] is True
        status = _status(b)["peer"]
        assert status["thread_restarts"] == 0 and status["held_shares"] == 1, status
        sock.close()
        # A is lost with its disk; the fresh one recovers its share from B, bit-exact
        a.kill()
        shutil.rmtree(a.root)
        a.start()
        monkeypatch.setenv("CKPTD_CONFIG", str(a.config))
        state = ckptd.load("job", 1)
        assert torch.equal(state["w"], saved[1])
    finally:
        ctx.destroy(linger=0)
        for n in (a, b):
            n.cleanup()


def test_a_serve_thread_that_fails_is_restarted_and_counted(tmp_path, monkeypatch) -> None:
    listen = f"tcp://127.0.0.1:{free_port()}"
    node = Daemon(tmp_path / "n", tables={"peer": {"listen": listen, "peers": [f"tcp://127.0.0.1:{free_port()}"]}},
                  metrics="127.0.0.1:0")
    ctx = zmq.Context()
    try:
        monkeypatch.setenv("CKPTD_FAILPOINTS", "peer.serve_loop")  # every request fails outside any handler
        node.start()
        monkeypatch.delenv("CKPTD_FAILPOINTS")
        sock = _client(ctx, listen, None, None)
        for i in range(3):
            sock.send_multipart([msgpack.packb({"op": "ping", "id": i})])
        _wait(lambda: _status(node)["peer"]["thread_restarts"] >= 3, "three restarts counted")
        assert node.log_text().count("thread ckptd-peer-serve failed") >= 3
        import urllib.request
        with urllib.request.urlopen(_status(node)["metrics"], timeout=30) as page:
            assert "ckptd_peer_thread_restarts_total 3.0" in page.read().decode()
    finally:
        ctx.destroy(linger=0)
        node.cleanup()


def test_the_peer_port_admits_only_peers_keys(tmp_path, keys) -> None:
    """One key pair per node: a producer's key (admitted by the daemon's own endpoint)
    and a peer list without the asker get nothing; the nodes replicate."""
    a_, b_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    secrets = node_keys(tmp_path / "nodekeys", [a_, b_])
    a = keyed_node(tmp_path / "a", a_, [b_], secrets[a_])
    b = keyed_node(tmp_path / "b", b_, [a_], secrets[b_])
    ctx = zmq.Context()
    try:
        a.start()
        b.start()
        _save(a, range(1, 2))
        _wait(lambda: _status(a)["peer"]["under_replicated"] == 0, "replicated with per-node keys")
        assert _held(b).get((1, 0)) == "memory"
        server = tmp_path / "nodekeys" / f"{key_name(b_)}.key"
        for secret in (keys["alice"], None):  # a producer's key; no key at all
            sock = _client(ctx, b_, secret, server if secret else None)
            sock.send_multipart([msgpack.packb({"op": "list", "id": 1, "run": "job"})])
            assert not sock.poll(1500), "a key that is not a peer's was answered"
            sock.close()
        assert load_config(b.config).peer.curve_peers
    finally:
        ctx.destroy(linger=0)
        for n in (a, b):
            n.cleanup()


def test_a_network_listen_without_keys_is_refused_unless_plaintext_is_allowed(tmp_path) -> None:
    port = free_port()
    other = f"tcp://127.0.0.1:{free_port()}"
    refused = Daemon(tmp_path / "refused", tables={"peer": {"listen": f"tcp://0.0.0.0:{port}", "peers": [other]}})
    with pytest.raises(RuntimeError, match=r"not a loopback address.*curve_secret_key.*curve_peers"
                                           r".*allow_plaintext = true"):
        refused.start()
    refused.cleanup()
    allowed = Daemon(tmp_path / "allowed", tables={"peer": {"listen": f"tcp://0.0.0.0:{port}", "peers": [other],
                                                            "allow_plaintext": True}})
    try:
        allowed.start()
        assert "runs in plaintext ([peer] allow_plaintext = true)" in allowed.log_text()
    finally:
        allowed.cleanup()
