"""``[remote.retention]``: the bucket keeps its own set of checkpoints, planned as the
local one (``ckptd.retention.plan``) over the steps complete there: never the newest,
a pinned one, one still uploading or one this daemon has a share of to upload
(``busy``). Manifests go first, so a step stops being complete at the first delete.
"""

from __future__ import annotations

import logging
import time

from .. import layout, retention
from ..config import RetentionConfig
from ..manifest import CheckpointInfo
from . import catalog
from .store import Store

log = logging.getLogger("ckptd.retention")


def plan(store: Store, run: str, policy: RetentionConfig, *, busy: set[int] = frozenset(),
         now: float | None = None) -> tuple[list[CheckpointInfo], list[retention.Decision], dict[int, dict[str, int]]]:
    objects = catalog.run_objects(store, run)
    infos = [i for s, objs in sorted(objects.items()) if (i := catalog.step_info(store, run, s, objs))]
    pinned = {s for s, objs in objects.items() if catalog.is_pinned(objs)} | set(busy)
    decisions = retention.plan(infos, policy, pinned=pinned, now=time.time() if now is None else now)
    return infos, decisions, objects


def prune(store: Store, run: str, policy: RetentionConfig, *, busy: set[int] = frozenset(),
          dry_run: bool = False) -> list[CheckpointInfo]:
    """Apply ``policy`` to the run's steps in the bucket; return the steps complete there
    afterwards (ascending)."""
    if not policy.enabled:
        return catalog.list_checkpoints(store, run, warn=False)
    infos, decisions, objects = plan(store, run, policy, busy=busy)
    gone = set()
    for d in decisions:
        if d.keep or dry_run:
            continue
        names = objects.get(d.step, {})
        manifests = [n for n in names if layout.MANIFEST.fullmatch(n)]
        store.delete(catalog.key(run, d.step, n) for n in manifests)  # first: no longer complete
        store.delete(catalog.key(run, d.step, n) for n in names if n not in manifests)
        gone.add(d.step)
        log.info("retention (remote): removed run=%s step=%d (%d bytes) from %s: %s",
                 run, d.step, d.nbytes, store.url, "; ".join(d.reasons))
    return [i for i in infos if i.step not in gone]
