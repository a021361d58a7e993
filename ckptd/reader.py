"""Find and read complete checkpoints straight from the checkpoint root.

Only manifests decide what is complete: a step folder is a checkpoint once every
rank's manifest exists. Reading goes by the manifest's offsets, one ``preadv``
per tensor into memory the caller then owns, so ``names=`` reads only those
tensors' bytes and nothing is ever unpickled. Chunk files and contiguous HDF5
datasets have offsets; a chunked HDF5 dataset (compressed) has none and is read
with h5py, straight into the same memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from . import dtypes, index, layout, state as state_mod
from .config import default_root
from .errors import CheckpointCorrupt, CheckpointNotFound
from .manifest import CheckpointInfo, Manifest, TensorRecord, checksum
from .names import check_run


def _run_dir(run: str, root: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    check_run(run)
    base = default_root(root)
    return base, base / run


def list_checkpoints(run: str, *, root: str | os.PathLike[str] | None = None) -> list[CheckpointInfo]:
    """Every complete checkpoint of ``run``, ascending by step."""
    _, run_dir = _run_dir(run, root)
    steps = index.scan_run(run_dir)
    return [steps[s] for s in sorted(steps)]


def latest(run: str, *, root: str | os.PathLike[str] | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint of ``run``, or None when it has none.

    Reads the ``<run>/latest`` pointer the daemon keeps, and falls back to a scan
    of the run's step folders when the pointer is missing or names a step that is
    no longer complete.
    """
    _, run_dir = _run_dir(run, root)
    return index.latest_from_pointer(run_dir) or index.latest_by_scan(run_dir)


def find(run: str, step: int | None, root: str | os.PathLike[str] | None) -> tuple[Path, list[Manifest]]:
    """The step folder and manifests of ``step`` (None: the newest), or CheckpointNotFound."""
    base, run_dir = _run_dir(run, root)
    if not run_dir.is_dir():
        raise CheckpointNotFound(f"run {run!r} has no checkpoints under {base}")
    if step is None:
        info = latest(run, root=base)
        if info is None:
            raise CheckpointNotFound(f"run {run!r} has no complete checkpoint under {base}")
        step = info.step
    path = layout.step_dir(base, run, step)
    manifests = index.read_manifests(path)
    if manifests is None:
        complete = [s for s, p in index.step_dirs(run_dir) if index.step_info(p)][:10]
        have = ", ".join(map(str, sorted(complete))) if complete else "none"
        raise CheckpointNotFound(
            f"run {run!r} has no complete checkpoint at step {step}; complete steps: {have}"
            + (" (newest 10 shown)" if len(complete) == 10 else "")
        )
    return path, manifests


def pick_rank(manifests: list[Manifest], rank: int | None) -> Manifest:
    """The manifest of ``rank`` (None: ``$RANK``, or 0 in a one-rank checkpoint)."""
    world = manifests[0].world_size
    if rank is None:
        env = os.environ.get("RANK")
        if world == 1:
            rank = 0
        elif env is not None and env.isdigit():
            rank = int(env)
        else:
            raise ValueError(f"this checkpoint has {world} ranks; pass rank= (or set RANK)")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is out of range: this checkpoint has {world} ranks")
    return manifests[rank]


def load(
    run: str,
    step: int | None = None,
    *,
    root: str | os.PathLike[str] | None = None,
    names: Iterable[str] | None = None,
    map_location: Any = "cpu",
    verify: bool = False,
    rank: int | None = None,
) -> dict[Any, Any]:
    """Load a complete checkpoint: the state as saved, or ``{name: tensor}``.

    ``step=None`` loads the newest complete step. ``names`` reads only those
    tensors and returns them flat. ``verify=True`` checks each tensor's checksum.
    In a multi-rank checkpoint, ``rank`` (default ``$RANK``) picks whose share.
    """
    path, manifests = find(run, step, root)
    manifest = pick_rank(manifests, rank)
    wanted = list(manifest.tensors) if names is None else list(names)
    missing = [n for n in wanted if n not in manifest.tensors]
    if missing:
        raise CheckpointNotFound(
            f"step {manifest.step} of run {run!r} has no tensor named "
            + ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else "")
        )
    tensors = read_tensors(path, {n: manifest.tensors[n] for n in wanted}, verify=verify)
    if map_location not in (None, "cpu"):
        tensors = {n: t.to(map_location) for n, t in tensors.items()}
    values = {
        n: (t.numpy() if manifest.tensors[n].numpy else t) for n, t in tensors.items()
    }
    if names is not None or manifest.state is None:
        return values
    return state_mod.unflatten(manifest.state, values.__getitem__)


