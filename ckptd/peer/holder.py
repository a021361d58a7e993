"""The copies of other nodes' shares this daemon holds, in memory, within a byte budget.

A share is received into room reserved at ``offer`` (``part``), closed by ``done`` (or
given up by its sender, ``cancel``: the room freed) and admitted once every tensor matched its checksum (``admit``): only then may held copies
be evicted for it, and only as ``_protected`` allows (never the newest copy of a rank,
nor the newest step complete here). A copy belongs to the key that sent it (``owner``);
only that key may replace or drop it. Start reading at ``Holder.offer``.
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import dtypes, layout
from ..errors import CheckpointCorrupt
from ..errors import PeerMemoryFull as Full
from ..errors import PeerNotOwner as NotYours
from ..manifest import Manifest, checksum

log = logging.getLogger("ckptd.peer")

Key = tuple[str, int, int]


@dataclass(eq=False)
class Copy:
    manifest: Manifest
    manifest_json: bytes
    files: dict[str, Any]
    received: dict[str, int] = field(default_factory=dict)
    touched: float = field(default_factory=time.monotonic)
    arrival: int = 0
    owner: str | None = None
    keep_last: int = 0
    dropped: bool = False
    writing: int = 0

    @property
    def key(self) -> Key:
        return self.manifest.run, self.manifest.step, self.manifest.rank

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())


class Holder:
    def __init__(self, budget: int, stall: float) -> None:
        self.budget = budget
        self.stall = stall
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        self._held: dict[Key, Copy] = {}
        self._incoming: dict[int, Copy] = {}
        self._verifying: dict[int, Copy] = {}
        self._xfers = itertools.count(1)
        self._arrivals = itertools.count()
        self.evicted = 0
        self.rejected = 0
        self.drop_requests = 0
        self.cancelled = 0

    # -- receiving -------------------------------------------------------------------------
    def offer(self, manifest_json: bytes, files: dict[str, int], keep_last: int, owner: str | None = None) -> int:
        """Reserve room for a share sent by ``owner``; its transfer id. CheckpointCorrupt
        for a bad manifest or file list, NotYours for a share held from another owner,
        Full when the budget cannot take it without evicting a protected copy."""
        m = Manifest.from_json(manifest_json, "a manifest offered by a peer")
        names = set(m.files) | {t.file for t in m.tensors.values()}
        if set(files) != names or not all(layout.is_data_file(f) for f in files):
            raise CheckpointCorrupt(f"run {m.run!r} step {m.step} rank {m.rank}: the files offered "
                                    f"{sorted(files)} are not those its manifest names {sorted(names)}")
        if any(m.files.get(f, size) != size for f, size in files.items()):
            raise CheckpointCorrupt(f"run {m.run!r} step {m.step} rank {m.rank}: file sizes differ from its manifest")
        for name, t in m.tensors.items():
            if t.offset is not None and t.offset + t.nbytes > files[t.file]:
                raise CheckpointCorrupt(f"tensor {name!r} lies beyond the end of {t.file}")
        need = sum(files.values())
        with self._lock:
            self._check_owner((m.run, m.step, m.rank), owner)
            self._expire()
            self._reserve(need)
            xfer = next(self._xfers)
            self._incoming[xfer] = Copy(m, manifest_json, {f: _memory(n) for f, n in files.items()},
                                        {f: 0 for f in files}, owner=owner, keep_last=keep_last)
            return xfer

    def part(self, xfer: int, file: str, offset: int, data: Any, owner: str | None = None) -> None:
        with self._lock:
            r = self._sent_by(xfer, owner)
            buf = r.files.get(file)
            if buf is None or offset + len(data) > len(buf):
                raise ValueError(f"a part of {len(data)} bytes at {offset} does not fit {file!r}")
            r.touched = time.monotonic()
            r.writing += 1
        try:
            buf[offset:offset + len(data)] = data  # outside the lock: a few MiB of copying
        finally:
            with self._lock:
                r.received[file] += len(data)
                r.writing -= 1
                self._written.notify_all()

    def cancel(self, xfer: int, owner: str | None = None) -> int:
        """``cancel``: the sender gives transfer ``xfer`` up (its share was superseded by a
        newer one of its rank); its room is freed and nothing held changes. The bytes freed."""
        with self._lock:
            r = self._sent_by(xfer, owner)
            del self._incoming[xfer]
            self.cancelled += 1
            log.info("run %r step %d rank %d: its sender cancelled the transfer", *r.key)
            return r.nbytes

    def _sent_by(self, xfer: int, owner: str | None) -> Copy:
        """Transfer ``xfer`` while parts may reach it, if ``owner`` (the sending peer) opened it."""
        r = self._incoming.get(xfer)
        if r is None:
            raise KeyError(f"transfer {xfer} is unknown, done, or given up after {self.stall:g} s without a part")
        if r.owner != owner:
            raise NotYours(f"transfer {xfer} is another peer's")
        return r

    def close(self, xfer: int, owner: str | None = None) -> None:
        """``done``: no part reaches transfer ``xfer`` from now on; its room stays taken
        until ``admit``."""
        with self._lock:
            r = self._incoming.get(xfer)
            if r is None:
                raise KeyError(f"transfer {xfer} is unknown")
            if r.owner != owner:
                raise NotYours(f"transfer {xfer} is another peer's")
            self._verifying[xfer] = self._incoming.pop(xfer)

    def admit(self, xfer: int) -> Key:
        """Hold the share of closed transfer ``xfer`` once its bytes verify, evicting for
        it what may go; CheckpointCorrupt (its room freed) if they do not."""
        with self._lock:
            r = self._verifying[xfer]
            while r.writing:
                self._written.wait()
        try:
            short = [f for f, b in r.files.items() if r.received[f] != len(b)]
            if short:
                raise CheckpointCorrupt(f"{', '.join(short)}: not every byte arrived")
            try:
                verify(r.manifest, r.files, "a copy received")
            except CheckpointCorrupt:
                with self._lock:
                    self.rejected += 1
                raise
            with self._lock:
                self._check_owner(r.key, r.owner)
                r.arrival = next(self._arrivals)
                del self._verifying[xfer]
                self._held[r.key] = r
                self._tidy(r.key[0])
                self._evict_over_budget()
            return r.key
        finally:
            with self._lock:
                self._verifying.pop(xfer, None)

    def done(self, xfer: int, owner: str | None = None) -> Key:
        """``close`` and ``admit`` in one call."""
        self.close(xfer, owner)
        return self.admit(xfer)

    def _check_owner(self, key: Key, owner: str | None) -> None:
        held = self._held.get(key)
        if held is not None and held.owner != owner:
            raise NotYours(f"run {key[0]!r} step {key[1]} rank {key[2]} is held here for another peer: "
                           "only the node whose share it is may replace it")

    # -- forgetting ------------------------------------------------------------------------
    def drop_many(self, runs: dict[str, list[int]], owner: str | None = None) -> int:
        """One ``drop`` message: ``drop`` for each run; the number of copies forgotten."""
        with self._lock:
            self.drop_requests += 1
        return sum(self.drop(run, steps, owner) for run, steps in runs.items())

    def drop(self, run: str, steps: list[int], owner: str | None = None) -> int:
        """Forget ``owner``'s copies of ``steps`` of ``run`` (its retention deleted them),
        but for those a recovery may still need (``_protected``): those go once they are not."""
        wanted = set(steps)
        with self._lock:
            mine = [r for k, r in self._held.items() if k[0] == run and k[1] in wanted and r.owner == owner]
            for r in mine:
                r.dropped = True
            before = len(self._held)
            self._tidy(run)
            return before - len(self._held)

    def _protected(self, run: str) -> set[Key]:
        """The copies of ``run`` a recovery may need: the newest held of each rank, and
        every share of the newest step whose ranks are all held here."""
        mine = [r for k, r in self._held.items() if k[0] == run]
        newest: dict[int, Copy] = {}
        for r in mine:
            if r.manifest.rank not in newest or r.arrival > newest[r.manifest.rank].arrival:
                newest[r.manifest.rank] = r
        keep = {r.key for r in newest.values()}
        ranks: dict[int, set[int]] = {}
        for r in mine:
            ranks.setdefault(r.manifest.step, set()).add(r.manifest.rank)
        whole = [step for step, got in ranks.items()
                 if any(len(got) == r.manifest.world_size for r in mine if r.manifest.step == step)]
        if whole:
            keep |= {r.key for r in mine if r.manifest.step == max(whole)}
        return keep

    def _tidy(self, run: str) -> None:
        """Forget what ``run``'s owners dropped and what is beyond their ``keep_last``
        (at least 2 steps of each rank), but never a protected copy."""
        keep = self._protected(run)
        by_rank: dict[int, list[Copy]] = {}
        for k, r in self._held.items():
            if k[0] == run:
                by_rank.setdefault(k[2], []).append(r)
        for copies in by_rank.values():
            copies.sort(key=lambda r: r.arrival, reverse=True)
            limit = max(copies[0].keep_last, 2) if copies[0].keep_last else len(copies)
            for i, r in enumerate(copies):
                if r.key not in keep and (r.dropped or i >= limit):
                    del self._held[r.key]
                    self.evicted += not r.dropped

    def _evictable(self) -> list[Copy]:
        """Copies that may go for room, in the order they go: dropped by their owner
        first, then the oldest; never a protected one."""
        keep = set().union(*(self._protected(run) for run in {k[0] for k in self._held}))
        return sorted((r for k, r in self._held.items() if k not in keep), key=lambda r: (not r.dropped, r.arrival))

    def _reserve(self, need: int) -> None:
        """Full unless ``need`` bytes fit beside the transfers under way and the copies
        no eviction may take; nothing is evicted here."""
        if need > self.budget:
            raise Full(f"a share of {need} bytes is larger than the whole [peer] memory budget ({self.budget})")
        used = self._used()
        if used + need <= self.budget:
            return
        reclaimable = sum(r.nbytes for r in self._evictable())
        if used - reclaimable + need > self.budget:
            raise Full(f"no room for a share of {need} bytes: {used - reclaimable} of {self.budget} bytes hold the "
                       "newest copy of each rank held here or transfers under way (a newest copy stays until a "
                       "newer one of its rank arrives: give [peer] memory room for two steps)")

    def _evict_over_budget(self) -> None:
        """Evict what may go, dropped copies first, then the oldest, until the held
        copies and transfers under way fit the budget."""
        over = self._used() - self.budget
        for r in self._evictable():
            if over <= 0:
                break
            del self._held[r.key]
            self.evicted += 1
            over -= r.nbytes

    def _used(self) -> int:
        return sum(r.nbytes for d in (self._held, self._incoming, self._verifying) for r in d.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for x in [x for x, r in self._incoming.items() if now - r.touched > self.stall]:
            r = self._incoming.pop(x)
            log.warning("gave up receiving run %r step %d rank %d: no part for %.0f s", *r.key, self.stall)

    def expire(self) -> None:
        with self._lock:
            self._expire()

    # -- serving ---------------------------------------------------------------------------
    def shares(self, run: str) -> list[Copy]:
        with self._lock:
            return [r for k, r in self._held.items() if k[0] == run]

    def get(self, key: Key) -> Copy | None:
        with self._lock:
            return self._held.get(key)

    def figures(self) -> dict[str, Any]:
        with self._lock:
            return {"held_bytes": sum(r.nbytes for r in self._held.values()), "held_shares": len(self._held),
                    "held_steps": len({(k[0], k[1]) for k in self._held}),
                    "held_ranks": len({(k[0], k[2]) for k in self._held}),
                    "receiving_bytes": sum(r.nbytes for d in (self._incoming, self._verifying) for r in d.values()),
                    "memory": self.budget, "evicted": self.evicted, "rejected": self.rejected,
                    "drop_requests": self.drop_requests, "cancelled": self.cancelled,
                    "evictable_shares": len(self._evictable())}


def _memory(n: int) -> Any:
    """``n`` bytes for a file being received: anonymous memory whose pages come as the
    parts are written (a bytearray would zero-fill every page first, under the
    holder's lock, before the first part could land)."""
    return mmap.mmap(-1, n) if n else bytearray()


def verify(m: Manifest, files: dict[str, Any], where: str) -> None:
    """Every tensor of ``m`` with a byte range against its checksum, in ``files``'
    bytes, and each chunk file's safetensors header against the manifest (the one
    part of a file no checksum covers); CheckpointCorrupt naming the first that does
    not match."""
    check_headers(m, files, where)
    for name, t in m.tensors.items():
        if t.offset is None:
            raise CheckpointCorrupt(f"{where}: tensor {name!r} is a chunked (compressed) HDF5 dataset, "
                                    "whose bytes the peer tier cannot check: no copy of it is made")
        view = memoryview(files[t.file])[t.offset:t.offset + t.nbytes]
        if checksum([view] if t.nbytes else []) != t.checksum:
            raise CheckpointCorrupt(f"{where}: run {m.run!r} step {m.step} rank {m.rank}: tensor {name!r} "
                                    "does not match its checksum")


def check_headers(m: Manifest, files: dict[str, Any], where: str) -> None:
    """Each chunk file's safetensors header in ``files`` against the manifest."""
    for file, buf in files.items():
        if layout.CHUNK.fullmatch(file):
            _check_header(m, file, memoryview(buf), where)


def _check_header(m: Manifest, file: str, buf: memoryview, where: str) -> None:
    """The safetensors header of chunk file ``file`` says what the manifest says of
    each of its tensors (as ``ckptd.reader`` checks a file on disk with verify=True)."""
    def bad(what: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{where}: {file}: {what}")

    n = int.from_bytes(buf[:8], "little") if len(buf) >= 8 else -1
    if not 0 <= n <= len(buf) - 8:
        raise bad("its safetensors header length is damaged")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (ValueError, RecursionError):
        raise bad("its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("its safetensors header is not a JSON object")
    for name, t in m.tensors.items():
        if t.file != file or t.offset is None or t.key == "__metadata__":
            continue
        info = dtypes.lookup(t.dtype)
        begin = t.offset - 8 - n
        want = {"dtype": info.st_code, "shape": info.stored_shape(t.shape), "data_offsets": [begin, begin + t.nbytes]}
        entry = header.get(t.key)
        if not isinstance(entry, dict) or {k: entry.get(k) for k in want} != want:
            raise bad(f"its safetensors header does not describe tensor {name!r} as the manifest does")
