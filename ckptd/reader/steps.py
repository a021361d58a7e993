"""Finding complete checkpoints: straight from the checkpoint root, and, where the
config has them, with the peers and in the remote tier (docs/tiers.md).

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
from typing import TYPE_CHECKING

from .. import env, index, layout
from ..config import Config, default_root, load as load_config
from ..errors import CheckpointCorrupt, CheckpointNotFound
from ..manifest import CheckpointInfo, Manifest
from ..names import check_run
from ..remote import catalog, tiers as remote_tiers
from ..remote.store import RemoteError
from .checks import check
from .tiers import RemoteSource, Source

if TYPE_CHECKING:
    from ..peer.tier import PeerTier

log = logging.getLogger("ckptd.reader")


def _run_dir(run: str, root: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    check_run(run)
    base = default_root(root)
    run_dir = base / run
    if os.path.islink(run_dir):
        raise CheckpointCorrupt(
            f"{run_dir} is a symlink; ckptd never reads through symlinks below the checkpoint "
            "root: put the run's folder itself there, or pass its parent as the root"
        )
    return base, run_dir


def _peer_tier(cfg: Config) -> PeerTier | None:
    """The peer tier where ``[peer]`` is set, else None. Its module (ZeroMQ's) is imported
    only then: ~60 ms of every `ckptd` command's start otherwise."""
    if not cfg.peer.enabled:
        return None
    from ..peer import tier as peer_tier

    return peer_tier.open_tier(cfg)


def list_checkpoints(run: str, *, root: str | os.PathLike[str] | None = None,
                     remote: str | None = None) -> list[CheckpointInfo]:
    """Every complete checkpoint of ``run``, ascending by step, in the local root and
    (``remote``: a URL, "" for none, None for the config's ``[remote]``) the remote
    tier; ``tiers`` says which hold each. A step whose manifest is damaged is not
    complete: it is left out, with a logged warning saying why."""
    _, run_dir = _run_dir(run, root)
    steps = index.scan_run(run_dir, warn=True)
    local = [steps[s] for s in sorted(steps)]
    store = remote_tiers.open_store(remote)
    return remote_tiers.merge(local, catalog.list_checkpoints(store, run)) if store else local


def latest(run: str, *, root: str | os.PathLike[str] | None = None,
           verify: bool = False, remote: str | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint of ``run`` in the local root or the remote tier
    (``remote`` as for ``list_checkpoints``; ``verify=True`` looks at the local root
    only), or None when it has none. See ``latest_local``."""
    cfg = None if verify else load_config()  # once: both tiers are in it (parsing it twice cost a load 4-8 ms)
    store = None if cfg is None else remote_tiers.open_store(remote, cfg)
    local = latest_local(run, root=root, verify=verify)
    peers = None if cfg is None else _peer_tier(cfg)
    if peers is not None:  # every rank's share here or with a peer (docs/tiers.md)
        local = peers.latest(check_run(run), default_root(root)) or local  # counts the local shares too
        if store is not None:
            try:
                return remote_tiers.newest(local, catalog.latest(store, run))
            except (OSError, RemoteError) as exc:  # the peers answer for it: docs/tiers.md
                log.warning("the remote tier %s is unreachable (%s); newest step from the local root and "
                            "the peers only", store.url, exc)
                return local
    return remote_tiers.newest(local, catalog.latest(store, run)) if store else local


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
        return index.latest_from_pointer(run_dir) or index.latest_by_scan(run_dir, warn=True)
    for _, path in index.step_dirs(run_dir):
        info = index.step_info(path, warn=True)
        if info is None or info.refused:  # replicas that disagree under "refuse" (docs/replicas.md)
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
                   remote: str | None, *, fill: bool = True) -> tuple[Path, list[Manifest], Source | None]:
    """The step's folder and manifests: locally if it is complete there (then no
    source), else with the peers, else in the remote tier: then also the ``Source``
    that holds it (the folder is where it would be locally). With peers: ``fill``
    fetches the shares this root lacks into it first; without, the source reads them
    into memory."""
    cfg = load_config()  # once: both tiers are in it (parsing it twice cost a load 4-8 ms)
    store = remote_tiers.open_store(remote, cfg)
    peers = _peer_tier(cfg)
    if peers is not None:  # local disk, then peers' memory, then the remote tier: docs/tiers.md
        base = default_root(root)
        if step is None:
            info = latest(run, root=root, remote=store.url if store else "")
            if info is None:
                raise CheckpointNotFound(f"run {run!r} has no complete checkpoint under {base}, with its peers"
                                         + (f" nor in {store.url}" if store else ""))
            step = info.step
        local_path = layout.step_dir(base, check_run(run), step)
        if index.step_info(local_path) is None:
            source = peers.source(run, step, base)
            if source is not None and not fill:
                return local_path, source.manifests, source
            if source is not None:
                source.fill()
            if index.step_info(local_path) is not None:
                store = None  # complete here now: read locally
    if store is not None:
        if step is None:
            info = latest(run, root=root, remote=store.url)
            if info is None:
                raise CheckpointNotFound(f"run {run!r} has no complete checkpoint under {default_root(root)} "
                                         f"nor in {store.url}")
            step = info.step
        local_path = layout.step_dir(default_root(root), check_run(run), step)
        if index.step_info(local_path) is None:  # not complete here: the bucket's copy
            _, manifests = remote_tiers.find(store, run, step)
            return local_path, manifests, RemoteSource(store, run, step, manifests, default_root(root))
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
