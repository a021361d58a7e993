"""The HDF5 format, both sides: one plain HDF5 (1.8) file per rank and step, one dataset
per tensor in the root group, named by the tensor name (``%`` and ``/`` escaped) with
the exact name and torch dtype in attributes. Contiguous datasets are written with
``pwritev`` at offsets known when they are created, chunked ones through h5py; an
unchanged tensor is an external link into the earlier step's linked file (``refer``).

The only module that imports h5py, and only once a file is written or read. Start at
``Hdf5Format``; its errors become ``OSError`` (writing) or ``CheckpointCorrupt`` (reading).
"""

from __future__ import annotations

import errno
import functools
import math
import os
import re
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Mapping, Sequence

from .. import dtypes, failpoints, layout
from ..dtypes import Dtype
from ..errors import CheckpointCorrupt
from .fileio import buffer_address
from .protocol import Entry, Hdf5Options, Ref, Stored, WriteIO, Written

if TYPE_CHECKING:
    import numpy as np

    from ..records import TensorRecord

ATTR_NAME = "name"
ATTR_DTYPE = "torch_dtype"
_ALIGN_THRESHOLD = 64 * 2**10  # datasets this large start on a page boundary, like chunk files' data
_ALIGN = 4096
_LIBVER = ("v108", "v108")  # readable by HDF5 >= 1.8 (Debian's h5dump, HDFView); large attributes
_H5PY_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError)
_ESCAPE = re.compile("%(25|2F)")


def dataset_key(name: str) -> str:
    """The link name of tensor ``name`` in the root group (injective: see ``tensor_name``)."""
    key = name.replace("%", "%25").replace("/", "%2F")
    return "%2E" if key == "." else key


def tensor_name(key: str) -> str:
    """The inverse of ``dataset_key``."""
    if key == "%2E":
        return "."
    return _ESCAPE.sub(lambda m: "%" if m.group(1) == "25" else "/", key)


def stored_dtype(dtype: Dtype) -> np.dtype:
    """The numpy dtype a dataset of ``dtype`` holds: its own, or same-width unsigned."""
    import numpy as np

    return np.dtype(dtype.numpy) if dtype.numpy else np.dtype(f"<u{dtype.itemsize}")


@dataclass(eq=False)
class Slot:
    """One tensor's dataset, being written; its bytes arrive in order through ``write``.

    ``offset``: absolute file offset of the data; None if chunked or empty
    ``rows``: for a chunked dataset: h5py writes whole rows"""

    key: str
    offset: int | None
    nbytes: int
    written: int = 0
    rows: _Rows | None = None


