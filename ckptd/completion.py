"""``producer.wait_complete``: until every rank's share of a step is durable in a tier
(by default the last durable one of the chain: the bucket where there is one, else the
shared root), seen through the storage itself, not through other ranks: no
coordinator, no collective (docs/runbook.md)."""

from __future__ import annotations

import os
import time

from . import tiers
from .config import load as load_config
from .errors import CheckpointError
from .manifest import CheckpointInfo


def wait_complete(run: str, step: int, *, timeout: float | None = None, root: str | os.PathLike[str] | None = None,
                  remote: str | None = None, world_size: int | None = None,
                  tier: str | None = None) -> CheckpointInfo:
    """The step's CheckpointInfo once it is complete in the remote tier (``remote``: a
    URL, "" for none, None for the config's ``[remote]``), else in the root; a
    ``CheckpointError`` naming the ranks still missing after ``timeout`` seconds.
    ``world_size`` (the caller's): no manifest is read until every rank's is listed.
    ``tier`` names the tier to wait for instead (``"peer"``: until every rank's share is
    in some peer's memory, docs/tiers.md)."""
    cfg = load_config()
    target = tiers.named(tiers.chain(cfg, root=root, remote=remote), tier, cfg)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        info, missing = target.complete(run, step, world_size)
        if info is not None:
            return info
        if deadline is not None and time.monotonic() >= deadline:
            raise CheckpointError(missing(timeout))  # type: ignore[arg-type]
        poll = target.poll_interval
        time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))
