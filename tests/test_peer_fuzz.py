"""The peer port read as a network service: every op with random and extreme fields,
and garbage frames, sent to a real daemon by a key admitted as a peer; the daemon
answers each with an error, keeps serving, and a lost node then recovers through it,
bit-exact. A serve thread that fails is restarted and counted."""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch

import ckptd
from ckptd.config import load as load_config
from ckptd.layout import manifest_name, step_dir
from ckptd.peer.keys import key_name
from ckptd.transport import curve
from ckptd.transport.sealed_server import Server
from conftest import Daemon, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import peer_fuzz  # noqa: E402  (benchmarks/peer_fuzz.py: the peer port's fuzz at scale)
from test_peer import _held, _save, _status, _wait

FUZZ_MESSAGES = 600
FUZZ_SECONDS = 40.0
OPS = ["ping", "offer", "part", "done", "cancel", "holds", "drop", "steps", "manifests", "read", "pull", "nonsense", None]
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
              "shares", "steps", "limit", "ranks", "have", "wait_ms"]
    header = {"op": rng.choice(OPS), "id": i}
    for name in rng.sample(fields, rng.randrange(len(fields))):
        header[name] = _value(rng)
    frames = [msgpack.packb(header, use_bin_type=True)]
    if rng.random() < 0.3:
        frames.append(rng.randbytes(rng.randrange(1, 5000)))
    return frames


def _client(endpoint: str, secret: Path | None = None, server: Path | None = None) -> peer_fuzz.Asker:
    """A client of the peer port; with ``secret``, it dials with that key pair a port whose
    public key file is ``server``."""
    keys = None
    if secret is not None and server is not None:
        public, private = curve.load_secret(secret, "a test's key")
        keys = curve.ClientKeys(curve.load_public(server, "a test's server key"), public, private, secret)
    return peer_fuzz.Asker(endpoint, keys)


def _ask(sock: peer_fuzz.Asker, frames: list[bytes], timeout: float = 10.0) -> dict:
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
    try:
        a.start()
        b.start()
        saved = _save(a, range(1, 2))
        _wait(lambda: _held(b).get((1, 0)) == "memory", "A's share held by B")
        sock = _client(b_, secrets[spy_], tmp_path / "keys" / f"{key_name(b_)}.key")
        # targeted: the fields that used to stop the thread or reach other nodes' replicas
        manifest = (step_dir(a.root, "job", 1) / manifest_name(0)).read_bytes()
        data_file = next(n for n in os.listdir(step_dir(a.root, "job", 1)) if n.endswith(".safetensors"))
        read = {"op": "read", "id": 1, "run": "job", "step": 1, "rank": 0, "file": data_file, "offset": 0}
        for fields in ({"length": 2**62}, {"length": 1024, "offset": 2**64 - 1}, {"length": 2**20, "offset": 2**20}):
            answer = _ask(sock, [msgpack.packb(dict(read, **fields))])
            assert answer["ok"] is False and answer["id"] == 1, answer
        answer = _ask(sock, [msgpack.packb({"op": "drop", "id": 2, "run": "job", "steps": [1]})])
        assert answer == {"ok": True, "id": 2, "v": 2, "dropped": 0}, answer  # not the spy's to drop
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
        for n in (a, b):
            n.cleanup()


def test_a_serve_thread_that_fails_is_restarted_and_counted(tmp_path, monkeypatch) -> None:
    listen = f"tcp://127.0.0.1:{free_port()}"
    node = Daemon(tmp_path / "n", tables={"peer": {"listen": listen, "peers": [f"tcp://127.0.0.1:{free_port()}"]}},
                  metrics="127.0.0.1:0")
    try:
        monkeypatch.setenv("CKPTD_FAILPOINTS", "peer.serve_loop")  # every request fails outside any handler
        node.start()
        monkeypatch.delenv("CKPTD_FAILPOINTS")
        sock = _client(listen)
        for i in range(3):
            sock.send_multipart([msgpack.packb({"op": "ping", "id": i})])
        _wait(lambda: _status(node)["peer"]["thread_restarts"] >= 3, "three restarts counted")
        assert node.log_text().count("thread ckptd-peer-serve failed") >= 3
        import urllib.request
        with urllib.request.urlopen(_status(node)["metrics"], timeout=30) as page:
            assert "ckptd_peer_thread_restarts_total 3.0" in page.read().decode()
    finally:
        node.cleanup()