class H5Writer:
    """Writes one HDF5 file. Not thread-safe; every call comes from one thread.

    ``create`` the file, ``add`` a dataset per tensor and ``write`` its bytes, then
    ``close``, which returns a descriptor of the file for the caller to fsync
    and close.
    """

    def __init__(self, path: Path, options: Hdf5Options, attrs: dict[str, Any] | None = None,
                 shown: Path | None = None, direct: bool = False) -> None:
        import h5py

        self.path = path
        self.shown = shown or path
        self.options = options
        self._file: Any = None
        self._fd = -1
        self._dfd = -1
        self._direct = False
        try:
            path.unlink(missing_ok=True)
            self._file = h5py.File(path, "x", libver=_LIBVER, locking="best-effort", track_order=False,
                                   alignment_threshold=_ALIGN_THRESHOLD, alignment_interval=_ALIGN)
            for key, value in (attrs or {}).items():
                self._file.attrs[key] = value
            self._fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self._dfd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT)
                    self._direct = True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
        except _H5PY_ERRORS as exc:
            self.abort()
            raise _os_error(f"cannot create {self.shown}", exc) from None
        self._lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        self._lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)

    def add(self, name: str, dtype: Dtype, shape: Sequence[int]) -> Slot:
        """Create the dataset of tensor ``name``; its bytes follow through ``write``."""
        import h5py

        key, shape = dataset_key(name), tuple(shape)
        stored = stored_dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        chunked = self.options.chunk_shape == "auto" and len(shape) > 0 and nbytes > 0
        try:
            if chunked:
                ds = self._file.create_dataset(key, shape=shape, dtype=stored, **self._filters())
                entry = Slot(key, None, nbytes, rows=_Rows(ds, stored, shape))
            else:
                ds = h5py.Dataset(self._contiguous(key, stored, shape))
                entry = Slot(key, ds.id.get_offset(), nbytes)
            ds.attrs[ATTR_NAME] = name
            ds.attrs[ATTR_DTYPE] = dtype.name
        except _H5PY_ERRORS as exc:
            raise _os_error(f"cannot create dataset {key!r} in {self.shown}", exc) from None
        return entry

    def link_external(self, key: str, file: str) -> None:
        """Make dataset ``key`` of ``file`` (an HDF5 file in the same folder, linked there
        from an earlier step: ``Hdf5Format.refer``) visible in this one as an external link, so
        that plain h5py, opening this file, sees every tensor of the share. HDF5 looks
        for a relative target beside the file that links to it."""
        try:
            self._file.id.links.create_external(key.encode("utf-8"), file.encode("utf-8"),
                                                ("/" + key).encode("utf-8"), lcpl=self._lcpl)
        except _H5PY_ERRORS as exc:
            raise _os_error(f"cannot link dataset {key!r} of {file} into {self.shown}", exc) from None

    def write(self, ds: Slot, buffers: Sequence[Any]) -> None:
        """Write the next bytes of ``ds`` (``buffers`` in order)."""
        n = sum(len(memoryview(b).cast("B")) for b in buffers)
        if ds.written + n > ds.nbytes:
            raise ValueError(f"dataset {ds.key!r} holds {ds.nbytes} bytes; {ds.written + n} were written")
        if ds.rows is not None:
            try:
                for b in buffers:
                    ds.rows.write(memoryview(b).cast("B"))
            except _H5PY_ERRORS as exc:
                raise _os_error(f"cannot write dataset {ds.key!r} of {self.shown}", exc) from None
        elif n:
            assert ds.offset is not None
            failpoints.hit("writer.hdf5_data")
            at = ds.offset + ds.written
            for b in buffers:
                at = self._pwrite(memoryview(b).cast("B"), at)
        ds.written += n

    def _pwrite(self, view: memoryview, at: int) -> int:
        """Write ``view`` at file offset ``at``: whole pages from a page-aligned address
        at a page-aligned offset with O_DIRECT, the rest buffered; the offset after it.
        O_DIRECT refused, ``_dfd`` stays open until ``close``: a write beside this one may use it."""
        if self._direct and at % _ALIGN == 0 and len(view) >= _ALIGN and buffer_address(view) % _ALIGN == 0:
            whole = len(view) - len(view) % _ALIGN
            try:
                done = _pwrite_all(self._dfd, view[:whole], at)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False
                done = 0
            at, view = at + done, view[done:]
        return at + _pwrite_all(self._fd, view, at)

    def close(self) -> int:
        """Write HDF5's metadata and close the file; return a descriptor of it, which the
        caller fsyncs (that covers h5py's writes too) and closes."""
        try:
            self._file.close()
        except _H5PY_ERRORS as exc:
            self.abort()
            raise _os_error(f"cannot finish {self.shown}", exc) from None
        self._file = None
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1
        fd, self._fd = self._fd, -1
        return fd

    def abort(self) -> None:
        """Let go of the file as it is (the caller removes it)."""
        if self._file is not None:
            try:
                self._file.close()
            except _H5PY_ERRORS:
                pass
            self._file = None
        for attr in ("_fd", "_dfd"):
            if getattr(self, attr) >= 0:
                os.close(getattr(self, attr))
                setattr(self, attr, -1)

    def _contiguous(self, key: str, stored: np.dtype, shape: tuple[int, ...]) -> Any:
        """A contiguous dataset whose space is allocated now and never filled: its offset
        is final, and HDF5 never writes to it."""
        import h5py

        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
        tid = h5py.h5t.py_create(stored, logical=True)
        return h5py.h5d.create(self._file.id, key.encode("utf-8"), tid, space, dcpl=dcpl, lcpl=self._lcpl)

    def _filters(self) -> dict[str, Any]:
        o = self.options
        kw: dict[str, Any] = {"chunks": True, "fletcher32": o.fletcher32, "track_times": False}
        if o.compression == "gzip":
            kw.update(compression="gzip", compression_opts=o.level)
        elif o.compression == "lzf":
            kw["compression"] = "lzf"
        return kw


