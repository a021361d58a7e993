"""What a storage format is: the protocol (``Format``) that the daemon's writer and the
reader meet, so that neither knows which format a share is in.

Its write side runs on the writer thread it names, with the writer's services
(``WriteIO``): write tensors, stream one in pieces, refer to an earlier step's record,
finish the files. Its read side (``DataReader``) checks a record against a data file
and reads one with no byte offset; a record with an offset the reader reads itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:
    from ..dtypes import Dtype
    from ..records import TensorRecord


class Hdf5Options(Protocol):
    """How HDF5 files are written: ``config.Hdf5Config`` (``[hdf5]``)."""

    @property
    def compression(self) -> str: ...

    @property
    def level(self) -> int: ...

    @property
    def chunk_shape(self) -> str: ...

    @property
    def fletcher32(self) -> bool: ...


@dataclass
class Entry:
    """One tensor as a writer sees it: a name, a type and its bytes.

    ``buffers``: bytes-like pieces, in order, adding up to nbytes
    ``numpy``: emitted as a numpy array
    ``shard``: a manifest.Shard: the piece of a larger tensor this is"""

    name: str
    dtype: Dtype
    shape: list[int]
    nbytes: int
    buffers: list[Any]
    numpy: bool = False
    shard: Any = None


class Stored(Protocol):
    """A share stored already, in an earlier step, as a format reads it (the writer's
    ``reuse.Base``): its folder, and its data files opened or checked by name."""

    path: Path
    step: int

    def check(self, file: str) -> tuple[int, int]:
        """The (device, inode) of data file ``file``, which is there as its manifest says; else OSError."""

    def open(self, file: str) -> int:
        """Data file ``file`` opened for reading, never through a symlink (the caller closes it)."""


@dataclass(eq=False)
class Ref:
    """A tensor of a share that refers to a record stored already, in an earlier step
    (``base``): placed in the share's folder at commit (``Format.place``).

    ``record``: the base's
    ``ident``: (device, inode) of the base's file that holds it (Stored.check)"""

    name: str
    base: Stored
    record: TensorRecord
    ident: tuple[int, int]


@dataclass
class Written:
    """What a batch left: each tensor written and where in the file (its key, its byte
    offset or None), from which the writer makes the manifest's records; and a descriptor
    of the file to fsync and close before the commit (None: nothing to sync now)."""

    placed: list[tuple[Entry, str, int | None]]
    fd: int | None = None


class DataFile(Protocol):
    """A new data file being written (``WriteIO.create``'s: O_DIRECT where it can be)."""

    def write(self, buffers: list[Any]) -> None: ...

    def finish(self) -> int: ...

    def close(self) -> None: ...


class PieceFile(Protocol):
    """A new data file written at offsets, from several threads at once (``WriteIO.create_pieces``)."""

    def write_at(self, buf: Any, offset: int) -> None: ...

    def finish(self) -> int: ...

    def close(self) -> None: ...


