"""The readers' view of both tiers: which remote tier to consider, and merging what the
local root and the bucket each hold.

``remote=`` on ``ckptd.latest``, ``list_checkpoints`` and ``load``: a URL, ``""`` for
the local root only, or None for the ``[remote] url`` of the discovered config
(``ckptd.config.load()``), if any.
"""

from __future__ import annotations

from ..config import Config, load as load_config
from ..errors import CheckpointNotFound
from ..manifest import CheckpointInfo, Manifest
from . import catalog
from .store import Store


def open_store(remote: str | None, config: Config | None = None) -> Store | None:
    """The remote tier ``remote`` names (None: ``config``'s, by default the discovered
    one), or None."""
    cfg = (config or load_config()).remote
    url = cfg.url if remote is None else remote.rstrip("/")
    if not url:
        return None
    return Store(url, part_bytes=cfg.part_bytes, concurrency=cfg.concurrency)


def merge(local: list[CheckpointInfo], remote: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """One info per step, ascending, naming every tier that holds it (the local copy's
    path where there is one: it is what a reader reads)."""
    by_step = {i.step: i for i in remote}
    for i in local:
        other = by_step.get(i.step)
        tiers = i.tiers + tuple(t for t in (other.tiers if other else ()) if t not in i.tiers)
        by_step[i.step] = _with_tiers(i, tiers)
    return [by_step[s] for s in sorted(by_step)]


def newest(local: CheckpointInfo | None, remote: CheckpointInfo | None) -> CheckpointInfo | None:
    if local is None or remote is None:
        return local or remote
    if local.step == remote.step:
        return _with_tiers(local, local.tiers + remote.tiers)
    return local if local.step > remote.step else remote


def find(store: Store, run: str, step: int | None) -> tuple[CheckpointInfo, list[Manifest]]:
    """A step complete in the bucket (None: the newest) and its manifests, or CheckpointNotFound."""
    objects = catalog.run_objects(store, run)
    if step is None:
        info = catalog.latest(store, run)
        if info is None:
            raise CheckpointNotFound(f"run {run!r} has no complete checkpoint in {store.url}")
        step = info.step
    found = catalog.manifests(store, run, step, objects.get(step, {}))
    if found is None:
        have = sorted(s for s, objs in objects.items() if catalog.step_info(store, run, s, objs))[-10:]
        raise CheckpointNotFound(f"run {run!r} has no complete checkpoint at step {step} in {store.url}; "
                                 f"complete steps there: {', '.join(map(str, have)) or 'none'}")
    path = store.where(catalog.step_prefix(run, step)).rstrip("/")
    return CheckpointInfo.from_manifests(path, found, tiers=(catalog.TIER,)), found


def _with_tiers(info: CheckpointInfo, tiers: tuple[str, ...]) -> CheckpointInfo:
    import dataclasses

    return dataclasses.replace(info, tiers=tiers)
