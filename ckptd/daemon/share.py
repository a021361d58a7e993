"""What the daemon's writer works on: a rank's share of a step (``Share``), a tensor
streamed into it (``Stream``), and what the I/O threads report back (``Result``).
The main loop makes them; ``ckptd.daemon.writer``'s threads fill them, with what the
share's storage format (``ckptd.format``) returns: a format never sees them.
"""

from __future__ import annotations

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


@dataclass(eq=False)
class Share:
    """One rank's part of one step. Main thread creates it; the I/O threads fill it."""

    root: Path
    run: str
    rank: int
    world_size: int
    step: int
    records: dict[str, TensorRecord] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    error: str | None = None
    reported: bool = False  # the producer was told of ``error``
    next_file: int = 0  # data-file sequence numbers (next_seq)
    started: float = field(default_factory=time.monotonic)
    dir_ready: bool = False
    format: str = "chunk"  # its storage format (ckptd.format), which writes it on the thread it names
    chunk_size: int = 64 * 2**20  # ``[daemon] chunk_size``: the most a file of copied tensors holds (reuse)
    kept: Any = None  # what its format keeps open between calls (format.WriteIO.kept), held for it
    owner: bytes = b""  # the session that sends it (its shared pieces are acknowledged to it)
    dir_fd: int = -1  # the step folder, held open while the I/O threads write in it
    attempt: str | None = None  # the job's attempt that writes it (ckptd.attempt)
    replicas: dict[str, int] = field(default_factory=dict)  # tensors of its state another rank wrote
    # replica comparison (ckptd.replicas): this rank's digests of its replicated pieces, the
    # producer's policy, its host; and, set by the share that completes the step, how many
    # tensors' copies disagree (ckptd_replica_mismatch_total)
    replica_digests: dict[str, str] = field(default_factory=dict)
    compare_replicas: str | None = None
    host: str | None = None
    mismatches: int = 0
    inflight: list[Future] = field(default_factory=list)  # its chunk files in the writer pool
    base: Any = None  # the earlier share it refers to (reuse.Base), once looked for
    base_sought: bool = False
    bases: list = field(default_factory=list)  # other steps frozen= tensors refer to (reuse.Base)
    refs: list[Ref] = field(default_factory=list)  # its tensors stored already, placed at commit
    reused: int = 0  # bytes of its tensors that refer to an earlier step's copy (reuse)
    recognised: int = 0  # bytes the daemon received and did not write from memory (reuse)
    copied: int = 0  # bytes of stored copies copied into files of its own (Format.place)
    lock: threading.Lock = field(default_factory=threading.Lock)  # file names, records, refs
    _seeking: threading.Lock = field(default_factory=threading.Lock)  # the base, looked for once
    settled: threading.Event = field(default_factory=threading.Event)  # committed or failed, for good
    before: "Share | None" = None  # this rank's share committing when this one's first chunk came

    @property
    def dir(self) -> Path:
        return layout.step_dir(self.root, self.run, self.step)

    def at(self, name: str) -> str:
        """A path to ``name`` in the step folder that resolves through the folder's open
        descriptor, not its name: a run or step folder swapped for a symlink after it was
        checked redirects nothing (docs/reliability.md). h5py and ``atomic_write`` take it too."""
        if self.dir_fd >= 0 and _PROC_FD:
            return f"{_PROC_FD}/{self.dir_fd}/{name}"
        return str(self.dir / name)

    def close_dir(self) -> None:
        for base in (self.base, *self.bases):
            if base is not None:
                base.close()
        self.bases.clear()
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def next_seq(self) -> int:
        """A new data-file sequence number of this share. The main thread numbers the files it
        hands over; the I/O threads those they link or copy from an earlier step (reuse)."""
        with self.lock:
            seq, self.next_file = self.next_file, self.next_file + 1
        return seq


@dataclass
class Result:
    kind: str  # "freed" | "failed" | "committed" | "commit_failed" | "discarded"
    share: Share
    nbytes: int = 0  # of the daemon's own memory, let go of
    seqs: list[int] = field(default_factory=list)  # shared-memory pieces no longer used
    info: CheckpointInfo | None = None
    message: str = ""
    token: Any = None  # the caller's, passed back with commit results


@dataclass
class Stream:
    """A tensor too large to batch: it gets a chunk file of its own, written as it arrives."""

    share: Share
    entry: Entry
    file: str
    out: Any = None  # where its pieces go, while it is open: what its format's open_stream returned
    hasher: Checksum | None = None
