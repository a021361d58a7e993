"""The daemon's answer to each message, and to what the I/O threads report.

``Handlers.dispatch`` decodes a message and calls ``on_<op>``, found by name among a
fixed set (``SESSIONLESS``, ``IN_SESSION``), as gunicorn's arbiter calls
``handle_<signal>``; the messages and their fields: docs/design.md. A handler checks
what a message says and hands the work on: tensors to the open step's assembly,
commits to the writer, sessions and failed steps to ``Sessions``.
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
from ..errors import CheckpointError, ProtocolError
from ..names import check_rank, check_run, check_step
from .assembly import OpenStep, StepError
from .attempts import resave
from ..transport.pidwatch import peer_pid
from .owners import NotOwner, principal
from .sessions import Session
from .share import CommitToken, Result, ResultKind, Share, ShareId

if TYPE_CHECKING:
    from ..config import Config
    from .arenas import Arenas
    from .ledger import Ledger
    from .lifecycle import Lifecycle, Reporter
    from .bucket_relay import BucketFetch
    from .relay import Relay
    from .replies import Replies
    from .upkeep import Upkeep
    from .writer import Writer
    from .sessions import Sessions

log = logging.getLogger("ckptd.daemon")

SESSIONLESS = frozenset({"hello", "latest", "list", "status", "recover", "fetch"})
IN_SESSION = frozenset({"ping", "tensor", "tensors", "same", "commit", "abort", "drain", "bye"})
# How long `latest` waits for the commits of its run under way (every byte received,
# the fsyncs left): a job restarted right after handing over its last save must see
# that step, or it trains the step again and its save is refused. Well below a
# producer's timeout.
SETTLE_S = 2.5


class Handlers:
    """``on_<op>(identity, header, frame)`` for ``SESSIONLESS`` messages (``frame``: the
    header's, which carries the peer's credentials); ``on_<op>(session, header,
    payload)`` for ``IN_SESSION`` ones (``payload``: a tensor's bytes, or None)."""

    def __init__(self, config: Config, *, sessions: Sessions, ledger: Ledger, replies: Replies,
                 lifecycle: Lifecycle, arenas: Arenas, writer: Writer, upkeep: Upkeep,
                 reporter: Reporter, relay: Relay | None = None, fetch: BucketFetch | None = None) -> None:
        self.cfg = config.daemon
        self.root = config.root
        self.sessions = sessions
        self.ledger = ledger
        self.replies = replies
        self.lifecycle = lifecycle
        self.arenas = arenas
        self.writer = writer
        self.upkeep = upkeep
        self.reporter = reporter
        self.relay = relay
        self.fetch = fetch
        self._settling: list[tuple[bytes, int, str, float]] = []

    def dispatch(self, frames: list[zmq.Frame]) -> None:
        """Handle one message as it came off the ROUTER socket: ``[identity, header, payload?]``."""
        identity = frames[0].bytes
        try:
            header, payload = wire.decode(frames[1:])
        except ProtocolError as exc:
            log.warning("bad message from peer %s: %s", identity.hex(), exc)
            self.ledger.figures.error("protocol")
            self.replies.send(identity, "error", seq=None, step=None, message=f"protocol error: {exc}")
            return
        op = header["op"]
        sess = self.sessions.get(identity)
        if sess is not None:
            sess.last_seen = time.monotonic()
        if sess is None and op not in SESSIONLESS:
            # A producer's socket reconnects by itself after a daemon restart: tell it
            # that its session, and its steps in flight, are gone.
            self.replies.send(identity, "error", seq=header.get("seq"), step=None, code=wire.NO_SESSION,
                              message=f"{op!r} from a producer without a session (the daemon restarted?); "
                                      "send hello first")
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
            self.ledger.figures.error("protocol")
            self.replies.send(identity, "error", seq=header.get("seq"), step=None, message=str(exc))

    def on_hello(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        if self.lifecycle.stopping:
            log.info("refused a producer of run %r (pid %s): the daemon is stopping", h["run"], h["pid"])
            self.replies.send(identity, "error", seq=None, step=None, code=wire.STOPPING,
                              message="the daemon is stopping; connect again once it has restarted")
            return
        fmt = self._check_hello(identity, h, frame)
        self._replace_sessions(identity, h)
        if h["retention"] is not None:
            try:
                self.upkeep.set_run_policy(h["run"], h["retention"])
            except ConfigError as exc:
                raise ProtocolError(str(exc)) from None
        sess = Session(identity, h["run"], h["rank"], h["world_size"], h["pid"], h["host"], fmt,
                       attempt=h["attempt"], chunk_size=self.cfg.chunk_size)
        if h["shm_token"] is not None and h["shm_size"] is not None:
            self._map_arena(sess, h)
        self.sessions.add(sess, peer_pid(frame) if self.replies.local else None)
        measuring = self.ledger.measuring
        measuring.hello(sess.run, sess.attempt)
        log.info("producer connected: %s host=%s format=%s transport=%s", sess.label, sess.host, sess.format,
                 "shm" if sess.shm is not None else "inline")
        self.replies.send(identity, "welcome", v=wire.VERSION, max_frame=self.cfg.max_frame,
                          daemon_pid=os.getpid(), shm=sess.shm is not None, batch=True,
                          advice=measuring.advice(sess.run, max_age=1.0))

    def _check_hello(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> str:
        """Refuse a hello that may not open a session (ProtocolError); its format."""
        if h["v"] != wire.VERSION:
            raise ProtocolError(f"protocol version {h['v']} is not supported; this daemon speaks {wire.VERSION}")
        try:
            check_run(h["run"])
            check_rank(h["rank"], h["world_size"])
            if h["attempt"] is not None:
                check_attempt(h["attempt"])
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        fmt = h["format"] or self.cfg.format
        if fmt not in FORMATS:
            raise ProtocolError(f"format {fmt!r} is not one of {', '.join(map(repr, FORMATS))}")
        for other in self.sessions:
            if other.run == h["run"] and other.world_size != h["world_size"] and other.identity != identity:
                raise ProtocolError(f"run {h['run']!r} already has producers with world_size "
                                    f"{other.world_size}, not {h['world_size']}")
        self._check_owner(h["run"], frame)
        return fmt

    def _check_owner(self, run: str, frame: zmq.Frame) -> None:
        """Refuse (ProtocolError) a sender that may not use ``run`` (docs/security.md)."""
        if self.cfg.shared_runs:
            return
        try:
            self.sessions.owners.check(run, principal(frame, tcp=not self.replies.local))
        except NotOwner as exc:
            raise ProtocolError(str(exc)) from None
        except OSError as exc:
            raise ProtocolError(f"cannot tell who owns run {run!r}: {exc}") from None

    def _replace_sessions(self, identity: bytes, h: dict[str, Any]) -> None:
        """End this identity's earlier session, and the one of a process that held its rank."""
        own = self.sessions.get(identity)
        if own is not None:
            self.sessions.end(own, "said hello again")
        gone = self.sessions.holding(h["run"], h["rank"])
        if gone is not None:
            self.sessions.end(gone, "was replaced by a new producer for the same rank",
                              failed=(gone.pid, gone.host) != (h["pid"], h["host"]))

    def _map_arena(self, sess: Session, h: dict[str, Any]) -> None:
        mapped = self.arenas.map(h)
        if mapped is not None:
            sess.shm, sess.arena = mapped
            self.arenas.reused(sess.arena)
            self.writer.holds.forget(sess.arena)
            # At most a quarter of the arena per chunk: writing one never waits for it to fill.
            sess.chunk_size = max(1, min(self.cfg.chunk_size, len(sess.shm) // 4))

    def on_latest(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        try:
            check_run(h["run"])
        except ValueError as exc:
            raise ProtocolError(f"latest: {exc}") from None
        if self.ledger.committing(h["run"]):
            self._settling.append((identity, h["seq"], h["run"], time.monotonic() + SETTLE_S))
            return
        self._answer_latest(identity, h["seq"], h["run"])

    def _answer_latest(self, identity: bytes, seq: int, run: str) -> None:
        info = self.upkeep.latest(run)
        self.replies.send(identity, "answer", seq=seq, info=info.to_dict() if info else None)

    def on_recover(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        """A reader on this node asks for a step the peers hold (``Relay``), for a run it owns."""
        try:
            check_run(h["run"])
            if h["step"] is not None:
                check_step(h["step"])
        except ValueError as exc:
            raise ProtocolError(f"recover: {exc}") from None
        if self.relay is None:
            raise ProtocolError("recover: this daemon has no [peer] table, so no peer holds its shares")
        user = principal(frame, tcp=not self.replies.local)
        claim = None
        owners = self.sessions.owners
        if not (self.cfg.shared_runs or user is None or user in owners.trusted):
            try:
                if owners.owner_of(h["run"]) is None:
                    claim = user
                else:
                    owners.check(h["run"], user)
            except NotOwner as exc:
                raise ProtocolError(str(exc)) from None
            except OSError as exc:
                raise ProtocolError(f"cannot tell who owns run {h['run']!r}: {exc}") from None
        try:
            self.relay.ask(identity, h["seq"], h, user=user, claim=claim)
        except CheckpointError as exc:
            raise ProtocolError(str(exc)) from None

    def on_fetch(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        """A reader on this node asks for shares in the bucket (``BucketFetch``), of a run it owns."""
        try:
            check_run(h["run"])
            check_step(h["step"])
        except ValueError as exc:
            raise ProtocolError(f"fetch: {exc}") from None
        if self.fetch is None:
            raise ProtocolError("fetch: this daemon has no [remote] url, so it reads no bucket; read it yourself")
        self._check_owner(h["run"], frame)
        try:
            self.fetch.ask(identity, h["seq"], h["run"], h["step"], h["ranks"], h["root"], h["url"])
        except CheckpointError as exc:
            raise ProtocolError(str(exc)) from None

    def settle_deadline(self) -> float | None:
        """When the first `latest` that waits for commits, or reader that waits for the
        peers (``Relay``) or the bucket (``BucketFetch``), is answered anyway, if any waits."""
        due = [q[3] for q in self._settling]
        waits = [self.relay.deadline() if self.relay is not None else None,
                 self.fetch.deadline() if self.fetch is not None else None]
        return min(due + [w for w in waits if w is not None], default=None)

    def answer_settled(self, now: float, *, every: bool = False) -> None:
        """Answer each `latest` whose run has no commit under way any more, or that has
        waited ``SETTLE_S``; ``every``: all of them (stopping)."""
        if self.relay is not None:
            self.relay.answer(now)
        if self.fetch is not None:
            self.fetch.answer(now)
        waiting = []
        for identity, seq, run, deadline in self._settling:
            if every or not self.ledger.committing(run) or now >= deadline:
                self._answer_latest(identity, seq, run)
            else:
                waiting.append((identity, seq, run, deadline))
        self._settling = waiting

    def on_list(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        """Every complete checkpoint of a run, each with whether it is pinned: what ``ckptd list --json`` prints."""
        try:
            run = check_run(h["run"])
        except ValueError as exc:
            raise ProtocolError(f"list: {exc}") from None
        infos = self.upkeep.list(run)
        pinned = retention.pinned_steps(self.root / run, [i.step for i in infos])
        header = wire.encode("listing", seq=h["seq"], root=str(self.root),
                             checkpoints=[{**i.to_dict(), "pinned": i.step in pinned} for i in infos])
        size = len(header)
        if size > wire.MAX_HEADER_BYTES:
            raise ProtocolError(f"list: the {len(infos)} checkpoints of run {run!r} take {size} bytes, more "
                                f"than a reply may ({wire.MAX_HEADER_BYTES}); read the root instead "
                                "(`ckptd list RUN` without --endpoint)")
        self.replies.send_encoded(identity, "listing", header)

    def on_status(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        self.replies.send(identity, "report", seq=h["seq"], status=self.reporter.report())

    def on_ping(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        self.replies.send(sess.identity, "pong", seq=h["seq"])

    def on_tensor(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        seq = sess.received = h["seq"]
        self.upkeep.received()
        open_step = self.open_step(sess, h["step"], seq)
        if open_step.share.error is not None:
            return
        try:
            if payload is not None:
                if len(payload) > self.cfg.max_frame:
                    raise StepError(f"tensor {h['name']!r}: a piece of {len(payload)} bytes exceeds "
                                    f"max_frame ({self.cfg.max_frame})")
                self.ledger.hold(open_step.add_piece(h, payload.buffer))
                return
            open_step.add_piece(h, _shared_piece(sess, h), seq)
        except StepError as exc:
            self.sessions.fail_step(sess, open_step, str(exc), seq)
            return
        sess.unwritten.append(seq)
        self._flush_if_filling(sess)

    def on_tensors(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        """A batch of small tensors in one region of shared memory."""
        seq = sess.received = h["seq"]
        open_step = self.open_step(sess, h["step"], seq)
        if open_step.share.error is not None:
            return
        taken = 0
        try:
            for piece in wire.batch_pieces(h):
                open_step.add_piece(piece, _shared_piece(sess, piece), seq)
                taken += piece["length"] > 0
        except StepError as exc:
            self.sessions.fail_step(sess, open_step, str(exc), seq)
        if taken:
            sess.expect(seq, taken)
        self._flush_if_filling(sess)

    @staticmethod
    def _flush_if_filling(sess: Session) -> None:
        """Several open steps gather chunks in the arena: write them before it fills."""
        if sum(st.gathered for st in sess.steps.values()) >= len(sess.shm or b"") // 2:
            sess.flush()

    def on_same(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        """Tensors declared unchanged since an earlier step (``save(frozen=...)``)."""
        open_step = self.open_step(sess, h["step"], h["seq"])
        if open_step.share.error is not None:
            return
        try:
            open_step.add_same(h)
        except StepError as exc:
            self.sessions.fail_step(sess, open_step, str(exc), h["seq"])

    def on_commit(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        step, seq = h["step"], h["seq"]
        open_step = self.open_step(sess, step, seq)
        share = open_step.share
        try:
            structure, metadata = _check_commit(open_step, h)
        except StepError as exc:
            if share.error is None:
                self.sessions.fail_step(sess, open_step, str(exc), seq)
            else:
                self.replies.send(sess.identity, "error", seq=seq, step=step,
                                  message=f"step {step} was not committed: {share.error}")
            self.sessions.drop_step(sess, step)
            return
        open_step.flush()
        del sess.steps[step]
        self.ledger.begin_commit((share.run, share.rank, step), h["timing"])
        if sess.arena is not None:
            self.arenas.committing(sess.arena, share)
        self.writer.commit(share, structure, metadata,
                           token=CommitToken(sess.identity, seq, open_step.received_bytes))

    def on_abort(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        self.sessions.drop_step(sess, h["step"])

    def on_drain(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        """The producer waits for staging: hand every chunk still gathered in its arena to
        the writer, so that it waits only for bytes being written, and give back at once
        the staging kept for replication up to seq ``through`` (all it sent, if it does
        not say), whose shares are then sent from their files."""
        sess.flush()
        through = sess.received if h["through"] is None else h["through"]
        self.writer.holds.drain(sess.identity, through, self.sessions)

    def on_bye(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        self.sessions.end(sess, "said bye")

    def on_result(self, r: Result) -> None:
        """Account for bytes written; answer a commit, or report a failed write at once."""
        self.ledger.free(r.nbytes)
        share, holds = r.share, self.writer.holds
        if r.seqs:
            sess = self.sessions.get(share.id.owner)
            if sess is not None and not (r.kind is ResultKind.FREED and holds.keep(share, r.seqs, self.sessions)):
                sess.mark_written(r.seqs)
                self.sessions.ack(sess)
        if r.kind not in (ResultKind.FREED, ResultKind.COMMITTED):
            holds.release(share, self.sessions)
        if r.kind is ResultKind.FAILED:
            self._report_failure(share, r.message)
        elif r.kind in (ResultKind.COMMITTED, ResultKind.COMMIT_FAILED):
            timing = self.ledger.end_commit((share.run, share.rank, share.step))
            self.arenas.committed(share)
            assert r.token is not None
            if r.kind is ResultKind.COMMITTED:
                self._committed(r, r.token, timing)
            else:
                self.ledger.figures.error("commit")
                self.replies.send(r.token.identity, "error", seq=r.token.seq, step=share.step,
                                  message=f"step {share.step} was not committed: {r.message}")

    def _committed(self, r: Result, token: CommitToken, timing: Any) -> None:
        share, figures, measuring = r.share, self.ledger.figures, self.ledger.measuring
        assert r.info is not None
        secs = max(time.monotonic() - share.started, 1e-9)
        nbytes = token.received + share.written.copied - share.written.recognised
        log.info("committed run=%s step=%d rank=%d bytes=%d reused=%d tensors=%d seconds=%.3f "
                 "rate=%s", share.run, share.step, share.rank, nbytes, share.written.reused,
                 len(share.written.records), secs, units.rate(nbytes, secs))
        figures.committed(share.run, share.step, share.rank, nbytes, secs, share.written.reused)
        if share.mismatches:
            figures.replica_mismatch(share.mismatches)
        measuring.committed(share.run, share.rank, share.step, share.id.attempt, timing, secs)
        self.ledger.durable(share.run, share.step)
        self.replies.send(token.identity, "committed", seq=token.seq, step=share.step, info=r.info.to_dict(),
                          advice=measuring.advice(share.run, max_age=1.0))

    def _report_failure(self, share: Share, message: str) -> None:
        """Tell the producer at once when a write failed, before it commits."""
        sess = self.sessions.holding(share.run, share.rank)
        if sess is not None and sess.steps.get(share.step) is not None and sess.steps[share.step].share is share:
            if not share.reported:
                share.reported = True
                self.ledger.figures.error("step")
                self.replies.send(sess.identity, "error", seq=None, step=share.step, message=message)

    def open_step(self, sess: Session, step: int, seq: int) -> OpenStep:
        """The open step ``step`` of ``sess``, created on first use. A step that may not
        be written is returned already failed, so that the rest of its messages are
        dropped quietly until the producer aborts or commits it."""
        open_step = sess.steps.get(step)
        if open_step is not None:
            return open_step
        open_step = sess.steps[step] = OpenStep(
            Share(ShareId(self.root, sess.run, sess.rank, sess.world_size, step, format=sess.format,
                          chunk_size=self.cfg.chunk_size, owner=sess.identity, attempt=sess.attempt,
                          host=sess.host)),
            self.writer, sess.chunk_size)
        try:
            check_step(step)
        except ValueError as exc:
            self.sessions.fail_step(sess, open_step, str(exc), seq)
            return open_step
        if self.lifecycle.stopping:
            self.sessions.fail_step(sess, open_step, (
                f"the daemon is stopping: step {step} of run {sess.run!r} was refused and not saved; "
                "save it again once the daemon has restarted"), seq, discard=False)
            return open_step
        verdict = resave(open_step.share.dir, sess.run, sess.rank, step, sess.attempt,
                         in_flight=self.ledger.committing(sess.run, sess.rank, step))
        if verdict.error is not None:
            self.sessions.fail_step(sess, open_step, verdict.error, seq, discard=False)
        elif verdict.replace:
            self.writer.replace_earlier(open_step.share)
        if open_step.share.error is None:
            self.writer.holds.open(open_step.share, sess.arena)
        return open_step


def _check_commit(open_step: OpenStep, h: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The commit's state and metadata, once the step is whole; StepError if not."""
    open_step.check_commit(h)
    structure = _parse_json(h["state"], "state")
    metadata = _parse_json(h["metadata"], "metadata")
    if not isinstance(metadata, dict):
        raise StepError("commit metadata must be a JSON object")
    missing = [n for n in state_mod.tensor_names(structure)
               if n not in open_step.names and n not in open_step.share.declared.written_by]
    if missing:
        raise StepError(f"the saved state refers to tensors never sent: {missing[:5]}")
    return structure, metadata


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
        # json.loads takes NaN, Infinity and lone surrogates, which a manifest cannot hold
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
        return value
    except (ValueError, RecursionError) as exc:
        raise StepError(f"commit {what} is not valid JSON: {exc}") from None
