"""The peer port's fuzz: two real daemons on loopback, many identities that reconnect
sending every op with random, extreme and wrongly typed fields, garbage and truncated
msgpack, scripted transfers of a real share (whole, corrupt, partial, overflowing,
parts after ``done``, cancelled), the memory probes (a 4 MiB header of empty maps, 48 unread
4 MiB reads, an unfinished message, three at once), the transport probes (garbage before
and inside the handshake, a length over the bound, a bad record, connections that never
finish their handshake), then a lost node recovered bit-exact through the port. Prints
one JSON object of figures; exits 1 when a bound is broken.

    python benchmarks/peer_fuzz.py --messages 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import torch

from ckptd.errors import PeerDown
from ckptd.peer.messages import MAX_HEADER_BYTES
from ckptd.transport import sealed, sealed_client
from daemons import DaemonProcess, free_tcp_port

OPS = ["ping", "offer", "part", "done", "cancel", "holds", "drop", "steps", "manifests", "read", "pull", "nonsense", None,
       7, [1]]
FIELDS = ["run", "step", "rank", "file", "offset", "length", "xfer", "files", "manifest", "keep_last",
          "shares", "steps", "limit", "ranks", "runs", "v", "id"]
EXTREME = [0, 1, -1, 2**31, 2**62, 2**63 - 1, 2**64 - 1, -2**63, 1.5, float("nan"), None, True, "", "x" * 5000,
           b"\x00" * 100, "../job", "job", [], {}, [[["deep"]]]]
GROWTH_LIMIT = 64 * 2**20
RSS_LIMIT = 2**30
FRAME = 4 * 2**20 + 65536  # the port's payload bound at the default [peer] frame
MESSAGE_BOUND = MAX_HEADER_BYTES + FRAME + sealed.RECORD  # what one unfinished message may hold


class Asker:
    """A client of the peer port in its own transport that sends whatever header and
    payload it is given, as a buggy or hostile node would; its answers are read only when
    asked for (``poll``, ``recv_multipart``)."""

    def __init__(self, endpoint: str, keys: Any = None) -> None:
        self.chan = sealed_client.Channel(endpoint, keys, max_header=MAX_HEADER_BYTES, max_payload=2**31,
                                          hwm=2**20)
        self._got: list[tuple[bytes, Any]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        """``frames[0]`` the header, the rest (joined) the payload; a connection that the
        port closed takes nothing (``poll`` then says False)."""
        try:
            self.chan.send(frames[0], b"".join(frames[1:]) if len(frames) > 1 else None, time.monotonic() + 30)
        except PeerDown:
            pass

    def poll(self, ms: int) -> bool:
        if not self._got:
            try:
                self._got.append(self.chan.recv(time.monotonic() + ms / 1000))
            except PeerDown:
                return False
        return True

    def recv_multipart(self) -> list[Any]:
        if not self.poll(30_000):
            raise PeerDown(f"{self.chan.endpoint}: no answer")
        head, payload = self._got.pop(0)
        return [bytes(head)] + ([payload] if payload is not None else [])

    def close(self, linger: int = 0) -> None:
        self.chan.close()


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(EXTREME)
    if kind == 1:
        return rng.randrange(-10, 1 << 24)
    if kind == 2:
        return rng.choice(["job", "own", "chunk-r00000-00000.safetensors", "step-1", "\x00", "é" * 40])
    if kind == 3:
        return rng.randbytes(rng.randrange(64))
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    if kind == 5:
        return {str(rng.randrange(100)): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [["job", rng.choice([0, 1, 2**63]), 0]] * rng.randrange(4)


def _request(rng: random.Random, i: int) -> list[bytes]:
    roll = rng.random()
    if roll < 0.15:
        return [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))]
    header: dict[Any, Any] = {"op": rng.choice(OPS), "id": i}
    for name in rng.sample(FIELDS, rng.randrange(len(FIELDS))):
        header[name] = _value(rng)
    packed = msgpack.packb(header, use_bin_type=True)
    if roll < 0.25:
        packed = packed[:rng.randrange(len(packed))]  # truncated msgpack
    frames = [packed]
    if rng.random() < 0.2:
        frames.append(rng.randbytes(rng.randrange(1, 8192)))
    return frames


def _memory(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _status(node: DaemonProcess) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "-c", str(node.config)],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)["peer"]


def _ask(sock: Asker, frames: list[bytes], timeout: float = 30.0) -> dict[str, Any]:
    sock.send_multipart(frames)
    if not sock.poll(int(timeout * 1000)):
        raise SystemExit("the peer port stopped answering")
    return msgpack.unpackb(sock.recv_multipart()[0], raw=False)


class Share:
    """A real committed share: its manifest and files, as an offer sends them."""

    def __init__(self, folder: Path) -> None:
        self.manifest = (folder / "manifest-r00000.json").read_bytes()
        self.files = {n: (folder / n).read_bytes() for n in os.listdir(folder) if n.endswith(".safetensors")}

    def transfer(self, sock: Asker, how: str) -> bool:
        """Send it in ``how`` (whole, corrupt, partial, overflowing, after_done, cancelled);
        whether the port answered as it must."""
        offer = {"op": "offer", "id": 1, "manifest": self.manifest, "keep_last": 2,
                 "files": {n: len(b) for n, b in self.files.items()}}
        answer = _ask(sock, [msgpack.packb(offer, use_bin_type=True)])
        if not answer.get("ok"):
            return "room" in answer.get("error", "")  # full: a refusal is an answer too
        xfer = answer["xfer"]
        for name, blob in self.files.items():
            data = bytearray(blob)
            if how == "corrupt":
                data[len(data) // 2] ^= 0xFF
            end = len(data) // 2 if how in ("partial", "cancelled") else len(data)
            for off in range(0, end, 2**20):
                _ask(sock, [msgpack.packb({"op": "part", "id": 2, "xfer": xfer, "file": name, "offset": off}),
                            bytes(data[off:off + 2**20])])
            if how == "overflowing":
                over = _ask(sock, [msgpack.packb({"op": "part", "id": 3, "xfer": xfer, "file": name,
                                                  "offset": len(data)}), b"x" * 4096])
                if over.get("ok"):
                    return False
        if how == "cancelled":  # its room freed at once; nothing reaches it after
            gone = _ask(sock, [msgpack.packb({"op": "cancel", "id": 6, "xfer": xfer})])
            again = _ask(sock, [msgpack.packb({"op": "cancel", "id": 7, "xfer": xfer})])
            late = _ask(sock, [msgpack.packb({"op": "done", "id": 8, "xfer": xfer})])
            return gone.get("ok") is True and gone.get("freed") == sum(map(len, self.files.values())) \
                and again.get("ok") is False and late.get("ok") is False
        done = _ask(sock, [msgpack.packb({"op": "done", "id": 4, "xfer": xfer})], timeout=60)
        if how == "after_done":
            name = next(iter(self.files))
            late = _ask(sock, [msgpack.packb({"op": "part", "id": 5, "xfer": xfer, "file": name, "offset": 0}),
                               b"x"])
            return done.get("ok") is True and late.get("ok") is False
        return done.get("ok") is (how in ("whole", "overflowing"))


def _probe(node: DaemonProcess, action: Any) -> int:
    """The daemon's peak resident memory during ``action`` over its resident memory before."""
    try:
        Path(f"/proc/{node.pid}/clear_refs").write_text("5")  # the peak starts again from here
    except OSError:
        pass
    before, _ = _memory(node.pid)
    action()
    time.sleep(2)
    return _memory(node.pid)[1] - before


