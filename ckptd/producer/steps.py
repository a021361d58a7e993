"""A producer's steps: the ones it is emitting, the commits it awaits, how each ended.

``CommitHandle`` is what ``commit`` returns. ``StepBook`` keeps, under one lock
(the training thread writes it, the sender thread brings the daemon's replies):
each open step's names and staging room, the commits awaiting a reply (by wire
seq), and the failed commits no caller was told of yet, which ``flush()`` and
``close()`` raise (docs/design.md: a failure always reaches the caller). A
``Step``'s ``opened`` flag alone is set outside the lock, by the copy that opens
the step (``copies.Copier.stage``, under the emit lock): only emits read it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import CheckpointError
from ..manifest import CheckpointInfo
from ..sharding import Box, intersect, piece_name

log = logging.getLogger("ckptd.producer")


class CommitHandle:
    """The outcome of one ``commit``: resolves once the daemon made the step durable."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._event = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: str | None = None
        self.observed = False  # a failure raised by wait() is not raised again by flush()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the commit is acknowledged; return its info or raise CheckpointError."""
        if not self._event.wait(timeout):
            raise CheckpointError(f"commit of step {self.step} was not acknowledged within {timeout} s")
        if self._error is not None:
            self.observed = True
            raise CheckpointError(self._error)
        assert self._info is not None
        return self._info

    def _resolve(self, info: CheckpointInfo | None = None, error: str | None = None) -> bool:
        if self._event.is_set():
            return False
        self._info, self._error = info, error
        self._event.set()
        return True

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"<CommitHandle step={self.step} {state}>"


@dataclass(eq=False)
class Step:
    """What this producer knows of a step it is emitting or committing."""

    names: set[str] = field(default_factory=set)
    pieces: dict[str, list[Box]] = field(default_factory=dict)  # hand-placed pieces emitted, by tensor
    room: int = 0  # staging bytes its tensors take at once (sizing.room_for)
    replicas: dict[str, int] = field(default_factory=dict)  # tensors of the step another rank writes
    handle: CommitHandle | None = None  # set once commit() was called
    error: str | None = None  # the daemon failed it before commit()
    opened: bool = False  # a tensor of it went out alone: the daemon knows the step is open
    began: float = field(default_factory=time.monotonic)  # its first emit: the stall of emit + commit


