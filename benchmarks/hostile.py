"""Malformed and hostile messages for a live daemon's socket.

``Fuzzer`` drives real ZeroMQ DEALER sockets against a running ``ckptd serve``
and sends, one message per ``send_one()``, something a well-behaved producer
never sends: random bytes, truncated or bit-flipped msgpack, fields of the wrong
type, missing or unknown fields, huge declared sizes and counts, deeply nested
maps, unknown ops, wrong protocol versions, the wrong number of frames, frames
out of order (a tensor before hello, a commit for an unknown step, pieces out of
order), hostile values (NaN in JSON, names with control characters, retention
overrides that do not parse), and it opens and closes identities all the time.
Beside an ``ipc://`` endpoint it also works the shared-memory handoff socket
(``PATH.shm``): junk, silent connections held open, descriptors that are not
sealed memory files, and real sealed memfds followed by hellos and tensors that
lie about their size and offsets. A few well-formed messages (hellos, tiny
complete steps) are mixed in so that the hostile ones reach the code behind the
session check.

Used by ``benchmarks/stress.py`` (>= 100,000 messages) and ``tests/test_fuzz.py``.
Nothing here knows what the daemon answers: the caller checks that the daemon
lives, that its memory stays bounded and that a good producer beside it loses
nothing.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import zmq

from ckptd.transport import wire

# The daemon accepts frames up to max(max_frame, the 64 MiB header limit); a frame
# larger than that makes libzmq drop the peer before Python sees it.
OVERSIZE = wire.MAX_HEADER_BYTES + 8192


def pack(op: Any, **fields: Any) -> bytes:
    """A header with any fields at all (``wire.encode`` is for well-formed ones)."""
    return msgpack.packb({"op": op, **fields}, use_bin_type=True)


def recover(rng: random.Random, seq: int, root: str = "/nonexistent") -> bytes:
    """A ``recover`` (a reader's ask for a step the peers hold), its fields often hostile:
    runs that are no run id, steps and ranks beyond anything held, roots not the daemon's."""
    fields: dict[str, Any] = {
        "seq": seq, "run": rng.choice(["fzv", "fzv", "../etc", "", ".x", "x" * 200, "a/b"]),
        "step": rng.choice([None, 0, 1, 7, 10**13, 2**63 - 1]),
        "ranks": rng.choice([None, [], [0], [0, 0, 1], [2**63 - 1], list(range(rng.randrange(1, 2000)))]),
        "root": rng.choice([root, root, "/", "", "x" * 300, root + "/../etc"]),
        "memory": rng.choice([None, False, True])}
    for key in rng.sample(sorted(fields), rng.randrange(0, 2)):
        fields[key] = _junk(rng)
    return pack("recover", **fields)


@dataclass(eq=False)
class Peer:
    sock: zmq.Socket
    session: bool = False  # sent a well-formed hello (the daemon may still have refused it)
    run: str = ""
    rank: int = 0
    world: int = 1
    seq: int = 0
    step: int = 0
    sent: int = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


@dataclass
class Counts:
    messages: int = 0  # every message sent
    malformed: int = 0  # of which not well-formed (or out of place)
    frames: int = 0  # ZeroMQ frames of all of them
    identities: int = 0  # sockets opened (each a new identity on the daemon's ROUTER)
    replies: int = 0  # answers read back
    errors: int = 0  # of which `error`
    stalled_s: float = 0.0  # time spent waiting for the daemon to read (its socket full)
    handoffs: int = 0  # hostile connections to the shared-memory handoff socket beside the endpoint
    handoffs_cut: int = 0  # of which the daemon closed unanswered (over its cap on pending ones) or was silent 5 s
    kinds: dict[str, int] = field(default_factory=dict)


class Stalled(Exception):
    """The daemon did not read a message for ``stall_limit`` seconds."""


class Fuzzer:
    def __init__(self, endpoint: str, rng: random.Random, *, peers: int = 48, chunk_size: int = 2**20,
                 oversize: bool = True, stall_limit: float = 30.0, avoid_runs: tuple[str, ...] = (),
                 silent_max: int = 1100) -> None:
        self.endpoint = endpoint
        self.rng = rng
        self.chunk_size = chunk_size  # a tensor declared just under this is gathered, not streamed
        self.oversize = oversize
        self.stall_limit = stall_limit
        self.avoid_runs = set(avoid_runs)  # never hello as these runs (the good producer's)
        self.silent_max = silent_max  # handoff connections held open without a word, at most
        self._silent: list[socket.socket] = []
        self._handoff_path = endpoint[len("ipc://"):] + ".shm" if endpoint.startswith("ipc://") else None
        self.counts = Counts()
        self.ctx = zmq.Context()
        self.peers = [self._new_peer() for _ in range(peers)]
        weighted: list[tuple[Callable[[Peer], list[bytes]], int]] = [
            (self._random_bytes, 8), (self._truncated, 8), (self._bitflip, 8), (self._wrong_type, 10),
            (self._missing_field, 4), (self._extra_field, 4), (self._huge_count, 5), (self._huge_size, 6),
            (self._deep, 3), (self._unknown_op, 5), (self._bad_version, 3), (self._frame_count, 5),
            (self._before_hello, 5), (self._out_of_order, 8), (self._bad_values, 8), (self._hold, 4),
            (self._bad_json, 4), (self._bad_hello, 4),
        ]
        self._kinds = [k for k, _ in weighted]
        self._weights = [w for _, w in weighted]
        self._poller = zmq.Poller()
        for p in self.peers:
            self._poller.register(p.sock, zmq.POLLIN)

    # -- driving ---------------------------------------------------------------------------
    def send_one(self) -> str:
        """Send one message (a hostile one, or the hello/valid step it needs); return its kind."""
        rng = self.rng
        peer = rng.choice(self.peers)
        if rng.random() < 0.01:
            self._renew(peer)  # many identities
        r = rng.random()
        if r < 0.03:
            kind, malformed, frames = "hello", False, [self._hello(peer)]
        elif r < 0.04:
            self._valid_step(peer)  # several messages, sent inside
            return "valid_step"
        elif self.oversize and r < 0.04005:
            kind, malformed, frames = "oversize", True, [b"\x80" + bytes(OVERSIZE)]
        elif self._handoff_path and r < 0.06:
            kind = self._handoff(peer)
            self.counts.kinds[kind] = self.counts.kinds.get(kind, 0) + 1
            return kind
        else:
            fn = rng.choices(self._kinds, self._weights)[0]
            kind, malformed = fn.__name__.lstrip("_"), True
            frames = fn(peer)
        self._send(peer, frames, malformed, kind)
        return kind

    def drain(self) -> None:
        """Read every reply waiting on any socket."""
        for sock, _ in self._poller.poll(0):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.counts.replies += 1
                try:
                    if msgpack.unpackb(frames[0], raw=False).get("op") == "error":
                        self.counts.errors += 1
                except Exception:
                    pass

    def close(self) -> None:
        """Close every socket; what is still queued is delivered first (LINGER)."""
        for p in self.peers:
            p.sock.close()
        for conn in self._silent:
            conn.close()
        self._silent.clear()
        self.ctx.term()

    def _send(self, peer: Peer, frames: list[bytes], malformed: bool, kind: str) -> None:
        c = self.counts
        waited = 0.0
        while True:
            try:
                peer.sock.send_multipart(frames, zmq.NOBLOCK)
                break
            except zmq.Again:  # the daemon is not reading fast enough: wait for it
                self.drain()
                self._poller.poll(5)
                waited += 0.005
                if waited > self.stall_limit:
                    raise Stalled(f"the daemon read nothing from a fuzz socket for {self.stall_limit:g} s")
        c.stalled_s += waited
        c.messages += 1
        c.malformed += malformed
        c.frames += len(frames)
        c.kinds[kind] = c.kinds.get(kind, 0) + 1
        peer.sent += 1
        if c.messages % 64 == 0:
            self.drain()

    def _new_socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 10_000)  # a closed peer's queued messages still go out
        sock.setsockopt(zmq.SNDHWM, 64)  # stay close behind the daemon, not 1000s ahead
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.rng.random() < 0.2:  # an identity of its own choosing, sometimes a reserved one (\0...)
            sock.setsockopt(zmq.ROUTING_ID, self.rng.randbytes(self.rng.randint(1, 255)))
        sock.connect(self.endpoint)
        self.counts.identities += 1
        return sock

    def _new_peer(self) -> Peer:
        return Peer(self._new_socket())

    def _renew(self, peer: Peer) -> None:
        """Give ``peer`` a new socket: a new identity, without a session."""
        self._poller.unregister(peer.sock)
        peer.sock.close()
        fresh = Peer(self._new_socket())
        peer.__dict__.update(fresh.__dict__)
        self._poller.register(peer.sock, zmq.POLLIN)

    # -- well-formed pieces ---------------------------------------------------------------------
    def _hello(self, peer: Peer) -> bytes:
        rng = self.rng
        run = f"fz{rng.randrange(40)}"
        while run in self.avoid_runs:
            run += "x"
        world = rng.choice([1, 1, 2, 4])
        peer.session, peer.run, peer.world, peer.rank = True, run, world, rng.randrange(world)
        return wire.encode("hello", v=wire.VERSION, run=run, rank=peer.rank, world_size=world,
                           pid=rng.randrange(1, 2**22), host="fuzz", retention=None, format=None)

    def _tensor(self, peer: Peer, step: int, name: str, shape: list[int], start: int = 0,
                nbytes: int | None = None, dtype: str = "uint8", **extra: Any) -> bytes:
        return pack("tensor", seq=peer.next_seq(), step=step, name=name, dtype=dtype, shape=shape,
                    nbytes=nbytes if nbytes is not None else _prod(shape), start=start, numpy=False, **extra)

    def _session(self, peer: Peer) -> None:
        if not peer.session:
            self._send(peer, [self._hello(peer)], False, "hello")

    def _valid_step(self, peer: Peer) -> None:
        """A tiny complete checkpoint of a fuzz run: hostile peers may also be correct."""
        self._session(peer)
        peer.step += 1
        n = self.rng.randrange(0, 3)
        for i in range(n):
            size = self.rng.randrange(1, 4096)
            self._send(peer, [self._tensor(peer, peer.step, f"v{i}", [size]), self.rng.randbytes(size)],
                       False, "valid_step")
        self._send(peer, [pack("commit", seq=peer.next_seq(), step=peer.step, ntensors=n, state="null",
                               metadata="{}")], False, "valid_step")

    def _any_valid(self, peer: Peer) -> list[bytes]:
        """A well-formed message of a random op (to be damaged by the caller)."""
        rng, step = self.rng, peer.step + 1
        op = rng.choice(["hello", "tensor", "commit", "abort", "ping", "latest", "status", "bye", "recover"])
        if op == "hello":
            return [wire.encode("hello", v=1, run="fzv", rank=0, world_size=1, pid=1, host="h",
                                retention=None, format=None)]
        if op == "tensor":
            size = rng.randrange(0, 64)
            return [self._tensor(peer, step, "w", [size]), rng.randbytes(size)]
        if op == "commit":
            return [pack("commit", seq=peer.next_seq(), step=step, ntensors=1, state="null", metadata="{}")]
        if op == "abort":
            return [pack("abort", seq=peer.next_seq(), step=step, reason="r")]
        if op == "latest":
            return [pack("latest", seq=peer.next_seq(), run="fzv")]
        if op == "recover":
            return [recover(rng, peer.next_seq())]
        if op == "bye":
            return [pack("bye")]
        return [pack(op, seq=peer.next_seq())]

    # -- the hostile kinds: each returns the frames of one message ------------------------------
    def _random_bytes(self, peer: Peer) -> list[bytes]:
        rng = self.rng
        return [rng.randbytes(int(rng.expovariate(1 / 64))) for _ in range(rng.randint(1, 3))]

    def _truncated(self, peer: Peer) -> list[bytes]:
        frames = self._any_valid(peer)
        frames[0] = frames[0][:self.rng.randrange(len(frames[0]))]
        return frames

    def _bitflip(self, peer: Peer) -> list[bytes]:
        frames = self._any_valid(peer)
        head = bytearray(frames[0])
        for _ in range(self.rng.randint(1, 8)):
            i = self.rng.randrange(len(head))
            head[i] ^= 1 << self.rng.randrange(8)
        frames[0] = bytes(head)
        return frames

    def _fields(self, peer: Peer) -> tuple[dict[str, Any], list[bytes]]:
        frames = self._any_valid(peer)
        return msgpack.unpackb(frames[0], raw=False), frames[1:]

    def _wrong_type(self, peer: Peer) -> list[bytes]:
        fields, rest = self._fields(peer)
        key = self.rng.choice(list(fields))
        fields[key] = _junk(self.rng)
        return [msgpack.packb(fields, use_bin_type=True), *rest]

    def _missing_field(self, peer: Peer) -> list[bytes]:
        fields, rest = self._fields(peer)
        if len(fields) > 1:
            del fields[self.rng.choice([k for k in fields if k != "op"])]
        return [msgpack.packb(fields, use_bin_type=True), *rest]

    def _extra_field(self, peer: Peer) -> list[bytes]:
        fields, rest = self._fields(peer)
        # plausible future fields too: an shm map in hello, an offset in tensor
        key = self.rng.choice(["shm", "offset", "evil", "path", "op2", "__class__"])
        fields[key] = self.rng.choice([{"path": "/etc/passwd", "size": 2**40}, 2**62, "../../x", _junk(self.rng)])
        return [msgpack.packb(fields, use_bin_type=True), *rest]

    def _huge_count(self, peer: Peer) -> list[bytes]:
        """Containers and strings whose declared length is far beyond the bytes that follow."""
        rng = self.rng
        n = rng.choice([2**32 - 1, 2**31, 1_000_001, 65_536])
        marker = rng.choice([b"\xdf", b"\xdd", b"\xdb", b"\xc6", b"\xc9"])  # map32 array32 str32 bin32 ext32
        inner = marker + struct.pack(">I", n) + rng.randbytes(rng.randrange(16))
        if rng.random() < 0.5:  # inside an otherwise plausible tensor header
            return [b"\x82\xa2op\xa6tensor\xa5shape" + inner, b""]
        return [inner]

    def _huge_size(self, peer: Peer) -> list[bytes]:
        self._session(peer)
        rng = self.rng
        peer.step += 1
        step = rng.choice([peer.step, 2**63 - 1, 10**12])
        choice = rng.randrange(6)
        if choice == 0:  # a shape whose bytes overflow int64
            return [self._tensor(peer, step, "huge", [2**40, 2**40], nbytes=2**62), b"x" * 16]
        if choice == 1:  # consistent, but 4 EiB declared, 16 bytes sent
            return [self._tensor(peer, step, "huge", [2**62], dtype="uint8"), b"x" * 16]
        if choice == 2:  # a piece far beyond the end
            return [self._tensor(peer, step, "huge", [16], start=2**62), b"x" * 16]
        if choice == 3:
            return [pack("commit", seq=peer.next_seq(), step=step, ntensors=2**63 - 1, state="null", metadata="{}")]
        if choice == 4:  # more bytes than declared
            return [self._tensor(peer, step, "huge", [4]), b"x" * rng.randrange(5, 70_000)]
        return [self._tensor(peer, step, "huge", [1] * 64), b"x"]

    def _deep(self, peer: Peer) -> list[bytes]:
        rng = self.rng
        depth = rng.choice([100, 1000, 5000, 100_000])
        nested = b"\x81\xa1a" * depth + b"\xc0"  # {"a": {"a": ... nil}}
        where = rng.randrange(3)
        if where == 0:
            return [nested]
        if where == 1:  # as the retention map of a hello
            return [b"\x89\xa2op\xa5hello\xa1v\x01\xa3run\xa3fzd\xa4rank\x00\xaaworld_size\x01"
                    b"\xa3pid\x01\xa4host\xa1h\xa6format\xc0\xa9retention" + nested]
        self._session(peer)  # as a commit's JSON state
        peer.step += 1
        text = "[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
        return [pack("commit", seq=peer.next_seq(), step=peer.step, ntensors=0, state=text, metadata="{}")]

    def _unknown_op(self, peer: Peer) -> list[bytes]:
        rng = self.rng
        op = rng.choice(["launch", "", "HELLO", "tensor ", 5, None, True, 2.5, b"hello", ["hello"],
                         "welcome", "ack", "committed", "error", "pong", "answer", "report"])
        return [pack(op, seq=1, step=1, message="m", info={}, status={}, v=1, max_frame=1, daemon_pid=1)]

    def _bad_version(self, peer: Peer) -> list[bytes]:
        v = self.rng.choice([0, 2, 3, 255, 2**63 - 1])
        return [pack("hello", v=v, run="fzv", rank=0, world_size=1, pid=1, host="h")]

    def _frame_count(self, peer: Peer) -> list[bytes]:
        rng = self.rng
        choice = rng.randrange(5)
        if choice == 0:
            return [self._tensor(peer, 1, "w", [4])]  # a tensor without its payload
        if choice == 1:
            return [pack("ping", seq=1), b"payload"]
        if choice == 2:
            return [self._tensor(peer, 1, "w", [4]), b"abcd", b"more", b"and more"]
        if choice == 3:
            return [b""]
        return [b"", b""]

    def _before_hello(self, peer: Peer) -> list[bytes]:
        """A message that needs a session, on a socket that never said hello."""
        self._renew(peer)
        return self._any_valid(peer)

    def _out_of_order(self, peer: Peer) -> list[bytes]:
        self._session(peer)
        rng = self.rng
        peer.step += 1
        step = peer.step
        choice = rng.randrange(6)
        if choice == 0:  # a later piece without the first
            return [self._tensor(peer, step, "w", [64], start=32), b"x" * 32]
        if choice == 1:  # the first piece, then (next time) a piece that skips ahead
            self._send(peer, [self._tensor(peer, step, "w", [64]), b"x" * 16], True, "out_of_order")
            return [self._tensor(peer, step, "w", [64], start=48), b"x" * 16]
        if choice == 2:  # a new tensor while the last is incomplete
            self._send(peer, [self._tensor(peer, step, "a", [64]), b"x" * 16], True, "out_of_order")
            return [self._tensor(peer, step, "b", [4]), b"x" * 4]
        if choice == 3:  # commit of a step never sent
            return [pack("commit", seq=peer.next_seq(), step=10**9 + step, ntensors=rng.randrange(3),
                         state="null", metadata="{}")]
        if choice == 4:  # a name twice
            self._send(peer, [self._tensor(peer, step, "d", [2]), b"xx"], True, "out_of_order")
            return [self._tensor(peer, step, "d", [2]), b"yy"]
        # abort of an unknown step, then bye, then a tensor after bye
        self._send(peer, [pack("abort", seq=peer.next_seq(), step=10**9, reason="x")], True, "out_of_order")
        self._send(peer, [pack("bye")], False, "out_of_order")
        peer.session = False
        return [self._tensor(peer, step, "w", [1]), b"x"]

    def _bad_values(self, peer: Peer) -> list[bytes]:
        self._session(peer)
        rng = self.rng
        peer.step += 1
        choice = rng.randrange(6)
        if choice == 0:
            dtype = rng.choice(["float128", "object", "", "torch.float32", "complex32", "x" * 300])
            return [self._tensor(peer, peer.step, "w", [2], nbytes=8, dtype=dtype), b"x" * 8]
        if choice == 1:
            name = rng.choice(["", "a\0b", "\x07", "x" * 2000, "../../../etc/passwd", "\ud800".encode(
                "utf-8", "surrogatepass").decode("utf-8", "replace"), "/abs", "a\nb"])
            return [self._tensor(peer, peer.step, name, [1]), b"x"]
        if choice == 2:
            run = rng.choice(["../etc", "", ".hidden", "a/b", "x" * 200, "-x", "nul\0"])
            return [pack("latest", seq=peer.next_seq(), run=run)]
        if choice == 3:  # a step number beyond what a folder name holds
            return [self._tensor(peer, 10**13, "w", [1]), b"x"]
        if choice == 4:
            return [pack("commit", seq=peer.next_seq(), step=peer.step, ntensors=0,
                         state='{"tensor": "never-sent"}', metadata="{}")]
        return [pack("commit", seq=peer.next_seq(), step=peer.step, ntensors=0, state="null",
                     metadata=rng.choice(["[1, 2]", '"text"', "null", "3"]))]

    def _bad_json(self, peer: Peer) -> list[bytes]:
        """JSON that json.loads accepts but that is no JSON a manifest may hold, or no JSON at all."""
        self._session(peer)
        rng = self.rng
        peer.step += 1
        text = rng.choice(["NaN", "Infinity", "-Infinity", '{"a": NaN}', "[1e999]", "{", "", "\x00",
                           '{"a": "\\ud800"}', '"' + "x" * 10000 + '"'])
        if rng.random() < 0.5:
            return [pack("commit", seq=peer.next_seq(), step=peer.step, ntensors=0, state=text, metadata="{}")]
        return [pack("commit", seq=peer.next_seq(), step=peer.step, ntensors=0, state="null",
                     metadata=text if text.startswith("{") else '{"m": ' + (text or "0") + "}")]

    def _bad_hello(self, peer: Peer) -> list[bytes]:
        """A hello whose fields have the right types but hostile values."""
        rng = self.rng
        fields: dict[str, Any] = dict(v=1, run="fzh", rank=0, world_size=1, pid=1, host="h", retention=None,
                                      format=None)
        choice = rng.randrange(5)
        if choice == 0:
            fields["world_size"] = rng.choice([0, 100_000, 2**63 - 1])
        elif choice == 1:
            fields["rank"], fields["world_size"] = 5, 2
        elif choice == 2:
            fields["format"] = rng.choice(["zip", "", "../hdf5", "HDF5"])
        elif choice == 3:
            key = rng.choice(["keep_last", "keep_every", "max_bytes", "keep_within", "keep_best", "mode",
                              "metric", "bogus"])
            value = rng.choice(["9" * 400, "9" * 400 + "MiB", "9" * 400 + "s", -1, 2**63 - 1, "1e999",
                                [1], {"a": 1}, None, "", 1.5, float("nan"), "NaN", "inf"])
            fields["retention"] = {key: value}
        else:
            fields["host"] = "h" * rng.choice([0, 10_000])
            fields["pid"] = 2**63 - 1
        return [pack("hello", **fields)]

    def _hold(self, peer: Peer) -> list[bytes]:
        """The first piece of a tensor declared just under chunk_size, never finished: a
        daemon that gathers such pieces in memory holds them until the step is dropped."""
        self._session(peer)
        peer.step += 1
        size = self.rng.randrange(1024, 65_536)
        return [self._tensor(peer, peer.step, "held", [self.chunk_size - 8]), self.rng.randbytes(size)]


    # -- the shared-memory handoff socket (PATH.shm, beside an ipc:// endpoint) -----------------
    def _handoff(self, peer: Peer) -> str:
        """Connect to the handoff socket and misbehave: say nothing (and hold the connection),
        send junk, send descriptors that are not sealed memory files, or hand over a real
        sealed memfd and then lie about it in a hello and in tensors' offsets."""
        rng, c = self.rng, self.counts
        c.handoffs += 1
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(5.0)
        try:
            conn.connect(self._handoff_path)
        except OSError:
            conn.close()
            return "handoff_refused"
        choice = rng.randrange(6)
        if choice == 0:  # silence: the daemon holds the connection until it expires
            self._silent.append(conn)
            if len(self._silent) > self.silent_max:
                self._silent.pop(0).close()
            return "handoff_silent"
        fds: list[int] = []
        token = rng.randbytes(16)
        kind = "handoff_junk"
        try:
            if choice == 1:
                conn.send(rng.randbytes(rng.randrange(1, 200)))
            else:
                size = rng.choice([4096, 65536, 1 << 20])
                fd = os.memfd_create("fuzz", os.MFD_ALLOW_SEALING)
                fds.append(fd)
                os.ftruncate(fd, size)
                os.pwrite(fd, rng.randbytes(4096), 0)
                if choice == 2:  # unsealed: it could shrink under the daemon's mapping
                    kind = "handoff_unsealed"
                elif choice == 3:  # other descriptors: a pipe, a directory, two at once
                    kind = "handoff_odd_fd"
                    r, w = os.pipe()
                    fds += [r, w]
                    fds.append(os.open("/", os.O_RDONLY | os.O_DIRECTORY))
                    fds = rng.sample(fds, rng.randint(1, 2))
                else:  # sealed, as it should be; then the hello and tensors lie
                    kind = "handoff_sealed"
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
                socket.send_fds(conn, [token if rng.random() < 0.9 else token[:rng.randrange(16)]], fds)
            try:
                conn.recv(512)
            except (socket.timeout, OSError):
                c.handoffs_cut += 1
        except OSError:
            pass
        finally:
            conn.close()
            for fd in set(fds):
                try:
                    os.close(fd)
                except OSError:
                    pass
        if kind == "handoff_sealed":
            self._shm_session(peer, token, size)
        return kind

    def _shm_session(self, peer: Peer, token: bytes, size: int) -> None:
        """A hello naming the handed-over memory, with a true or false size; then tensors
        whose offsets lie inside, across the end or far beyond the arena."""
        rng = self.rng
        declared = rng.choice([size, size // 2, size * 2, 2**62, 0])
        self._hello(peer)
        self._send(peer, [pack("hello", v=wire.VERSION, run=peer.run, rank=peer.rank, world_size=peer.world,
                               pid=1, host="fuzz", retention=None, format=None, shm_token=token,
                               shm_size=declared)], False, "shm_hello")
        peer.step += 1
        for _ in range(rng.randint(1, 4)):
            n = rng.choice([0, 1, 100, 4096, size])
            offset = rng.choice([0, size - n, size - n + 1, size, 2**62, rng.randrange(size)])
            self._send(peer, [self._tensor(peer, peer.step, f"s{rng.randrange(3)}", [n], offset=offset,
                                           length=rng.choice([n, n, n + 1, 0]))], True, "shm_tensor")
        if rng.random() < 0.5:
            self._send(peer, [pack("commit", seq=peer.next_seq(), step=peer.step, ntensors=rng.randrange(3),
                                   state="null", metadata="{}")], True, "shm_tensor")


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _junk(rng: random.Random, depth: int = 0) -> Any:
    """A value of a random type, often the wrong one for any given field."""
    kinds = [None, True, False, -1, 0, 2**63, 2**64 - 1, -2**63, 3.5, float("nan"), float("inf"), "",
             "x" * rng.randrange(100), b"\x00" * rng.randrange(10)]
    if depth < 3:
        kinds += [[_junk(rng, depth + 1) for _ in range(rng.randrange(4))],
                  {"k": _junk(rng, depth + 1)}, {}, []]
    return rng.choice(kinds)