def read_tensors(step_path: Path, records: dict[str, TensorRecord], *, verify: bool) -> dict[str, Any]:
    import torch

    by_file: dict[str, list[tuple[str, TensorRecord]]] = {}
    for name, rec in records.items():
        by_file.setdefault(rec.file, []).append((name, rec))
    out: dict[str, Any] = {}
    for file, items in by_file.items():
        path = _data_file(step_path, file)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise CheckpointCorrupt(f"{path}: cannot open a file the manifest names: {exc.strerror}") from None
        h5 = None  # opened for the first record without an offset (a chunked HDF5 dataset)
        try:
            for name, rec in sorted(items, key=lambda it: -1 if it[1].offset is None else it[1].offset):
                buf = torch.empty(rec.nbytes, dtype=torch.uint8)
                view = memoryview(buf.numpy()) if rec.nbytes else memoryview(b"")
                if rec.offset is not None:
                    got = _pread_into(fd, view, rec.offset)
                    if got != rec.nbytes:
                        raise CheckpointCorrupt(
                            f"{path}: tensor {name!r} is truncated: {got} of {rec.nbytes} bytes at offset {rec.offset}"
                        )
                elif rec.nbytes:
                    h5 = h5 or _open_h5(path)
                    _read_dataset(h5, path, name, rec, buf.numpy())
                if verify and checksum([view]) != rec.checksum:
                    raise CheckpointCorrupt(f"{path}: tensor {name!r} does not match its checksum")
                out[name] = as_tensor(buf, rec)
        finally:
            os.close(fd)
            if h5 is not None:
                h5.close()
    return out


def _open_h5(path: Path) -> Any:
    from . import hdf5file  # h5py loads only for a checkpoint that needs it

    try:
        return hdf5file.open_file(path)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointCorrupt(f"{path}: not a readable HDF5 file: {exc}") from None


def _read_dataset(h5: Any, path: Path, name: str, rec: TensorRecord, out: Any) -> None:
    from . import hdf5file

    try:
        hdf5file.read_into(h5, rec.key, dtypes.lookup(rec.dtype), rec.shape, out)
    except KeyError:
        raise CheckpointCorrupt(f"{path}: no dataset {rec.key!r}, which holds tensor {name!r}") from None
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointCorrupt(f"{path}: cannot read tensor {name!r} (dataset {rec.key!r}): {exc}") from None


def as_tensor(raw: Any, rec: TensorRecord) -> Any:
    """View raw uint8 bytes as the record's dtype and shape."""
    dtype = dtypes.torch_dtype(rec.dtype)
    return raw.view(dtype).reshape(rec.shape)


def _data_file(step_path: Path, file: str) -> Path:
    # The manifest names files inside the step folder only; anything else is tampering.
    if not layout.is_data_file(file):
        raise CheckpointCorrupt(f"{step_path}: manifest names an unexpected file {file!r}")
    return step_path / file


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def verify(run: str, step: int | None = None, *, root: str | os.PathLike[str] | None = None) -> tuple[Path, list[str]]:
    """Check every tensor of a checkpoint; return its folder and a list of problems."""
    path, manifests = find(run, step, root)
    problems = []
    for manifest in manifests:
        for name, rec in manifest.tensors.items():
            try:
                read_tensors(path, {name: rec}, verify=True)
            except CheckpointCorrupt as exc:
                problems.append(f"rank {manifest.rank}: {exc}")
    return path, problems
