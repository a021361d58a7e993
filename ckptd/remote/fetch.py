"""Reading a rank's share back from the bucket: tensors straight into memory, or files
into a local root.

``read_tensors`` is what ``ckptd.load`` uses on a node whose disk lacks the step: it
fetches only the records asked for (one rank's, or ``names=``), each as ranged reads
of ``part_bytes`` issued together (``concurrency`` tensors at once), into memory the
caller then owns, and checks every tensor against its checksum (the network is not
the disk: checksums are always verified on download).

``fetch_share`` is for readers that want files (``load_into`` after the sharded-
training merge, ``ckptd export``): it downloads one rank's data files and, last, its
manifest into ``<root>/<run>/step-<n>/``, each checked, so the local rules (manifest
last, orphans removed at start-up) hold for the copy too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import dtypes, layout
from ..durable import atomic_write, replacing
from ..errors import CheckpointCorrupt
from ..manifest import Checksum, Manifest, TensorRecord, checksum
from . import catalog
from .store import RemoteError, Store


def read_tensors(store: Store, manifest: Manifest, records: dict[str, TensorRecord]) -> dict[str, Any]:
    """``records`` (of ``manifest``) read from the bucket and checked; CheckpointCorrupt
    names the object and tensor that does not match."""
    items = sorted(records.items(), key=lambda it: (it[1].file, it[1].offset or 0))
    with _pool(store, len(items)) as pool:
        return dict(pool.map(lambda it: (it[0], _read_one(store, manifest, *it)), items))


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


def _read_one(store: Store, manifest: Manifest, name: str, rec: TensorRecord) -> Any:
    import torch

    k = catalog.key(manifest.run, manifest.step, rec.file)
    if rec.offset is None:  # a chunked HDF5 dataset: no byte range of its own
        raise CheckpointCorrupt(f"{store.where(k)}: tensor {name!r} is a chunked (compressed) HDF5 dataset; "
                                "fetch the file with ckptd.remote.fetch.fetch_share and load it locally")
    buf = torch.empty(rec.nbytes, dtype=torch.uint8)
    try:
        store.read_into(k, rec.offset, memoryview(buf.numpy()))
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{store.where(k)}: a file the manifest names is missing; load another "
                                "step (`ckptd list RUN --remote` lists the bucket's)") from None
    except RemoteError as exc:
        if "shorter than its manifest" not in str(exc):
            raise
        raise CheckpointCorrupt(str(exc)) from None
    if checksum([memoryview(buf.numpy())] if rec.nbytes else []) != rec.checksum:
        raise CheckpointCorrupt(f"{store.where(k)}: tensor {name!r} does not match its checksum; load "
                                "another step (`ckptd list RUN --remote` lists the bucket's)")
    return buf.view(dtypes.torch_dtype(rec.dtype)).reshape(rec.shape)


def fetch_share(store: Store, run: str, step: int, rank: int, root: Path) -> Manifest:
    """Download rank ``rank``'s share of ``step`` into ``root`` (data files, then the
    manifest); files already there at their full size are kept. Returns the manifest."""
    manifest = catalog.read_manifest(store, run, step, rank)
    step_dir = layout.step_dir(root, run, step)
    layout.ensure_real_dir(step_dir, root)
    files = sorted(set(manifest.files) | {t.file for t in manifest.tensors.values()})
    for file in files:
        path = step_dir / file
        want = manifest.files.get(file)
        if path.is_file() and not path.is_symlink() and want is not None and path.stat().st_size == want:
            continue
        # the manifest written below vouches for this file: it goes through the one
        # durable path (fsync, rename, fsync the folder) so that a power loss cannot
        # leave a complete step whose data never reached the disk
        with replacing(path) as tmp:
            tmp.unlink(missing_ok=True)  # named for this host and pid: a crashed earlier self's
            store.download(catalog.key(run, step, file), tmp)
            _check_file(tmp, file, manifest)
    atomic_write(step_dir / layout.manifest_name(rank), manifest.to_json())
    return manifest


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
