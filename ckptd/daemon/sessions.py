"""Who is connected: each producer's ``Session`` and the daemon's ``Sessions``.

A session holds its open steps and which of its staging memory the daemon still
needs. ``Sessions`` admits producers (run owners, one session per rank), ends them
(goodbye, death, silence) and fails or drops their steps, freeing what they held.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from .assembly import OpenStep

if TYPE_CHECKING:
    from .ledger import Ledger
    from .liveness import Liveness
    from .owners import Owners
    from .replies import Replies
    from .writer import Writer

log = logging.getLogger("ckptd.daemon")


@dataclass(eq=False)
class Session:
    """One producer: ``received`` is its newest tensor seq received, ``shm`` its staging
    arena mapped read-only (``arena``: its (st_dev, st_ino)), ``written`` the seqs written
    out of order, each waiting for the older ones in ``unwritten``."""

    identity: bytes
    run: str
    rank: int
    world_size: int
    pid: int
    host: str
    format: str = "chunk"
    attempt: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.time)
    steps: dict[int, OpenStep] = field(default_factory=dict)
    # The producer may reuse staging up to ``acked``: inline bytes once received, bytes
    # in shared memory once written (``unwritten``, in order).
    received: int = 0
    acked: int = 0
    unwritten: deque[int] = field(default_factory=deque)
    written: set[int] = field(default_factory=set)
    shm: memoryview | None = None
    arena: tuple[int, int] | None = None
    chunk_size: int = 0
    # A ``tensors`` batch shares one seq among tensors that may land in different chunk
    # files: the seq is written once every one of them is.
    pieces: dict[int, int] = field(default_factory=dict)

    def expect(self, seq: int, count: int) -> None:
        """``seq`` names ``count`` pieces; it is written when the last of them is."""
        self.unwritten.append(seq)
        if count > 1:
            self.pieces[seq] = count

    def mark_written(self, seqs: list[int]) -> None:
        """The writer is done with these pieces (a seq once per piece)."""
        for seq in seqs:
            left = self.pieces.get(seq, 1) - 1
            if left > 0:
                self.pieces[seq] = left
            else:
                self.pieces.pop(seq, None)
                self.written.add(seq)

    def acknowledgeable(self) -> int:
        """The newest seq whose staging memory the daemon no longer needs."""
        while self.unwritten and self.unwritten[0] in self.written:
            self.written.discard(self.unwritten.popleft())
        return self.unwritten[0] - 1 if self.unwritten else self.received

    def open_steps(self) -> Iterator[OpenStep]:
        """Steps begun and not yet failed, committed or aborted."""
        return (st for st in self.steps.values() if st.share.error is None)

    def flush(self) -> None:
        """Hand every chunk gathered in the producer's arena to the writer."""
        for open_step in self.steps.values():
            open_step.flush()

    @property
    def label(self) -> str:
        return f"run={self.run} rank={self.rank} pid={self.pid}"


class Sessions:
    """The sessions by identity, which one holds each (run, rank), and how they end."""

    def __init__(self, liveness: Liveness, owners: Owners, ledger: Ledger, replies: Replies,
                 writer: Writer) -> None:
        self.liveness = liveness
        self.owners = owners
        self._ledger = ledger
        self._replies = replies
        self._writer = writer
        self._by_id: dict[bytes, Session] = {}
        self._holder: dict[tuple[str, int], bytes] = {}

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, identity: bytes | None) -> Session | None:
        return self._by_id.get(identity) if identity is not None else None

    def holding(self, run: str, rank: int) -> Session | None:
        """The session that writes ``rank`` of ``run``, if one does."""
        return self.get(self._holder.get((run, rank)))

    def add(self, sess: Session, pid: int | None) -> None:
        """``pid``: the producer's process, known over ipc://; its death ends the session."""
        self._by_id[sess.identity] = sess
        self._holder[(sess.run, sess.rank)] = sess.identity
        if pid is not None:
            self.liveness.watch(sess.identity, pid)

    def open_steps(self) -> list[tuple[Session, OpenStep]]:
        return [(sess, st) for sess in self._by_id.values() for st in sess.open_steps()]

    def ack(self, sess: Session) -> None:
        """Let the producer reuse the staging memory the daemon is done with."""
        through = sess.acknowledgeable()
        if through > sess.acked:
            self._replies.send(sess.identity, "ack", seq=through)
            sess.acked = through

    def ack_all(self) -> None:
        for sess in self._by_id.values():
            self.ack(sess)

    def fail_step(self, sess: Session, open_step: OpenStep, message: str, seq: int | None,
                  *, discard: bool = True) -> None:
        """Report a failed step once and throw away what was written of it."""
        share = open_step.share
        log.warning("%s step=%d failed: %s", sess.label, share.step, message)
        self._ledger.figures.error("step")
        self._replies.send(sess.identity, "error", seq=seq, step=share.step, message=message)
        share.error = message
        share.reported = True
        self._release_partial(sess, open_step)
        open_step.flush()
        if discard:
            self._writer.discard(share)

    def drop_step(self, sess: Session, step: int) -> None:
        open_step = sess.steps.pop(step, None)
        if open_step is None:
            return
        if open_step.share.error is None:
            open_step.share.error = "aborted by the producer"
        self._release_partial(sess, open_step)
        open_step.flush()
        self._writer.discard(open_step.share)

    def _release_partial(self, sess: Session, open_step: OpenStep) -> None:
        held, seqs = open_step.release_partial()
        self._ledger.free(held)
        sess.mark_written(seqs)

    def end(self, sess: Session, why: str, *, failed: bool = False) -> None:
        """End a session; ``failed``: its producer went without a goodbye (its attempt failed)."""
        log.info("producer %s %s; discarding %d unfinished step(s)", sess.label, why, len(sess.steps))
        if failed:
            self._ledger.measuring.ended(sess.run, sess.attempt, why)
        for step in list(sess.steps):
            self.drop_step(sess, step)
        self._writer.holds.ended(sess.identity)
        self._by_id.pop(sess.identity, None)
        self.liveness.forget(sess.identity)
        if self._holder.get((sess.run, sess.rank)) == sess.identity:
            del self._holder[(sess.run, sess.rank)]

    def end_dead(self, now: float) -> None:
        """End the sessions of local producers whose process exited."""
        last_seen = lambda i: self._by_id[i].last_seen if i in self._by_id else 0.0  # noqa: E731
        for identity, pid in self.liveness.ended(now, last_seen):
            if identity in self._by_id:
                self.end(self._by_id[identity], f"died (process {pid} exited)", failed=True)
            else:
                self.liveness.forget(identity)

    def expire(self, now: float) -> None:
        for sess in self:
            if self.liveness.silent_too_long(sess.identity, now - sess.last_seen, now):
                self.end(sess, f"was silent for {now - sess.last_seen:.0f} s", failed=True)

    def keep_alive(self, now: float) -> None:
        """While the daemon is not reading, producers' pings go unread: tell them it is
        alive, and do not hold their silence against them."""
        for sess in self._by_id.values():
            sess.last_seen = now
            self._replies.send(sess.identity, "pong", seq=0)
