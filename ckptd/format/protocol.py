"""What a storage format is: the small protocol that the daemon's writer and the
reader meet, so that neither knows which format a share is in (docs/format.md).

A format has a **write side**, called on the writer thread it names (``thread``)
with the writer's services (``WriteIO``): write a batch of tensors, open a streamed
tensor and write it piece by piece, refer to an unchanged record of an earlier step
(link or copy it), and finish the share's files before its commit or discard. Its
**read side** opens one data file of a step (``DataReader``): check a record against
the file's own structure, and read a record that has no byte offset. A record with
an offset is read by the reader itself, the same way for every format (``preadv``
or a mapping), which is what keeps reads zero-copy.

The formats are ``ckptd.format.chunk`` (safetensors chunk files) and
``ckptd.format.hdf5``; ``ckptd.format.get`` finds one by name, ``for_file`` by a
data file's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import Hdf5Config
    from ..dtypes import Dtype
    from ..daemon.share import Share, Stream
    from ..manifest import TensorRecord


@dataclass
class Entry:
    """One tensor as a writer sees it: a name, a type and its bytes."""

    name: str
    dtype: Dtype
    shape: list[int]
    nbytes: int
    buffers: list[Any]  # bytes-like pieces, in order, adding up to nbytes
    numpy: bool = False  # emitted as a numpy array
    shard: Any = None  # a manifest.Shard: the piece of a larger tensor this is


@dataclass(eq=False)
class Ref:
    """A tensor of a share that refers to a record stored already, in an earlier step
    (``base``, a ``ckptd.daemon.reuse.Base``): placed in the share's folder at commit."""

    name: str
    base: Any
    record: TensorRecord  # the base's
    ident: tuple[int, int]  # (device, inode) of the base's file that holds it (Base.check)


class DataFile(Protocol):
    """A new data file being written (``ckptd.daemon.datafile.DataFile``)."""

    def write(self, buffers: list[Any]) -> None: ...

    def finish(self) -> int: ...

    def close(self) -> None: ...


class WriteIO(Protocol):
    """What a format's write side asks of the daemon's writer (``ckptd.daemon.writer``)."""

    direct_io: bool  # O_DIRECT where the filesystem takes it
    fsync: bool  # files are fsynced before the commit ([daemon] fsync)
    hdf5_options: Hdf5Config

    def ensure_dir(self, share: Share) -> None: ...

    def create(self, share: Share, name: str, *, listed: bool = False) -> DataFile:
        """A new data file ``name`` of ``share`` (``listed``: in ``share.files`` already)."""

    def recognise(self, share: Share, entries: list[Entry], digests: dict[str, str]) -> list[Entry]:
        """Refer to the stored copy of each entry unchanged since the share's base; the others."""

    def throttled(self, nbytes: int) -> None: ...

    def sync(self, share: Share, name: str, fd: int) -> None:
        """Queue descriptor ``fd`` of file ``name`` for fsync (and close) before the commit."""

    def fail(self, share: Share, what: str, exc: OSError) -> None: ...


class DataReader(Protocol):
    """One data file of a step, opened for reading (``Format.open``). Its errors are
    ``CheckpointCorrupt`` saying what is wrong; the reader adds the file and tensor."""

    def check(self, name: str, rec: TensorRecord) -> None:
        """The file's own structure agrees with the record (what a reader without ckptd sees)."""

    def read_into(self, name: str, rec: TensorRecord, out: Any) -> None:
        """Read a record that has no byte offset into ``out`` (a uint8 numpy array of its
        size), once ``check`` passed (the caller allocates ``out`` only then)."""

    def close(self) -> None: ...


class Format(Protocol):
    """A storage format: one module of ``ckptd.format`` holds one."""

    name: str  # as manifests and ``[daemon] format`` name it
    thread: str  # the writer thread its shares are written on
    parallel: bool  # each batch is a file of its own: a pool may write several at once

    # -- names and records ------------------------------------------------------------------
    def owns(self, file: str) -> bool:
        """``file`` (a data file name) is one of this format's."""

    def record_problem(self, name: str, key: str, offset: int | None) -> str | None:
        """What is wrong with a manifest record of this format (its key, its offset), or None."""

    def next_file(self, share: Share) -> str:
        """On the main loop: the file the share's next batch or streamed tensor goes into."""

    def link_name(self, share: Share, base_step: int, file: str) -> str:
        """The name, in the share's folder, of data file ``file`` of step ``base_step``
        when it is linked there (unchanged tensors)."""

    # -- the write side, on ``thread`` ------------------------------------------------------
    def write_batch(self, io: WriteIO, share: Share, name: str, entries: list[Entry], digests: dict[str, str],
                    *, listed: bool = False) -> int | None:
        """Write ``entries`` (checksums ``digests``) into file ``name``; a descriptor to fsync
        and close, or None (nothing to sync now, or failed: ``share.error`` says)."""

    def open_stream(self, io: WriteIO, stream: Stream) -> bool:
        """Start a tensor that arrives in pieces; False if that failed (``share.error`` says)."""

    def stream_piece(self, io: WriteIO, stream: Stream, piece: Any, last: bool) -> None: ...

    def refer(self, io: WriteIO, share: Share, base: Any, name: str, old: TensorRecord, received: bool) -> None:
        """Tensor ``name`` is ``old``, stored in ``base``: link or copy it, now or at commit
        (``share.refs``)."""

    def place(self, io: WriteIO, share: Share, refs: list[Ref]) -> tuple[dict[str, TensorRecord], int, int]:
        """At the commit, on the syncer, before the manifest: the references ``refer``
        left for it, put in the share's folder (linked or copied); their records, the
        bytes linked and the bytes copied. Raises OSError naming what failed."""

    def close(self, io: WriteIO, share: Share) -> None:
        """Before a commit or discard: finish the share's open file (queued for fsync); a
        failed share's file is only let go of."""

    # -- the read side ---------------------------------------------------------------------
    def open(self, fd: int, size: int) -> DataReader:
        """A reader of the data file open as ``fd`` (``size`` bytes; the caller closes ``fd``)."""
