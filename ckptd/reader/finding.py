"""Finding complete checkpoints in the tiers of the chain (``ckptd.tiers``): the local
root, and where the config has them the peers and the bucket. Only manifests decide
what is complete; what is on disk is untrusted (``Manifest.from_json``, no symlink
below the root). Start at ``open_step`` (a step's ``Holding``) and ``latest``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

from .. import env, index, tiers
from ..config import Config, load as load_config
from ..errors import CheckpointCorrupt, CheckpointNotFound
from ..manifest import CheckpointInfo, Manifest
from ..errors import TierUnavailable
from ..tiers.base import Holding, merge, newest
from ..tiers.local import LocalTier, newest_in, run_dir as _run_dir
from .agree import agreed, group
from .checks import check

log = logging.getLogger("ckptd.reader")


def list_checkpoints(run: str, *, root: str | os.PathLike[str] | None = None,
                     remote: str | None = None, config: Config | None = None) -> list[CheckpointInfo]:
    """Every complete checkpoint of ``run``, ascending by step, in every tier of the chain
    of ``config`` (None: the discovered one; ``remote``: a URL, "" for none, None for the
    config's ``[remote]``); ``tiers`` says which hold each. A step whose manifest is
    damaged is left out, with a warning."""
    infos: list[CheckpointInfo] = []
    for tier in tiers.chain(config, root=root, remote=remote):
        infos = merge(infos, tier.steps(run))
    return infos


def latest(run: str, *, root: str | os.PathLike[str] | None = None, verify: bool = False,
           remote: str | None = None, config: Config | None = None, agree: bool = False) -> CheckpointInfo | None:
    """The newest complete checkpoint of ``run`` in any tier of the chain (``remote`` and
    ``config`` as for ``list_checkpoints``; ``verify=True`` looks at the local root only),
    or None when it has none. See ``latest_local``.

    ``agree=True``, under a process group of more than one rank: the newest step that
    every rank can read, the same on every rank (None on all, or the same error on all:
    ``agree.agreed``); a collective, so every rank must call it. Without a group, the same
    as ``agree=False``."""
    if agree:
        return agreed(run, _lookup(run, root, verify, remote, config))
    if verify:
        return latest_local(run, root=root, verify=True)
    return _latest(tiers.chain(config, root=root, remote=remote), run)


def _lookup(run: str, root: str | os.PathLike[str] | None, verify: bool, remote: str | None,
            config: Config | None, local: bool = False) -> Callable[[int | None], CheckpointInfo | None]:
    """``latest``'s lookup (``local``: in the local root only), given the newest step it
    may answer (None: any)."""
    chain: list[tiers.Tier] = []

    def newest_at_most(bound: int | None) -> CheckpointInfo | None:
        if verify or local:
            return latest_local(run, root=root, verify=verify, at_most=bound)
        if not chain:
            chain.extend(tiers.chain(config, root=root, remote=remote))
        if bound is None:
            return _latest(chain, run)
        older = [i for i in _steps(chain, run) if i.step <= bound]
        return older[-1] if older else None
    return newest_at_most


def _latest(chain: list[tiers.Tier], run: str) -> CheckpointInfo | None:
    """The newest step any tier of ``chain`` holds. A tier out of reach is left out, with
    a warning, when two others answered (the peers answer for a bucket out of reach,
    and the bucket for silent peers); else its error is the caller's."""
    info: CheckpointInfo | None = None
    out_of_reach: list[tuple[tiers.Tier, TierUnavailable]] = []
    for tier in chain:
        try:
            info = newest(info, tier.latest(run))
        except TierUnavailable as exc:
            out_of_reach.append((tier, exc))
    if out_of_reach and len(chain) - len(out_of_reach) < 2:
        raise out_of_reach[0][1]
    for tier, why in out_of_reach:
        log.warning("the %s tier %s is out of reach (%s); newest step from the others only", tier.name, tier.where, why)
    return info


def latest_local(run: str, *, root: str | os.PathLike[str] | None = None,
                 verify: bool = False, at_most: int | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint of ``run``, or None when it has none.

    Reads the ``<run>/latest`` pointer the daemon keeps, and falls back to a scan
    of the run's step folders when the pointer is missing or names a step that is
    no longer complete. ``verify=True`` reads every tensor of each candidate,
    newest first, and returns the newest that passes verification (``verify``),
    skipping damaged ones with a logged warning; None when none passes. ``at_most``:
    the newest of the steps up to that one (scanned).
    """
    _, run_dir = _run_dir(run, root)
    if not verify and at_most is None:
        return newest_in(run_dir)
    for step, path in index.step_dirs(run_dir):
        if at_most is not None and step > at_most:
            continue
        info = index.step_info(path, warn=True)
        if info is None or info.refused:
            continue
        try:
            manifests = index.read_manifests(path)
        except CheckpointCorrupt as exc:  # replaced since step_info looked
            problems = [str(exc)]
        else:
            problems = (check(path, manifests) if verify else []) if manifests else ["no longer complete"]
        if not problems:
            return info
        log.warning("run %r step %d is damaged; skipped: %s%s", run, info.step, problems[0],
                    f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
    return None


def find(run: str, step: int | None, root: str | os.PathLike[str] | None) -> tuple[Path, list[Manifest]]:
    """The step folder and manifests of ``step`` (None: the newest) in the local root,
    or CheckpointNotFound; CheckpointCorrupt if its manifests are damaged."""
    base, run_dir = _run_dir(run, root)
    if not run_dir.is_dir():
        raise CheckpointNotFound(f"run {run!r} has no checkpoints under {base}")
    holding = open_step(run, step, [LocalTier(root)])
    return holding.path, holding.manifests


def open_step(run: str, step: int | None, chain: list[tiers.Tier]) -> Holding:
    """``step`` (None: the newest) as the first tier of ``chain`` that holds it holds it;
    CheckpointNotFound naming the complete steps when none does."""
    if step is None:
        info = _latest(chain, run)
        if info is None:
            raise CheckpointNotFound(f"run {run!r} has no checkpoints {_wheres(chain)}: no step of it is complete")
        step = info.step
    for tier in chain:
        holding = tier.open(run, step)
        if holding is not None:
            return holding
    have = [i.step for i in _steps(chain, run)]
    raise CheckpointNotFound(f"run {run!r} has no complete checkpoint at step {step}; complete steps: "
                             + (", ".join(map(str, have[-10:])) or "none")
                             + (" (newest 10 shown)" if len(have) > 10 else "") + f" ({_wheres(chain)})")


def agreed_step(run: str, root: str | os.PathLike[str] | None, remote: str | None = None, *,
                local: bool = False) -> int | None:
    """Under a process group of more than one rank, the step ``latest(agree=True)`` agrees
    on (``local``: looking in the local root only), or the same ``CheckpointNotFound`` on
    every rank when no rank has one; else None (each process takes its own newest)."""
    dist = group()
    if dist is None:
        return None
    info = agreed(run, _lookup(run, root, False, remote, None, local))
    if info is None:
        raise CheckpointNotFound(f"run {run!r} has no checkpoints on any of the {dist.get_world_size()} "
                                 "ranks of this job: no step of it is complete")
    return info.step


def open_in_tiers(run: str, step: int | None, root: str | os.PathLike[str] | None, remote: str | None) -> Holding:
    """``open_step`` over the chain of the discovered config."""
    return open_step(run, step, tiers.chain(load_config(), root=root, remote=remote))


def _steps(chain: list[tiers.Tier], run: str) -> list[CheckpointInfo]:
    infos: list[CheckpointInfo] = []
    for tier in chain:
        try:
            infos = merge(infos, tier.steps(run))
        except TierUnavailable:
            continue
    return infos


def _wheres(chain: list[tiers.Tier]) -> str:
    """Where the chain looked: "under /ckpt, with its peers nor in s3://b/p"."""
    *first, last = [t.where for t in chain]
    return ", ".join(first) + " nor " + last if first else last


def pick_rank(manifests: list[Manifest], rank: int | None) -> Manifest:
    """The manifest of ``rank`` (None: ``$RANK``, or 0 in a one-rank checkpoint)."""
    world = manifests[0].world_size
    if rank is None:
        given = env.rank()
        if world == 1:
            rank = 0
        elif given is not None:
            rank = given
        else:
            raise ValueError(f"this checkpoint has {world} ranks; pass rank= (or set RANK)")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is out of range: this checkpoint has {world} ranks")
    return manifests[rank]