@dataclass(eq=False)
class _Rows:
    """Feeds a chunked dataset whole rows (slices of its first dimension) from bytes
    that arrive in pieces of any size; only a row split between pieces is copied.

    ``done``: rows written"""

    ds: Any
    dtype: np.dtype
    shape: tuple[int, ...]
    done: int = 0
    carry: bytearray = field(default_factory=bytearray)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def write(self, view: memoryview) -> None:
        size = self.row_bytes
        if self.carry:
            take = min(len(view), size - len(self.carry))
            self.carry += view[:take]
            view = view[take:]
            if len(self.carry) == size:
                self._put(memoryview(self.carry))
                self.carry = bytearray()
        whole = len(view) // size * size
        if whole:
            self._put(view[:whole])
        if whole < len(view):
            self.carry += view[whole:]

    def _put(self, view: memoryview) -> None:
        import numpy as np

        n = len(view) // self.row_bytes
        rows = np.frombuffer(view, dtype=self.dtype).reshape((n, *self.shape[1:]))
        self.ds[self.done:self.done + n] = rows
        self.done += n


def _pwrite_all(fd: int, view: memoryview, at: int) -> int:
    """``os.pwrite`` until all of ``view`` is written (in pieces of at most 64 MiB)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + 64 * 2**20], at + done)
    return done


def _os_error(what: str, exc: BaseException) -> OSError:
    if isinstance(exc, OSError) and exc.strerror:
        return OSError(exc.errno, f"{what}: {exc.strerror}")
    return OSError(f"{what}: {exc}")


# a file read is untrusted: only the storage and filters the writer itself makes are accepted
_EXPANSION = 1032  # the most that deflate expands (lzf: about 90); shuffle and fletcher32 do not


@functools.cache
def _safe_filters() -> frozenset[int]:
    import h5py

    return frozenset({h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32,
                      h5py.h5z.FILTER_LZF})


@functools.cache
def _layouts() -> dict[int, str]:
    import h5py

    return {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.COMPACT: "compact", h5py.h5d.CHUNKED: "chunked"}


def open_file(source: Path | BinaryIO) -> Any:
    """Open an HDF5 file for reading: a path, or a file object (an already opened,
    already checked file; h5py then reads only through it). The caller closes it."""
    import h5py

    if isinstance(source, Path):
        return h5py.File(source, "r", locking="best-effort")
    return h5py.File(source, "r")


def find_dataset(file: Any, key: str, dtype: Dtype, shape: Sequence[int], offset: int | None) -> Any:
    """Dataset ``key`` of the root group, checked against the manifest before anything
    is allocated by its size: ``KeyError`` if it is missing, ``ValueError`` saying
    what is wrong if it is not a plain dataset of this file with the manifest's type
    and shape (and, where the manifest has one, offset)."""
    import h5py

    layouts, safe = _layouts(), _safe_filters()
    link = file.get(key, getlink=True)
    if link is None:
        raise KeyError(key)
    if not isinstance(link, h5py.HardLink):
        raise ValueError(f"{key!r} is a link elsewhere (h5py.{type(link).__name__}), not a dataset of this file")
    ds = file[key]
    if not isinstance(ds, h5py.Dataset):
        raise ValueError(f"{key!r} is a {type(ds).__name__}, not a dataset")
    stored = stored_dtype(dtype)
    if tuple(ds.shape) != tuple(shape) or ds.dtype != stored:
        raise ValueError(f"dataset {key!r} is {ds.dtype}{list(ds.shape)}, not {stored} "
                         f"({dtype.name}){list(shape)} as the manifest says")
    plist = ds.id.get_create_plist()
    storage = plist.get_layout()
    if storage not in layouts or plist.get_external_count():
        raise ValueError(f"dataset {key!r} keeps its data outside this file (external or virtual "
                         "storage), which ckptd never writes and never reads")
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    unknown = [f for f in filters if f not in safe]
    if unknown:
        raise ValueError(f"dataset {key!r} uses HDF5 filter(s) {unknown}, which ckptd does not write")
    nbytes = math.prod(shape) * dtype.itemsize
    if storage == h5py.h5d.CHUNKED and nbytes:
        limit = ds.id.get_storage_size() * (_EXPANSION if filters else 1)
        chunk = math.prod(ds.chunks) * stored.itemsize
        if nbytes > limit or chunk > nbytes:
            raise ValueError(f"dataset {key!r} declares {nbytes} bytes (chunks of {chunk}) but stores "
                             f"{ds.id.get_storage_size()}: not a file that ckptd wrote")
    if offset is not None and (storage != h5py.h5d.CONTIGUOUS or ds.id.get_offset() != offset):
        where = ds.id.get_offset() if storage == h5py.h5d.CONTIGUOUS else f"{layouts[storage]} storage"
        raise ValueError(f"dataset {key!r} is at {where}, not at offset {offset} as the manifest says")
    return ds


def read_into(ds: Any, dtype: Dtype, shape: Sequence[int], out: np.ndarray) -> None:
    """Read dataset ``ds`` (from ``find_dataset``) into ``out`` (uint8, the tensor's size)."""
    if out.size:
        ds.read_direct(out.view(stored_dtype(dtype)).reshape(tuple(shape)))


class Hdf5Format:
    """HDF5 files (``r<rank>.h5``): one per share, open across its batches, written on a
    thread of its own (docs/design.md says why a thread)."""

    name = "hdf5"
    thread = "ckptd-hdf5"
    parallel = False

    def owns(self, file: str) -> bool:
        return bool(layout.H5.fullmatch(file))

    def record_problem(self, name: str, key: str, offset: int | None) -> str | None:
        return None

    def next_file(self, io: WriteIO) -> str:
        return layout.h5_name(io.rank)

    def link_name(self, io: WriteIO, base_step: int, file: str) -> str:
        if file == layout.h5_name(io.rank):
            return layout.h5_link_name(io.rank, base_step)
        return file

    @staticmethod
    def _file(io: WriteIO) -> H5Writer:
        """The share's open HDF5 file (kept between calls), created on first use."""
        if io.kept is None:
            io.ensure_dir()
            name = layout.h5_name(io.rank)
            io.listed(name)
            io.kept = H5Writer(Path(io.at(name)), io.hdf5_options, shown=io.dir / name, direct=io.direct_io,
                               attrs={"run": io.run, "step": io.step, "rank": io.rank})
        return io.kept

    def write_batch(self, io: WriteIO, name: str, entries: list[Entry], digests: Mapping[str, str],
                    *, listed: bool = False) -> Written:
        """A dataset per entry; a contiguous one's bytes go to the disk on the writer's pool
        while the next is made, all of them before this returns (and the buffers are let go of)."""
        placed: list[tuple[Entry, str, int | None]] = []
        writes: list[Future] = []
        try:
            h5 = self._file(io)
            for e in io.recognise(entries, digests):
                dataset = h5.add(e.name, e.dtype, e.shape)
                if dataset.rows is None:
                    writes.append(io.submit(h5.write, dataset, e.buffers))
                else:
                    h5.write(dataset, e.buffers)
                io.throttled(e.nbytes)
                placed.append((e, dataset.key, dataset.offset))
        except OSError as exc:
            io.fail(f"writing {io.dir / name}", exc)
        finally:
            failed = [err for w in writes if (err := w.exception()) is not None]
        if failed and not io.failed:
            if not isinstance(failed[0], OSError):
                raise failed[0]
            io.fail(f"writing {io.dir / name}", failed[0])
        return Written(placed if not failed else [])

    def open_stream(self, io: WriteIO, entry: Entry, file: str) -> Slot | None:
        try:
            return self._file(io).add(entry.name, entry.dtype, entry.shape)
        except OSError as exc:
            io.fail(f"writing {io.dir / file}", exc)
            return None

    def split(self, io: WriteIO, entry: Entry, file: str) -> None:
        """Never called: one file per share is not ``parallel``; its tensors stream."""

    def stream_piece(self, io: WriteIO, out: Slot, piece: Any, last: bool) -> tuple[str, int | None] | None:
        self._file(io).write(out, [piece])
        io.throttled(len(memoryview(piece)))
        return (out.key, out.offset) if last else None

    def drop_stream(self, out: Slot) -> None:
        """The file itself is let go of when the failed share is closed."""

    def refer(self, io: WriteIO, base: Stored, name: str, old: TensorRecord) -> TensorRecord:
        """Link the base's file now, and show the tensor in r<rank>.h5 through an external
        link (plain h5py sees it there)."""
        record = replace(old, file=io.link(base, old.file))
        self._file(io).link_external(record.key, record.file)
        return record

    def place(self, io: WriteIO, refs: list[Ref]) -> tuple[dict[str, TensorRecord], int, int]:
        return {}, 0, 0

    def close(self, io: WriteIO) -> None:
        """HDF5 writes its metadata now; the file is then queued for fsync."""
        h5, io.kept = io.kept, None
        if h5 is None:
            return
        if io.failed:
            h5.abort()
            return
        try:
            fd = h5.close()
        except OSError as exc:
            io.fail(f"writing {io.dir / h5.path.name}", exc)
            return
        io.sync(h5.path.name, fd)

    def open(self, fd: int, size: int) -> Hdf5Reader:
        return Hdf5Reader(fd)


class Hdf5Reader:
    """An HDF5 file open for reading, through h5py once a record needs it. h5py reads
    through the descriptor already opened (and checked), never by the path, which
    could be replaced meanwhile."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._file: Any = None
        self._source: Any = None
        self._error: CheckpointCorrupt | None = None
        self._checked: tuple[str, Any] | None = None

    def check(self, name: str, rec: TensorRecord) -> None:
        self._checked = (rec.key, self._dataset(name, rec))

    def read_into(self, name: str, rec: TensorRecord, out: Any) -> None:
        if self._checked is not None and self._checked[0] == rec.key:
            ds = self._checked[1]
        else:
            ds = self._dataset(name, rec)
        self._checked = None
        try:
            read_into(ds, dtypes.lookup(rec.dtype), rec.shape, out)
        except (OSError, ValueError, RuntimeError, TypeError) as exc:
            raise CheckpointCorrupt(f"cannot read dataset {rec.key!r}: {exc}") from None

    def _dataset(self, name: str, rec: TensorRecord) -> Any:
        if rec.key != dataset_key(name):
            raise CheckpointCorrupt(f"its dataset key {rec.key!r} is not the one its name maps to")
        if self._file is None:
            if self._error is None:
                self._source = os.fdopen(os.dup(self.fd), "rb")
                try:
                    self._file = open_file(self._source)
                except (OSError, ValueError, RuntimeError, TypeError, KeyError) as exc:
                    self._error = CheckpointCorrupt(f"not a readable HDF5 file: {exc}")
            if self._error is not None:
                raise CheckpointCorrupt(str(self._error))
        try:
            return find_dataset(self._file, rec.key, dtypes.lookup(rec.dtype), rec.shape, rec.offset)
        except KeyError:
            raise CheckpointCorrupt(f"the file has no dataset {rec.key!r}") from None
        except (OSError, ValueError, RuntimeError, TypeError) as exc:
            raise CheckpointCorrupt(str(exc)) from None

    def close(self) -> None:
        self._checked = None
        if self._file is not None:
            try:
                self._file.close()
            except (OSError, ValueError, RuntimeError):
                pass
            self._file = None
        if self._source is not None:
            self._source.close()
            self._source = None


FORMAT = Hdf5Format()