def _probes(node: DaemonProcess, listen: str, own_file: str) -> dict[str, int]:
    def empty_maps() -> None:
        sock = Asker(listen)
        _ask(sock, [msgpack.packb({"op": "holds", "id": 1, "shares": [{}] * (4 * 2**20 - 64)})], timeout=120)
        sock.close()

    def unread_reads() -> None:
        sock = Asker(listen)
        read = {"op": "read", "run": "own", "step": 1, "rank": 0, "file": own_file, "offset": 0, "length": 4 * 2**20}
        for i in range(48):
            sock.send_multipart([msgpack.packb(dict(read, id=i))])
        time.sleep(3)
        sock.close()

    closed_early: list[int] = []

    def unfinished(connections: int) -> None:
        raws = [unfinished_message(listen) for _ in range(connections)]
        time.sleep(3)
        closed_early.append(sum(not still_open(raw) for raw in raws))  # a pending message, not a refused one
        for raw in raws:
            raw.close()

    figures = {"empty_maps_header": _probe(node, empty_maps), "unread_reads": _probe(node, unread_reads),
               "unfinished_message": _probe(node, lambda: unfinished(1)),
               "unfinished_messages_3": _probe(node, lambda: unfinished(3))}
    return {**figures, "unfinished_closed_early": sum(closed_early), **transport_probes(node, listen)}


