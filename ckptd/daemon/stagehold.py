"""A committed share's bytes kept in its producer's shared staging for the peer tier, so
that replication sends what the producer staged instead of reading the files back.

``StagingHolds`` keeps one ``Hold`` per share: the writer threads add each data file's
pieces (views of the arena), the main loop keeps back the acknowledgements of the
pieces' staging, and the peer tier's senders copy out of it (``Hold.fill``). The staging
goes back to the producer when the share is sent, or at once when the producer needs the
room (``drain``) or hands its arena over again: then the senders read the files.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from .share import Share

Key = tuple[str, int, int]
Arena = tuple[int, int]


class Sessions(Protocol):
    """The main loop's ``sessions.Sessions``: whom a hold's staging goes back to."""

    def get(self, identity: bytes | None) -> Any: ...

    def ack(self, sess: Any) -> None: ...


class Hold:
    """One share's data files as pieces of staging: ``files`` maps a file to its
    ``(offset, view)`` pieces; ``seqs`` are the staging's acknowledgements kept back.
    ``lock`` orders a copy out of staging against the staging's return: a copy either
    ends before the producer is told it may reuse the staging, or does not begin."""

    def __init__(self, owner: bytes, arena: Arena) -> None:
        self.owner, self.arena = owner, arena
        self.files: dict[str, list[tuple[int, memoryview]]] = {}
        self.seqs: list[int] = []
        self.live = True
        self.lock = threading.Lock()

    def fill(self, file: str, offset: int, out: memoryview) -> list[tuple[int, int]] | None:
        """Copy the bytes of ``file`` at ``offset`` that staging holds into ``out``; the
        ``(start, end)`` ranges of ``out`` it does not hold (to read from the file), or
        None when the staging went back (all of it is to be read)."""
        end = offset + len(out)
        gaps, at = [], offset
        with self.lock:
            if not self.live:
                return None
            for start, view in self.files.get(file, ()):
                stop = start + len(view)
                if stop <= at or start >= end:
                    continue
                if start > at:
                    gaps.append((at - offset, start - offset))
                lo, hi = max(start, at), min(stop, end)
                out[lo - offset:hi - offset] = view[lo - start:hi - start]
                at = hi
        if at < end:
            gaps.append((at - offset, end - offset))
        return gaps


class StagingHolds:
    """Every share's ``Hold``, by share and, once committed, by ``(run, step, rank)``;
    ``enabled`` only where a tier sends shares from staging. ``wake()`` wakes the main
    loop when a sender is done with a hold (``sent``)."""

    def __init__(self, enabled: bool = False, wake: Callable[[], None] = lambda: None) -> None:
        self.enabled = enabled
        self._wake = wake
        self._lock = threading.Lock()
        self._by_share: dict[Share, Hold] = {}
        self._by_key: dict[Key, Hold] = {}
        self._sent: list[Key] = []
        self._drained: dict[bytes, int] = {}  # session -> the newest seq its producer asked back

    def open(self, share: Share, arena: Arena | None) -> None:
        """On the main loop: ``share`` begins, its producer's staging shared as ``arena``."""
        if self.enabled and arena is not None:
            with self._lock:
                self._by_share[share] = Hold(share.id.owner, arena)

    def add(self, share: Share, file: str, pieces: list[tuple[int, Any]]) -> None:
        """On a writer thread, before the pieces are reported written: data file ``file``
        of ``share`` holds these ``(offset, buffer)`` pieces of staging (none yet: a file
        streamed is named at its first piece, its pieces added once it is whole)."""
        with self._lock:
            hold = self._by_share.get(share)
        if hold is not None:
            with hold.lock:
                if hold.live:
                    hold.files.setdefault(file, []).extend((o, memoryview(b).cast("B")) for o, b in pieces)
                    hold.files[file].sort(key=lambda p: p[0])

    def committed(self, share: Share) -> None:
        """``share``'s manifest is durable: its hold is found by its key from now on."""
        with self._lock:
            hold = self._by_share.get(share)
            key = (share.run, share.step, share.rank)
            if hold is not None:
                self._by_key[key] = hold
            else:
                self._by_key.pop(key, None)

    def find(self, key: Key) -> Hold | None:
        """The hold of the committed share ``key``, if its staging is still held."""
        with self._lock:
            hold = self._by_key.get(key)
        return hold if hold is not None and hold.live else None

    def sent(self, key: Key) -> None:
        """Replication is done with ``key`` (held by its partners, or no longer wanted)."""
        with self._lock:
            if key not in self._by_key:
                return
            self._sent.append(key)
        self._wake()

    def keep(self, share: Share, seqs: list[int], sessions: Sessions) -> bool:
        """Whether the staging of ``seqs``, written for ``share``, stays with the daemon
        for replication (its acknowledgement kept back) instead of going back now. Not
        once the producer asked for it back (``drain``): the share's whole hold goes."""
        with self._lock:
            hold = self._by_share.get(share)
            asked = self._drained.get(share.id.owner, -1)
        if hold is None or share.error is not None:
            return False
        if min(seqs) <= asked:
            self._give_back(hold, sessions)
            return False
        with hold.lock:
            kept = hold.live and bool(hold.files)  # a format that wrote no file from staging (HDF5) gains nothing
            if kept:
                hold.seqs.extend(seqs)
            return kept

    def settle(self, sessions: Sessions) -> None:
        """Give back the staging of the shares the senders are done with."""
        with self._lock:
            done, self._sent = self._sent, []
            holds = [self._by_key[k] for k in done if k in self._by_key]
        for hold in holds:
            self._give_back(hold, sessions)

    def release(self, share: Share, sessions: Sessions) -> None:
        """``share`` failed, or its commit did: its staging goes back."""
        with self._lock:
            hold = self._by_share.get(share)
        if hold is not None:
            self._give_back(hold, sessions)

    def drain(self, owner: bytes, through: int, sessions: Sessions) -> int:
        """The producer of session ``owner`` needs its staging up to seq ``through``: give
        back every hold with a piece there, now or as it is written; how many went back."""
        with self._lock:
            self._drained[owner] = max(through, self._drained.get(owner, -1))
            holds = [h for h in self._by_share.values() if h.owner == owner and h.seqs and min(h.seqs) <= through]
        for hold in holds:
            self._give_back(hold, sessions)
        return len(holds)

    def ended(self, owner: bytes) -> None:
        """Session ``owner`` ended: its producer asks nothing back any more."""
        with self._lock:
            self._drained.pop(owner, None)

    def forget(self, arena: Arena) -> None:
        """``arena`` is handed over anew: its producer writes it again from the welcome on,
        so nothing is sent out of it any more. (A producer that ends its session without
        one never writes its arena again: what it held stays until sent.)"""
        with self._lock:
            holds = [h for h in self._by_share.values() if h.arena == arena]
        for hold in holds:
            self._give_back(hold, None)

    def _give_back(self, hold: Hold, sessions: Sessions | None) -> None:
        with hold.lock:
            hold.live = False
            seqs, hold.seqs, hold.files = hold.seqs, [], {}
        with self._lock:
            for share in [s for s, h in self._by_share.items() if h is hold]:
                del self._by_share[share]
            for key in [k for k, h in self._by_key.items() if h is hold]:
                del self._by_key[key]
        sess = sessions.get(hold.owner) if sessions is not None and seqs else None
        if sess is not None:
            sess.mark_written(seqs)
            assert sessions is not None
            sessions.ack(sess)

    def figures(self) -> dict[str, int]:
        with self._lock:
            return {"staging_holds": len(self._by_share)}
