"""Finding complete checkpoints: straight from the checkpoint root, and, where the
config has them, in the other tiers of the chain: the peers, the bucket (docs/tiers.md).

Only manifests decide what is complete: a step folder is a checkpoint once every
rank's manifest exists, all of one attempt (``ckptd.index.one_attempt``). What is on
disk is untrusted: manifests are checked field by field when parsed
(``Manifest.from_json``), and a symlink planted in place of a run folder, a step
folder or a manifest is refused with ``CheckpointCorrupt``. The root itself may be a
symlink.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .. import env, index, layout, tiers
from ..config import default_root, load as load_config
from ..errors import CheckpointCorrupt, CheckpointNotFound
from ..manifest import CheckpointInfo, Manifest
from ..tiers.base import Holding, merge, newest
from ..tiers.local import newest_in, run_dir as _run_dir
from .checks import check

log = logging.getLogger("ckptd.reader")


def list_checkpoints(run: str, *, root: str | os.PathLike[str] | None = None,
                     remote: str | None = None) -> list[CheckpointInfo]:
    """Every complete checkpoint of ``run``, ascending by step, in every tier of the chain
    (``remote``: a URL, "" for none, None for the config's ``[remote]``); ``tiers`` says
    which hold each. A step whose manifest is damaged is not complete: it is left out,
    with a logged warning saying why."""
    infos: list[CheckpointInfo] = []
    for tier in tiers.chain(root=root, remote=remote):
        infos = merge(infos, tier.list(run))
    return infos


def latest(run: str, *, root: str | os.PathLike[str] | None = None,
           verify: bool = False, remote: str | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint of ``run`` in any tier of the chain (``remote`` as
    for ``list_checkpoints``; ``verify=True`` looks at the local root only), or None
    when it has none. See ``latest_local``."""
    if verify:
        return latest_local(run, root=root, verify=True)
    return _latest(tiers.chain(root=root, remote=remote), run)


def _latest(chain: list[tiers.Tier], run: str) -> CheckpointInfo | None:
    """The newest step any tier of ``chain`` holds. A tier out of reach is logged and
    left out once a tier besides the root has answered (docs/tiers.md: the peers answer
    for an unreachable bucket); else its error is the caller's."""
    info: CheckpointInfo | None = None
    for i, tier in enumerate(chain):
        try:
            info = newest(info, tier.latest(run))
        except tier.unreachable as exc:
            if i < 2:  # no tier besides the root answered before it
                raise
            log.warning("the %s tier %s is out of reach (%s); newest step from the tiers before it only",
                        tier.name, tier.where, exc)
    return info


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
        return newest_in(run_dir)
    for _, path in index.step_dirs(run_dir):
        info = index.step_info(path, warn=True)
        if info is None or info.refused:  # replicas that disagree under "refuse" (docs/training.md)
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


def find_in_tiers(run: str, step: int | None, root: str | os.PathLike[str] | None,
                  remote: str | None, *, fill: bool = True) -> tuple[Path, list[Manifest], Holding | None]:
    """The step's folder and manifests: locally if it is complete there (then no
    holding), else in the first tier of the chain that holds it: then also that
    ``Holding`` (the folder is where the step would be locally). A tier whose holding
    ``fills_root`` (the peers): with ``fill``, the shares this root lacks are fetched
    into it first and the step read locally; without, the holding reads them into memory."""
    chain = tiers.chain(load_config(), root=root, remote=remote)  # the config parsed once: 4-8 ms a load
    if len(chain) == 1:
        path, manifests = find(run, step, root)
        return path, manifests, None
    base = default_root(root)
    if step is None:
        info = _latest(chain, run)
        if info is None:
            raise CheckpointNotFound(f"run {run!r} has no complete checkpoint {chain[0].where}"
                                     + "".join(f", {t.where}" for t in chain[1:-1]) + f" nor {chain[-1].where}")
        step = info.step
    local_path = layout.step_dir(base, run, step)
    declined: CheckpointNotFound | None = None
    for tier in chain[1:]:
        if index.step_info(local_path) is not None:
            break  # complete here (filled by a tier before): read locally
        try:
            holding = tier.find(run, step)
        except CheckpointNotFound as exc:  # not there, and the tier says why
            declined = exc
            continue
        if holding is None:
            continue
        if not fill or not holding.fills_root:
            return local_path, holding.manifests, holding
        holding.fill()
    else:
        if declined is not None and index.step_info(local_path) is None:
            raise declined
    path, manifests = find(run, step, root)
    return path, manifests, None


def own_share_here(path: Path, manifest: Manifest) -> bool:
    """This rank's share of the step is committed in the local root (the node that wrote
    it, its disk intact), with the same manifest as the bucket's."""
    try:
        local = index.read_share(path, manifest.rank)
    except (CheckpointCorrupt, OSError):
        return False
    return local is not None and local.time == manifest.time
