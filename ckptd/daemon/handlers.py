"""The daemon's answer to each message: one method per message type, found by name;
and to what the I/O threads report (a commit durable or failed, bytes written).

``Handlers.dispatch`` decodes a message and calls ``on_<op>`` (as gunicorn's arbiter
calls ``handle_<signal>``), from a fixed set: a peer cannot reach any other method
by naming it, and a message no producer sends (``welcome``, ``ack``, ...) gets an
error reply naming it. The messages and their fields: docs/format.md.

Handlers validate what a message says and hand the work on: tensors to the open
step's assembly (``assembly.OpenStep``), commits to the writer. What outlives one
message (sessions, steps failed or dropped, replies) is the daemon's (``server``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import zmq

from .. import retention, state as state_mod, units
from ..transport import wire
from ..attempt import check_attempt
from ..config import FORMATS, ConfigError
from ..errors import ProtocolError
from ..names import check_rank, check_run, check_step
from . import status
from .assembly import OpenStep, StepError
from .attempts import resave
from ..transport.pidwatch import peer_pid
from .owners import NotOwner, principal
from .session import Session
from .share import Result, Share

if TYPE_CHECKING:
    from .server import Daemon

log = logging.getLogger("ckptd.daemon")

# A producer's first message, and the command line's questions: no session needed.
SESSIONLESS = frozenset({"hello", "latest", "list", "status"})
# The rest of what a producer sends, within its session.
IN_SESSION = frozenset({"ping", "tensor", "tensors", "same", "commit", "abort", "drain", "bye"})
# How long `latest` waits for the commits of its run already under way (every byte
# received; what is left is the fsyncs): a job restarted the moment its last save was
# handed over must see that step, not the one before it, or it trains that step again
# and its save of it is refused. Well below a producer's timeout (10 s by default).
SETTLE_S = 2.5


class Handlers:
    """``on_<op>(identity, header, frame)`` for ``SESSIONLESS`` messages (``frame``: the
    header's, which carries the peer's credentials); ``on_<op>(session, header,
    payload)`` for ``IN_SESSION`` ones (``payload``: a tensor's bytes, or None)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self._settling: list[tuple[bytes, int, str, float]] = []  # `latest` asked: (identity, seq, run, deadline)

    def dispatch(self, frames: list[zmq.Frame]) -> None:
        """Handle one message as it came off the ROUTER socket: ``[identity, header, payload?]``."""
        d = self.d
        identity = frames[0].bytes
        try:
            header, payload = wire.decode(frames[1:])
        except ProtocolError as exc:
            log.warning("bad message from peer %s: %s", identity.hex(), exc)
            d.figures.error("protocol")
            d.send(identity, "error", seq=None, step=None, message=f"protocol error: {exc}")
            return
        op = header["op"]
        sess = d.sessions.get(identity)
        if sess is not None:
            sess.last_seen = time.monotonic()
        if sess is None and op not in SESSIONLESS:
            # After a daemon restart, a producer's socket reconnects by itself and
            # keeps talking: tell it that its session (and steps in flight) are gone.
            d.send(identity, "error", seq=header.get("seq"), step=None, code=wire.NO_SESSION,
                   message=f"{op!r} from a producer without a session (the daemon restarted?); send hello first")
            return
        try:
            if op in SESSIONLESS:
                getattr(self, "on_" + op)(identity, header, frames[1])
            elif op in IN_SESSION:
                getattr(self, "on_" + op)(sess, header, payload)
            else:
                raise ProtocolError(f"{op!r} is not a message a producer sends")
        except ProtocolError as exc:
            log.warning("peer %s: %s", sess.label if sess else identity.hex(), exc)
            d.figures.error("protocol")
            d.send(identity, "error", seq=header.get("seq"), step=None, message=str(exc))

    # -- without a session --------------------------------------------------------------
    def on_hello(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        d = self.d
        if d.stopping:
            log.info("refused a producer of run %r (pid %s): the daemon is stopping", h["run"], h["pid"])
            d.send(identity, "error", seq=None, step=None, code=wire.STOPPING,
                   message="the daemon is stopping; connect again once it has restarted")
            return
        if h["v"] != wire.VERSION:
            raise ProtocolError(f"protocol version {h['v']} is not supported; this daemon speaks {wire.VERSION}")
        try:
            check_run(h["run"])
            check_rank(h["rank"], h["world_size"])
            if h["attempt"] is not None:
                check_attempt(h["attempt"])
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        fmt = h["format"] or d.cfg.format
        if fmt not in FORMATS:
            raise ProtocolError(f"format {fmt!r} is not one of {', '.join(map(repr, FORMATS))}")
        for other in d.sessions.values():
            if other.run == h["run"] and other.world_size != h["world_size"] and other.identity != identity:
                raise ProtocolError(
                    f"run {h['run']!r} already has producers with world_size {other.world_size}, "
                    f"not {h['world_size']}"
                )
        if not d.cfg.shared_runs:
            try:
                d.owners.check(h["run"], principal(frame, tcp=not d.endpoint.startswith("ipc://")))
            except NotOwner as exc:
                raise ProtocolError(str(exc)) from None
            except OSError as exc:
                raise ProtocolError(f"cannot tell who owns run {h['run']!r}: {exc}") from None
        if identity in d.sessions:
            d.end_session(d.sessions[identity], "said hello again")
        key = (h["run"], h["rank"])
        previous = d.owner.get(key)
        if previous is not None and previous in d.sessions:
            # A restarted trainer: its predecessor's unfinished steps can never complete.
            gone = d.sessions[previous]  # another process took its rank: it is gone without a goodbye
            d.end_session(gone, "was replaced by a new producer for the same rank",
                          failed=(gone.pid, gone.host) != (h["pid"], h["host"]))
        if h["retention"] is not None:
            assert d.upkeep is not None
            try:
                d.upkeep.set_run_policy(h["run"], h["retention"])
            except ConfigError as exc:
                raise ProtocolError(str(exc)) from None
        sess = Session(identity, h["run"], h["rank"], h["world_size"], h["pid"], h["host"], fmt,
                       attempt=h["attempt"], chunk_size=d.cfg.chunk_size)
        if h["shm_token"] is not None and h["shm_size"] is not None:
            mapped = d.arenas.map(h)
            if mapped is not None:
                sess.shm, sess.arena = mapped
                d.arenas.reused(sess.arena)  # before the welcome: nothing is reused yet
                # Chunks gather in the producer's arena until written: at most a quarter
                # of it per chunk, so that writing one never waits for the arena to fill.
                sess.chunk_size = max(1, min(d.cfg.chunk_size, len(sess.shm) // 4))
        d.sessions[identity] = sess
        d.owner[key] = identity
        assert d.measuring is not None
        d.measuring.hello(sess.run, sess.attempt)
        pid = peer_pid(frame) if d.endpoint.startswith("ipc://") else None
        if pid is not None:  # tcp:// producers keep session_timeout
            d.liveness.watch(identity, pid)
        log.info("producer connected: %s host=%s format=%s transport=%s", sess.label, sess.host, sess.format,
                 "shm" if sess.shm is not None else "inline")
        d.send(identity, "welcome", v=wire.VERSION, max_frame=d.cfg.max_frame, daemon_pid=os.getpid(),
               shm=sess.shm is not None, batch=True, advice=d.measuring.advice(sess.run, max_age=1.0))

    def on_latest(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        try:
            check_run(h["run"])
        except ValueError as exc:
            raise ProtocolError(f"latest: {exc}") from None
        if any(run == h["run"] for run, _, _ in self.d.committing):  # answered once they are done
            self._settling.append((identity, h["seq"], h["run"], time.monotonic() + SETTLE_S))
            return
        self._answer_latest(identity, h["seq"], h["run"])

    def _answer_latest(self, identity: bytes, seq: int, run: str) -> None:
        assert self.d.upkeep is not None
        info = self.d.upkeep.latest(run)  # from the index: no disk access
        self.d.send(identity, "answer", seq=seq, info=info.to_dict() if info else None)

    def settle_deadline(self) -> float | None:
        """When the first `latest` that waits for commits is answered anyway, if any waits."""
        return min(q[3] for q in self._settling) if self._settling else None

    def answer_settled(self, now: float, *, every: bool = False) -> None:
        """Answer each `latest` that waits (``SETTLE_S``) and whose run has no commit under
        way any more, or that has waited long enough; ``every``: all of them (stopping)."""
        if not self._settling:
            return
        busy = {run for run, _, _ in self.d.committing}
        waiting = []
        for identity, seq, run, deadline in self._settling:
            if every or run not in busy or now >= deadline:
                self._answer_latest(identity, seq, run)
            else:
                waiting.append((identity, seq, run, deadline))
        self._settling = waiting

    def on_list(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        """Every complete checkpoint of a run, from the index, each with whether it is
        pinned: what ``ckptd list --json`` prints (docs/service.md)."""
        try:
            run = check_run(h["run"])
        except ValueError as exc:
            raise ProtocolError(f"list: {exc}") from None
        d = self.d
        assert d.upkeep is not None
        infos = d.upkeep.list(run)  # from the index; pins are one stat per step
        pinned = retention.pinned_steps(d.root / run, [i.step for i in infos])
        fields = {"seq": h["seq"], "root": str(d.root),
                  "checkpoints": [{**i.to_dict(), "pinned": i.step in pinned} for i in infos]}
        header = wire.encode("listing", **fields)  # once: 10,000 steps take ~0.1 s to encode
        size = len(header)
        if size > wire.MAX_HEADER_BYTES:  # no reader would take it (their metadata, at most 64 MiB each)
            raise ProtocolError(f"list: the {len(infos)} checkpoints of run {run!r} take {size} bytes, more "
                                f"than a reply may ({wire.MAX_HEADER_BYTES}); read the root instead "
                                "(`ckptd list RUN` without --endpoint)")
        d.send_encoded(identity, "listing", header)

    def on_status(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        self.d.send(identity, "report", seq=h["seq"], status=status.report(self.d))

    # -- within a session ----------------------------------------------------------------
    def on_ping(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        self.d.send(sess.identity, "pong", seq=h["seq"])

    def on_tensor(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        d = self.d
        seq = sess.received = h["seq"]  # an inline piece is received: its staging is free
        assert d.upkeep is not None
        d.upkeep.received()  # a snapshot is under way: uploads to the remote tier hold off
        open_step = self.open_step(sess, h["step"], seq)
        if open_step.share.error is not None:
            return  # failed and reported; dropped until the producer aborts
        try:
            if payload is not None:
                if len(payload) > d.cfg.max_frame:  # libzmq's limit also admits 64 MiB headers
                    raise StepError(f"tensor {h['name']!r}: a piece of {len(payload)} bytes exceeds "
                                    f"max_frame ({d.cfg.max_frame})")
                d.queued += open_step.add_piece(h, payload.buffer)
                return
            open_step.add_piece(h, _shared_piece(sess, h), seq)
        except StepError as exc:
            d.fail_step(sess, open_step, str(exc), seq)
            return
        sess.unwritten.append(seq)  # its staging is free once the writer is done with it
        assert sess.shm is not None  # _shared_piece checked
        if sum(st.gathered for st in sess.steps.values()) >= len(sess.shm) // 2:
            # Several open steps gather chunks in the arena: write them before it fills.
            for st in sess.steps.values():
                st.flush()

    def on_tensors(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        """A batch of small tensors in one region of shared memory (docs/format.md)."""
        seq = sess.received = h["seq"]
        open_step = self.open_step(sess, h["step"], seq)
        if open_step.share.error is not None:
            return
        taken = 0
        try:
            for piece in wire.batch_pieces(h):
                open_step.add_piece(piece, _shared_piece(sess, piece), seq)
                taken += piece["length"] > 0  # an empty tensor holds no piece of the region
        except StepError as exc:
            self.d.fail_step(sess, open_step, str(exc), seq)
        if taken:  # the pieces handed on are reported written, one by one
            sess.expect(seq, taken)
        if sum(st.gathered for st in sess.steps.values()) >= len(sess.shm or b"") // 2:
            for st in sess.steps.values():
                st.flush()

    def on_same(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        """Tensors declared unchanged since an earlier step (``save(frozen=...)``)."""
        open_step = self.open_step(sess, h["step"], h["seq"])
        if open_step.share.error is not None:
            return
        try:
            open_step.add_same(h)
        except StepError as exc:
            self.d.fail_step(sess, open_step, str(exc), h["seq"])

    def on_commit(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        d = self.d
        step, seq = h["step"], h["seq"]
        open_step = self.open_step(sess, step, seq)
        share = open_step.share
        try:
            open_step.check_commit(h)
            structure = _parse_json(h["state"], "state")
            metadata = _parse_json(h["metadata"], "metadata")
            if not isinstance(metadata, dict):
                raise StepError("commit metadata must be a JSON object")
            missing = [n for n in state_mod.tensor_names(structure)
                       if n not in open_step.names and n not in share.replicas]
            if missing:
                raise StepError(f"the saved state refers to tensors never sent: {missing[:5]}")
        except StepError as exc:
            if share.error is None:
                d.fail_step(sess, open_step, str(exc), seq)
            else:  # the step failed earlier: this is the commit's answer
                d.send(sess.identity, "error", seq=seq, step=step,
                       message=f"step {step} was not committed: {share.error}")
            d.drop_step(sess, step)
            return
        open_step.flush()
        del sess.steps[step]
        d.timings[(share.run, share.rank, step)] = h["timing"]
        d.committing.add((share.run, share.rank, step))
        if sess.arena is not None:
            d.arenas.committing(sess.arena, share)
        assert d.writer is not None
        d.writer.commit(share, structure, metadata, token=(sess.identity, seq, open_step.received_bytes))

    def on_abort(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        self.d.drop_step(sess, h["step"])

    def on_drain(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        """The producer waits for staging: hand every chunk still gathered in its arena to
        the writer, so that it waits only for bytes being written (docs/format.md)."""
        for open_step in sess.steps.values():
            open_step.flush()

    def on_bye(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        self.d.end_session(sess, "said bye")

    # -- what the I/O threads report (daemon.writer) --------------------------------------
    def on_result(self, r: Result) -> None:
        """Account for bytes written; answer a commit, or report a failed write at once."""
        d = self.d
        d.queued -= r.nbytes
        share = r.share
        if r.seqs:
            sess = d.sessions.get(share.owner)
            if sess is not None:
                sess.mark_written(r.seqs)
                d.ack(sess)
        if r.kind == "failed":
            self._report_failure(share, r.message)
        elif r.kind in ("committed", "commit_failed"):
            d.committing.discard((share.run, share.rank, share.step))  # the loop answers a waiting `latest`
            timing = d.timings.pop((share.run, share.rank, share.step), None)
            d.arenas.committed(share)
            identity, seq, nbytes = r.token
            if r.kind == "committed":
                assert r.info is not None
                secs = max(time.monotonic() - share.started, 1e-9)
                # received but stored already; and copied from an earlier step (daemon.reuse)
                nbytes += share.copied - share.recognised
                log.info("committed run=%s step=%d rank=%d bytes=%d reused=%d tensors=%d seconds=%.3f "
                         "rate=%s", share.run, share.step, share.rank, nbytes, share.reused,
                         len(share.records), secs, units.rate(nbytes, secs))
                d.figures.committed(share.run, share.step, share.rank, nbytes, secs, share.reused)
                if share.mismatches:  # this share completed a step whose replicas disagree (ckptd.replicas)
                    d.figures.replica_mismatch(share.mismatches)
                assert d.measuring is not None
                d.measuring.committed(share.run, share.rank, share.step, share.attempt, timing, secs)
                d.send(identity, "committed", seq=seq, step=share.step, info=r.info.to_dict(),
                       advice=d.measuring.advice(share.run, max_age=1.0))
            else:
                d.figures.error("commit")
                d.send(identity, "error", seq=seq, step=share.step,
                       message=f"step {share.step} was not committed: {r.message}")

    def _report_failure(self, share: Share, message: str) -> None:
        """Tell the producer at once when a write failed, before it commits."""
        d = self.d
        identity = d.owner.get((share.run, share.rank))
        sess = d.sessions.get(identity) if identity else None
        if sess is not None and sess.steps.get(share.step) is not None and sess.steps[share.step].share is share:
            if not share.reported:
                share.reported = True
                d.figures.error("step")
                d.send(sess.identity, "error", seq=None, step=share.step, message=message)

    # -- steps -------------------------------------------------------------------------
    def open_step(self, sess: Session, step: int, seq: int) -> OpenStep:
        """The open step ``step`` of ``sess``, created on first use. A step that may not
        be written is still returned, already failed, so that the rest of its
        messages are dropped quietly until the producer aborts or commits it."""
        d = self.d
        open_step = sess.steps.get(step)
        if open_step is not None:
            return open_step
        assert d.writer is not None
        open_step = sess.steps[step] = OpenStep(
            Share(d.root, sess.run, sess.rank, sess.world_size, step, format=sess.format, owner=sess.identity,
                  attempt=sess.attempt, chunk_size=d.cfg.chunk_size, host=sess.host),
            d.writer, sess.chunk_size)
        try:
            check_step(step)
        except ValueError as exc:
            d.fail_step(sess, open_step, str(exc), seq)
            return open_step
        if d.stopping:  # draining: steps begun before SIGTERM finish, new ones do not start
            d.fail_step(sess, open_step, (
                f"the daemon is stopping: step {step} of run {sess.run!r} was refused and not saved; "
                "save it again once the daemon has restarted"), seq, discard=False)
            return open_step
        verdict = resave(open_step.share.dir, sess.run, sess.rank, step, sess.attempt,
                         in_flight=(sess.run, sess.rank, step) in d.committing)
        if verdict.error is not None:
            d.fail_step(sess, open_step, verdict.error, seq, discard=False)
        elif verdict.replace:
            d.writer.replace_earlier(open_step.share)
        return open_step


def _shared_piece(sess: Session, h: dict[str, Any]) -> memoryview:
    """The piece's bytes in the producer's arena, checked against the arena's bounds."""
    if sess.shm is None:
        raise StepError(f"tensor {h['name']!r} names shared memory, but this producer shared none")
    start, end = h["offset"], h["offset"] + h["length"]
    if end > len(sess.shm):
        raise StepError(
            f"tensor {h['name']!r}: bytes [{start}, {end}) lie outside the {len(sess.shm)} bytes "
            "of shared staging memory"
        )
    return sess.shm[start:end]


def _parse_json(text: str, what: str) -> Any:
    try:
        value = json.loads(text)
        # json.loads takes NaN, Infinity, 1e999 and lone surrogates, which the manifest
        # cannot hold: refuse them here, or its write fails on the syncer thread
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
        return value
    except (ValueError, RecursionError) as exc:
        raise StepError(f"commit {what} is not valid JSON: {exc}") from None