class WriteIO(Protocol):
    """Where one share is written, and what a format's write side asks of the daemon's
    writer for it. The writer makes one for each call: a format keeps nothing of it
    between calls but ``kept``, and never sees the daemon's own objects.

    ``chunk_size``: ``[daemon] chunk_size``: the most a file of copied tensors holds
    ``direct_io``: O_DIRECT where the filesystem takes it
    ``fsync``: files are fsynced before the commit ([daemon] fsync)
    ``kept``: what the format keeps open between calls for this share (None at first)"""

    run: str
    step: int
    rank: int
    chunk_size: int
    direct_io: bool
    fsync: bool
    kept: Any

    @property
    def hdf5_options(self) -> Hdf5Options:
        """``[hdf5]``: how HDF5 files are written."""

    @property
    def dir(self) -> Path:
        """The step folder, as messages name it."""

    @property
    def failed(self) -> bool:
        """The share failed already (its error is set): nothing more is written."""

    def at(self, name: str) -> str:
        """A path to file ``name`` of the step folder that resolves through the folder's open
        descriptor (docs/reliability.md); h5py takes it too."""

    def next_seq(self) -> int:
        """The share's next data-file sequence number (thread-safe)."""

    def ensure_dir(self) -> None: ...

    def create(self, name: str, *, listed: bool = False) -> DataFile:
        """A new data file ``name`` (``listed``: the writer listed it already)."""

    def create_pieces(self, name: str) -> PieceFile:
        """A new data file of the share (listed, its folder made) written at offsets."""

    def create_plain(self, name: str) -> int:
        """A new file ``name``, listed as the share's (a failed step removes it), opened for
        writing without O_DIRECT and never through a symlink; the caller closes it."""

    def listed(self, name: str) -> None:
        """File ``name`` (made by the format itself, through ``at``) is the share's now."""

    def link(self, base: Stored, file: str) -> str:
        """Data file ``file`` of ``base`` linked (or copied) into the step folder, once per
        share; its name there. Raises OSError naming what failed."""

    def recognise(self, entries: list[Entry], digests: Mapping[str, str]) -> list[Entry]:
        """Refer to the stored copy of each entry unchanged since the share's base; the others."""

    def submit(self, fn: Callable[..., None], *args: Any) -> Future:
        """``fn(*args)`` on the writer's pool (at once on this thread where it has none); the
        format waits for it before the buffers it writes are let go of."""

    def throttled(self, nbytes: int) -> None: ...

    def sync(self, name: str, fd: int) -> None:
        """Queue descriptor ``fd`` of file ``name`` for fsync (and close) before the commit."""

    def fail(self, what: str, exc: OSError) -> None: ...


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
    """A storage format: one module of ``ckptd.format`` holds one.

    ``name``: as manifests and ``[daemon] format`` name it
    ``thread``: the writer thread its shares are written on
    ``parallel``: each batch is a file of its own: a pool may write several at once"""

    name: str
    thread: str
    parallel: bool

    def owns(self, file: str) -> bool:
        """``file`` (a data file name) is one of this format's."""

    def record_problem(self, name: str, key: str, offset: int | None) -> str | None:
        """What is wrong with a manifest record of this format (its key, its offset), or None."""

    def next_file(self, io: WriteIO) -> str:
        """On the main loop: the file the share's next batch or streamed tensor goes into."""

    def link_name(self, io: WriteIO, base_step: int, file: str) -> str:
        """The name, in the share's folder, of data file ``file`` of step ``base_step``
        when it is linked there (unchanged tensors)."""

    def write_batch(self, io: WriteIO, name: str, entries: list[Entry], digests: Mapping[str, str],
                    *, listed: bool = False) -> Written:
        """Write ``entries`` (checksums ``digests``, each waited for when read) into file
        ``name``; what was written (nothing where it failed: ``io.fail`` was told)."""

    def open_stream(self, io: WriteIO, entry: Entry, file: str) -> Any:
        """Start a tensor that arrives in pieces, in file ``file``: what ``stream_piece``
        writes to; None if that failed (``io.fail`` was told)."""

    def split(self, io: WriteIO, entry: Entry, file: str) -> tuple[PieceFile, str, int] | None:
        """Start a tensor that arrived whole, in file ``file``, whose bytes the writer then
        writes in pieces side by side (``parallel`` formats): the file, the tensor's key and
        the offset of its bytes; None if that failed (``io.fail`` was told)."""

    def stream_piece(self, io: WriteIO, out: Any, piece: Any, last: bool) -> tuple[str, int | None] | None:
        """Write the next piece of the streamed tensor (``out``: ``open_stream``'s); after the
        ``last``, where the tensor is (its key and offset). Raises OSError."""

    def drop_stream(self, out: Any) -> None:
        """Let go of a streamed tensor that will not be finished (its share failed)."""

    def refer(self, io: WriteIO, base: Stored, name: str, old: TensorRecord) -> Ref | TensorRecord:
        """Tensor ``name`` is ``old``, stored in ``base``: its record in the share now (linked
        at once), or a ``Ref`` that ``place`` puts in the share's folder at the commit.
        Raises OSError."""

    def place(self, io: WriteIO, refs: list[Ref]) -> tuple[dict[str, TensorRecord], int, int]:
        """At the commit, on the syncer, before the manifest: the references ``refer``
        left for it, put in the share's folder (linked or copied); their records, the
        bytes linked and the bytes copied. Raises OSError naming what failed."""

    def close(self, io: WriteIO) -> None:
        """Before a commit or discard: finish the share's open file (queued for fsync); a
        failed share's file is only let go of."""

    def open(self, fd: int, size: int) -> DataReader:
        """A reader of the data file open as ``fd`` (``size`` bytes; the caller closes ``fd``)."""
