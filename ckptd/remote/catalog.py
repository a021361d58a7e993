"""What the bucket holds: the local root's layout under the URL's prefix, each rank's
manifest uploaded after its files (an object store has no rename: that order is the
commit protocol). A step is complete under the local rule: every rank's manifest, of
one attempt, and every file each names at its full size. Manifests are untrusted
input (``Manifest.from_json``). Start at ``latest`` and ``manifests``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from .. import index, layout
from ..errors import CheckpointCorrupt
from ..manifest import MAX_MANIFEST_BYTES, CheckpointInfo, Manifest
from ..retention import PIN_FILE
from .store import Store

log = logging.getLogger("ckptd.remote")

TIER = "remote"


def step_prefix(run: str, step: int) -> str:
    return f"{run}/{layout.step_dir_name(step)}/"


def key(run: str, step: int, name: str) -> str:
    return step_prefix(run, step) + name


def run_objects(store: Store, run: str) -> dict[int, dict[str, int]]:
    """Every object of ``run``, by step: {step: {file name: size}}."""
    steps: dict[int, dict[str, int]] = {}
    for k, size in store.list(f"{run}/").items():
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == run and (step := layout.parse_step_dir(parts[1])) is not None:
            steps.setdefault(step, {})[parts[2]] = size
    return steps


def read_manifest(store: Store, run: str, step: int, rank: int) -> Manifest:
    k = key(run, step, layout.manifest_name(rank))
    m = Manifest.from_json(store.get(k, MAX_MANIFEST_BYTES), store.where(k))
    if (m.run, m.step, m.rank) != (run, step, rank):
        raise CheckpointCorrupt(f"{store.where(k)} holds the manifest of run {m.run!r} step {m.step} rank {m.rank}")
    return m


def read_manifests(store: Store, run: str, step: int, ranks: list[int]) -> list[Manifest]:
    """``ranks``' manifests, read ``store.concurrency`` at a time: a reader's lookup
    waits on one round trip per batch, not per rank."""
    if len(ranks) < 2:
        return [read_manifest(store, run, step, r) for r in ranks]
    with ThreadPoolExecutor(min(store.concurrency, len(ranks)), thread_name_prefix="ckptd-manifests") as pool:
        return list(pool.map(lambda r: read_manifest(store, run, step, r), ranks))


def manifests(store: Store, run: str, step: int, objects: dict[str, int], *,
              world_size: int | None = None) -> list[Manifest] | None:
    """All ranks' manifests of a step complete in the bucket, else None; a manifest that
    is damaged raises CheckpointCorrupt. ``world_size``, when the caller knows it, spares
    reading any manifest until all of them are listed (``wait_complete`` polls)."""
    ranks = sorted(int(m.group(1)) for n in objects if (m := layout.MANIFEST.fullmatch(n)))
    if not ranks or (world_size is not None and ranks != list(range(world_size))):
        return None
    # ranks 0 to n - 1 listed: all read at once, else the first says whether more are due
    read = read_manifests(store, run, step, ranks if ranks == list(range(len(ranks))) else ranks[:1])
    if ranks != list(range(read[0].world_size)):
        return None
    # the local rule (index.one_attempt): shares of two attempts of the job, one left by
    # a node that died and one saved again after the restart, never make a step complete
    found = index.one_attempt(read + read_manifests(store, run, step, ranks[len(read):]),
                              store.where(step_prefix(run, step)))
    if found is None:
        return None
    for m in found:
        for file, size in _needed(m).items():
            if objects.get(file, -1) < size:
                return None  # a manifest ahead of its data: not uploaded by ckptd, or damaged
    return found


def _needed(m: Manifest) -> dict[str, int]:
    """Each object of the share and the least size it must have (compressed: its own)."""
    need = dict(m.files)
    for t in m.tensors.values():
        if t.offset is not None:
            need[t.file] = max(need.get(t.file, 0), t.offset + t.nbytes)
    need.update({file: p.size for file, p in m.compression.items()})
    return need


def step_info(store: Store, run: str, step: int, objects: dict[str, int], *,
              warn: bool = False, world_size: int | None = None) -> CheckpointInfo | None:
    found = _complete(store, run, step, objects, warn=warn, world_size=world_size)
    return None if found is None else found[0]


def _complete(store: Store, run: str, step: int, objects: dict[str, int], *, warn: bool = False,
              world_size: int | None = None) -> tuple[CheckpointInfo, list[Manifest]] | None:
    try:
        found = manifests(store, run, step, objects, world_size=world_size)
    except (CheckpointCorrupt, FileNotFoundError) as exc:
        (log.warning if warn else log.debug)("remote run %r step %d is not complete: %s", run, step, exc)
        return None
    if found is None:
        return None
    path = store.where(step_prefix(run, step)).rstrip("/")
    return CheckpointInfo.from_manifests(path, found, tiers=(TIER,)), found


def list_checkpoints(store: Store, run: str, *, warn: bool = True) -> list[CheckpointInfo]:
    """Every step complete in the bucket, ascending."""
    out = []
    for step, objects in sorted(run_objects(store, run).items()):
        info = step_info(store, run, step, objects, warn=warn)
        if info is not None:
            out.append(info)
    return out


def latest(store: Store, run: str) -> CheckpointInfo | None:
    """The newest step complete in the bucket (manifests read newest first, until one is)."""
    found = newest(store, run)
    return None if found is None else found[0]


def newest(store: Store, run: str) -> tuple[CheckpointInfo, list[Manifest]] | None:
    """``latest``, with the step's manifests."""
    for step, objects in sorted(run_objects(store, run).items(), reverse=True):
        found = _complete(store, run, step, objects, warn=True)
        if found is not None and not found[0].refused:
            return found
    return None


def is_pinned(objects: dict[str, int]) -> bool:
    return PIN_FILE in objects
