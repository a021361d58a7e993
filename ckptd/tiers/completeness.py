"""Which steps of a run are complete across the cluster, for retention where each node
has its own root (docs/service.md, "Retention across nodes"): every rank's share of one
attempt committed somewhere (this root, a peer's root, a peer's memory: each peer's
``steps`` summary), or the step complete in the bucket. Start with ``survey``;
``decide`` turns a survey into retention's decisions for this root.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .. import index, layout, retention
from ..config import Config, RetentionConfig
from ..errors import CheckpointCorrupt
from ..manifest import CheckpointInfo, Manifest
from ..remote import catalog
from ..remote.store import RemoteError, Store
from . import bucket, local, peer

log = logging.getLogger("ckptd.retention")

FLIGHT = "in flight: the newest step here"
ASKED_ALONE = 64  # older steps of this root asked of the peers one by one, in one pass at most


class Summaries(Protocol):
    """The peers as retention asks them (``peer_reader.PeerTier``)."""

    def summary(self, run: str, step: int | None = None) -> dict[int, dict[int, list[Any]]]: ...


def open_peers(config: Config) -> Summaries:
    """The peers of a config with ``[peer]``, asked as a reader on this node asks them."""
    from .peer_reader import PeerTier

    return PeerTier(config, config.root).discovery


@dataclass
class Survey:
    """One run as this root and the cluster hold it."""

    run: str
    here: dict[int, list[Manifest]]  # step -> this root's committed shares of it
    complete: dict[int, tuple[str, ...]] = field(default_factory=dict)  # step -> the tiers it is complete in
    ranks: dict[int, tuple[set[int], int]] = field(default_factory=dict)  # step -> (ranks committed anywhere, world)


def local_shares(run_dir: Path) -> dict[int, list[Manifest]]:
    """step -> the shares committed in this run folder (every file they name there)."""
    out: dict[int, list[Manifest]] = {}
    for step, path in index.step_dirs(run_dir):
        shares = []
        for rank in committed_ranks(path):
            try:
                if (share := index.read_share(path, rank)) is not None:
                    shares.append(share)
            except (CheckpointCorrupt, OSError) as exc:  # a damaged share is no share: `ckptd verify` names it
                log.warning("retention: %s", exc)
        if shares:
            out[step] = shares
    return out


def committed_ranks(step_path: Path) -> list[int]:
    """The ranks whose manifest is in a step folder (their shares may be damaged)."""
    try:
        names = os.listdir(step_path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := layout.MANIFEST.fullmatch(n)))


def survey(run: str, run_dir: Path, peers: Summaries | None, store: Store | None,
           known: dict[int, tuple[str, ...]] | None = None) -> Survey:
    """Where each step of ``run`` this root holds is complete. ``store``: the bucket;
    ``known``: steps already found complete, not asked again (None: every tier is
    asked of every step, to say where each is complete)."""
    out = Survey(run, local_shares(run_dir))
    seen: dict[int, dict[int, list[Any]]] = {}
    if peers is not None:
        seen = peers.summary(run)
        older = [s for s in sorted(out.here, reverse=True) if s not in seen and s not in (known or {})]
        for step in older[:ASKED_ALONE]:  # beyond the peers' newest: a backlog, or keep_every's
            seen.update(peers.summary(run, step))
    for step, shares in out.here.items():
        tiers = (known or {}).get(step) or _where(shares, seen.get(step, {}))
        if store is not None and (known is None or not tiers) and _in_bucket(store, run, step):
            tiers += (bucket.NAME,)
        if tiers:
            out.complete[step] = tiers
        else:
            out.ranks[step] = _ranks(shares, seen.get(step, {}))
    return out


def _in_bucket(store: Store, run: str, step: int) -> bool:
    """Whether the step is complete in the bucket; False (logged) when it is out of reach."""
    prefix = catalog.step_prefix(run, step)
    try:
        objects = {k[len(prefix):]: v for k, v in store.list(prefix).items()}
        return catalog.step_info(store, run, step, objects) is not None
    except (OSError, RemoteError) as exc:
        log.warning("retention: %s is out of reach, its steps are not counted: %s", store.url, exc)
        return False


def _where(shares: list[Manifest], seen: dict[int, list[Any]]) -> tuple[str, ...]:
    """Where a step is complete short of the bucket: in this root alone, or with the peers."""
    groups: dict[tuple[str | None, int], set[int]] = {}
    for m in shares:
        groups.setdefault((m.attempt, m.world_size), set()).add(m.rank)
    here = any(len(ranks) == world for (_, world), ranks in groups.items())
    for rank, copies in seen.items():
        for c in copies:
            groups.setdefault((c.attempt, c.world_size), set()).add(rank)
    across = any(ranks >= set(range(world)) for (_, world), ranks in groups.items())
    return (local.NAME,) if here else (peer.NAME,) if across else ()


def _ranks(shares: list[Manifest], seen: dict[int, list[Any]]) -> tuple[set[int], int]:
    ranks = {m.rank for m in shares} | set(seen)
    return ranks, max(m.world_size for m in shares)


def decide(s: Survey, run_dir: Path, policy: RetentionConfig, *, now: float,
           protect: set[int]) -> list[retention.Decision]:
    """Retention's decisions for the steps this root holds of ``s.run``, bounded whatever
    the cluster completes (docs/service.md, "Retention across nodes"): the policy counts
    every step held, complete across the cluster or not, and keeps the newest complete
    one as its newest; the newest step held, while not complete, is in flight and kept.
    Until a step is known complete, no step that is not is removed: the newest complete
    one cannot be told. Each decision says where the step is complete."""
    newest = max(s.complete, default=None)
    held = sorted(s.here) if s.complete else []
    flight = max(s.here, default=None)
    keep = dict.fromkeys(protect, retention.UPLOADING)
    if flight not in s.complete and flight is not None:
        keep[flight] = FLIGHT
    infos = [CheckpointInfo.from_manifests(str(layout.step_dir(run_dir.parent, s.run, st)), s.here[st])
             for st in held]
    decisions = retention.plan(infos, policy, pinned=retention.pinned_steps(run_dir, held), now=now,
                               protect=keep, newest=newest)
    for d in decisions:
        d.reasons.append(_standing(s, d.step, newest, flight))
    for st in sorted(set(s.here) - set(held)):
        ranks, world = s.ranks[st]
        d = retention.Decision(st, True, [f"not complete across the cluster: rank(s) {sorted(ranks)} of {world} "
                                          "committed anywhere (in flight, or its other shares are out of reach); "
                                          "no step is known complete yet"], sum(m.nbytes for m in s.here[st]))
        decisions.append(d)
    return sorted(decisions, key=lambda d: d.step)


def _standing(s: Survey, step: int, newest: int | None, flight: int | None) -> str:
    if step in s.complete:
        return f"complete across the cluster in: {', '.join(s.complete[step])}"
    ranks, world = s.ranks[step]
    held = f"not complete across the cluster: rank(s) {sorted(ranks)} of {world} committed anywhere"
    if step == flight:
        return held
    if newest is not None and step < newest:
        return f"{held}, older than step {newest}, which is: it never completes"
    return (f"{held}, newer than step {newest}, the newest complete: the rules count it as if complete, so that "
            "the disk stays bounded while the cluster lags")


def apply(s: Survey, run_dir: Path, policy: RetentionConfig, *, now: float, dry_run: bool = False,
          protect: set[int] | None = None) -> tuple[list[retention.Decision], list[Path]]:
    """``decide``, then (unless ``dry_run``) make the removals invisible; the decisions
    and the trash folders the caller removes (``retention.apply``'s contract)."""
    decisions = decide(s, run_dir, policy, now=now, protect=protect or set())
    trash = []
    for d in decisions:
        if not d.keep and not dry_run and (t := retention.delete(run_dir, d.step)) is not None:
            trash.append(t)
            log.info("retention: removed run=%s step=%d (%d bytes): %s", s.run, d.step, d.nbytes, "; ".join(d.reasons))
    return decisions, trash


def whole_here(s: Survey) -> set[int]:
    """The steps complete in this root alone (what its ``latest`` pointer may name)."""
    return {step for step, tiers in s.complete.items() if local.NAME in tiers}
