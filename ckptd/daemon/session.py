"""One producer's session with the daemon: who it is, its open steps, and which of
its staging memory the daemon still needs."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .assembly import OpenStep


@dataclass(eq=False)
class Session:
    identity: bytes
    run: str
    rank: int
    world_size: int
    pid: int
    host: str
    format: str = "chunk"  # of this session's checkpoints: its hello's, else [daemon] format
    attempt: str | None = None  # of the job (ckptd.attempt), recorded in its manifests
    last_seen: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.time)  # Unix time of the hello
    steps: dict[int, OpenStep] = field(default_factory=dict)
    # Acknowledgements: the producer may reuse staging up to ``acked``. Inline bytes are
    # free once received; bytes in shared memory once written (``unwritten``, in order).
    received: int = 0  # newest tensor seq received
    acked: int = 0
    unwritten: deque[int] = field(default_factory=deque)
    written: set[int] = field(default_factory=set)  # out of order: waits for older ones
    shm: memoryview | None = None  # the producer's staging arena, mapped read-only
    arena: tuple[int, int] | None = None  # that arena's identity (st_dev, st_ino)
    chunk_size: int = 0

    # a ``tensors`` batch shares one region (one seq) among its tensors, which may land
    # in different chunk files: its seq is written once every one of them is
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

    @property
    def label(self) -> str:
        return f"run={self.run} rank={self.rank} pid={self.pid}"
