"""``producer.wait_complete``: until every rank's share of a step is durable in the
remote tier (or, with none, on the shared root), seen through the storage itself,
not through other ranks: no coordinator, no collective (docs/many-nodes.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import index, layout
from .config import default_root, load as load_config
from .errors import CheckpointError
from .manifest import CheckpointInfo
from .remote import catalog, tiers


def wait_complete(run: str, step: int, *, timeout: float | None = None, root: str | os.PathLike[str] | None = None,
                  remote: str | None = None, world_size: int | None = None,
                  tier: str | None = None) -> CheckpointInfo:
    """The step's CheckpointInfo once it is complete in the remote tier (``remote``: a
    URL, "" for none, None for the config's ``[remote]``), else in the root; a
    ``CheckpointError`` naming the ranks still missing after ``timeout`` seconds.
    ``world_size`` (the caller's): no manifest is read until every rank's is listed.
    ``tier="peer"``: until every rank's share is in some peer's memory (docs/tiers.md)."""
    if tier == "peer":
        return _wait_peers(run, step, timeout)
    if tier is not None:
        raise ValueError(f"wait_complete(tier={tier!r}): tier is \"peer\" or None (the remote tier, else the root)")
    store = tiers.open_store(remote)
    poll = load_config().remote.poll_interval
    base = default_root(root)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if store is not None:
            prefix = catalog.step_prefix(run, step)
            objects = {k[len(prefix):]: v for k, v in store.list(prefix).items()}
            info = catalog.step_info(store, run, step, objects, world_size=world_size)
            where, names = store.url, list(objects)
        else:
            path = layout.step_dir(base, run, step)
            info = index.step_info(path)
            where, names = str(base), _names(path)
        if info is not None:
            return info
        if deadline is not None and time.monotonic() >= deadline:
            have = sorted(int(m.group(1)) for n in names if (m := layout.MANIFEST.fullmatch(n)))
            raise CheckpointError(
                f"step {step} of run {run!r} is not complete in {where} after {timeout:g} s: "
                f"the manifests of rank(s) {have or 'none'} are there; every rank's must be "
                "(is each node's daemon running and uploading? see `ckptd status`)")
        time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))


def _names(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _wait_peers(run: str, step: int, timeout: float | None) -> CheckpointInfo:
    from .peer.tier import open_tier

    cfg = load_config()
    peers = open_tier(cfg)
    if peers is None:
        raise CheckpointError("wait_complete(tier=\"peer\") needs a [peer] table in the config "
                              f"({cfg.path or cfg.origin})")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        held = {k: [c for c in v if c[1] == "memory"] for k, v in peers.holdings(run).items()}
        info = peers.step_info(run, step, Path("/nonexistent"), {k: v for k, v in held.items() if v})
        if info is not None:
            return info
        if deadline is not None and time.monotonic() >= deadline:
            have = sorted(r for (s, r), v in held.items() if s == step and v)
            raise CheckpointError(f"step {step} of run {run!r} has no replica in a peer's memory for every rank "
                                  f"after {timeout:g} s: rank(s) {have or 'none'} have one (see `ckptd status`: "
                                  "peer.under_replicated, peer.down)")
        time.sleep(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic())))
