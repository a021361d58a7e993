"""The ``ckptd-peer-serve`` thread: the port on ``[peer] listen``
(``ckptd.transport.sealed_server``) that takes copies of other nodes' shares into the
holder and serves shares to readers, from memory (copies) or from this daemon's own root. Each request is decoded against ``messages.REQUESTS``
and handled by ``PeerServer.on_<op>``; a ``done`` is answered from the
``ckptd-peer-verify`` thread, which checksums the share while this one serves on."""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

from .. import index, layout
from .. import failpoints, inflight
from ..errors import CheckpointCorrupt, ProtocolError
from ..manifest import Manifest
from ..names import check_run
from ..transport.sealed_server import Server
from . import messages, supervise
from .holder import Full, Holder, NotYours
from .messages import Request

log = logging.getLogger("ckptd.peer")

Answer = tuple[dict[str, Any], Any]
Make = Callable[[], Answer]


class Later:
    """A handler's answer made on the verify thread, by ``make``."""

    def __init__(self, make: Make) -> None:
        self.make = make


@dataclass
class Parked:
    """A ``pull`` that waits (``wait_ms``) until its share's marks pass ``have``, it
    lands, or ``deadline``: looked at again each time a mark moves (``inflight.watch``),
    on the serve thread, which meanwhile serves every other connection."""

    run: str
    step: int
    rank: int
    have: dict[str, int]
    deadline: float
    ident: bytes = b""
    request: Request | None = None


Reply = Union[Answer, Later, Parked, None]
UNREAD_FRAMES = 12
UNREAD_TOTAL_FRAMES = 64
PULL_WAIT_MS = 5000  # the longest a pull may wait: under any asker's stall, so it never reads as a dead peer
PARKED_PULLS = 256  # pulls waiting at once, in all; past them a pull is answered at once


class Backlog:
    """Bytes of answers made for an asker (read from disk, or packed; not views of
    memory held anyway) that its connection has not yet written, per asker and in all:
    an asker over its share, or any asker while the total is over, has its reads and
    manifests refused until they are taken. (The port also stops reading an asker's
    requests while ``per_asker`` bytes of any answers to it wait.)"""

    def __init__(self, port: Server, per_asker: int, total: int) -> None:
        self.port, self.per_asker, self.total = port, per_asker, total

    def check(self, ident: bytes) -> None:
        mine, everyone = self.port.unwritten(ident), self.port.unwritten()
        if mine > self.per_asker or everyone > self.total:
            raise ProtocolError(f"{mine} bytes of answers to this asker ({everyone} to all) are not yet taken "
                                f"(at most {self.per_asker}, {self.total} in all): read them before asking more")

    def figures(self) -> int:
        return self.port.unwritten()


