"""Reading a rank's share back from the bucket, every tensor checked against its
checksum: ``read_tensors`` (ranged reads straight into memory), ``check`` (``ckptd
verify --remote``), ``download_file`` (one data file, for ``ckptd.tiers.bucket``'s
``fetch_share``, which lands it in a root); compressed files are decoded on the way.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .. import dtypes, durable
from ..errors import CheckpointCorrupt
from ..manifest import Checksum, Manifest, TensorRecord, checksum
from . import catalog, codec
from .store import RemoteError, Store


def read_tensors(store: Store, manifest: Manifest, records: dict[str, TensorRecord],
                 into: dict[str, memoryview] | None = None) -> dict[str, Any]:
    """``records`` (of ``manifest``) read from the bucket and checked; CheckpointCorrupt
    names the object and tensor that does not match. ``into``: memory to read a tensor
    into, by name (its entry in the result is then that memory's)."""
    items = sorted(records.items(), key=lambda it: (it[1].file, it[1].offset or 0))
    with _pool(store, len(items)) as pool:
        return dict(pool.map(lambda it: (it[0], _read_one(store, manifest, it[0], it[1], (into or {}).get(it[0]))), items))


def check(store: Store, manifests: list[Manifest]) -> list[str]:
    """Every tensor of every manifest read and checked: one problem per damaged tensor."""
    def one(item: tuple[Manifest, str, TensorRecord]) -> str | None:
        try:
            _read_one(store, *item)
        except CheckpointCorrupt as exc:
            return f"rank {item[0].rank}: {exc}"
        return None

    items = [(m, n, r) for m in manifests for n, r in m.tensors.items()]
    with _pool(store, len(items)) as pool:
        return [p for p in pool.map(one, items) if p is not None]


def _pool(store: Store, n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(store.concurrency, n)), thread_name_prefix="ckptd-fetch")


def _read_one(store: Store, manifest: Manifest, name: str, rec: TensorRecord, dst: memoryview | None = None) -> Any:
    import torch

    k = catalog.key(manifest.run, manifest.step, rec.file)
    if rec.offset is None and rec.nbytes:  # a chunked HDF5 dataset: no byte range of its own
        raise CheckpointCorrupt(f"{store.where(k)}: tensor {name!r} is a chunked (compressed) HDF5 dataset; "
                                "fetch the file with ckptd.tiers.bucket.fetch_share and load it locally")
    buf = torch.empty(rec.nbytes if dst is None else 0, dtype=torch.uint8)
    view = memoryview(buf.numpy()) if dst is None else dst  # type: ignore[arg-type]
    try:
        if rec.nbytes:
            _read_range(store, manifest, rec.file, rec.offset or 0, view)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{store.where(k)}: a file the manifest names is missing; load another "
                                "step (`ckptd list RUN --remote` lists the bucket's)") from None
    except RemoteError as exc:
        if "shorter than its manifest" not in str(exc):
            raise
        raise CheckpointCorrupt(str(exc)) from None
    if checksum([view] if rec.nbytes else []) != rec.checksum:
        raise CheckpointCorrupt(f"{store.where(k)}: tensor {name!r} does not match its checksum; load "
                                "another step (`ckptd list RUN --remote` lists the bucket's)")
    return view if dst is not None else buf.view(dtypes.torch_dtype(rec.dtype)).reshape(rec.shape)


def _read_range(store: Store, manifest: Manifest, file: str, offset: int, out: memoryview) -> None:
    """Bytes ``offset ..`` of ``file`` as the root holds it, into ``out``: a compressed
    object's frames that hold them, read and decoded."""
    k = catalog.key(manifest.run, manifest.step, file)
    packed = manifest.compression.get(file)
    if packed is None:
        store.read_into(k, offset, out)
        return

    def stored(start: int, end: int) -> memoryview:
        into = memoryview(bytearray(end - start))
        store.read_into(k, start, into)
        return into

    codec.unpack_range(stored, packed, offset, out, store.where(k))


def missing_files(manifest: Manifest, folder: Path) -> list[str]:
    """The files of ``manifest``'s share not yet in step folder ``folder`` at their full size."""
    out = []
    for file in sorted(set(manifest.files) | {t.file for t in manifest.tensors.values()}):
        path, want = folder / file, manifest.files.get(file)
        if not (path.is_file() and not path.is_symlink() and want is not None and path.stat().st_size == want):
            out.append(file)
    return out


def download_file(store: Store, manifest: Manifest, file: str, path: Path,
                  landed: Callable[[int], None] | None = None) -> None:
    """``file`` of ``manifest``'s share downloaded to ``path``, in order, every tensor
    checked; ``landed(n)`` told each time its first ``n`` bytes are in ``path``."""
    k = catalog.key(manifest.run, manifest.step, file)
    packed = manifest.compression.get(file)
    with open(path, "xb", buffering=0) as fh:
        def write(data: Any) -> None:
            durable.write_all(fh.fileno(), data)
            if landed is not None:
                landed(fh.tell())

        unpacker = None if packed is None else codec.Unpacker(packed, write, store.where(k))
        for piece in store.stream(k):
            if unpacker is None:
                write(piece)
            else:
                unpacker.feed(piece)
        if unpacker is not None:
            unpacker.close()
    _check_file(path, file, manifest)


def _check_file(path: Path, file: str, manifest: Manifest) -> None:
    """Every tensor of ``file`` with a byte range against its checksum."""
    with open(path, "rb") as fh:
        for name, rec in manifest.tensors.items():
            if rec.file != file or rec.offset is None:
                continue
            fh.seek(rec.offset)
            c, left = Checksum(), rec.nbytes
            while left:
                piece = fh.read(min(left, 1 << 24))
                if not piece:
                    break
                c.update(piece)
                left -= len(piece)
            if left or c.text() != rec.checksum:
                raise CheckpointCorrupt(f"{file} of run {manifest.run!r} step {manifest.step} from the remote tier: "
                                        f"tensor {name!r} does not match its checksum")
