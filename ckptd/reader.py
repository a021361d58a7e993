"""Find and read complete checkpoints straight from the checkpoint root.

Only manifests decide what is complete: a step folder is a checkpoint once every
rank's manifest exists, all of one attempt (``ckptd.index.one_attempt``). Reading goes by the manifest's offsets, one ``preadv``
per tensor into memory the caller then owns, so ``names=`` reads only those
tensors' bytes and nothing is ever unpickled. Chunk files and contiguous HDF5
datasets have offsets; a chunked HDF5 dataset (compressed) has none and is read
with h5py, straight into the same memory.

What is on disk is untrusted. Manifests are checked field by field when parsed
(``Manifest.from_json``); a tensor's size is checked against the real size of its
file before memory is allocated for it; files are opened relative to the step
folder's descriptor and never through a symlink: a symlink planted in place of a
run folder, a step folder, a manifest or a data file is refused with
``CheckpointCorrupt``, so nothing outside the step folder is ever read. The root
itself may be a symlink.
"""

from __future__ import annotations

import logging
import mmap as mmap_mod
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Iterator

from . import devicecopy, dtypes, format as formats, index, layout, measures, state as state_mod
from .config import default_root
from .errors import CheckpointCorrupt, CheckpointNotFound
from .format import DataReader
from .format.chunk import pread_into
from .manifest import CheckpointInfo, Manifest, TensorRecord, checksum
from .names import check_run
from .peer import tier as peer_tier
from .remote import catalog, fetch, tiers
from .remote.store import RemoteError

log = logging.getLogger("ckptd.reader")

