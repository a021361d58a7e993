"""Who holds what of a run among the peers (``PeerDiscovery``, owned by the daemon's ``PeerTier``):
one small ``steps`` summary from every peer at once, then the manifests of only the
shares the root lacks, one holder a rank. A peer that does not answer is backed off;
what ``latest`` learnt serves the ``open`` that follows. Start at ``resolve``.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from .. import layout
from ..config import Config, ConfigError
from ..errors import CheckpointCorrupt, ProtocolError
from ..manifest import Manifest
from ..peer import messages
from ..peer.asking import ask_all
from ..peer.backoff import Backoff
from .landing import read_share

log = logging.getLogger("ckptd.peer")

STEPS_ASKED = 16  # newest steps each peer is asked about for ``latest`` (messages.MAX_STEPS_ANSWERED at most)
DEAD_S = 10.0  # a silent peer is not asked again for this long, doubled while it stays silent, up to DEAD_MAX_S
DEAD_MAX_S = 160.0
LEARNT_S = 10.0  # what ``latest`` learnt of its step serves an ``open`` of that step this long
PATIENT_S = 10.0  # a search that found nothing while peers were silent asks them again, waiting this long

Copy = tuple[str, str, Manifest]
Held = dict[tuple[int, int], list[Copy]]


@dataclass(frozen=True)
class Seen:
    """A share a peer says (``steps``) it can serve; its manifest is asked only if needed."""

    endpoint: str
    where: str
    attempt: str | None
    world_size: int


Summary = dict[int, dict[int, list[Seen]]]


def reader_keys(config: Config) -> Any:
    """The keys the daemon asks its peers with: its own key pair (``daemon_curve``), the
    only one the peer port admits for reading; None for plain TCP. A reader in a
    training process holds none: it asks its daemon (``peer_relay``)."""
    from ..peer.keys import daemon_curve

    return daemon_curve(config)[1]


class PeerDiscovery:
    def __init__(self, config: Config, silent: Backoff | None = None) -> None:
        self.config, self.cfg = config, config.peer
        self.endpoints = list(dict.fromkeys([self.cfg.listen, *self.cfg.peers]))
        self.silent = silent or Backoff(DEAD_S, DEAD_MAX_S)
        self.wait, self.retry = self.cfg.timeout, set[str]()
        self._warned: set[str] = set()
        self._learnt: dict[tuple[Any, ...], tuple[float, Held]] = {}

    @functools.cached_property
    def keys(self) -> Any:
        """Read when the peers are first asked: a key that cannot be read is their error only."""
        return reader_keys(self.config)

    def warn_once(self, message: str) -> None:
        """A WARNING logged once: a reader polling the tier would repeat it every poll."""
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s", message)

    def patiently(self, peers: list[str]) -> PeerDiscovery:
        """This discovery (its back-off and what it learnt shared) asking ``peers`` even
        if backed off, waiting ``PATIENT_S``: a peer slow to answer once must not make a
        step that exists look absent."""
        other = copy.copy(self)
        other.wait, other.retry = max(self.cfg.timeout, PATIENT_S), set(peers)
        return other

    def newly_silent(self) -> list[str]:
        """The other peers that did not answer when last asked, having answered (or not
        been asked) before: slow, or just lost."""
        return [e for e in self.endpoints if e != self.cfg.listen and self.silent.failures(e) == 1]

    def ask(self, requests: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Each endpoint's answer to its request, all asked at once within one ``wait``;
        a peer that does not answer is backed off (``silent``), a process that cannot
        read its keys asks nobody (one WARNING)."""
        try:
            keys = self.keys
        except ConfigError as exc:  # ``latest`` still answers from the local root (and the bucket)
            self.warn_once(f"peer tier: not asked, it holds nothing for this process: {exc}")
            return {}
        links: dict[str, messages.Link] = {}
        for e in requests:
            if self.silent.skipped(e) and e not in self.retry:
                log.info("peer tier: %s not asked: it did not answer; asked again in %.0f s", e, self.silent.left(e))
                continue
            try:
                links[e] = messages.Link(e, keys)
            except messages.PeerRefused as exc:
                self.warn_once(f"peer tier: {exc}; that peer is not asked")
        try:
            answers = ask_all(links, {e: requests[e] for e in links}, self.wait)
        finally:
            for link in links.values():
                link.close()
        for e, answer in answers.items():
            if not isinstance(answer, messages.PeerDown):
                self.silent.answered(e)
                if isinstance(answer, Exception):
                    log.info("peer tier: %s", answer)
                continue
            back_off = self.silent.failed(e)
            log.info("peer tier: %s did not answer within %g s; not asked for %g s", e, self.wait, back_off)
        return {e: a for e, a in answers.items() if not isinstance(a, Exception)}

    def summary(self, run: str, step: int | None = None) -> Summary:
        """What the peers can serve of the newest ``STEPS_ASKED`` steps of ``run`` (or of
        ``step`` alone), from one small ``steps`` answer each: no manifest."""
        request: dict[str, Any] = {"op": "steps", "run": run, "limit": STEPS_ASKED if step is None else 1}
        if step is not None:
            request["step"] = step
        out: Summary = {}
        for e, answer in self.ask({e: request for e in self.endpoints}).items():
            try:
                for s, rank, seen in _listed(e, answer, step):
                    out.setdefault(s, {}).setdefault(rank, []).append(seen)
            except ProtocolError as exc:
                log.warning("peer tier: %s answered a bad list of steps, not used: %s", e, exc)
                out = {s: {r: [c for c in v if c.endpoint != e] for r, v in ranks.items()} for s, ranks in out.items()}
        order = {e: i for i, e in enumerate(self.endpoints)}  # after memory, as configured: not as they answered
        for ranks in out.values():
            for copies in ranks.values():
                copies.sort(key=lambda c: (c.where != "memory", order[c.endpoint]))
        return out

    def manifests(self, run: str, step: int, holders: dict[int, list[Seen]]) -> dict[int, list[Copy]]:
        """The manifest of each rank in ``holders``, asked of one holder a rank (memory
        first; the next where that one fails), each checked to be the share the holder
        listed. rank -> the holders that agree, each with that manifest."""
        got: dict[int, list[Copy]] = {}
        tried = dict.fromkeys(holders, 0)
        for _ in range(messages.MAX_STEPS_ANSWERED):
            asked: dict[str, list[int]] = {}
            for r, hs in holders.items():
                if r not in got and tried[r] < len(hs):
                    asked.setdefault(hs[tried[r]].endpoint, []).append(r)
            if not asked:
                break
            answers = self.ask({e: {"op": "manifests", "run": run, "step": step, "ranks": ranks}
                                for e, ranks in asked.items()})
            for e, ranks in asked.items():
                left = _take(run, step, e, answers.get(e), {r: holders[r][tried[r]:] for r in ranks}, got)
                for r in ranks:
                    if r not in got and r not in left:
                        tried[r] += 1
        return got

    def resolve(self, run: str, step: int, path: Path, seen: dict[int, list[Seen]]) -> Held:
        """The copies of ``step``'s shares that ``path`` (the step's local folder) lacks,
        if the peers can complete it, all of one attempt and world size (the root's,
        where it holds some). {} when they cannot (then no manifest is asked)."""
        local = local_shares(path)
        if local:
            first = next(iter(local.values()))
            groups = [(first.attempt, first.world_size)]
        else:
            count: dict[tuple[str | None, int], int] = {}
            for copies in seen.values():
                for key in {(c.attempt, c.world_size) for c in copies}:
                    count[key] = count.get(key, 0) + 1
            groups = sorted(count, key=lambda k: -count[k])
        for attempt, world in groups:
            need = [r for r in range(world) if not (r in local and (local[r].attempt, local[r].world_size)
                                                    == (attempt, world))]
            holders = {r: [c for c in seen.get(r, []) if (c.attempt, c.world_size) == (attempt, world)] for r in need}
            if not all(holders.values()):
                continue
            got = self.manifests(run, step, holders)
            if len(got) == len(need):
                return {(step, r): copies for r, copies in got.items()}
        return {}

    def holdings(self, run: str) -> Held:
        """(step, rank) -> the copies, memory first, of the newest steps the peers list."""
        return {(step, rank): copies for step, seen in self.summary(run).items()
                for rank, copies in self.manifests(run, step, seen).items()}

    def learn(self, base: Path, run: str, step: int, held: Held) -> None:
        now = time.monotonic()
        for key in [k for k, (until, _) in self._learnt.items() if until <= now]:
            del self._learnt[key]
        self._learnt[(str(base), run, step)] = (now + LEARNT_S, held)

    def held(self, run: str, step: int, path: Path, base: Path) -> Held:
        """The copies of ``step``'s shares the root lacks: what ``latest`` learnt of it a
        moment ago, else asked of the peers for that step alone."""
        learnt = self._learnt.pop((str(base), run, step), None)
        if learnt is not None and learnt[0] > time.monotonic():
            return learnt[1]
        return self.resolve(run, step, path, self.summary(run, step).get(step, {}))


