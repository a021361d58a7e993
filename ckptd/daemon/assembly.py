"""Assembling one rank's share of a step from ``tensor`` messages (``OpenStep``).

Small tensors gather into a chunk that goes to the writer whole at ``chunk_size``; a
larger tensor, or one in pieces, gets a file of its own, written as it arrives.
Buffers are handed on as they came (frames, or views of a producer's arena): nothing
here copies tensor bytes. An inconsistent declaration is a ``StepError`` that fails
this step only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .. import dtypes, replicas
from ..errors import StepError
from ..format import Entry
from ..manifest import TIERS, Shard
from ..names import check_name
from .share import Declared, Share, Stream
from .writer import Writer


@dataclass(eq=False)
class Partial:
    """The tensor whose pieces are arriving; a producer sends one tensor at a time."""

    entry: Entry
    received: int = 0
    stream: Stream | None = None
    held: int = 0
    seqs: list[int] = field(default_factory=list)
    frozen: bool = False
    whole: bool = False


@dataclass(eq=False)
class OpenStep:
    share: Share
    writer: Writer
    chunk_size: int
    names: set[str] = field(default_factory=set)
    complete: int = 0
    partial: Partial | None = None
    chunk: list[Entry] = field(default_factory=list)
    chunk_bytes: int = 0
    chunk_held: int = 0
    chunk_seqs: list[int] = field(default_factory=list)
    chunk_frozen: bool = False
    received_bytes: int = 0

    @property
    def gathered(self) -> int:
        """Bytes received and not yet handed to the writer."""
        partial = self.partial
        return self.chunk_bytes + (partial.received if partial is not None and partial.stream is None else 0)

    def add_piece(self, h: dict[str, Any], data: memoryview, shared_seq: int | None = None) -> int:
        """Take bytes ``[start, start+len(data))`` of tensor ``name``; return how many
        bytes the daemon now holds in its own memory (until the writer reports them
        freed). ``shared_seq``: the piece is a view of shared memory, sent under it."""
        n, name, start = len(data), h["name"], h["start"]
        partial = self.partial if start else self._start_tensor(h, n)
        if partial is None or partial.entry.name != name or partial.received != start:
            raise StepError(f"piece of tensor {name!r} at byte {start} arrived out of order")
        entry = partial.entry
        if partial.received + n > entry.nbytes or (n == 0 and entry.nbytes > 0):
            raise StepError(
                f"tensor {name!r}: a piece of {n} bytes at byte {start} does not fit "
                f"the declared {entry.nbytes} bytes"
            )
        partial.received += n
        self.received_bytes += n
        last = partial.received == entry.nbytes
        held = 0 if shared_seq is not None else n
        seqs = [] if shared_seq is None else [shared_seq]
        if partial.stream is not None:
            self.writer.stream_piece(partial.stream, data, last, held, seqs)
        elif n:
            entry.buffers.append(data)
            partial.held += held
            partial.seqs += seqs
        if last:
            self._finish_tensor(partial)
        return held

    def _start_tensor(self, h: dict[str, Any], first: int) -> Partial:
        name = h["name"]
        if self.partial is not None:
            raise StepError(f"tensor {name!r} started before tensor {self.partial.entry.name!r} was complete")
        try:
            check_name(name)
            dtype = dtypes.lookup(h["dtype"])
        except (ValueError, TypeError) as exc:
            raise StepError(str(exc)) from None
        if name in self.names:
            raise StepError(f"tensor name {name!r} appears twice in step {self.share.step}")
        expected = math.prod(h["shape"]) * dtype.itemsize
        if expected != h["nbytes"]:  # a declared size is never trusted
            raise StepError(
                f"tensor {name!r}: shape {h['shape']} of {dtype.name} is {expected} bytes, "
                f"but the message declares {h['nbytes']}"
            )
        try:
            shard = None if h["shard"] is None else Shard.parse(h["shard"], h["shape"])
        except ValueError as exc:
            raise StepError(f"tensor {name!r}: {exc}") from None
        partial = self.partial = Partial(Entry(name, dtype, h["shape"], h["nbytes"], [], numpy=h["numpy"],
                                               shard=shard), frozen=bool(h["frozen"]))
        self.names.add(name)
        # A tensor in pieces is written as it arrives: held whole, its pieces could fill
        # memory_budget, and the daemon, no longer reading, never gets the last ones.
        if partial.entry.nbytes >= self.chunk_size or first < partial.entry.nbytes:
            self.flush()
            if first == partial.entry.nbytes and self.writer.splits(self.share):
                partial.whole = True  # in one piece: written in pieces side by side, not streamed
            else:
                partial.stream = self.writer.open_stream(self.share, partial.entry)
        return partial

    def add_same(self, h: dict[str, Any]) -> None:
        """Tensors of this step that the producer declared unchanged since step
        ``base`` (``save(frozen=...)``): no bytes, only what they are; the writer refers
        to that step's stored copies (daemon.reuse)."""
        base = h["base"]
        if base >= self.share.step:
            raise StepError(f"frozen tensors of step {self.share.step} refer to step {base}, which is not earlier")
        entries = []
        for name, dtype_name, shape, numpy, shard in h["items"]:
            try:
                check_name(name)
                dtype = dtypes.lookup(dtype_name)
                parsed = None if shard is None else Shard.parse(shard, shape)
            except (ValueError, TypeError) as exc:
                raise StepError(f"frozen tensor {name!r}: {exc}") from None
            if name in self.names:
                raise StepError(f"tensor name {name!r} appears twice in step {self.share.step}")
            self.names.add(name)
            self.complete += 1
            entries.append(Entry(name, dtype, shape, math.prod(shape) * dtype.itemsize, [], numpy=numpy,
                                 shard=parsed))
        if entries:
            self.writer.link_same(self.share, base, entries)

    def _finish_tensor(self, partial: Partial) -> None:
        self.partial = None
        self.complete += 1
        if partial.whole:
            self.writer.write_whole(self.share, partial.entry, partial.held, partial.seqs)
        elif partial.stream is None:
            if partial.frozen != self.chunk_frozen:
                self.flush()
                self.chunk_frozen = partial.frozen
            self.chunk.append(partial.entry)
            self.chunk_bytes += partial.entry.nbytes
            self.chunk_held += partial.held
            self.chunk_seqs += partial.seqs
            if self.chunk_bytes >= self.chunk_size:
                self.flush()

    def flush(self) -> None:
        """Hand the gathered chunk to the writer (it frees, not writes, a failed share's)."""
        if self.chunk:
            self.writer.write_chunk(self.share, self.chunk, self.chunk_held, self.chunk_seqs)
            self.chunk, self.chunk_bytes, self.chunk_held, self.chunk_seqs = [], 0, 0, []

    def release_partial(self) -> tuple[int, list[int]]:
        """Let go of a half-received tensor of a failed step (its own file is closed by
        the writer); return the bytes dropped here, which the caller no longer holds,
        and the shared pieces it no longer uses."""
        partial, self.partial = self.partial, None
        if partial is None:
            return 0, []
        if partial.stream is not None:
            self.writer.stream_piece(partial.stream, b"", True, 0, [])
            return 0, []
        partial.entry.buffers.clear()
        return partial.held, partial.seqs

    def check_commit(self, h: dict[str, Any]) -> None:
        """A commit closes a step only if it is whole: every tensor the producer counts."""
        if self.share.error is not None:
            raise StepError(self.share.error)
        if self.partial is not None:
            raise StepError(f"commit arrived while tensor {self.partial.entry.name!r} was incomplete")
        if self.complete != h["ntensors"]:
            raise StepError(
                f"commit of step {h['step']} declares {h['ntensors']} tensors, "
                f"but the daemon received {self.complete}"
            )
        digests, compare = _digests(h["digests"] or {}, h["compare"])
        self.share.declared = Declared(self._written_by(h["replicas"] or {}), digests, compare, _due(h["tiers"]))

    def _written_by(self, written_by: dict[Any, Any]) -> dict[str, int]:
        """The commit's ``replicas`` field: tensors of the state that another rank writes."""
        share = self.share
        for name, writer in written_by.items():
            try:
                check_name(name)
            except ValueError as exc:
                raise StepError(f"replicas: {exc}") from None
            if name in self.names:
                raise StepError(f"replicas: tensor {name!r} was also sent by this rank")
            if isinstance(writer, bool) or not isinstance(writer, int) or not 0 <= writer < share.id.world_size \
                    or writer == share.rank:
                raise StepError(f"replicas: tensor {name!r} names writer rank {writer!r}, not another rank "
                                f"of 0..{share.id.world_size - 1}")
        return dict(written_by)