def test_the_peer_port_admits_only_peers_keys(tmp_path, keys) -> None:
    """One key pair per node: a producer's key (admitted by the daemon's own endpoint)
    and a peer list without the asker get nothing; the nodes replicate."""
    a_, b_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    secrets = node_keys(tmp_path / "nodekeys", [a_, b_])
    a = keyed_node(tmp_path / "a", a_, [b_], secrets[a_])
    b = keyed_node(tmp_path / "b", b_, [a_], secrets[b_])
    try:
        a.start()
        b.start()
        _save(a, range(1, 2))
        _wait(lambda: _status(a)["peer"]["under_replicated"] == 0, "replicated with per-node keys")
        assert _held(b).get((1, 0)) == "memory"
        server = tmp_path / "nodekeys" / f"{key_name(b_)}.key"
        for secret in (keys["alice"], None):  # a producer's key; no key at all
            sock = _client(b_, secret, server if secret else None)
            sock.send_multipart([msgpack.packb({"op": "list", "id": 1, "run": "job"})])
            assert not sock.poll(1500), "a key that is not a peer's was answered"
            sock.close()
        assert load_config(b.config).peer.curve_peers
    finally:
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


# -- a hostile member, one item at a time: each leaves the thread serving and memory bounded --
def _memory(node: Daemon) -> tuple[int, int]:
    """The daemon's resident and peak resident memory, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{node.pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _plain_node(tmp_path: Path, **peer: object) -> tuple[Daemon, str]:
    listen = f"tcp://127.0.0.1:{free_port()}"
    node = Daemon(tmp_path / "n", tables={"peer": {"listen": listen, "peers": [f"tcp://127.0.0.1:{free_port()}"],
                                                   **peer}})
    return node, listen


def test_a_deeply_nested_field_is_refused_without_restarting_the_thread(tmp_path) -> None:
    node, listen = _plain_node(tmp_path)
    try:
        node.start()
        sock = _client(listen)
        deep: object = "ping"
        for _ in range(1000):
            deep = [deep]
        for i, header in enumerate(({"op": deep, "id": 1}, {"op": "read", "id": 2, "run": deep},
                                    {"op": "holds", "id": 3, "shares": [deep]}, {"op": "ping", "id": 4, "x": deep})):
            answer = _ask(sock, [msgpack.packb(header)])
            if header["op"] == "ping":
                assert answer["ok"] is True, answer  # a field the op does not know is left unread
            else:
                assert answer["ok"] is False and "RecursionError" not in answer["error"], answer
        assert _status(node)["peer"]["thread_restarts"] == 0
        assert "failed (restart" not in node.log_text()
    finally:
        node.cleanup()


def test_a_header_of_empty_maps_is_refused_within_bounded_memory(tmp_path) -> None:
    node, listen = _plain_node(tmp_path)
    try:
        node.start()
        sock = _client(listen)
        assert _ask(sock, [msgpack.packb({"op": "ping", "id": 0})])["ok"] is True
        before, _ = _memory(node)
        header = msgpack.packb({"op": "holds", "id": 1, "shares": [{}] * (4 * 2**20 - 64)})
        answer = _ask(sock, [header], timeout=60)
        assert answer["ok"] is False, answer
        assert _memory(node)[1] - before <= 64 * 2**20
    finally:
        node.cleanup()


def test_unread_answers_are_capped(tmp_path) -> None:
    """48 reads of 4 MiB from the daemon's own root, their answers never read."""
    node, listen = _plain_node(tmp_path)
    try:
        node.start()
        _save(node, range(1, 2), nbytes=5 * 2**20)
        folder = step_dir(node.root, "job", 1)
        data_file = next(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        sock = _client(listen)  # its answers are read only when asked for
        sock.send_multipart([msgpack.packb({"op": "ping", "id": 0})])
        assert sock.poll(10000)
        sock.recv_multipart()
        before, _ = _memory(node)
        read = {"op": "read", "run": "job", "step": 1, "rank": 0, "file": data_file, "offset": 0, "length": 4 * 2**20}
        for i in range(48):
            sock.send_multipart([msgpack.packb(dict(read, id=i + 1))])
        time.sleep(3)
        assert _memory(node)[1] - before <= 64 * 2**20
        other = _client(listen)
        assert _ask(other, [msgpack.packb({"op": "ping", "id": 1})])["ok"] is True
    finally:
        node.cleanup()


def _big_share(tmp_path: Path, nbytes: int) -> tuple[bytes, dict[str, int], dict[str, bytes]]:
    """A real committed share of run "big" (its manifest, its files' sizes and bytes)."""
    node = Daemon(tmp_path / "maker")
    try:
        node.start()
        with node.producer("big", rank=0, world_size=1) as p:
            p.save({"w": torch.arange(nbytes // 4, dtype=torch.float32)}, 1).wait(30)
        folder = step_dir(node.root, "big", 1)
        data = {n: (folder / n).read_bytes() for n in os.listdir(folder) if n.endswith(".safetensors")}
        return (folder / manifest_name(0)).read_bytes(), {n: len(b) for n, b in data.items()}, data
    finally:
        node.cleanup()


def test_an_offer_reserves_room_and_evicts_nothing_until_its_share_is_verified(tmp_path) -> None:
    a_, b_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = Daemon(tmp_path / "a", tables={"peer": {"listen": a_, "peers": [b_]}, "retention": {"keep_last": 3}})
    b = Daemon(tmp_path / "b", tables={"peer": {"listen": b_, "peers": [a_], "memory": "4MiB", "stall": "2s"}})
    manifest, files, _ = _big_share(tmp_path, 3 * 2**20)
    try:
        a.start()
        b.start()
        for step in range(1, 4):
            _save(a, range(step, step + 1))
            _wait(lambda: _status(b)["peer"]["held_shares"] == step, f"{step} of A's steps held by B")
        sock = _client(b_)
        offer = {"op": "offer", "id": 1, "manifest": manifest, "files": files, "keep_last": 1}
        answer = _ask(sock, [msgpack.packb(offer, use_bin_type=True)])
        assert answer["ok"] is True, answer
        status = _status(b)["peer"]
        assert status["held_shares"] == 3 and status["evicted"] == 0, status
        # no part comes: the reservation is given up after [peer] stall, and held copies stay
        _wait(lambda: _status(b)["peer"]["receiving_bytes"] == 0, "the reservation given up", timeout=20)
        assert _status(b)["peer"]["held_shares"] == 3
        # an offer that fits only by evicting the newest copy of a rank is refused
        big, big_files, _ = _big_share(tmp_path / "bigger", 4 * 2**20 - 64 * 1024)
        answer = _ask(sock, [msgpack.packb(dict(offer, id=2, manifest=big, files=big_files), use_bin_type=True)])
        assert answer["ok"] is False and "room" in answer["error"], answer
        assert _status(b)["peer"]["held_shares"] == 3
    finally:
        for n in (a, b):
            n.cleanup()


def test_parts_after_done_are_refused(tmp_path) -> None:
    node, listen = _plain_node(tmp_path, memory="64MiB")
    manifest, files, data = _big_share(tmp_path, 8 * 2**20)
    try:
        node.start()
        sock = _client(listen)
        answer = _ask(sock, [msgpack.packb({"op": "offer", "id": 1, "manifest": manifest, "files": files,
                                            "keep_last": 1}, use_bin_type=True)])
        xfer = answer["xfer"]
        for i, (name, blob) in enumerate(data.items()):
            for off in range(0, len(blob), 2**20):
                part = {"op": "part", "id": 10, "xfer": xfer, "file": name, "offset": off}
                assert _ask(sock, [msgpack.packb(part), blob[off:off + 2**20]])["ok"] is True
        name, blob = next(iter(data.items()))
        # done, then parts racing it: each part is refused, and the share verifies as sent
        sock.send_multipart([msgpack.packb({"op": "done", "id": 20, "xfer": xfer})])
        for i in range(5):
            sock.send_multipart([msgpack.packb({"op": "part", "id": 21 + i, "xfer": xfer, "file": name,
                                                "offset": 0}), bytes(2**20)])
        answers = {}
        while len(answers) < 6:
            assert sock.poll(30000)
            a = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
            answers[a["id"]] = a
        assert answers[20]["ok"] is True, answers[20]
        assert all(answers[21 + i]["ok"] is False for i in range(5)), answers
    finally:
        node.cleanup()


@pytest.mark.slow
def test_the_peer_fuzz_at_small_scale_keeps_every_bound(capsys) -> None:
    """benchmarks/peer_fuzz.py, short: no restart, the probes bounded, a lost node recovered."""
    assert peer_fuzz.main(["--messages", "3000", "--identities", "8"]) == 0, capsys.readouterr().out


def test_versions_on_the_wire(tmp_path) -> None:
    """Answers carry the peer protocol version; a request of a newer one is refused by
    name; a peer answering as version 1 did (no ``v``) is named in the log and status."""
    import threading

    old_ = f"tcp://127.0.0.1:{free_port()}"
    listen = f"tcp://127.0.0.1:{free_port()}"
    node = Daemon(tmp_path / "n", tables={"peer": {"listen": listen, "peers": [old_], "heartbeat": "1s"}})
    old = Server(old_, None, max_header=2**20, max_payload=2**20, unread_cap=2**20)
    stop = threading.Event()

    def answer_as_version_1() -> None:
        while not stop.is_set():
            for ident, frames, _ in old.poll(0.1):
                request = msgpack.unpackb(bytes(frames[0]), raw=False)
                answer = {"ok": True, "id": request.get("id"), "node": "old", "listen": old_}
                if request.get("op") == "holds":
                    answer["held"] = [True] * len(request["shares"])
                old.send(ident, msgpack.packb(answer), None, counted=False)

    thread = threading.Thread(target=answer_as_version_1, daemon=True)
    thread.start()
    try:
        node.start()
        sock = _client(listen)
        assert _ask(sock, [msgpack.packb({"op": "ping", "id": 1})])["v"] == 2  # a version 1 request
        answer = _ask(sock, [msgpack.packb({"op": "ping", "id": 2, "v": 99})])
        assert answer["ok"] is False and answer["code"] == "version" and "version 99" in answer["error"], answer
        _wait(lambda: _status(node)["peer"]["peer_versions"] == {old_: 1}, "the old peer named in status")
        assert f"peer {old_} speaks peer protocol version 1, this node 2" in node.log_text()
    finally:
        stop.set()
        thread.join()
        old.close()
        node.cleanup()


def test_a_cancelled_transfer_frees_its_room_at_once_and_takes_nothing_after(tmp_path) -> None:
    """``cancel``: the room of an offer half sent is freed at once (not after ``stall``),
    answered with the bytes freed; a part, a ``done`` or a second ``cancel`` after it is
    refused, and the same share offered again fits the room it freed."""
    node, listen = _plain_node(tmp_path, memory="12MiB", stall="600s")
    manifest, files, data = _big_share(tmp_path, 8 * 2**20)
    try:
        node.start()
        sock = _client(listen)
        offer = {"op": "offer", "id": 1, "manifest": manifest, "files": files, "keep_last": 1}
        xfer = _ask(sock, [msgpack.packb(offer, use_bin_type=True)])["xfer"]
        name, blob = next(iter(data.items()))
        part = {"op": "part", "id": 2, "xfer": xfer, "file": name, "offset": 0}
        assert _ask(sock, [msgpack.packb(part), blob[:2**20]])["ok"] is True
        assert _status(node)["peer"]["receiving_bytes"] == sum(files.values())
        answer = _ask(sock, [msgpack.packb({"op": "cancel", "id": 3, "xfer": xfer})])
        assert answer["ok"] is True and answer["freed"] == sum(files.values()), answer
        status = _status(node)["peer"]
        assert status["receiving_bytes"] == 0 and status["cancelled"] == 1 and status["held_shares"] == 0, status
        for i, late in enumerate(({"op": "part", "xfer": xfer, "file": name, "offset": 2**20},
                                  {"op": "done", "xfer": xfer}, {"op": "cancel", "xfer": xfer})):
            frames = [msgpack.packb(dict(late, id=10 + i))] + ([blob[2**20:2**21]] if late["op"] == "part" else [])
            answer = _ask(sock, frames)
            assert answer["ok"] is False and f"transfer {xfer} is unknown" in answer["error"], answer
        again = _ask(sock, [msgpack.packb(dict(offer, id=20), use_bin_type=True)])
        assert again["ok"] is True and again["xfer"] != xfer, again
    finally:
        node.cleanup()