def local_shares(path: Path) -> dict[int, Manifest]:
    """The shares in step folder ``path``, by rank."""
    try:
        names = os.listdir(path)
    except OSError:
        return {}
    ranks = sorted(int(m.group(1)) for n in names if (m := layout.MANIFEST.fullmatch(n)))
    return {r: share for r in ranks if (share := read_share(path, r)) is not None}


def _listed(e: str, answer: dict[str, Any], step: int | None) -> list[tuple[int, int, Seen]]:
    """(step, rank, seen) of each share a ``steps`` answer lists; ProtocolError if one does not fit."""
    out = []
    for entry in _maps(messages.field(answer, "steps", list), "steps"):
        s = messages.field(entry, "step", int)
        for share in _maps(messages.field(entry, "shares", list), "shares"):
            rank, world = messages.field(share, "rank", int), messages.field(share, "world_size", int)
            attempt = share.get("attempt")
            if step not in (None, s) or rank >= world or not isinstance(attempt, (str, type(None))):
                raise ProtocolError(f"steps: share {share!r} of step {s} does not fit")
            out.append((s, rank, Seen(e, str(share.get("where")), attempt, world)))
    return out


def _take(run: str, step: int, e: str, answer: dict[str, Any] | None, asked: dict[int, list[Seen]],
          got: dict[int, list[Copy]]) -> set[int]:
    """The manifests of one ``manifests`` answer into ``got`` (``asked``: rank -> the
    holders not yet tried, ``e`` first); the ranks it left out for its size."""
    if answer is None:
        return set()
    try:
        entries = _maps(messages.field(answer, "manifests", list), "manifests")
        left = messages.field(answer, "left", list)
    except ProtocolError as exc:
        log.warning("peer tier: %s: %s", e, exc)
        return set()
    for entry in entries:
        rank = entry.get("rank")
        if not isinstance(rank, int) or rank not in asked or rank in got:
            continue
        seen, rest = asked[rank][0], asked[rank][1:]
        try:
            m = Manifest.from_json(messages.field(entry, "manifest", bytes), f"a manifest from {e}")
        except (CheckpointCorrupt, ProtocolError) as exc:
            log.warning("peer tier: %s", exc)
            continue
        if (m.run, m.step, m.rank, m.attempt, m.world_size) != (run, step, rank, seen.attempt, seen.world_size):
            log.warning("peer tier: %s sent a manifest of run %r step %d rank %d attempt %r of %d ranks for the "
                        "share it listed as run %r step %d rank %d attempt %r of %d; not used", e, m.run, m.step,
                        m.rank, m.attempt, m.world_size, run, step, rank, seen.attempt, seen.world_size)
            continue
        got[rank] = [(c.endpoint, c.where, m) for c in [seen, *rest]]
    return {r for r in left if isinstance(r, int)}


def _maps(value: list[Any], what: str) -> list[dict[str, Any]]:
    if not all(isinstance(v, dict) for v in value):
        raise ProtocolError(f"{what}: an entry is not a map")
    return value