# Files read at once by a load: preadv releases the GIL, so the copies out of the page
# cache (and the first touch of fresh memory, which costs more than the copy) run on
# several cores, and a cold read keeps several requests in flight on the device.
# Measured on a 2-core VM: two threads faulting fresh memory in one process ran slower
# than one, so a reader thread per spare pair of cores.
READERS = max(1, min(4, (os.cpu_count() or 1) // 2))


def _run_dir(run: str, root: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    check_run(run)
    base = default_root(root)
    run_dir = base / run
    if os.path.islink(run_dir):
        raise CheckpointCorrupt(
            f"{run_dir} is a symlink; ckptd never reads through symlinks below the checkpoint "
            "root: put the run's folder itself there, or pass its parent as the root"
        )
    return base, run_dir


def list_checkpoints(run: str, *, root: str | os.PathLike[str] | None = None,
                     remote: str | None = None) -> list[CheckpointInfo]:
    """Every complete checkpoint of ``run``, ascending by step, in the local root and
    (``remote``: a URL, "" for none, None for the config's ``[remote]``) the remote
    tier; ``tiers`` says which hold each. A step whose manifest is damaged is not
    complete: it is left out, with a logged warning saying why."""
    _, run_dir = _run_dir(run, root)
    steps = index.scan_run(run_dir, warn=True)
    local = [steps[s] for s in sorted(steps)]
    store = tiers.open_store(remote)
    return tiers.merge(local, catalog.list_checkpoints(store, run)) if store else local


def latest(run: str, *, root: str | os.PathLike[str] | None = None,
           verify: bool = False, remote: str | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint of ``run`` in the local root or the remote tier
    (``remote`` as for ``list_checkpoints``; ``verify=True`` looks at the local root
    only), or None when it has none. See ``latest_local``."""
    store = None if verify else tiers.open_store(remote)
    local = latest_local(run, root=root, verify=verify)
    peers = None if verify else peer_tier.open_tier()
    if peers is not None:  # every rank's share here or with a peer (docs/tiers.md)
        local = peers.latest(check_run(run), default_root(root)) or local  # counts the local shares too
        if store is not None:
            try:
                return tiers.newest(local, catalog.latest(store, run))
            except (OSError, RemoteError) as exc:  # the peers answer for it: docs/tiers.md
                log.warning("the remote tier %s is unreachable (%s); newest step from the local root and "
                            "the peers only", store.url, exc)
                return local
    return tiers.newest(local, catalog.latest(store, run)) if store else local


def latest_local(run: str, *, root: str | os.PathLike[str] | None = None,
                 verify: bool = False) -> CheckpointInfo | None:
    """The newest complete checkpoint of ``run``, or None when it has none.

    Reads the ``<run>/latest`` pointer the daemon keeps, and falls back to a scan
    of the run's step folders when the pointer is missing or names a step that is
    no longer complete. ``verify=True`` reads every tensor of each candidate,
    newest first, and returns the newest that passes verification (``verify``),
    skipping damaged ones with a logged warning; None when none passes.
    """
    _, run_dir = _run_dir(run, root)
    if not verify:
        return index.latest_from_pointer(run_dir) or index.latest_by_scan(run_dir, warn=True)
    for _, path in index.step_dirs(run_dir):
        info = index.step_info(path, warn=True)
        if info is None:
            continue
        try:
            manifests = index.read_manifests(path)
        except CheckpointCorrupt as exc:  # replaced since step_info looked
            problems = [str(exc)]
        else:
            problems = check(path, manifests) if manifests else ["no longer complete"]
        if not problems:
            return info
        log.warning("run %r step %d is damaged; skipped: %s%s", run, info.step, problems[0],
                    f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
    return None


def find(run: str, step: int | None, root: str | os.PathLike[str] | None) -> tuple[Path, list[Manifest]]:
    """The step folder and manifests of ``step`` (None: the newest), or CheckpointNotFound;
    CheckpointCorrupt if its manifests are damaged."""
    base, run_dir = _run_dir(run, root)
    if not run_dir.is_dir():
        raise CheckpointNotFound(f"run {run!r} has no checkpoints under {base}")
    if step is None:
        info = latest_local(run, root=base)
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
    first = manifests[0]
    if first.run != run or first.step != step:
        raise CheckpointCorrupt(f"{path}: its manifests are those of run {first.run!r} step {first.step}")
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


@measures.timed_restore(0)  # a resume's time, for the interval advice (docs/advise.md)
def load(
    run: str,
    step: int | None = None,
    *,
    root: str | os.PathLike[str] | None = None,
    names: Iterable[str] | None = None,
    map_location: Any = "cpu",
    verify: bool = False,
    rank: int | None = None,
    out: Any = None,
    mmap: bool = False,
    remote: str | None = None,
) -> dict[Any, Any]:
    """Load a complete checkpoint: the state as saved, or ``{name: tensor}``.

    ``step=None`` loads the newest complete step. ``names`` reads only those
    tensors and returns them flat. ``verify=True`` checks each tensor's checksum
    (and that each file's own header agrees with the manifest).
    In a multi-rank checkpoint, ``rank`` (default ``$RANK``) picks whose share
    (its replicated tensors included, wherever they were written); with neither,
    the whole state, sharded tensors assembled to their global shape.
    ``out``: a state (nested, as saved, or flat ``{name: tensor}``) whose tensors
    are read into in place, no memory allocated for them: each must be a contiguous
    CPU tensor (or numpy array) of the record's dtype and shape; the result holds
    those very tensors. ``mmap=True``: tensors are mapped copy-on-write from the
    chunk files (as ``torch.load(mmap=True)``): nothing is read until touched, and
    writes stay in this process; a tensor the format cannot map (a compressed HDF5
    dataset, a misaligned offset) is read as usual.
    ``remote`` (a URL, "" for none, None for the config's ``[remote]``): a step not
    complete in the local root is read from the remote tier, only that rank's
    tensors (or ``names``), in parallel ranged reads, every checksum checked.
    """
    if mmap and out is not None:
        raise ValueError("load(out=..., mmap=True): choose one; out= reads into your tensors, "
                         "mmap=True maps the files instead")
    if mmap and map_location not in (None, "cpu"):
        raise ValueError(f"load(mmap=True) maps the files into CPU memory; map_location={map_location!r} "
                         "would copy every byte at once: load without mmap=True")
    path, manifests, store = find_in_tiers(run, step, root, remote, fill=False)
    whole = rank is None and manifests[0].world_size > 1 and not os.environ.get("RANK", "").isdigit()
    if isinstance(store, peer_tier.PeerSource) and (whole or out is not None or mmap):
        store.fill()  # these read local files: the peers' shares come into the root first
        path, manifests, store = find_in_tiers(run, manifests[0].step, root, remote)
    # one rank's share is the whole state, its tensors held in several pieces assembled
    whole = whole or (manifests[0].world_size == 1 and rank in (None, 0) and out is None and not mmap
                      and store is None
                      and any(rec.tensor_name(k) != k for k, rec in manifests[0].tensors.items()))
    if whole:
        if out is not None or mmap:
            raise ValueError(f"load(out=/mmap=True) reads one rank's share, and step {manifests[0].step} has "
                             f"{manifests[0].world_size} ranks: pass rank=, or fill your tensors of the whole "
                             "state with ckptd.load_into(state, run, step)")
        if store is not None:
            raise ValueError(f"step {manifests[0].step} of run {run!r} is complete only in {store.url}: load "
                             "one rank's share there with rank= (or set RANK), or fetch the step into the "
                             "local root first (ckptd.remote.fetch.fetch_share) to load the whole state")
        from .load_into import load_whole

        return load_whole(path, manifests, names=names, map_location=map_location, verify=verify)
    manifest = pick_rank(manifests, rank)
    records = share_records(path, manifests, manifest)
    wanted = list(records) if names is None else list(names)
    missing = [n for n in wanted if n not in records]
    if missing:
        raise CheckpointNotFound(
            f"step {manifest.step} of run {run!r} has no tensor named "
            + ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else "")
        )
    rebuild = names is None and manifest.state is not None
    # a tensor this rank stored in several pieces has no one record to hand back for its name
    split = sorted({rec.tensor_name(k) for k, rec in records.items() if rec.tensor_name(k) != k}
                   & ({n for n in wanted if n in records} if not rebuild else set(records)))
    if split:
        raise ValueError(f"rank {manifest.rank} stored tensor {split[0]!r} of step {manifest.step} in several pieces "
                         "(docs/format.md); load the whole state with ckptd.load(run, step) without rank= (and "
                         "without $RANK), or fill your own tensors with ckptd.load_into")
    if rebuild:  # a malformed structure fails now, before gigabytes are read
        check_structure(path, manifest)
    if rank is None and os.environ.get("RANK", "").isdigit():
        _refuse_pieces_by_default(run, manifest, {n: records[n] for n in wanted})
    wanted_records = {n: records[n] for n in wanted}
    # from the bucket unless every file it needs was written here (the node that wrote it)
    writers = {manifest.rank} | {manifest.replicas[n] for n in wanted if n in manifest.replicas}
    if store is not None and not all(_own_share_here(path, manifests[r]) for r in writers):
        if out is not None or mmap:
            raise ValueError(f"load(out=/mmap=True) reads local files, and rank {manifest.rank}'s share of step "
                             f"{manifest.step} is only in {store.url}: load without them, or fetch it first")
        if isinstance(store, peer_tier.PeerSource):  # from peers' memory, what this root lacks
            tensors = store.read_tensors(wanted_records, lambda recs: read_tensors(path, recs, verify=verify))
        else:
            tensors = fetch.read_tensors(store, manifest, wanted_records)  # checksums always checked
    else:
        into = destinations(out, records, manifest.step) if out is not None else None
        if into is None and devicecopy.is_cuda(map_location):
            # onto the GPU as each tensor is read, through pinned buffers (ckptd.devicecopy)
            copier = devicecopy.DeviceCopier(map_location)
            tensors = read_tensors(path, wanted_records, verify=verify,  # numpy arrays stay on the host
                                   convert=lambda n, t: t if records[n].numpy else copier.to_device(t))
            copier.finish()
            map_location = None
        else:
            tensors = read_tensors(path, wanted_records, verify=verify, into=into, mapped=mmap)
    if map_location not in (None, "cpu"):
        tensors = {n: t.to(map_location) for n, t in tensors.items()}
    values = {  # (an out= numpy array is one already)
        n: (t.numpy() if records[n].numpy and hasattr(t, "numpy") else t) for n, t in tensors.items()
    }
    return _unflatten(path, manifest, values) if rebuild else values


def _refuse_pieces_by_default(run: str, manifest: Manifest, records: dict[str, TensorRecord]) -> None:
    """Under torchrun ($RANK set, no ``rank=``), a share holding pieces of sharded tensors
    (an FSDP2 / DTensor model's) is refused: its pieces as plain tensors are what
    ``model.load_state_dict`` cannot take, and PyTorch's own error (a size mismatch)
    says nothing of what to do. ``load_into`` fills the model's own sharded state in
    place; ``rank=`` asks for the pieces knowingly (docs/sharded.md)."""
    for name, rec in records.items():
        if rec.shard is not None and rec.shape != rec.shard.global_shape:
            raise ValueError(
                f"step {manifest.step} of run {run!r} holds sharded tensors: under torchrun "
                f"(RANK={manifest.rank}) ckptd.load would return this rank's pieces as plain tensors "
                f"({name!r}: a {rec.shape} piece of {rec.shard.global_shape}), which "
                "model.load_state_dict cannot take. Fill the model's own sharded state in place "
                "instead: state = {'model': model.state_dict()}; ckptd.load_into(state, run); "
                "model.load_state_dict(state['model']) (docs/sharded.md); or pass rank= to get this "
                "rank's pieces as plain tensors")


def find_in_tiers(run: str, step: int | None, root: str | os.PathLike[str] | None,
                   remote: str | None, *, fill: bool = True) -> tuple[Path, list[Manifest], Any]:
    """The step's folder and manifests: locally if it is complete there, else with the
    peers, else from the remote tier (then also its store; the folder is where it
    would be locally). With peers: ``fill`` fetches the shares this root lacks into
    it; without, the third value is a ``PeerSource`` that reads them into memory."""
    store = tiers.open_store(remote)
    peers = peer_tier.open_tier()
    if peers is not None:  # local disk, then peers' memory, then the remote tier: docs/tiers.md
        base = default_root(root)
        if step is None:
            info = latest(run, root=root, remote=store.url if store else "")
            if info is None:
                raise CheckpointNotFound(f"run {run!r} has no complete checkpoint under {base}, with its peers"
                                         + (f" nor in {store.url}" if store else ""))
            step = info.step
        local_path = layout.step_dir(base, check_run(run), step)
        if index.step_info(local_path) is None:
            source = peers.source(run, step, base)
            if source is not None and not fill:
                return local_path, source.manifests, source
            if source is not None:
                source.fill()
            if index.step_info(local_path) is not None:
                store = None  # complete here now: read locally
    if store is not None:
        if step is None:
            info = latest(run, root=root, remote=store.url)
            if info is None:
                raise CheckpointNotFound(f"run {run!r} has no complete checkpoint under {default_root(root)} "
                                         f"nor in {store.url}")
            step = info.step
        local_path = layout.step_dir(default_root(root), check_run(run), step)
        if index.step_info(local_path) is None:  # not complete here: the bucket's copy
            _, manifests = tiers.find(store, run, step)
            return local_path, manifests, store
    path, manifests = find(run, step, root)
    return path, manifests, None


def share_records(step_path: Path, manifests: list[Manifest], manifest: Manifest) -> dict[str, TensorRecord]:
    """The records of one rank's share: its own tensors, and each replicated tensor it
    lists under ``replicas`` from the manifest of the rank that wrote it."""
    if not manifest.replicas:
        return manifest.tensors
    records = dict(manifest.tensors)
    for name, writer in manifest.replicas.items():
        rec = manifests[writer].tensors.get(name)
        if rec is None:
            raise CheckpointCorrupt(
                f"{step_path / layout.manifest_name(manifest.rank)}: replicated tensor {name!r} is listed as "
                f"written by rank {writer}, whose manifest has no such tensor (were the ranks saved with "
                "different replicated= or different tensors?)")
        records[name] = rec
    return records


def _own_share_here(path: Path, manifest: Manifest) -> bool:
    """This rank's share of the step is committed in the local root (the node that wrote
    it, its disk intact), with the same manifest as the bucket's."""
    try:
        local = index.read_share(path, manifest.rank)
    except (CheckpointCorrupt, OSError):
        return False
    return local is not None and local.time == manifest.time


def check_structure(step_path: Path, manifest: Manifest) -> None:
    """CheckpointCorrupt if the manifest's saved structure cannot be rebuilt (a node
    ckptd does not write, a reference to a tensor it does not list, ...)."""
    if manifest.state is not None:
        _unflatten(step_path, manifest, dict.fromkeys([*manifest.tensors, *manifest.replicas]))


def _unflatten(path: Path, manifest: Manifest, values: dict[str, Any]) -> Any:
    def lookup(name: Any) -> Any:
        if not isinstance(name, str) or name not in values:
            raise KeyError(f"it refers to a tensor {name!r} that the manifest does not list")
        return values[name]

    try:
        return state_mod.unflatten(manifest.state, lookup)
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError, RecursionError) as exc:
        where = path / layout.manifest_name(manifest.rank)
        raise CheckpointCorrupt(f"{where}: the saved structure (\"state\") is malformed: "
                                f"{exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}") from None


def read_tensors(step_path: Path, records: dict[str, TensorRecord], *, verify: bool,
                 into: dict[str, Any] | None = None, mapped: bool = False,
                 progress: Callable[[int], None] | None = None,
                 convert: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
    """Read ``records`` (of one rank's manifest) from the step folder; the first problem
    is raised as CheckpointCorrupt naming the file and the tensor. ``into``: tensors
    (flat, by name) to read into instead of fresh memory (``destinations``);
    ``mapped``: map the files instead of reading them (``load(mmap=True)``).
    ``progress`` is called with each tensor's bytes once it is read; ``convert``
    (``devicecopy``) turns each tensor as it is read, before the next is kept."""
    out: dict[str, Any] = {}
    with closing(_tensors(step_path, records, verify=verify, into=into, mapped=mapped)) as it:
        for name, tensor, error in it:
            if error is not None:
                raise error
            out[name] = tensor if convert is None else convert(name, tensor)
            if progress is not None:
                progress(records[name].nbytes)
    return out


def verify(run: str, step: int | None = None, *, root: str | os.PathLike[str] | None = None) -> tuple[Path, list[str]]:
    """Check every tensor of a checkpoint; return its folder and a list of problems,
    one for each damaged tensor, naming it and its file."""
    path, manifests = find(run, step, root)
    return path, check(path, manifests)


def check(step_path: Path, manifests: list[Manifest], progress: Callable[[int], None] | None = None) -> list[str]:
    """Every problem of a step whose manifests were read: each tensor's bytes against
    its checksum and its file's own header, and each saved structure. ``progress`` is
    called with each tensor's bytes once it is checked."""
    problems = []
    for manifest in manifests:
        try:
            with closing(_tensors(step_path, manifest.tensors, verify=True)) as it:
                for name, _, error in it:
                    if error is not None:
                        problems.append(f"rank {manifest.rank}: {error}")
                    if progress is not None:
                        progress(manifest.tensors[name].nbytes)
            check_structure(step_path, manifest)
            share_records(step_path, manifests, manifest)
        except CheckpointCorrupt as exc:
            problems.append(f"rank {manifest.rank}: {exc}")
    return problems


def destinations(out: Any, records: dict[str, TensorRecord], step: int) -> dict[str, Any]:
    """The tensors of ``out`` (a state as saved, or flat ``{name: tensor}``) by name,
    each checked against its record (of a rank's share of ``step``): ValueError naming
    the first that cannot take it."""
    import numpy as np
    import torch

    if isinstance(out, dict) and all(isinstance(k, str) and k in records for k in out):
        flat = dict(out)
    else:
        _, flat = state_mod.flatten(out)
    unknown = [n for n in flat if n not in records]
    if unknown:
        raise ValueError(f"load(out=...): step {step} has no tensor named "
                         + ", ".join(map(repr, unknown[:5])) + (" ..." if len(unknown) > 5 else "")
                         + "; pass a state with only the checkpoint's tensors")
    for name, t in flat.items():
        rec = records[name]
        if isinstance(t, np.ndarray):
            ok = t.flags.c_contiguous and t.flags.writeable and dtypes.BY_NUMPY.get(t.dtype.name) is not None \
                and dtypes.BY_NUMPY[t.dtype.name].name == rec.dtype and list(t.shape) == rec.shape
            have = f"a numpy array of {t.dtype} {list(t.shape)}"
        elif isinstance(t, torch.Tensor):
            ok = t.device.type == "cpu" and t.is_contiguous() and dtypes.torch_name(t.dtype) == rec.dtype \
                and list(t.shape) == rec.shape and not t.is_conj() and not t.is_neg()
            have = f"a {t.device.type} tensor of {dtypes.torch_name(t.dtype)} {list(t.shape)}" + (
                "" if t.is_contiguous() else ", not contiguous")
        else:
            ok, have = False, f"a {type(t).__name__}"
        if not ok:
            raise ValueError(f"load(out=...): tensor {name!r} is {rec.dtype} {rec.shape} in the checkpoint; "
                             f"out= holds {have}: pass a contiguous CPU tensor of that dtype and shape")
    return flat


# -- reading files ---------------------------------------------------------------------------
def _tensors(step_path: Path, records: dict[str, TensorRecord], *, verify: bool,
             into: dict[str, Any] | None = None,
             mapped: bool = False) -> Generator[tuple[str, Any, CheckpointCorrupt | None], None, None]:
    """``(name, tensor, None)`` for each record read, ``(name, None, error)`` for each
    that cannot be; grouped by file, in file order. Up to ``READERS`` files are read
    at once (checksums too); mapping reads nothing, so it runs on the calling thread."""
    try:
        dir_fd = layout.open_step_dir(step_path)
    except OSError as exc:
        raise CheckpointCorrupt(f"cannot open the step folder: {exc.strerror}") from None
    by_file: dict[str, list[tuple[str, TensorRecord]]] = {}
    for name, rec in records.items():
        by_file.setdefault(rec.file, []).append((name, rec))

    def one(file: str, items: list[tuple[str, TensorRecord]]) -> Iterator[tuple[str, Any, CheckpointCorrupt | None]]:
        return _DataFile(dir_fd, step_path, file, into=into, mapped=mapped).tensors(items, verify)

    def read_all(file: str, items: list[tuple[str, TensorRecord]]) -> list[tuple[str, Any, CheckpointCorrupt | None]]:
        return list(one(file, items))

    try:
        if mapped or len(by_file) < 2 or READERS < 2:
            for file, items in by_file.items():
                yield from one(file, items)
            return
        with ThreadPoolExecutor(READERS, thread_name_prefix="ckptd-read") as pool:
            pending: deque[Any] = deque()
            for file, items in by_file.items():  # at most READERS files read ahead: memory stays bounded
                pending.append(pool.submit(read_all, file, items))
                if len(pending) >= READERS:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
    finally:
        os.close(dir_fd)


class _DataFile:
    """One data file of a step, opened without following a symlink. A record with a
    byte offset is read here (``preadv``, or a mapping), whatever the format; the
    file's format (``ckptd.format``) checks its own structure and reads a record
    without one, and is only asked when needed."""

    def __init__(self, dir_fd: int, step_path: Path, file: str, *, into: dict[str, Any] | None = None,
                 mapped: bool = False) -> None:
        self.dir_fd = dir_fd
        self.into = into  # name -> tensor to read into (load(out=...))
        self.mapped = mapped
        self._map: Any = None  # the file mapped copy-on-write (load(mmap=True)), once needed
        self.path = step_path / file
        fmt = formats.for_file(file)
        assert fmt is not None  # (the manifest's parser accepts data file names only)
        self.format = fmt
        self.fd = -1
        self.size = 0
        self._reader: DataReader | None = None

    def tensors(self, items: list[tuple[str, TensorRecord]],
                verify: bool) -> Iterator[tuple[str, Any, CheckpointCorrupt | None]]:
        try:
            self.fd = layout.open_regular(self.path.name, dir_fd=self.dir_fd)
        except OSError as exc:
            for name, _ in items:
                yield name, None, self._corrupt(name, f"cannot open a file the manifest names: {exc.strerror}")
            return
        try:
            self.size = os.fstat(self.fd).st_size
            for name, rec in sorted(items, key=lambda it: -1 if it[1].offset is None else it[1].offset):
                try:
                    yield name, self._read(name, rec, verify), None
                except CheckpointCorrupt as exc:
                    yield name, None, exc
        finally:
            self._close()

    def _corrupt(self, name: str, what: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{self.path}: tensor {name!r}: {what}")

    def _file(self) -> DataReader:
        if self._reader is None:
            self._reader = self.format.open(self.fd, self.size)
        return self._reader

    def _read(self, name: str, rec: TensorRecord, verify: bool) -> Any:
        import torch

        dst = self.into.get(name) if self.into is not None else None
        buf: Any  # a torch uint8 tensor, or None where the bytes went into dst
        if rec.offset is not None:
            end = rec.offset + rec.nbytes
            if end > self.size:  # checked before allocating: the manifest's sizes are untrusted
                raise self._corrupt(name, f"is truncated: the manifest puts it at bytes {rec.offset}..{end}, "
                                          f"but the file has {self.size} bytes")
            if verify:
                self._check_structure(name, rec)
            if dst is None and self.mapped and rec.nbytes and rec.offset % dtypes.lookup(rec.dtype).itemsize == 0:
                buf = self._mapped(rec)
            else:
                buf = torch.empty(rec.nbytes, dtype=torch.uint8) if dst is None else None
                view = memoryview(buf.numpy()) if dst is None else _bytes_of(dst)
                got = pread_into(self.fd, view, rec.offset) if rec.nbytes else 0
                if got != rec.nbytes:
                    raise self._corrupt(name, f"is truncated: {got} of {rec.nbytes} bytes at offset {rec.offset}")
                if dst is not None:
                    if verify and checksum([view] if rec.nbytes else []) != rec.checksum:
                        raise self._corrupt(name, "does not match its checksum")
                    return dst
        else:
            import numpy as np

            self._check_structure(name, rec)  # its size against its storage, before allocating by it
            buf = torch.empty(rec.nbytes, dtype=torch.uint8) if dst is None else None
            target = buf.numpy() if dst is None else np.frombuffer(_bytes_of(dst), dtype=np.uint8)
            try:
                self._file().read_into(name, rec, target)
            except CheckpointCorrupt as exc:
                raise self._corrupt(name, str(exc)) from None
            if dst is not None:
                if verify and checksum([_as_bytes(target)] if rec.nbytes else []) != rec.checksum:
                    raise self._corrupt(name, "does not match its checksum")
                return dst
        if verify and checksum([memoryview(buf.numpy())] if rec.nbytes else []) != rec.checksum:
            raise self._corrupt(name, "does not match its checksum")
        return as_tensor(buf, rec)

    def _check_structure(self, name: str, rec: TensorRecord) -> None:
        """The file's own structure agrees with the record: what a reader without ckptd sees."""
        try:
            self._file().check(name, rec)
        except CheckpointCorrupt as exc:
            raise self._corrupt(name, str(exc)) from None

    def _mapped(self, rec: TensorRecord) -> Any:
        """The record's bytes in a copy-on-write mapping of the file (kept alive by the
        tensors made from it, not by this object)."""
        import torch

        if self._map is None:
            self._map = mmap_mod.mmap(self.fd, 0, flags=mmap_mod.MAP_PRIVATE,
                                      prot=mmap_mod.PROT_READ | mmap_mod.PROT_WRITE)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=rec.nbytes, offset=rec.offset)

    def _close(self) -> None:
        self._map = None  # the tensors hold it open as long as they live
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_range(fd: int, path: Path, name: str, rec: TensorRecord, start: int, dst: memoryview) -> None:
    """Read bytes ``[start, start + len(dst))`` of record ``rec`` from ``fd`` (its data
    file, ``path``) straight into ``dst``. The record must have an offset (chunk files,
    contiguous HDF5 datasets); its end is checked against the file's size first.
    Nothing is checksummed: a part of a record cannot be."""
    assert rec.offset is not None and 0 <= start and start + len(dst) <= rec.nbytes
    size = os.fstat(fd).st_size
    if rec.offset + rec.nbytes > size:
        raise CheckpointCorrupt(f"{path}: tensor {name!r}: is truncated: the manifest puts it at bytes "
                                f"{rec.offset}..{rec.offset + rec.nbytes}, but the file has {size} bytes")
    got = pread_into(fd, dst, rec.offset + start)
    if got != len(dst):
        raise CheckpointCorrupt(f"{path}: tensor {name!r}: is truncated: {got} of {len(dst)} bytes "
                                f"at offset {rec.offset + start}")


def _bytes_of(t: Any) -> memoryview:
    """The memory of a contiguous CPU tensor or numpy array, as writable bytes."""
    import numpy as np

    arr = t if isinstance(t, np.ndarray) else t.detach().view(-1).view(dtypes.torch_dtype("uint8")).numpy()
    return _as_bytes(arr.reshape(-1).view(np.uint8))


def _as_bytes(arr: Any) -> memoryview:
    """A numpy array's memory (typed Any: numpy's stubs do not declare the buffer protocol)."""
    return memoryview(arr)


def as_tensor(raw: Any, rec: TensorRecord) -> Any:
    """View raw uint8 bytes as the record's dtype and shape."""
    dtype = dtypes.torch_dtype(rec.dtype)
    return raw.view(dtype).reshape(rec.shape)