def plain(listen: str) -> socket.socket:
    """A TCP connection to a plaintext peer port that has sent its greeting."""
    host, port = listen.removeprefix("tcp://").rsplit(":", 1)
    raw = socket.create_connection((host, int(port)))
    raw.sendall(sealed.MAGIC + sealed.PLAIN)
    raw.recv(sealed.GREETING, socket.MSG_WAITALL)
    return raw


def unfinished_message(listen: str) -> socket.socket:
    """A connection that sends every record of the largest message the port takes
    (a header of ``MAX_HEADER_BYTES``, a payload of ``FRAME``) but its last byte."""
    raw = plain(listen)
    raw.settimeout(3)  # a port that stops reading it (its cap on unfinished messages) is left so
    first = sealed.RECORD - sealed.PREAMBLE.size
    records = [sealed.PREAMBLE.pack(MAX_HEADER_BYTES, FRAME + 1) + bytes(first)]
    records += [bytes(n) for n in _cut(MAX_HEADER_BYTES - first)] + [bytes(n) for n in _cut(FRAME - 1)]
    try:
        for record in records:
            raw.sendall(sealed.LENGTH.pack(len(record)) + record)
    except socket.timeout:
        pass
    return raw


def _cut(n: int) -> list[int]:
    """``n`` bytes as the sizes of the records that carry them."""
    return [min(sealed.RECORD, n - off) for off in range(0, n, sealed.RECORD)]


def still_open(raw: socket.socket) -> bool:
    """Whether the port keeps ``raw`` open (its greeting read, nothing more to come)."""
    raw.setblocking(False)
    try:
        return raw.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def closed(raw: socket.socket, timeout: float = 20.0) -> bool:
    """Whether the port closed ``raw`` within ``timeout`` (its greeting is skipped)."""
    raw.settimeout(timeout)
    try:
        while raw.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except socket.timeout:
        return False
    finally:
        raw.close()
    return True


def transport_probes(node: DaemonProcess, listen: str) -> dict[str, int]:
    """Each hostile connection is closed by the port (1) and the port serves on: the
    number of probes that were not."""
    host, port = listen.removeprefix("tcp://").rsplit(":", 1)
    garbage = socket.create_connection((host, int(port)))
    garbage.sendall(random.Random(1).randbytes(4096))
    over = plain(listen)
    over.sendall(sealed.LENGTH.pack(2**32 - 1))
    stops = plain(listen)
    stops.sendall(sealed.LENGTH.pack(4096) + sealed.PREAMBLE.pack(10, 0) + bytes(100))
    results = [closed(garbage), closed(over)]
    # never finishing a handshake: past the cap, refused at once; the rest closed after [peer] stall
    idle = [socket.create_connection((host, int(port))) for _ in range(300)]
    results.append(closed(idle[-1], timeout=5))
    results += [closed(stops), all(closed(s, timeout=30) for s in idle[:-1])]
    sock = Asker(listen)
    served = _ask(sock, [msgpack.packb({"op": "ping", "id": 1})]).get("ok") is True
    sock.close()
    return {"transport_probes_not_closed": results.count(False) + (not served)}