class PeerServer:
    def __init__(self, listen: str, root: Path, holder: Holder, curve: Any, max_frame: int,
                 node_id: str) -> None:
        """``curve``: a PeerCurveServer, or None
        for plaintext; ``max_frame``: the largest payload a request carries."""
        self.node_id = node_id
        self.root = root
        self.holder = holder
        self.listen = listen
        per_asker = UNREAD_FRAMES * max_frame
        try:
            self.port = Server(listen, curve, max_header=messages.MAX_HEADER_BYTES, max_payload=max_frame,
                               unread_cap=per_asker, handshake_s=holder.stall, stall_s=holder.stall)
        except (OSError, ValueError) as exc:
            raise ProtocolError(f"[peer] listen {listen!r}: cannot listen there: {exc}") from None
        if curve is not None:
            log.info("CurveZMQ on %s: daemon public key %s; peers admitted: the *.key files in %s", listen,
                     curve.public.decode(), curve.clients)
        self.curve = curve
        self.max_read = max_frame
        self.backlog = Backlog(self.port, per_asker, UNREAD_TOTAL_FRAMES * max_frame)
        self._logged: dict[str, float] = {}
        self._muted: set[int] = set()
        self.served: dict[str, list[int]] = {}
        self.pull: Callable[..., bool] | None = None
        self._parked: list[Parked] = []
        self._disk: dict[Path, tuple[tuple[int, int, int], Manifest | None]] = {}
        self._stop = threading.Event()
        self._expired = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name="ckptd-peer-serve", daemon=True)
        self._verified: deque[tuple[bytes, dict[str, Any]]] = deque()
        self._received: deque[tuple[bytes, list[Any], str | None]] = deque()
        self._verifier = _Verifier(self)

    def start(self) -> None:
        inflight.watch(self.port.wake)
        self._verifier.start()
        self.thread.start()

    def close(self) -> None:
        inflight.unwatch(self.port.wake)
        self._stop.set()
        self.thread.join()
        self._verifier.close()
        self.port.close()

    def _loop(self) -> None:
        supervise.run(self.thread.name, self._serve, self._stop.is_set)

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._received.extend(self.port.poll(0.2))
            while self._received:  # kept across a restart of this thread
                self._take(*self._received.popleft())
            while self._verified:
                self._send(*self._verified.popleft(), None)
            if self._parked:
                self._unpark(time.monotonic())
            if time.monotonic() - self._expired > 1.0:
                self._expired = time.monotonic()
                self.holder.expire()

    def _take(self, ident: bytes, frames: list[Any], user: str | None) -> None:
        """Answer one request (``frames``) of connection ``ident``, whose client key is ``user``."""
        failpoints.hit("peer.serve_loop")  # a failure outside any handler: the thread restarts
        request: Request | None = None
        rid = None
        try:
            request = messages.decode_request(frames)
        except ProtocolError as exc:
            rid = getattr(exc, "rid", None)
            reply: Reply = _refusal(exc), None
            log.debug("peer request refused: %s", exc)
        except Exception as exc:
            reply = _refusal(exc, f"{type(exc).__name__} decoding the request"), None
        else:
            reply = self._guard(request, lambda: self._dispatch(ident, request, user))
        if isinstance(reply, Later):
            assert request is not None
            self._verifier.put((ident, request, reply.make))
        elif isinstance(reply, Parked):
            reply.ident, reply.request = ident, request
            self._parked.append(reply)
        elif reply is not None:
            self._send(ident, _answer(reply[0], request, rid), reply[1])

    def _dispatch(self, ident: bytes, request: Request, user: str | None) -> Reply:
        if request.op != "ping" and self.curve is not None and not self.curve.may_write(user):
            raise NotYours(f"{request.op}: only a peer daemon's key is served here, not {user or 'an unknown key'}; "
                           "a training process asks its node's daemon (docs/tiers.md, \"Recovery\")")
        if request.op in ("read", "manifests"):
            self.backlog.check(ident)
        handler: Callable[[Request, str | None], Reply] = getattr(self, f"on_{request.op}")
        return handler(request, user)

    def _send(self, ident: bytes, answer: dict[str, Any], payload: Any) -> None:
        op = answer.pop(_OP, None)
        head = messages.pack(answer)
        nbytes = len(head) + (len(payload) if payload is not None else 0)
        self._count(op, nbytes)
        if not self.port.send(ident, head, payload, counted=not isinstance(payload, memoryview)):
            log.debug("cannot answer a peer: its connection is gone")

    def _guard(self, request: Request, make: Callable[[], Reply]) -> Reply:
        """``make``'s reply to ``request``: any failure, expected or not, is an error
        answer, never an exception out of the loop."""
        try:
            return make()
        except (ProtocolError, CheckpointCorrupt, Full, NotYours, KeyError, ValueError, OSError) as exc:
            error = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            log.debug("peer request %s refused: %s", request.op, error)
            return _refusal(exc, str(error)), None
        except Exception as exc:
            if self._log_now(type(exc).__name__):
                log.exception("peer request %s failed", request.op)
            return _refusal(exc, f"{type(exc).__name__}: {exc}"), None

    def _count(self, op: Any, nbytes: int) -> None:
        """Requests answered and bytes sent, by op (``served`` in ``ckptd status --json``):
        what readers and senders cost this node."""
        op = op if isinstance(op, str) and op in messages.REQUESTS else "other"
        counts = self.served.setdefault(op, [0, 0])
        counts[0] += 1
        counts[1] += nbytes

    def figures(self) -> dict[str, Any]:
        served = {op: {"requests": n, "bytes": b} for op, (n, b) in list(self.served.items())}
        return {"served": served, "served_bytes": sum(v["bytes"] for v in served.values()),
                "unread_bytes": self.backlog.figures()}

    def _log_now(self, what: str) -> bool:
        now = time.monotonic()
        if now - self._logged.get(what, -60.0) < 60.0:
            return False
        self._logged[what] = now
        return True

    def _writer(self, user: str | None, op: str) -> str | None:
        """The asker of a writing op, checked to be a peer daemon (never a producer)."""
        if self.curve is not None and not self.curve.may_write(user):
            raise NotYours(f"{op}: only a peer daemon's key may write copies here, not {user or 'an unknown key'}")
        return user

    # -- the requests, one method each (``messages.REQUESTS`` gives their fields) ------------
    def on_ping(self, r: Request, user: str | None) -> Reply:
        return {"node": self.node_id, "listen": self.listen}, None

    def on_offer(self, r: Request, user: str | None) -> Reply:
        f = r.fields
        xfer = self.holder.offer(f["manifest"], f["files"], f["keep_last"], owner=self._writer(user, "offer"))
        return {"xfer": xfer}, None

    def on_part(self, r: Request, user: str | None) -> Reply:
        xfer = r.fields["xfer"]
        if xfer in self._muted:
            return None
        try:
            failpoints.hit("peer.receive")
        except failpoints.Failpoint:
            log.warning("failpoint peer.receive: transfer %d is no longer answered", xfer)
            self._muted.add(xfer)
            return None
        if r.payload is None:
            raise ProtocolError("part: no bytes")
        self.holder.part(xfer, r.fields["file"], r.fields["offset"], r.payload,
                         owner=self._writer(user, "part"))
        return {}, None

    def on_done(self, r: Request, user: str | None) -> Reply:
        xfer = r.fields["xfer"]
        if xfer in self._muted:
            return None
        owner = self._writer(user, "done")
        self.holder.close(xfer, owner=owner)  # here, so that no later part reaches it

        def verify() -> Answer:
            key = self.holder.admit(xfer)
            log.info("holding a copy of run %r step %d rank %d for a peer", *key)
            return {}, None
        return Later(verify)

    def on_cancel(self, r: Request, user: str | None) -> Reply:
        xfer = r.fields["xfer"]
        if xfer in self._muted:
            return None
        return {"freed": self.holder.cancel(xfer, owner=self._writer(user, "cancel"))}, None

    def on_holds(self, r: Request, user: str | None) -> Reply:
        return {"held": [self.holder.get((run, step, rank)) is not None for run, step, rank in r.fields["shares"]]}, None

    def on_drop(self, r: Request, user: str | None) -> Reply:
        """``{runs: {run: [step, ...]}}`` (batched), or ``{run, steps}``."""
        f = r.fields
        if f["runs"] is not None:
            runs = f["runs"]
        elif f["run"] is not None and f["steps"] is not None:
            runs = {f["run"]: f["steps"]}
        else:
            raise ProtocolError("drop: give runs, or run and steps")
        wanted = {check_run(run): steps for run, steps in runs.items()}
        return {"dropped": self.holder.drop_many(wanted, owner=self._writer(user, "drop"))}, None

    def on_steps(self, r: Request, user: str | None) -> Reply:
        limit = r.fields["limit"]
        if not 1 <= limit <= messages.MAX_STEPS_ANSWERED:
            raise ProtocolError(f"steps: limit {limit} is not within 1 to {messages.MAX_STEPS_ANSWERED}")
        return self._steps(check_run(r.fields["run"]), limit, r.fields["step"]), None

    def on_manifests(self, r: Request, user: str | None) -> Reply:
        f = r.fields
        return self._manifests(check_run(f["run"]), f["step"], f["ranks"]), None

    def on_read(self, r: Request, user: str | None) -> Reply:
        return {}, self._read(r.fields)

    def on_pull(self, r: Request, user: str | None) -> Reply:
        """The share's download started (or joined) and how far it landed; with
        ``wait_ms``, answered once a mark passes ``have`` (or it lands, or fails), at
        most that long after: the asker learns of each piece as it lands, without polling."""
        f = r.fields
        if self.pull is None:
            raise ProtocolError("pull: this daemon has no [remote] bucket to fetch from")
        run, wait = check_run(f["run"]), f["wait_ms"] or 0
        if wait > PULL_WAIT_MS:
            raise ProtocolError(f"pull: wait_ms {wait} is more than this node waits ({PULL_WAIT_MS}); ask again instead")
        landed = self.pull(run, f["step"], f["rank"])
        try:
            failpoints.hit("peer.pull_unmarked")
        except failpoints.Failpoint:
            return {"landed": landed}, None
        answer = self._pulled(run, f["step"], f["rank"], landed)
        have = f["have"] or {}
        if wait and not _passed(answer, have) and len(self._parked) < PARKED_PULLS:
            return Parked(run, f["step"], f["rank"], have, time.monotonic() + wait / 1000)
        return answer, None

    def _pulled(self, run: str, step: int, rank: int, landed: bool) -> dict[str, Any]:
        if landed:
            return {"landed": True}
        marks = inflight.marks(layout.step_dir(self.root, run, step), rank)
        return {"landed": False, "readable": marks or {}}

    def _unpark(self, now: float) -> None:
        """Each waiting pull whose marks moved past what it has, whose share stopped
        landing (landed, or failed: its error), or whose time is up, answered."""
        waiting = []
        for p in self._parked:
            marks = inflight.marks(layout.step_dir(self.root, p.run, p.step), p.rank)
            if marks is not None and now < p.deadline and not _passed({"readable": marks}, p.have):
                waiting.append(p)
                continue
            assert p.request is not None
            reply = self._guard(p.request, functools.partial(self._pulled_again, p))
            assert isinstance(reply, tuple)
            if reply[0].get("landed") is False and marks is None and now < p.deadline:
                waiting.append(p)  # its download not begun yet
                continue
            self._send(p.ident, _answer(reply[0], p.request), None)
        self._parked = waiting

    def _pulled_again(self, p: Parked) -> Answer:
        """A waiting pull's answer: landed once its manifest is in the root (its job may
        not have ended yet), else as the job says (its failure raised)."""
        assert self.pull is not None
        there = self._disk_share(layout.step_dir(self.root, p.run, p.step), p.run, p.step, p.rank) is not None
        return self._pulled(p.run, p.step, p.rank, there or self.pull(p.run, p.step, p.rank, asked=False)), None

    def _steps(self, run: str, limit: int, only: int | None) -> dict[str, Any]:
        """The newest ``limit`` steps of ``run`` of which this daemon can serve a share
        (``only``: that step alone), newest first: for each, the shares' rank, attempt,
        world size and where (memory: a copy; disk: this node's own root), memory
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
            copy = self.holder.get((run, step, rank))
            if copy is not None:
                data, where = copy.manifest_json, "memory"
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
        if len(self._disk) >= 4096:
            self._disk.clear()
        self._disk[name] = (ident, m)
        return m

    def _read(self, f: dict[str, Any]) -> Any:
        run = check_run(f["run"])
        key = (run, f["step"], f["rank"])
        file, offset, length = f["file"], f["offset"], f["length"]
        if not layout.is_data_file(file):
            raise ProtocolError(f"read: {file!r} is not a data file")
        copy = self.holder.get(key)
        if copy is not None:
            return self._read_memory(key, copy.files.get(file), file, offset, length)
        if length > self.max_read:
            raise ProtocolError(f"read: {length} bytes at once from disk; ask at most {self.max_read} ([peer] frame) "
                                "a request")
        step_path = layout.step_dir(self.root, run, key[1])
        if index.read_share(step_path, key[2]) is not None:
            return _pread(step_path, [file], offset, length)
        landing = inflight.source(step_path, key[2], file, offset + length)
        if not landing:
            raise KeyError(f"no share of run {run!r} step {key[1]} rank {key[2]} here")
        data = _pread(step_path, [p.name for p in landing], offset, length)
        inflight.count_streamed(length)
        return data

    def _read_memory(self, key: tuple[str, int, int], buf: Any, file: str, offset: int, length: int) -> Any:
        """Any range of a file of a copy held here: a view of memory held anyway, sent without a copy."""
        if buf is None:
            raise KeyError(f"run {key[0]!r} step {key[1]} rank {key[2]} has no file {file!r}")
        _within(file, offset, length, len(buf))
        data: Any = memoryview(buf)[offset:offset + length]
        try:
            failpoints.hit("peer.serve")
        except failpoints.Failpoint:
            data = bytearray(data)
            if data:
                data[len(data) // 2] ^= 0xFF
        return data


_OP = "\x00op"


def _passed(answer: dict[str, Any], have: dict[str, int]) -> bool:
    """Whether a pull's ``answer`` tells its asker more than ``have``: landed, or a file's mark past it."""
    return answer.get("landed") is True or any(n > have.get(f, 0) for f, n in answer.get("readable", {}).items())


def _refusal(exc: Exception, error: str | None = None) -> dict[str, Any]:
    answer = {"ok": False, "error": str(exc) if error is None else error}
    code = getattr(exc, "code", None)
    if isinstance(code, str):
        answer["code"] = code
    return answer


def _answer(fields: dict[str, Any], request: Request | None, rid: Any = None) -> dict[str, Any]:
    """The answer header: ``fields``, ``ok`` unless they say otherwise, the request's id
    and this node's protocol version."""
    answer = dict(fields)
    answer.setdefault("ok", True)
    answer["id"] = request.rid if request is not None else rid
    answer["v"] = messages.VERSION
    answer[_OP] = request.op if request is not None else None
    return answer


