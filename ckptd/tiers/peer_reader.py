"""The peer tier as the daemon reads it with its key (``PeerTier``, for retention and for
its node's readers' ``recover``; it imports ZeroMQ): a step is complete when every
rank's share is in the local root or with some peer. Who holds what is ``peer_discovery``, the bytes ``peer_transfer``,
their landing in the root ``landing``. Start at ``PeerTier.open``.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar


from .. import index, layout
from ..config import Config
from ..errors import CheckpointCorrupt, CheckpointNotFound, ProtocolError
from ..manifest import CheckpointInfo, Manifest, TensorRecord
from ..peer import messages
from ..peer.backoff import Backoff
from . import landing
from .files import read_tensors
from .peer import NAME
from .local import NAME as ROOT
from .peer_discovery import Held, PeerDiscovery, local_shares
from .peer_transfer import PeerTransfer, share_files

log = logging.getLogger("ckptd.peer")

FETCH_THREADS = 4  # shares landed at once: a recovery fans in from several peers
FAILED = (CheckpointCorrupt, messages.PeerDown, messages.PeerRefused, ProtocolError)
T = TypeVar("T")


class PeerTier:
    """The peers' memory and disks, with the local root's shares counted in."""

    name = NAME
    where = "with its peers"
    durable = False  # memory: gone with the partners' daemons
    poll_interval = 0.2

    def __init__(self, config: Config, base: Path | None = None, silent: Backoff | None = None) -> None:
        self.config, self.cfg = config, config.peer
        self.base = base or config.root
        self.discovery = PeerDiscovery(config, silent)
        self.fetched = {"fetched_shares": 0, "fetched_bytes": 0}  # landed in the root from the peers
        self._counting = threading.Lock()

    def count_fetched(self, nbytes: int) -> None:
        with self._counting:
            self.fetched["fetched_shares"] += 1
            self.fetched["fetched_bytes"] += nbytes

    @functools.cached_property
    def transfer(self) -> PeerTransfer:
        return PeerTransfer(self.cfg, self.discovery.keys)

    def latest(self, run: str) -> CheckpointInfo | None:
        """The newest step whose every rank's share is in the root or with a peer: one
        ``steps`` answer from each peer, then the manifests of the candidate's ranks the
        root lacks; an ``open`` of it that follows uses them."""
        return self._patiently(functools.partial(self._latest, run), f"the newest step of run {run!r}")

    def _latest(self, run: str, discovery: PeerDiscovery) -> CheckpointInfo | None:
        seen = discovery.summary(run)
        run_dir = self.base / run
        local_steps = {s for s, _ in index.step_dirs(run_dir)} if run_dir.is_dir() else set()
        for step in sorted(set(seen) | local_steps, reverse=True):
            path = layout.step_dir(self.base, run, step)
            held = discovery.resolve(run, step, path, seen.get(step, {}))
            info = step_info(step, path, held)
            if info is not None and not info.refused:
                discovery.learn(self.base, run, step, held)
                return info
        return None

    def _patiently(self, find: Callable[[PeerDiscovery], T | None], what: str) -> T | None:
        """``find`` with the usual discovery; when it finds nothing while a peer fell
        silent, once more, waiting longer for that peer (a resumed job must not start
        over because a peer answered late)."""
        found = find(self.discovery)
        if found is not None or not (silent := self.discovery.newly_silent()):
            return found
        patient = self.discovery.patiently(silent)
        log.info("peer tier: %s: %s did not answer; asked again, waiting up to %g s", what, ", ".join(silent),
                 patient.wait)
        found = find(patient)
        if found is None and (still := [e for e in silent if self.discovery.silent.failures(e)]):
            log.warning("peer tier: %s: %s did not answer within %g s; what they hold is not counted", what,
                        ", ".join(still), patient.wait)
        return found

    def steps(self, run: str) -> list[CheckpointInfo]:
        """None listed: the peers hold only the newest steps, for ``latest`` and loads."""
        return []

    def open(self, run: str, step: int) -> PeerHolding | None:
        return self._patiently(functools.partial(self._open, run, step), f"run {run!r} step {step}")

    def _open(self, run: str, step: int, discovery: PeerDiscovery) -> PeerHolding | None:
        path = layout.step_dir(self.base, run, step)
        held = discovery.held(run, step, path, self.base)
        info = step_info(step, path, held)
        if info is None:
            return None
        manifests = [landing.read_share(path, r) or held[(step, r)][0][2] for r in range(info.world_size)]
        return PeerHolding(self, run, step, held, manifests)

    def completion(self, run: str, step: int,
                   world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        """Every rank's share in some peer's memory (the root and the peers' disks do not count)."""
        nowhere = Path("/nonexistent")
        seen = self.discovery.summary(run, step).get(step, {})
        memory = {r: m for r, copies in seen.items() if (m := [c for c in copies if c.where == "memory"])}
        info = step_info(step, nowhere, self.discovery.resolve(run, step, nowhere, memory))
        have = sorted(memory)
        return info, lambda timeout: (
            f"after {timeout:g} s, step {step} of run {run!r} has no replica in a peer's memory for every rank: "
            f"rank(s) {have or 'none'} have one (see `ckptd status`: peer.under_replicated, peer.down)")


class PeerHolding:
    """A step the local root and the peers hold together: the shares a read needs are
    landed in the root from the peers, then read there."""

    where = "the peers' memory"

    def __init__(self, tier: PeerTier, run: str, step: int, held: Held, manifests: list[Manifest]) -> None:
        self.tier, self.run, self.step, self.held = tier, run, step, held
        self.manifests = manifests
        self.path = layout.step_dir(tier.base, run, step)

    def read(self, manifest: Manifest, records: dict[str, TensorRecord], into: dict[str, Any] | None = None, *,
             verify: bool = False, mapped: bool = False,
             convert: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
        """``records`` read from the root, the shares it lacks landed there first."""
        self.materialize(sorted({r for rec in records.values() if (r := layout.file_rank(rec.file)) is not None}))
        return read_tensors(self.path, records, verify=verify, into=into, mapped=mapped, convert=convert)

    def materialize(self, ranks: Iterable[int] | None = None, placed: Callable[[str], None] | None = None,
                    land: Callable[[int, Callable[[str], None] | None], None] | None = None) -> None:
        """The shares of ``ranks`` (None: every rank) the root lacks landed in it, each
        once a node; CheckpointNotFound naming the ranks no peer served a good copy of.
        ``placed(file)``: told of each data file in place, checked, before its share is.
        ``land(rank, placed)``: how a share lands (the daemon's one job per share), else
        here (``land``)."""
        wanted = range(len(self.manifests)) if ranks is None else sorted(set(ranks))
        missing = [r for r in wanted if landing.read_share(self.path, r) is None]
        landing_one = land or self.land

        def one(rank: int) -> None:
            landing_one(rank, placed)

        if len(missing) > 1:
            with ThreadPoolExecutor(min(len(missing), FETCH_THREADS), thread_name_prefix="ckptd-peer-fetch") as pool:
                list(pool.map(lambda r: _quietly(one, r), missing))
        elif missing:
            _quietly(one, missing[0])
        lacking = [r for r in missing if landing.read_share(self.path, r) is None]
        if lacking:
            asked = sorted({e for r in lacking for e, _, _ in self.held.get((self.step, r), [])})
            raise CheckpointNotFound(f"run {self.run!r} step {self.step}: no peer served a good copy of rank(s) "
                                     f"{lacking} (asked: {', '.join(asked) or 'none holds it now'}; their daemons' "
                                     "logs say why); load another step (ckptd.latest)")

    def land(self, rank: int, placed: Callable[[str], None] | None = None) -> None:
        """Rank ``rank``'s share landed from the first peer that serves it whole."""
        landing.land_from(self.tier.base, self.run, self.step, rank, self.sources(rank), FAILED, placed)

    def sources(self, rank: int) -> list[PeerCopy]:
        """The peers' copies of rank ``rank``'s share, memory first."""
        return [PeerCopy(self.tier, endpoint, where, m) for endpoint, where, m in self.held.get((self.step, rank), [])]


class PeerCopy:
    """A share as a peer holds it (``where``: in its memory, or on its disk)."""

    def __init__(self, tier: PeerTier, endpoint: str, where: str, manifest: Manifest) -> None:
        self.tier, self.endpoint, self.manifest = tier, endpoint, manifest
        self.what = f"{endpoint} ({where})"

    def fill(self, folder: Path, placed: Callable[[str], None]) -> Manifest:
        m = self.manifest
        sizes = share_files(m)
        landing.stream(folder, sizes, functools.partial(self.tier.transfer.read_files, self.endpoint, m), placed)
        self.tier.count_fetched(sum(sizes.values()))
        log.info("peer tier: run %r step %d rank %d fetched from %s", m.run, m.step, m.rank, self.what)
        return m


def _quietly(land: Callable[[int], None], rank: int) -> None:
    """A share no source served is found missing by the caller, which says so."""
    try:
        land(rank)
    except (CheckpointNotFound, *FAILED):
        pass


def step_info(step: int, path: Path, held: Held) -> CheckpointInfo | None:
    """The step as the root's folder ``path`` and the peers' copies ``held`` hold it
    together, if complete."""
    manifests, tiers = [], set()
    candidates = [m for (s, _), copies in held.items() if s == step for _, _, m in copies[:1]]
    local = local_shares(path)
    world = next(iter(local.values()), None) or (candidates[0] if candidates else None)
    if world is None:
        return None
    for rank in range(world.world_size):
        if rank in local:
            manifests.append(local[rank])
            tiers.add(ROOT)
        elif (step, rank) in held:
            manifests.append(held[(step, rank)][0][2])
            tiers.add(NAME)
    try:
        complete = index.one_attempt(manifests, path)
    except CheckpointCorrupt:
        return None
    if complete is None:
        return None
    return CheckpointInfo.from_manifests(str(path), complete, tiers=tuple(t for t in (ROOT, NAME) if t in tiers))