def _due(names: list[str] | None) -> tuple[str, ...] | None:
    """The commit's ``tiers``: the tier names its step is due for, each one ckptd knows."""
    if names is None:
        return None
    unknown = [n for n in names if n not in TIERS]
    if unknown:
        raise StepError(f"tiers: {unknown!r} are not tier names; a commit names some of {', '.join(TIERS)}")
    return tuple(dict.fromkeys(names))


def _digests(digests: dict[Any, Any], policy: Any) -> tuple[dict[str, str], str | None]:
    """The commit's replica digests and compare_replicas policy (ckptd.replicas), checked
    as the manifest's parser will read them back."""
    for key, value in digests.items():
        function, _, hexdigits = value.partition(":") if isinstance(value, str) else ("", "", "")
        if not isinstance(key, str) or not 0 < len(key) <= 4096 or function not in replicas.FUNCTIONS \
                or len(hexdigits) != 16 or hexdigits.strip("0123456789abcdef"):
            raise StepError(f"digests: {key!r}: {value!r} is not <{' or '.join(replicas.FUNCTIONS)}>:<16 hex digits>")
    if policy is not None and policy not in replicas.POLICIES:
        raise StepError(f"compare {policy!r} is not one of {', '.join(replicas.POLICIES)}")
    return dict(digests), (policy if digests else None)