Deferred = tuple[bytes, Request, Make]


class _Verifier(supervise.Queued[Deferred]):
    """The ``ckptd-peer-verify`` thread: makes the answers a ``Later`` defers, in turn,
    and hands each to the serve thread (which alone sends on the port)."""

    def __init__(self, server: PeerServer) -> None:
        super().__init__("ckptd-peer-verify")
        self.server = server

    def _run(self) -> None:
        while (job := self._next()) is not None:
            ident, request, make = job
            reply = self.server._guard(request, make)
            assert isinstance(reply, tuple)
            self.server._verified.append((ident, _answer(reply[0], request)))
            self.server.port.wake()


def _pread(step_path: Path, names: list[str], offset: int, length: int) -> bytes:
    """Bytes of the first of ``names`` in the step folder that is there (a file still
    landing is renamed into place once whole)."""
    dir_fd = layout.open_step_dir(step_path)
    try:
        fd = _open_first(names, dir_fd)
    finally:
        os.close(dir_fd)
    try:
        _within(names[-1], offset, length, os.fstat(fd).st_size)
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _open_first(names: list[str], dir_fd: int) -> int:
    for name in names[:-1]:
        try:
            return layout.open_regular(name, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
    return layout.open_regular(names[-1], dir_fd=dir_fd)


def _within(file: str, offset: int, length: int, size: int) -> None:
    if offset + length > size:
        raise ProtocolError(f"read: {length} bytes at {offset} lie beyond the end of {file} ({size} bytes)")


def _summary(m: Manifest, where: str) -> dict[str, Any]:
    return {"rank": m.rank, "attempt": m.attempt, "world_size": m.world_size, "where": where}


def _manifest_ranks(path: Path) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := layout.MANIFEST.fullmatch(n)))