def _fuzz(listen: str, n: int, identities: int, share: Share, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    socks: list[Asker] = []
    counts = {"sent": 0, "answered": 0, "transfers": 0, "transfers_wrong": 0, "reconnects": 0}
    hows = ["whole", "corrupt", "partial", "overflowing", "after_done", "cancelled"]
    while counts["sent"] < n:
        if len(socks) < identities or rng.random() < 0.05:
            if socks and len(socks) >= identities:
                socks.pop(rng.randrange(len(socks))).close()
                counts["reconnects"] += 1
            socks.append(Asker(listen))
        sock = rng.choice(socks)
        batch = min(64, n - counts["sent"])
        for _ in range(batch):
            sock.send_multipart(_request(rng, counts["sent"]))
            counts["sent"] += 1
        deadline = time.monotonic() + 30
        got = 0
        while got < batch and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            sock.recv_multipart()
            got += 1
        counts["answered"] += got
        if counts["sent"] // 64 % 50 == 0:
            counts["transfers"] += 1
            counts["transfers_wrong"] += not share.transfer(sock, hows[counts["transfers"] % len(hows)])
    for sock in socks:
        sock.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--identities", type=int, default=16)
    parser.add_argument("--seed", type=int, default=39)
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="ckptd-peer-fuzz-"))
    a_, b_ = (f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2))
    a = DaemonProcess(base, None, name="a", tables={"peer": {"listen": a_, "peers": [b_]}})
    b = DaemonProcess(base, None, name="b", tables={"peer": {"listen": b_, "peers": [a_], "memory": "256MiB"}})
    began = time.monotonic()
    try:
        figures = _run(a, b, a_, b_, args)
    finally:
        for node in (a, b):
            node.close()
        shutil.rmtree(base, ignore_errors=True)
    figures["seconds"] = round(time.monotonic() - began, 1)
    print(json.dumps(figures, indent=2))
    ok = (figures["thread_restarts"] == 0 and figures["peak_rss"] < RSS_LIMIT and figures["recovered_bit_exact"]
          and figures["empty_maps_header"] <= GROWTH_LIMIT and figures["unread_reads"] <= GROWTH_LIMIT
          and figures["unfinished_message"] <= MESSAGE_BOUND
          and figures["unfinished_messages_3"] <= 3 * MESSAGE_BOUND
          and figures["unfinished_closed_early"] == 0 and figures["transport_probes_not_closed"] == 0
          and figures["transfers_wrong"] == 0)
    return 0 if ok else 1


def _save(node: DaemonProcess, run: str, step: int, nbytes: int) -> torch.Tensor:
    from ckptd import Producer

    t = torch.arange(nbytes // 4, dtype=torch.float32) + step
    with Producer(node.endpoint, run, rank=0, world_size=1, staging_size="64MiB") as p:
        p.save({"w": t}, step).wait(60)
    return t


def _run(a: DaemonProcess, b: DaemonProcess, a_: str, b_: str,
         args: argparse.Namespace) -> dict[str, Any]:
    a.start()
    b.start()
    saved = _save(a, "job", 1, 2 * 2**20)
    _save(b, "own", 1, 5 * 2**20)
    deadline = time.monotonic() + 60
    while _status(b)["held_shares"] < 1:
        if time.monotonic() > deadline:
            raise SystemExit("A's share never reached B")
        time.sleep(0.5)
    share = Share(a.root / "job" / "step-000000000001")
    own = b.root / "own" / "step-000000000001"
    own_file = next(n for n in os.listdir(own) if n.endswith(".safetensors"))
    counts = _fuzz(b_, args.messages, args.identities, share, args.seed)
    probes = _probes(b, b_, own_file)
    status = _status(b)
    peak = _memory(b.pid)[1]
    a.kill()
    shutil.rmtree(a.root)
    a.start()
    import ckptd

    saved_config = os.environ.get("CKPTD_CONFIG")
    os.environ["CKPTD_CONFIG"] = str(a.config)
    try:
        state = ckptd.load("job", 1)
    finally:
        if saved_config is None:
            del os.environ["CKPTD_CONFIG"]
        else:
            os.environ["CKPTD_CONFIG"] = saved_config
    return {**counts, **probes, "thread_restarts": status["thread_restarts"], "peak_rss": peak,
            "held_shares": status["held_shares"], "recovered_bit_exact": bool(torch.equal(state["w"], saved))}


if __name__ == "__main__":
    sys.exit(main())
