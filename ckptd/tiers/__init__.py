"""The tiers (docs/tiers.md): every place a share can be, behind one interface
(``base``), in one chain built from the config.

    local        the local root: where the daemon commits; always first
    peer         the peers' memory ([peer]): the daemon's part (PeerReplica)
    peer_reader  ... and the readers' (PeerTier, PeerHolding; imports ZeroMQ)
    bucket       the object store ([remote]): BucketTier, BucketHolding, BucketReplica

Readers (``ckptd.reader``, ``ckptd.completion``) loop over ``chain``; the daemon's
``Upkeep`` over ``replicas``. Neither names a tier. A fourth tier is one module here
plus one line in ``chain`` (and its module in ``_COPIED_TO`` if the daemon copies
shares to it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError
from ..config import Config, default_root, load as load_config
from ..manifest import CheckpointInfo
from . import bucket, local, peer
from .base import Holding, Replica, Tier

_COPIED_TO = (bucket, peer)  # the tiers a daemon may copy shares to, in the order they start

__all__ = ["Holding", "Replica", "Tier", "chain", "replicas", "named", "replica_names", "status_lines"]


def chain(config: Config | None = None, *, root: str | os.PathLike[str] | None = None,
          remote: str | None = None) -> list[Tier]:
    """The tiers ``config`` (None: the discovered one) has, in the order reads try them:
    the local root (``root``), the peers' memory, the bucket (``remote``: a URL, "" for
    none, None for the config's)."""
    cfg = config or load_config()
    base = default_root(root)
    found: list[Tier | None] = [
        local.LocalTier(root, cfg.remote.poll_interval),
        _peers(cfg, base),
        bucket.open_tier(cfg, base, remote),
    ]
    return [t for t in found if t is not None]


def _peers(config: Config, base: Path) -> Tier | None:
    """The peers with ``[peer]``; their reader (ZeroMQ's) is imported only then: ~60 ms
    of every `ckptd` command's start otherwise."""
    if not config.peer.enabled:
        return None
    from .peer_reader import PeerTier

    return PeerTier(config, base)


def replicas(config: Config, keep_last: Callable[[str], int],
             on_complete: Callable[[str, list[CheckpointInfo]], None]) -> list[Replica]:
    """The tiers the daemon copies each committed share to, in the order they start
    (and, reversed, close): uploads, then replication. ``keep_last(run)``: the run's
    local retention; ``on_complete(run, infos)``: steps became complete in a tier that
    local retention may count (each node with its own root)."""
    found = [m.open_replica(config, keep_last, on_complete) for m in _COPIED_TO]
    return [r for r in found if r is not None]


def replica_names() -> tuple[str, ...]:
    """Every tier a daemon may copy shares to: each has its key in `ckptd status --json`
    (null where the config has no such tier)."""
    return tuple(m.NAME for m in _COPIED_TO)


def status_lines(report: dict[str, Any]) -> list[str]:
    """The lines of `ckptd status` of each tier the daemon's ``report`` has figures of."""
    return [text for m in _COPIED_TO if report.get(m.NAME) for text in m.status_lines(report[m.NAME])]


def named(tiers: list[Tier], name: str | None, config: Config) -> Tier:
    """The tier of the chain called ``name``; None: the last durable one (the bucket
    where there is one, else the root). ValueError for a name that is no tier's; a
    ``ckptd.errors.CheckpointError`` for one ``config`` does not have."""
    if name is None:
        return [t for t in tiers if t.durable][-1]
    for t in tiers:
        if t.name == name:
            return t
    tables = {m.NAME: m.TABLE for m in (local, peer, bucket)}
    if name not in tables:
        raise ValueError(f"tier={name!r}: a tier is one of {', '.join(map(repr, tables))}, or None (the bucket "
                         "where there is one, else the root)")
    raise CheckpointError(f"tier={name!r} needs a [{tables[name]}] table in the config "
                          f"({config.path or config.origin})")
