"""The ``ckptd-peer-serve`` thread: a ROUTER on ``[peer] listen`` that receives
replicas into the holder and serves shares to readers, from memory (replicas) or
from this daemon's own root (its committed shares: a node recovering finds the
surviving nodes' shares there).

A ``done`` is answered from the ``ckptd-peer-verify`` thread: it checksums a whole
share (about a second for 10 GB), and meanwhile the serve thread answers the others,
whose readers would otherwise wait, time out and back this node off."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import zmq

from .. import index, layout
from .. import failpoints
from ..errors import CheckpointCorrupt, ProtocolError
from ..manifest import Manifest
from ..names import check_run
from . import messages, supervise
from .holder import Full, Holder, NotYours

log = logging.getLogger("ckptd.peer")


class PeerServer:
    def __init__(self, ctx: zmq.Context, listen: str, root: Path, holder: Holder, curve: Any, max_frame: int,
                 node_id: str) -> None:
        self.node_id = node_id  # this daemon, as ``ping`` answers it
        self.root = root
        self.holder = holder
        self.listen = listen
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(max_frame, messages.MAX_HEADER_BYTES) + 4096)
        if curve is not None:
            curve.secure(ctx, self.sock)
        try:
            self.sock.bind(listen)
        except zmq.ZMQError as exc:
            self.sock.close()
            raise ProtocolError(f"[peer] listen {listen!r}: cannot listen there: {exc}") from None
        self.curve = curve
        self.max_read = max_frame
        self._logged: dict[str, float] = {}  # unexpected failures -> when last logged
        self._muted: set[int] = set()  # transfers a failpoint stopped answering (tests)
        self.served: dict[str, list[int]] = {}  # op -> [requests answered, bytes sent]
        self._disk: dict[Path, tuple[tuple[int, int, int], Manifest | None]] = {}  # own shares, by manifest file
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="ckptd-peer-serve", daemon=True)
        # the verify thread's answers, and a socket that wakes the serve thread for each
        self._verified: deque[tuple[bytes, dict[str, Any]]] = deque()
        self._wake = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        self._wake[0].bind(f"inproc://ckptd-peer-verified-{id(self)}")
        self._wake[1].connect(f"inproc://ckptd-peer-verified-{id(self)}")
        self._verifier = _Verifier(self)

    def start(self) -> None:
        self._verifier.start()
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        self.thread.join()
        self._verifier.close()
        for sock in (self.sock, *self._wake):
            sock.close(linger=0)

    def _loop(self) -> None:
        supervise.run(self.thread.name, self._serve, self._stop.is_set)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake[0], zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(200))
            if self._wake[0] in ready:
                while self._wake[0].poll(0):
                    self._wake[0].recv()
                while self._verified:
                    self._send(*self._verified.popleft(), None)
            if self.sock not in ready:
                self.holder.expire()
                continue
            frames = self.sock.recv_multipart(copy=False)
            failpoints.hit("peer.serve_loop")  # a failure outside any handler: the thread restarts
            ident, rest = frames[0].bytes, frames[1:]
            header: dict[str, Any] = {}
            try:
                answer, payload = self._guard(header, lambda: self._parse(header, rest))
            except _NoAnswer:
                continue
            except _Later as later:
                self._verifier.put((ident, header, later.make))
                continue
            self._send(ident, answer, payload)

    def _send(self, ident: bytes, answer: dict[str, Any], payload: Any) -> None:
        op = answer.pop(_OP, None)
        frames_out = [ident, messages.pack(answer)] + ([payload] if payload is not None else [])
        self._count(op, sum(len(f) for f in frames_out[1:]))
        try:
            self.sock.send_multipart(frames_out, copy=payload is None, flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:  # the asker is gone, or has a backlog
            log.debug("cannot answer a peer: %s", exc)

    def _parse(self, header: dict[str, Any], rest: list[Any]) -> tuple[dict[str, Any], Any]:
        """Handle one request (the frames after the asker's identity), its header read into ``header``."""
        if not rest:
            raise ProtocolError("an empty peer request")
        header.update(messages.unpack(rest[0]))
        return self._handle(header, rest[1] if len(rest) > 1 else None, _user(rest[0]))

    def _guard(self, header: dict[str, Any],
               make: Callable[[], tuple[dict[str, Any], Any]]) -> tuple[dict[str, Any], Any]:
        """The answer ``make`` gives to the request ``header``: any failure, expected or
        not, is an error answer, never an exception out of the loop (but ``_NoAnswer``
        and ``_Later``, which say what to do instead)."""
        try:
            answer, payload = make()
        except (_NoAnswer, _Later):
            raise
        except (ProtocolError, CheckpointCorrupt, Full, NotYours, KeyError, ValueError, OSError) as exc:
            answer, payload = {"ok": False, "error": str(exc) if not isinstance(exc, KeyError) else exc.args[0]}, None
            log.debug("peer request %r refused: %s", header.get("op"), answer["error"])
        except Exception as exc:  # a bug, or memory exhausted: this request fails, the thread serves on
            answer, payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
            if self._log_now(type(exc).__name__):
                log.exception("peer request %r failed", header.get("op"))
        answer.setdefault("ok", True)
        answer[_OP] = header.get("op")
        rid = header.get("id")
        answer["id"] = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
        return answer, payload

    def _count(self, op: Any, nbytes: int) -> None:
        """Requests answered and bytes sent, by op (``served`` in ``ckptd status --json``):
        what readers and senders cost this node."""
        op = op if isinstance(op, str) and op in _COUNTED else "other"
        counts = self.served.setdefault(op, [0, 0])
        counts[0] += 1
        counts[1] += nbytes

    def figures(self) -> dict[str, Any]:
        served = {op: {"requests": n, "bytes": b} for op, (n, b) in list(self.served.items())}
        return {"served": served, "served_bytes": sum(v["bytes"] for v in served.values())}

    def _log_now(self, what: str) -> bool:
        now = time.monotonic()
        if now - self._logged.get(what, -60.0) < 60.0:
            return False
        self._logged[what] = now
        return True

    def _writer(self, user: str | None, op: str) -> str | None:
        """The asker of a writing op, checked to be a peer daemon (never a producer)."""
        if self.curve is not None and not self.curve.may_write(user):
            raise NotYours(f"{op}: only a peer daemon's key may write replicas here, not {user or 'an unknown key'}")
        return user

    def _handle(self, h: dict[str, Any], payload: Any, user: str | None) -> tuple[dict[str, Any], Any]:
        op = h.get("op")
        if op == "ping":
            return {"node": self.node_id, "listen": self.listen}, None
        if op == "offer":
            files = messages.field(h, "files", dict)
            if len(files) > messages.MAX_FILES_OFFERED:
                raise ProtocolError(f"offer: {len(files)} files at once")
            if not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in files.items()):
                raise ProtocolError("offer: files must map names to sizes")
            xfer = self.holder.offer(messages.field(h, "manifest", bytes), files, messages.field(h, "keep_last", int),
                                     owner=self._writer(user, "offer"))
            return {"xfer": xfer}, None
        if op == "part":
            xfer = messages.field(h, "xfer", int)
            if xfer in self._muted:
                raise _NoAnswer
            try:
                failpoints.hit("peer.receive")
            except failpoints.Failpoint:  # a partner that hangs in mid-transfer
                log.warning("failpoint peer.receive: transfer %d is no longer answered", xfer)
                self._muted.add(xfer)
                raise _NoAnswer from None
            if payload is None:
                raise ProtocolError("part: no bytes")
            self.holder.part(xfer, messages.field(h, "file", str), messages.field(h, "offset", int), payload.buffer,
                             owner=self._writer(user, "part"))
            return {}, None
        if op == "done":
            xfer = messages.field(h, "xfer", int)
            if xfer in self._muted:
                raise _NoAnswer
            raise _Later(functools.partial(self._done, xfer, self._writer(user, "done")))
        if op == "holds":
            shares = messages.field(h, "shares", list)
            if len(shares) > messages.MAX_SHARES_ASKED:
                raise ProtocolError(f"holds: {len(shares)} shares asked at once")
            return {"held": [self._holds(s) for s in shares]}, None
        if op == "drop":  # {runs: {run: [step, ...]}} (batched), or {run, steps}
            runs: dict[Any, Any] = (messages.field(h, "runs", dict) if "runs" in h
                                    else {messages.field(h, "run", str): messages.field(h, "steps", list)})
            if not all(isinstance(r, str) and isinstance(s, list) for r, s in runs.items()):
                raise ProtocolError("drop: runs must map run names to lists of steps")
            n = sum(len(s) for s in runs.values())
            if n > messages.MAX_STEPS_DROPPED:
                raise ProtocolError(f"drop: {n} steps at once, more than {messages.MAX_STEPS_DROPPED}")
            wanted = {check_run(r): [s for s in steps if isinstance(s, int)] for r, steps in runs.items()}
            return {"dropped": self.holder.drop_many(wanted, owner=self._writer(user, "drop"))}, None
        if op == "steps":
            limit = messages.field(h, "limit", int)
            if not 1 <= limit <= messages.MAX_STEPS_ANSWERED:
                raise ProtocolError(f"steps: limit {limit} is not within 1 to {messages.MAX_STEPS_ANSWERED}")
            only = h.get("step")
            if only is not None:
                only = messages.field(h, "step", int)
            return self._steps(check_run(messages.field(h, "run", str)), limit, only), None
        if op == "manifests":
            ranks = messages.field(h, "ranks", list)
            if len(ranks) > messages.MAX_RANKS_ASKED or not all(isinstance(r, int) and not isinstance(r, bool)
                                                              for r in ranks):
                raise ProtocolError(f"manifests: ranks must be at most {messages.MAX_RANKS_ASKED} integers")
            return self._manifests(check_run(messages.field(h, "run", str)), messages.field(h, "step", int), ranks), None
        if op == "read":
            return {}, self._read(h)
        raise ProtocolError(f"unknown peer request {str(op)[:64]!r}")

    def _done(self, xfer: int, owner: str | None) -> tuple[dict[str, Any], Any]:
        key = self.holder.done(xfer, owner=owner)  # on the verify thread: it checksums the share
        log.info("holding run %r step %d rank %d for a peer", *key)
        return {}, None

    def _holds(self, share: Any) -> bool:
        """Whether ``share`` ([run, step, rank]) is held here in memory."""
        if not (isinstance(share, list) and len(share) == 3 and isinstance(share[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in share[1:])):
            raise ProtocolError(f"holds: {share!r} is not [run, step, rank]")
        return self.holder.get((share[0], share[1], share[2])) is not None

    def _steps(self, run: str, limit: int, only: int | None) -> dict[str, Any]:
        """The newest ``limit`` steps of ``run`` of which this daemon can serve a share
        (``only``: that step alone), newest first: for each, the shares' rank, attempt,
        world size and where (memory: a replica; disk: this node's own root), memory
        first. At most ``MAX_SHARES_ANSWERED`` shares; ``more``: steps were left out."""
        held: dict[int, dict[int, dict[str, Any]]] = {}
        for r in self.holder.shares(run):
            m = r.manifest
            if only is None or m.step == only:
                held.setdefault(m.step, {})[m.rank] = _summary(m, "memory")
        run_dir = self.root / run
        on_disk = [(s, p) for s, p in (index.step_dirs(run_dir) if run_dir.is_dir() else []) if only in (None, s)]
        steps = sorted(set(held) | {s for s, _ in on_disk}, reverse=True)
        paths = dict(on_disk)
        out: list[dict[str, Any]] = []
        count = 0
        for step in steps:
            if len(out) == limit:
                return {"steps": out, "more": True}
            shares = held.get(step, {})
            if step in paths:
                for rank in _manifest_ranks(paths[step]):
                    if rank not in shares and (own := self._disk_share(paths[step], run, step, rank)) is not None:
                        shares[rank] = _summary(own, "disk")
            if not shares:
                continue
            if count + len(shares) > messages.MAX_SHARES_ANSWERED:
                return {"steps": out, "more": True}
            count += len(shares)
            out.append({"step": step, "shares": [shares[r] for r in sorted(shares)]})
        return {"steps": out, "more": False}

    def _manifests(self, run: str, step: int, ranks: list[int]) -> dict[str, Any]:
        """The manifests of those of ``ranks``' shares of ``step`` this daemon can serve,
        from memory before disk; ``left``: ranks it holds but left out of this answer to
        keep it under ``MAX_MANIFEST_BYTES`` (ask again for them)."""
        out: list[dict[str, Any]] = []
        left: list[int] = []
        total = 0
        path = layout.step_dir(self.root, run, step)
        for rank in dict.fromkeys(ranks):
            replica = self.holder.get((run, step, rank))
            if replica is not None:
                data, where = replica.manifest_json, "memory"
            elif self._disk_share(path, run, step, rank) is not None:
                data, where = layout.read_small(path / layout.manifest_name(rank), messages.MAX_HEADER_BYTES - 2**20), "disk"
            else:
                continue
            if out and total + len(data) > messages.MAX_MANIFEST_BYTES:
                left.append(rank)
                continue
            total += len(data)
            out.append({"rank": rank, "where": where, "manifest": data})
        return {"manifests": out, "left": left}

    def _disk_share(self, path: Path, run: str, step: int, rank: int) -> Manifest | None:
        """This node's own committed share, read once per version of its manifest file."""
        name = path / layout.manifest_name(rank)
        try:
            st = os.stat(name, follow_symlinks=False)
        except OSError:
            return None
        ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._disk.get(name)
        if cached is not None and cached[0] == ident:
            return cached[1]
        m: Manifest | None = None
        try:
            m = index.read_share(path, rank)
        except (CheckpointCorrupt, OSError):
            pass
        if m is not None and (m.run, m.step) != (run, step):
            m = None
        if len(self._disk) >= 4096:  # a bounded cache: the steps a reader asks are the newest
            self._disk.clear()
        self._disk[name] = (ident, m)
        return m

    def _read(self, h: dict[str, Any]) -> Any:
        run = check_run(messages.field(h, "run", str))
        key = (run, messages.field(h, "step", int), messages.field(h, "rank", int))
        file, offset, length = messages.field(h, "file", str), messages.field(h, "offset", int), messages.field(h, "length", int)
        if not layout.is_data_file(file):
            raise ProtocolError(f"read: {file!r} is not a data file")
        replica = self.holder.get(key)
        if replica is not None:
            buf = replica.files.get(file)
            if buf is None:
                raise KeyError(f"run {run!r} step {key[1]} rank {key[2]} has no file {file!r}")
            _within(file, offset, length, len(buf))
            # any length within the file: a view of memory held anyway, sent without a copy
            data: Any = memoryview(buf)[offset:offset + length]
            try:
                failpoints.hit("peer.serve")
            except failpoints.Failpoint:  # a replica damaged in this holder's memory
                data = bytearray(data)
                if data:
                    data[len(data) // 2] ^= 0xFF
            return data
        if length > self.max_read:  # read from disk into memory of its own: at most a frame
            raise ProtocolError(f"read: {length} bytes at once from disk; ask at most {self.max_read} ([peer] frame) "
                                "a request")
        step_path = layout.step_dir(self.root, run, key[1])
        if index.read_share(step_path, key[2]) is None:
            raise KeyError(f"no share of run {run!r} step {key[1]} rank {key[2]} here")
        dir_fd = layout.open_step_dir(step_path)
        try:
            fd = layout.open_regular(file, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            _within(file, offset, length, os.fstat(fd).st_size)
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)


_OP = "\x00op"  # the op an answer is to, for the counts; taken out before it is sent
_COUNTED = frozenset({"ping", "offer", "part", "done", "holds", "drop", "steps", "manifests", "read"})


class _NoAnswer(Exception):
    pass


class _Later(Exception):
    """From ``_handle``: this answer is made on the verify thread, by ``make``."""

    def __init__(self, make: Callable[[], tuple[dict[str, Any], Any]]) -> None:
        super().__init__()
        self.make = make


Deferred = tuple[bytes, dict[str, Any], Callable[[], tuple[dict[str, Any], Any]]]  # (asker, header, make)


class _Verifier(supervise.Queued[Deferred]):
    """The ``ckptd-peer-verify`` thread: makes the answers ``_Later`` defers, in turn,
    and hands each to the serve thread (which alone sends on the port)."""

    def __init__(self, server: PeerServer) -> None:
        super().__init__("ckptd-peer-verify")
        self.server = server

    def _run(self) -> None:
        while (job := self._next()) is not None:
            ident, header, make = job
            answer, _ = self.server._guard(header, make)
            self.server._verified.append((ident, answer))
            self.server._wake[1].send(b"", zmq.NOBLOCK)  # this thread alone sends on this end


def _within(file: str, offset: int, length: int, size: int) -> None:
    if offset + length > size:
        raise ProtocolError(f"read: {length} bytes at {offset} lie beyond the end of {file} ({size} bytes)")


def _summary(m: Manifest, where: str) -> dict[str, Any]:
    return {"rank": m.rank, "attempt": m.attempt, "world_size": m.world_size, "where": where}


def _user(frame: Any) -> str | None:
    """The asker's CurveZMQ public key (Z85), as the ZAP handler admitted it; None in plaintext."""
    try:
        return frame.get("User-Id") or None
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None


def _manifest_ranks(path: Path) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := layout.MANIFEST.fullmatch(n)))