class StepBook:
    """The steps in flight and the commits awaited. ``on_done(step, ok)`` hears how
    each commit ended (``frozen.Frozen.done``: only a committed step is a base)."""

    def __init__(self, on_done: Callable[[int, bool], None]) -> None:
        self._lock = threading.Lock()
        self._steps: dict[int, Step] = {}
        self._commits: dict[int, CommitHandle] = {}  # wire seq -> handle
        self._failures: list[CommitHandle] = []  # failed commits flush() has not raised yet
        self._on_done = on_done

    # -- the training thread: emit, save, commit, abort --------------------------------------
    def idle(self) -> bool:
        """No step in flight: none of their bytes is in staging."""
        with self._lock:
            return not self._steps

    def claim(self, step: int, *names: str, replica_of: int | None = None, room: int = 0,
              piece: tuple[str, Box] | None = None) -> Step:
        """Record ``names`` as emitted in ``step`` (or, ``replica_of``, written by that
        rank), taking ``room`` more bytes of staging; ``piece``: the one name is the
        hand-placed piece (tensor, box) that ``place`` named. Return the step (the
        training thread stages into it); ValueError if the step is committed or a
        name was emitted in it before."""
        with self._lock:
            st = self._steps.get(step)
            if st is None:
                st = self._steps[step] = Step()
            if st.handle is not None:
                raise ValueError(f"step {step} was already committed by this producer; save under a new "
                                 "step number")
            if len(names) == 1:
                clash = names[0] in st.names or names[0] in st.replicas
            else:  # a save's thousands of names, checked in C
                clash = not st.names.isdisjoint(names) or not st.replicas.keys().isdisjoint(names)
            if clash:
                name = next(n for n in names if n in st.names or n in st.replicas)
                raise ValueError(f"tensor name {name!r} was already emitted in step {step}")
            if replica_of is None:
                st.names.update(names)
            else:
                st.replicas.update(dict.fromkeys(names, replica_of))
            st.room += room
            if piece is not None:
                st.pieces.setdefault(piece[0], []).append(piece[1])
            return st

    def unclaim(self, step: int, name: str, room: int = 0, piece: tuple[str, Box] | None = None) -> None:
        """Undo ``claim`` of ``name`` (its copy into staging failed): it may be emitted again."""
        with self._lock:
            st = self._steps.get(step)
            if st is not None:
                st.names.discard(name)
                st.room -= room
                if piece is not None:
                    st.pieces[piece[0]].remove(piece[1])

    def place(self, step: int, tensor: str, box: Box) -> str:
        """The name a hand-placed piece ``box`` of ``tensor`` is kept under: ``tensor``
        if it is this rank's first piece of it in ``step``, else ``piece_name``'s
        (docs/format.md). ValueError if it overlaps a piece emitted before."""
        with self._lock:
            st = self._steps.get(step)
            earlier = list(st.pieces.get(tensor, ())) if st is not None else []
        for other in earlier:
            both = intersect(box, other)
            if both is not None and both.numel:
                raise ValueError(f"emit({tensor!r}, ...): the piece at offsets {list(box.offsets)} of shape "
                                 f"{list(box.sizes)} overlaps the piece at offsets {list(other.offsets)} of shape "
                                 f"{list(other.sizes)} emitted before in step {step}; emit each block once")
        return piece_name(tensor, box.offsets) if earlier else tensor

    def opened(self, step: int) -> bool:
        """The daemon knows ``step`` is open (a message of it goes out now); whether it knew already."""
        with self._lock:
            st = self._steps.get(step)
            if st is None:
                return False
            was, st.opened = st.opened, True
            return was

    def set_room(self, step: int, room: int) -> None:
        """The staging ``step``'s tensors take at once, as a save counted it."""
        with self._lock:
            st = self._steps.get(step)
            if st is not None:  # the commit asks sizing for room to fit it next time
                st.room = room

    def drop(self, step: int) -> bool:
        """Forget an uncommitted step (an abort); False if it is unknown or committed."""
        with self._lock:
            st = self._steps.get(step)
            if st is None or st.handle is not None:
                return False
            del self._steps[step]
            return True

    def close_step(self, step: int, handle: CommitHandle) -> Step:
        """``commit``: ``handle`` stands for ``step`` from now on; ValueError if it
        was committed already. The step's ``error`` is final from here."""
        with self._lock:
            st = self._steps.setdefault(step, Step())
            if st.handle is not None:
                raise ValueError(f"step {step} was already committed by this producer; save under a new "
                                 "step number")
            st.handle = handle
            return st

    def expect(self, seq: int, handle: CommitHandle) -> None:
        """The ``commit`` message numbered ``seq`` resolves ``handle`` when answered."""
        with self._lock:
            self._commits[seq] = handle

    def wait_all(self, timeout: float | None) -> None:
        """Until every commit made so far is answered; CheckpointError after ``timeout``."""
        with self._lock:
            handles = [st.handle for st in self._steps.values() if st.handle is not None]
        for h in handles:
            if not h._event.wait(timeout):
                raise CheckpointError(f"commit of step {h.step} was not acknowledged within {timeout} s")

    def raise_unseen(self) -> None:
        """Raise CheckpointError naming every failed commit no ``wait()`` raised already."""
        with self._lock:
            failures, self._failures = self._failures, []
        unseen = [h._error for h in failures if not h.observed]
        if unseen:
            raise CheckpointError("; ".join(e for e in unseen if e))

    def finish(self, step: int, handle: CommitHandle, info: CheckpointInfo | None = None,
               error: str | None = None) -> None:
        """Resolve ``handle`` and forget its step; a failure is kept for ``raise_unseen``."""
        self._on_done(step, error is None)
        with self._lock:
            st = self._steps.get(step)
            if st is not None and st.handle is handle:
                del self._steps[step]
            if handle._resolve(info, error) and error is not None:
                self._failures.append(handle)
        if error is not None:
            log.error("checkpoint step %d failed: %s", step, error)

    # -- the sender thread: the daemon's replies ----------------------------------------------
    def committed(self, seq: int, step: int, info: CheckpointInfo) -> None:
        handle = self._take(seq)
        if handle is not None:
            self.finish(step, handle, info=info)

    def failed(self, seq: int | None, step: int | None, message: str) -> bool:
        """The daemon failed the commit numbered ``seq``, or ``step`` (before or after its
        commit); False if that names neither (a message for the log alone)."""
        handle = self._take(seq) if seq is not None else None
        if step is None and handle is None:
            return False
        with self._lock:
            st = self._steps.get(step) if step is not None else None
            if handle is None and st is not None:
                handle = st.handle
                if handle is not None:
                    self._commits = {k: v for k, v in self._commits.items() if v is not handle}
                elif st.error is None:
                    st.error = message  # reported again when the step is committed
        if handle is not None:
            self.finish(handle.step, handle, error=message)
        return True

    def lose(self, message: str) -> None:
        """The daemon went silent: every step in flight fails with ``message``, loudly."""
        with self._lock:
            commits, self._commits = self._commits, {}
            for st in self._steps.values():
                if st.handle is None and st.error is None:
                    st.error = message
        for handle in commits.values():
            self.finish(handle.step, handle, error=message)

    def _take(self, seq: int) -> CommitHandle | None:
        with self._lock:
            return self._commits.pop(seq, None)
