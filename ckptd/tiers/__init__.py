"""The tiers: every place a share can be, behind ``base``'s protocols, in one chain
built from the config: ``local`` (the root), ``peer_relay`` / ``peer`` (the peers'
memory, the readers' part through the daemon and the daemon's own), ``bucket`` (the object store). Readers
loop over ``chain``, the daemon over ``copy_targets``; neither names a tier. A fourth
tier is one module here, one line in ``chain`` and, if the daemon copies to it, in
``_COPIED_TO``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from ..config import Config, default_root, load as load_config
from ..errors import CheckpointError, TierUnavailable
from ..manifest import CheckpointInfo
from . import bucket, local, peer
from .base import CopyTarget, Holding, Tier

_COPIED_TO = (bucket, peer)  # the tiers a daemon may copy shares to, in the order they start
_PEER_TIERS: dict[tuple[str, str, int], Tier] = {}

__all__ = ["CopyTarget", "Holding", "Tier", "TierUnavailable", "chain", "copy_targets", "named", "status_lines",
           "target_names"]


def chain(config: Config | None = None, *, root: str | os.PathLike[str] | None = None,
          remote: str | None = None) -> list[Tier]:
    """The tiers ``config`` (None: the discovered one) has, in the order reads try them:
    the local root (``root``), the peers' memory, the bucket (``remote``: a URL, "" for
    none, None for the config's)."""
    cfg = config or load_config()
    base = default_root(root)
    found: list[Tier | None] = [
        local.LocalTier(root, cfg.remote.poll_interval),
        _peers(cfg, base) if cfg.peer.enabled else None,
        bucket.open_tier(cfg, base, remote),
    ]
    return [t for t in found if t is not None]


def _peers(config: Config, base: Path) -> Tier:
    """One peer tier a process per config and root: a reader asks its node's daemon,
    which alone holds a key to the peers (``peer_relay``)."""
    from .peer_relay import RelayTier

    key = (repr(config), str(base), os.getpid())
    if key not in _PEER_TIERS:
        _PEER_TIERS[key] = RelayTier(config, base)
    return _PEER_TIERS[key]


def copy_targets(config: Config, keep_last: Callable[[str], int],
                 on_complete: Callable[[str, list[CheckpointInfo]], None]) -> list[CopyTarget]:
    """The tiers the daemon copies each committed share to, in the order they start
    (and, reversed, close). ``keep_last(run)``: the run's local retention;
    ``on_complete(run, infos)``: steps became complete in a tier that local retention
    may count (each node with its own root)."""
    found = [m.open_target(config, keep_last, on_complete) for m in _COPIED_TO]
    return [t for t in found if t is not None]


def target_names() -> tuple[str, ...]:
    """Every tier a daemon may copy shares to: each has its key in `ckptd status --json`."""
    return tuple(m.NAME for m in _COPIED_TO)


def status_lines(report: dict[str, Any]) -> list[str]:
    """The lines of `ckptd status` of each tier the daemon's ``report`` has figures of."""
    return [text for m in _COPIED_TO if report.get(m.NAME) for text in m.status_lines(report[m.NAME])]


def named(tiers: list[Tier], name: str | None, config: Config) -> Tier:
    """The tier of the chain called ``name``; None: the last durable one. ValueError for
    a name that is no tier's; CheckpointError for one ``config`` does not have."""
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
