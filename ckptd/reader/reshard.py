"""Resharding loads: ``load_into`` fills a state's tensors and DTensors in place from a
step saved in any layout, and ``load_whole`` assembles every sharded tensor of a
multi-rank step. Each stored piece is a block of the whole tensor (``sharding.Box``):
of each target only the overlapping pieces are read, straight into its memory where
the overlap is one contiguous run of one dtype, else through one strided ``copy_``
(which casts), on a small thread pool. ``verify=True`` reads each needed record whole
to check its checksum. Start at ``load_into``; ``fill`` does the reading.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .. import dtypes, env, layout, measures, state as state_mod
from ..errors import CheckpointCorrupt, CheckpointNotFound
from ..manifest import CheckpointInfo, Manifest, TensorRecord, checksum
from ..sharding import Box, byte_span, describe_dtensor, intersect, is_dtensor, local_slices
from . import optim
from ..tiers.files import read_range, read_tensors
from .finding import agreed_step, open_in_tiers

READ_THREADS = 8
SPLIT_BYTES = 32 << 20


@dataclass(frozen=True)
class Piece:
    """One stored piece: a record of one rank's manifest (kept there under ``key``), and
    its block of the whole tensor."""

    rank: int
    key: str
    rec: TensorRecord
    box: Box

    @classmethod
    def of(cls, rank: int, key: str, rec: TensorRecord) -> "Piece":
        return cls(rank, key, rec, Box(tuple(rec.offsets), tuple(rec.shape)))


@dataclass
class Target:
    """A tensor to fill, and the block of the whole tensor it holds. Made by ``of``.

    ``fill`` never puts stored bytes of one dtype into memory of another: it reads
    straight into ``buf`` only where the dtypes agree, and otherwise copies the stored
    values in with ``copy_``, which converts them (as DCP's own reader does)."""

    name: str
    buf: Any
    box: Box
    final: Any = None
    direct: Any = field(default=None, repr=False)

    @classmethod
    def of(cls, name: str, dest: Any, box: Box) -> "Target":
        """The target that fills tensor ``dest`` (of ``box``'s sizes): ``dest`` itself when
        it is a contiguous CPU tensor, else a stand-in copied into it at the end."""
        import torch

        dest = dest.detach()
        if dest.device.type == "cpu" and dest.is_contiguous():
            return cls(name, dest, box)
        return cls(name, torch.empty(dest.shape, dtype=dest.dtype), box, final=dest)


@measures.timed_restore(1)
def load_into(state: Any, run: str, step: int | None = None, *, root: str | os.PathLike[str] | None = None,
              verify: bool = False, strict: bool = True, remote: str | None = None) -> CheckpointInfo:
    """Fill the tensors and DTensors of ``state`` in place from ``step`` of ``run``
    (None: the newest complete step), resharding from whatever layout it was saved
    in; plain values in ``state``'s dicts and lists are replaced by the saved ones.

    A tensor or plain value of ``state`` the checkpoint lacks is a
    ``CheckpointNotFound`` naming it, unless ``strict=False`` (then it is left as it
    is); a global shape or dtype that differs is a ``ValueError`` naming the tensor.
    ``remote`` (as for ``ckptd.load``): a step complete only in the remote tier is
    read from there: the shares of the ranks whose pieces overlap this process's
    targets, and only those, are fetched into the local root first (checksums
    checked), then read as a local step is.
    Under a process group of more than one rank, ``step=None`` is the newest step every
    rank can read, agreed by all (``latest(agree=True)``): every rank must call it.
    """
    holding = open_in_tiers(run, agreed_step(run, root, remote) if step is None else step, root, remote)
    path, manifests = holding.path, holding.manifests
    rank = env.group_rank()  # per-rank values stored whole: this rank's own copy is preferred
    pieces = pieces_of(manifests)
    saved = _saved_structure(path, manifests, rank)
    targets: dict[str, Any] = {}
    missing: list[str] = []
    _walk(state, saved, (), targets, missing, manifests[0].step)
    plans = []
    placed: dict[Any, Any] = {}
    for name, value in targets.items():
        if name not in pieces:
            missing.append(name)
            continue
        plans.append(_target(name, value, pieces[name], placed))
    if missing and strict:
        raise CheckpointNotFound(
            f"step {manifests[0].step} of run {run!r} has no " + ", ".join(map(repr, missing[:5]))
            + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
            + "; pass strict=False to load what it has and leave the rest as it is")
    holding.materialize({p.rank for t in plans for p, _ in _choose(t, pieces[t.name], rank)})
    fill(path, plans, pieces, rank, verify)
    return CheckpointInfo.from_manifests(str(path), manifests)


def load_whole(path: Path, manifests: list[Manifest], *, names: Iterable[str] | None = None,
               map_location: Any = "cpu", verify: bool = False) -> Any:
    """The whole state of a multi-rank checkpoint: each tensor at its global shape, a
    replicated one once; plain values and structure as rank 0 saved them. A tensor
    several ranks stored whole (not sharded) is taken from the lowest of them."""
    import torch

    pieces = pieces_of(manifests)
    wanted = list(pieces) if names is None else list(names)
    absent = [n for n in wanted if n not in pieces]
    if absent:
        raise CheckpointNotFound(f"step {manifests[0].step} of run {manifests[0].run!r} has no tensor named "
                                 + ", ".join(map(repr, absent[:5])) + (" ..." if len(absent) > 5 else ""))
    out: dict[str, Any] = {}
    plans = []
    for name in wanted:
        rec = pieces[name][0].rec
        out[name] = torch.empty(rec.global_shape, dtype=dtypes.torch_dtype(rec.dtype))
        plans.append(_target(name, out[name], pieces[name]))
    fill(path, plans, pieces, 0, verify)
    if map_location not in (None, "cpu"):
        out = {n: t.to(map_location) for n, t in out.items()}
    out = {n: (t.numpy() if pieces[n][0].rec.numpy else t) for n, t in out.items()}
    first = manifests[0]
    if names is not None or first.state is None:
        return out
    try:
        return state_mod.unflatten(first.state, out.__getitem__)
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{path / layout.manifest_name(0)}: the saved structure (\"state\") is "
                                f"malformed: {exc}; load its tensors by name with ckptd.load(run, step, names=[...]), "
                                "which does not read it, or load another step") from None


def pieces_of(manifests: list[Manifest]) -> dict[str, list[Piece]]:
    """Every stored piece, by the name of its tensor (a rank may hold several pieces of
    one: its later ones are kept under other keys, docs/format.md)."""
    out: dict[str, list[Piece]] = {}
    for m in manifests:
        for key, rec in m.tensors.items():
            out.setdefault(rec.tensor_name(key), []).append(Piece.of(m.rank, key, rec))
    return out


def _saved_structure(path: Path, manifests: list[Manifest], rank: int) -> Any:
    """The saved state with plain values decoded and tensors as ``_TENSOR``: this rank's
    where the checkpoint has it, else rank 0's."""
    m = manifests[rank] if rank < len(manifests) else manifests[0]
    if m.state is None:
        return None
    try:
        return state_mod.unflatten(m.state, lambda name: _TENSOR)
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{path / layout.manifest_name(m.rank)}: the saved structure (\"state\") is "
                                f"malformed: {exc}: load_into cannot match it to your state; ckptd.load(run, step, "
                                "names=[...]) reads the tensors without it, or load another step") from None


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()
_MISSING = object()


def _walk(target: Any, saved: Any, path: tuple[Any, ...], targets: dict[str, Any], missing: list[str],
          step: int) -> None:
    """Collect the tensors of ``target`` by the names they are stored under (``path`` is
    the saved one); set its plain values from ``saved``."""
    import numpy as np
    import torch

    if optim.is_optimizer_state(target) and optim.is_optimizer_state(saved):
        _walk_optimizer(target, saved, path, targets, missing, step)
        return
    if isinstance(target, dict):
        items: Iterable[tuple[Any, Any]] = list(target.items())
        get = (lambda k: saved.get(k, _MISSING)) if isinstance(saved, dict) else (lambda k: _MISSING)
    elif isinstance(target, (list, tuple)):
        items = list(enumerate(target))
        ok = isinstance(saved, (list, tuple))
        get = lambda i: saved[i] if ok and i < len(saved) else _MISSING  # noqa: E731
    else:
        return
    for key, value in items:
        sub = path + (key,)
        if isinstance(value, (torch.Tensor, np.ndarray)):
            targets[state_mod.path_name(sub)] = value
        elif isinstance(value, (dict, list, tuple)):
            _walk(value, get(key), sub, targets, missing, step)
        else:
            old = get(key)
            if old is _MISSING or old is _TENSOR or isinstance(old, (dict, list, tuple)):
                missing.append(state_mod.path_name(sub))
            elif not isinstance(target, tuple):
                target[key] = old


def _walk_optimizer(target: dict, saved: dict, path: tuple[Any, ...], targets: dict[str, Any],
                    missing: list[str], step: int) -> None:
    """An optimizer state: each parameter's state from the saved one of the same
    parameter, whether either names its parameters by number or by name (reader/optim.py);
    the target's ``params`` lists stay as they are (they name its own parameters)."""
    where = "state[" + "][".join(map(repr, path)) + "]" if path else "the state"
    optim.check_has_state(target, saved, where, step)
    keys = optim.param_keys(target, saved, where)
    for param, per in target["state"].items():
        mapped = keys.get(param, _MISSING)
        if mapped is _MISSING:  # not in the target's own groups: nothing says which saved state is its
            missing.append(state_mod.path_name(path + ("state", param)))
        elif isinstance(per, dict):
            _walk(per, saved["state"].get(mapped, _MISSING), path + ("state", mapped), targets, missing, step)
    groups = saved["param_groups"]
    for i, group in enumerate(target["param_groups"]):
        rest = {k: v for k, v in group.items() if k != "params"}
        _walk(rest, groups[i] if i < len(groups) else _MISSING, path + ("param_groups", i), targets, missing, step)
        group.update(rest)
    others = {k: v for k, v in target.items() if k not in ("state", "param_groups")}
    _walk(others, saved, path, targets, missing, step)
    target.update(others)


def _target(name: str, value: Any, stored: list[Piece], placed: dict[Any, Any] | None = None) -> Target:
    """Where ``value`` (a tensor, DTensor or array to fill) wants its bytes, checked
    against what is stored."""
    import numpy as np
    import torch

    if is_dtensor(value):
        piece = describe_dtensor(name, value, placed)
        local, box = piece.local, Box(tuple(piece.shard.offsets), tuple(piece.local.shape))
        global_shape = list(piece.shard.global_shape)
    else:
        local = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        box = Box((0,) * local.dim(), tuple(local.shape))
        global_shape = list(local.shape)
    rec = stored[0].rec
    if rec.global_shape != global_shape:
        raise ValueError(f"tensor {name!r} has shape {global_shape} here, but {rec.global_shape} in the "
                         "checkpoint; build the target with the saved shape")
    want = dtypes.torch_name(local.dtype)
    if rec.dtype != want:
        raise ValueError(f"tensor {name!r} is {want} here, but {rec.dtype} in the checkpoint; "
                         "make the target that dtype (or load it and convert)")
    return Target.of(name, local, box)


def _choose(target: Target, stored: list[Piece], rank: int) -> list[tuple[Piece, Box]]:
    """The stored pieces to read for ``target``, each with the block it gives."""
    whole = [p for p in stored if p.rec.shard is None]
    if whole:  # held whole (per rank, or replicated): one copy, this rank's if it has one
        candidates = [min(whole, key=lambda p: (p.rank != rank, p.rank))]
    else:  # the same block stored twice (replicated shards saved by emit) is read once
        seen: dict[Box, Piece] = {}
        for p in sorted(stored, key=lambda p: p.rank):
            seen.setdefault(p.box, p)
        candidates = list(seen.values())
    first = stored[0].rec
    for p in candidates:
        if p.rec.dtype != first.dtype or p.rec.global_shape != first.global_shape:
            raise CheckpointCorrupt(f"tensor {target.name!r}: rank {p.rank} stored a piece of a {p.rec.dtype} "
                                    f"tensor of shape {p.rec.global_shape}, rank {stored[0].rank} one of a "
                                    f"{first.dtype} tensor of shape {first.global_shape}")
    out = []
    for p in candidates:
        overlap = intersect(p.box, target.box)
        if overlap is not None and overlap.numel:
            out.append((p, overlap))
    # pieces that overlap each other could leave a gap that the count below misses
    for i, (a, box_a) in enumerate(out):
        for b, box_b in out[i + 1:]:
            both = intersect(box_a, box_b)
            if both is not None and both.numel:
                raise CheckpointCorrupt(f"tensor {target.name!r}: the pieces stored by ranks {a.rank} and "
                                        f"{b.rank} overlap at offsets {list(both.offsets)}")
    covered = sum(o.numel for _, o in out)
    if covered != target.box.numel:
        raise CheckpointCorrupt(f"tensor {target.name!r}: the stored pieces cover {covered} of the "
                                f"{target.box.numel} elements at offsets {list(target.box.offsets)} "
                                f"sizes {list(target.box.sizes)}; the checkpoint is incomplete: load another "
                                "step (`ckptd latest RUN --verify` names the newest undamaged one)")
    return out


def fill(path: Path, targets: list[Target], pieces: dict[str, list[Piece]], rank: int, verify: bool) -> None:
    work: list[tuple[Target, Piece, Box]] = []
    for t in targets:
        work += [(t, p, box) for p, box in _choose(t, pieces[t.name], rank)]
    try:
        dir_fd = layout.open_step_dir(path)
    except OSError as exc:
        raise CheckpointCorrupt(f"cannot open the step folder: {exc.strerror}") from None
    files = _Files(dir_fd, path)
    try:
        tasks = _tasks(work, files, verify)
        if len(tasks) <= 1:
            for task in tasks:
                task()
        else:
            with ThreadPoolExecutor(min(READ_THREADS, len(tasks)), thread_name_prefix="ckptd-load") as pool:
                for future in [pool.submit(task) for task in tasks]:
                    future.result()
    finally:
        files.close()
        os.close(dir_fd)
    for t in targets:
        if t.final is not None:
            t.final.copy_(t.buf)


class _Files:
    """The step's data files, each opened once (never through a symlink)."""

    def __init__(self, dir_fd: int, path: Path) -> None:
        self.dir_fd, self.path = dir_fd, path
        self.fds: dict[str, int] = {}

    def fd(self, file: str) -> int:
        if file not in self.fds:
            try:
                self.fds[file] = layout.open_regular(file, dir_fd=self.dir_fd)
            except OSError as exc:
                raise CheckpointCorrupt(f"{self.path / file}: cannot open a file the manifest names: "
                                        f"{exc.strerror or exc}") from None
        return self.fds[file]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _tasks(work: list[tuple[Target, Piece, Box]], files: _Files, verify: bool) -> list[Any]:
    """Closures that each do one read (and copy); independent, to run in any order."""
    tasks: list[Any] = []
    by_piece: dict[tuple[int, str], list[tuple[Target, Box]]] = {}
    for target, piece, box in work:
        if verify or piece.rec.offset is None:  # read whole: checked, or HDF5 without one place
            by_piece.setdefault((piece.rank, piece.key), []).append((target, box))
            if piece.rec.offset is not None:
                files.fd(piece.rec.file)
            continue
        fd = files.fd(piece.rec.file)
        itemsize = dtypes.lookup(piece.rec.dtype).itemsize
        start, length, rows = byte_span(box, piece.box, itemsize)
        t_start, _, t_rows = byte_span(box, target.box, itemsize)
        same = target.buf.dtype == dtypes.torch_dtype(piece.rec.dtype)
        if rows == 1 and t_rows == 1 and same:  # one run in both, one dtype: straight into the target
            dst = _flat_bytes(target)
            for part in range(0, length, SPLIT_BYTES):
                n = min(SPLIT_BYTES, length - part)
                tasks.append(_direct(files, fd, piece, start + part, dst[t_start + part:t_start + part + n]))
        else:
            tasks.append(_span(files, fd, piece, box, target, start, length))
    pieces = {(p.rank, p.key): p for _, p, _ in work}
    for key, wanted in by_piece.items():
        tasks.append(_whole(files, pieces[key], wanted, verify))
    return tasks


def _flat_bytes(target: Target) -> memoryview:
    if target.direct is None:
        import torch

        target.direct = memoryview(target.buf.reshape(-1).view(torch.uint8).numpy())
    return target.direct


def _direct(files: _Files, fd: int, piece: Piece, start: int, dst: memoryview) -> Any:
    return lambda: read_range(fd, files.path / piece.rec.file, piece.key, piece.rec, start, dst)


def _span(files: _Files, fd: int, piece: Piece, box: Box, target: Target, start: int, length: int) -> Any:
    def run() -> None:
        import torch

        raw = torch.empty(length, dtype=torch.uint8)
        read_range(fd, files.path / piece.rec.file, piece.key, piece.rec, start, memoryview(raw.numpy()))
        _copy_out(raw, piece, box, target)
    return run


def _whole(files: _Files, piece: Piece, wanted: list[tuple[Target, Box]], verify: bool) -> Any:
    def run() -> None:
        import torch

        rec = piece.rec
        if rec.offset is None:
            raw = read_tensors(files.path, {piece.key: rec}, verify=verify)[piece.key]
            raw = raw.reshape(-1).view(torch.uint8)
        else:
            raw = torch.empty(rec.nbytes, dtype=torch.uint8)
            if rec.nbytes:
                read_range(files.fd(rec.file), files.path / rec.file, piece.key, rec, 0,
                                  memoryview(raw.numpy()))
            if verify and checksum([memoryview(raw.numpy())] if rec.nbytes else []) != rec.checksum:
                raise CheckpointCorrupt(f"{files.path / rec.file}: tensor {piece.key!r}: does not match "
                                        "its checksum: its bytes changed after the commit; load another step "
                                        "(`ckptd latest RUN --verify` names the newest undamaged one)")
        itemsize = dtypes.lookup(rec.dtype).itemsize
        for target, box in wanted:
            start, length, _ = byte_span(box, piece.box, itemsize)
            _copy_out(raw[start:start + length], piece, box, target)
    return run


def _copy_out(raw: Any, piece: Piece, box: Box, target: Target) -> None:
    """Copy ``box`` out of ``raw``, the bytes of ``piece``'s storage from ``box``'s first
    element on, into the target; ``copy_`` converts the stored dtype to the target's."""
    import torch

    dtype = dtypes.torch_dtype(piece.rec.dtype)
    strides = [1] * len(piece.box.sizes)
    for d in range(len(strides) - 2, -1, -1):
        strides[d] = strides[d + 1] * piece.box.sizes[d + 1]
    src = raw.view(dtype).as_strided(box.sizes, strides) if box.sizes else raw.view(dtype).reshape(())
    with torch.no_grad():
        target.buf[local_slices(box, target.box)].copy_(src)

