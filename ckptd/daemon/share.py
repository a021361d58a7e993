"""What the daemon's writer works on: a rank's share of a step (``Share``), a tensor
streamed into it (``Stream``), and what the I/O threads report back (``Result``).

A share is pieces by phase: what it is (``ShareId``, fixed), what the I/O threads
have written (``Written``), the earlier step it refers to (``BaseSearch``), and what
its commit declares (``Declared``). A format never sees them (``writer.ShareIO``).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import layout
from ..format import Entry, Ref
from ..manifest import Checksum, CheckpointInfo, TensorRecord

_PROC_FD = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else ""


@dataclass(frozen=True)
class ShareId:
    """Which share: fixed by its producer's session when its first message comes."""

    root: Path
    run: str
    rank: int
    world_size: int
    step: int
    format: str = "chunk"
    chunk_size: int = 64 * 2**20
    owner: bytes = b""  # the session that sends it, to which its shared pieces are acknowledged
    attempt: str | None = None
    host: str | None = None

    @property
    def dir(self) -> Path:
        return layout.step_dir(self.root, self.run, self.step)


@dataclass(eq=False)
class Written:
    """What the I/O threads have put in the step folder; ``lock`` guards files, records
    and refs, which pool threads add to."""

    records: dict[str, TensorRecord] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    refs: list[Ref] = field(default_factory=list)
    next_file: int = 0
    dir_ready: bool = False
    dir_fd: int = -1
    kept: Any = None
    inflight: list[Future] = field(default_factory=list)
    reused: int = 0
    recognised: int = 0
    copied: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class BaseSearch:
    """The earlier share this one refers to (``reuse.Base``), looked for once."""

    before: "Share | None" = None  # this rank's share committing when this one's first chunk came
    base: Any = None
    sought: bool = False
    bases: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Declared:
    """What a commit declares beside the tensors (ckptd.replicas compares the digests)."""

    written_by: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    compare: str | None = None
    due: tuple[str, ...] | None = None  # the tiers the step is due for (ckptd.picks); None: all


class Share:
    """One rank's part of one step. The main loop makes it; the I/O threads fill it.
    ``reported``: the producer was told of ``error``; ``settled``: committed or failed
    for good; ``mismatches``: replicated tensors that disagree, set by the share that
    completes the step."""

    def __init__(self, id: ShareId) -> None:
        self.id = id
        self.written = Written()
        self.search = BaseSearch()
        self.declared = Declared()
        self.started = time.monotonic()
        self.error: str | None = None
        self.reported = False
        self.settled = threading.Event()
        self.mismatches = 0

    @property
    def run(self) -> str:
        return self.id.run

    @property
    def rank(self) -> int:
        return self.id.rank

    @property
    def step(self) -> int:
        return self.id.step

    @property
    def dir(self) -> Path:
        return self.id.dir

    @property
    def records(self) -> dict[str, TensorRecord]:
        return self.written.records

    def at(self, name: str) -> str:
        """A path to ``name`` that resolves through the step folder's open descriptor: a
        folder swapped for a symlink after it was checked redirects nothing."""
        if self.written.dir_fd >= 0 and _PROC_FD:
            return f"{_PROC_FD}/{self.written.dir_fd}/{name}"
        return str(self.dir / name)

    def close_dir(self) -> None:
        for base in (self.search.base, *self.search.bases):
            if base is not None:
                base.close()
        self.search.bases.clear()
        if self.written.dir_fd >= 0:
            os.close(self.written.dir_fd)
            self.written.dir_fd = -1

    def next_seq(self) -> int:
        """A new data-file sequence number: the main loop numbers the files it hands
        over, the I/O threads those they link or copy from an earlier step."""
        with self.written.lock:
            seq, self.written.next_file = self.written.next_file, self.written.next_file + 1
        return seq


class ResultKind(str, enum.Enum):
    """What an I/O thread reports: received bytes let go of (written, or unwritten as the
    share FAILED), a commit's end, or a discard done."""

    FREED = "freed"
    FAILED = "failed"
    COMMITTED = "committed"
    COMMIT_FAILED = "commit_failed"
    DISCARDED = "discarded"


@dataclass(frozen=True)
class CommitToken:
    """Who asked for a commit, passed back with its result: the session, the commit
    message's seq, and the tensor bytes received for the step."""

    identity: bytes
    seq: int
    received: int


@dataclass
class Result:
    """``nbytes`` of the daemon's own memory and the shared-memory pieces ``seqs`` are let
    go of; a commit's result carries its ``info`` or failure ``message``, and its token."""

    kind: ResultKind
    share: Share
    nbytes: int = 0
    seqs: list[int] = field(default_factory=list)
    info: CheckpointInfo | None = None
    message: str = ""
    token: CommitToken | None = None


@dataclass
class Stream:
    """A tensor too large to batch: it gets a chunk file of its own, written as it arrives;
    ``pieces``: its bytes in shared staging, in order (None once one was not there)."""

    share: Share
    entry: Entry
    file: str
    out: Any = None
    hasher: Checksum | None = None
    pieces: list[Any] | None = field(default_factory=list)

    def note(self, piece: Any, *, staged: bool) -> bool:
        """A piece written, in order: kept while every piece is a view of shared staging;
        whether it was kept."""
        if self.pieces is not None:
            if staged:
                self.pieces.append(piece)
                return True
            self.pieces = None
        return False
