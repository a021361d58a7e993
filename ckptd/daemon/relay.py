"""Recovery from the peers on behalf of this node's readers (``recover``, docs/tiers.md
"Recovery"): a trainer holds no key to the peer port, so its daemon asks the peers
with its own and lands their shares in its root, where the trainer reads them. Asks
for the same thing at once join one job (``landing_jobs``). Start at ``Relay.ask``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..config import Config
from ..errors import CheckpointError, CheckpointNotFound, NotOwner
from ..manifest import CheckpointInfo
from ..transport import wire
from .landing_jobs import Ask, Job, Jobs, ShareJobs
from .owners import Owners, describe

if TYPE_CHECKING:
    from ..tiers.peer_reader import PeerHolding
    from .replies import Replies

log = logging.getLogger("ckptd.daemon")

THREADS = 4
OPENED_S = 10.0  # a step opened for a reader serves the landing asks that follow this long
ASKS_PER_USER = 32
ASKS = 128
JOBS_PER_USER = 16
JOBS = 32

Key = tuple[str, int | None, tuple[int, ...] | None, bool, str | None]


class Relay:
    """The daemon's ``recover`` jobs, run on ``ckptd-relay`` threads with its own peer
    tier (its key pair); ``answer(now)``, on the main loop, sends what is ready."""

    def __init__(self, config: Config, replies: Replies, wake: Callable[[], None], owners: Owners,
                 shares: ShareJobs | None = None) -> None:
        from ..tiers.peer_reader import PeerTier

        self.root = config.root
        self.tier = PeerTier(config, config.root)
        self.shares = shares or ShareJobs(config.root, wake)
        self.replies, self.owners = replies, owners
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ckptd-relay")
        self.jobs: Jobs[Key] = Jobs(wake)
        self._lock = threading.Lock()
        self._opened: dict[tuple[str, int], tuple[float, PeerHolding]] = {}
        self.counts = {"asks": 0, "joined": 0, "jobs": 0, "failed": 0, "refused": 0}

    def ask(self, identity: bytes, seq: int, h: dict[str, Any], *, user: str | None, claim: str | None) -> None:
        """Start (or join) the job ``recover`` ``h`` names, for ``user`` (``principal``);
        ``claim``: ``user`` when the run has no owner here, to be its owner if the peers'
        manifests say so. Answered by ``answer``; CheckpointError for a refusal."""
        if not _same_dir(h["root"], self.root):
            raise CheckpointError(f"recover: this daemon lands the peers' shares in its root {self.root}, not in "
                                  f"{h['root']}: read without root= (or with root={str(self.root)!r})")
        step, ranks = h["step"], h["ranks"]
        key: Key = (h["run"], step, None if ranks is None else tuple(sorted(set(ranks))),
                    bool(h["memory"]) and step is not None, claim)
        self._bound(user, key)
        self.counts["asks"] += 1
        job, joined = self.jobs.job(key, lambda j: self._pool.submit(self._run, j), user)
        self.counts["joined" if joined else "jobs"] += 1
        self.jobs.wait(Ask(identity, seq, [job], self._finish, self._progress, user, h["seen"]))

    def _bound(self, user: str | None, key: Key) -> None:
        """Refuse an ask beyond ``ASKS_PER_USER`` or ``ASKS`` waiting (a reader asks one
        at a time), or one that would start a recovery beyond ``JOBS_PER_USER`` (a node's
        ranks ask one each) or ``JOBS`` under way."""
        who = describe(user) if user else "this reader"
        mine = sum(a.user == user for a in self.jobs.waiting)
        running = self.jobs.running()
        theirs = sum(user in j.users for j in running)
        new = all(j.key != key for j in running)
        refusal = None
        if mine >= ASKS_PER_USER:
            refusal = (f"{who} has {mine} recover asks waiting, the most one user may (ASKS_PER_USER = "
                       f"{ASKS_PER_USER}); ask again once they are answered")
        elif len(self.jobs.waiting) >= ASKS:
            refusal = f"{len(self.jobs.waiting)} recover asks are waiting, the most this daemon takes (ASKS = {ASKS}); ask again in a few seconds"
        elif new and theirs >= JOBS_PER_USER:
            refusal = (f"{who} has {theirs} recoveries under way, the most one user may (JOBS_PER_USER = "
                       f"{JOBS_PER_USER}); ask again once one is done")
        elif new and len(running) >= JOBS:
            refusal = f"{len(running)} recoveries are under way, the most this daemon runs at once (JOBS = {JOBS}); ask again in a few seconds"
        if refusal is not None:
            self.counts["refused"] += 1
            raise CheckpointError(f"recover: {refusal}")

    def deadline(self) -> float | None:
        return self.jobs.deadline()

    def answer(self, now: float) -> None:
        self.jobs.answer(now)

    def _progress(self, a: Ask[Key], now: float, landed: list[str] | None) -> None:
        job = a.jobs[0]
        self.replies.send(a.identity, "recovered", seq=a.seq, done=False, info=None, manifests=None,
                          progress=f"{_what(job.key)}: asking the peers for {now - job.started:.0f} s",
                          **({} if landed is None else {"landed": landed}))

    def _finish(self, a: Ask[Key]) -> None:
        """The job's answer; a run it claims becomes the asker's, unless another claimed it meanwhile."""
        job = a.jobs[0]
        exc = job.future.exception()
        if exc is None and job.key[4] is not None:
            try:
                self.owners.check(job.key[0], job.key[4])
            except (NotOwner, OSError) as refused:
                exc = CheckpointError(str(refused))
        if exc is None:
            header = wire.encode("recovered", seq=a.seq, done=True, **{"progress": None, **job.future.result()})
            if len(header) <= wire.MAX_HEADER_BYTES:
                self.replies.send_encoded(a.identity, "recovered", header)
                return
            exc = CheckpointError(f"the manifests of {_what(job.key)} take {len(header)} bytes, more than a reply "
                                  f"may ({wire.MAX_HEADER_BYTES}); read it as the daemon's user (ckptd load)")
        if not isinstance(exc, CheckpointError):
            log.error("recover: %s failed: %s: %s", _what(job.key), type(exc).__name__, exc)
        self.replies.send(a.identity, "error", seq=a.seq, step=job.key[1], message=f"recover: {exc}",
                          code=wire.error_code(exc))

    def _run(self, job: Job[Key]) -> dict[str, Any]:
        """One job: the newest step (``step`` None), a step's manifests (``ranks`` None),
        or those ranks' shares landed in the root (each file named in ``job.landed`` as
        it is in place)."""
        run, step, ranks, memory, claim = job.key
        try:
            if claim is not None:
                self._check_claim(run, step, claim)
            if memory:
                assert step is not None
                info, missing = self.tier.completion(run, step, None)
                return {"info": info.to_dict() if info else None, "manifests": None, "progress": missing(0)}
            if step is None:
                info = self.tier.latest(run)
                return {"info": info.to_dict() if info else None, "manifests": None}
            holding = self._holding(run, step, again=ranks is None and claim is None)
            beyond = [r for r in ranks or () if r >= len(holding.manifests)]
            if beyond:
                raise CheckpointNotFound(f"run {run!r} step {step} has {len(holding.manifests)} ranks: no rank "
                                         f"{beyond}")
            if ranks is None:
                info = CheckpointInfo.from_manifests(str(holding.path), holding.manifests, tiers=("peer",))
                return {"info": info.to_dict(), "manifests": [m.to_json() for m in holding.manifests]}
            holding.materialize(ranks, placed=lambda file: self.jobs.placed(job, file),
                                land=functools.partial(self._land, holding))
            return {"info": None, "manifests": None}
        except Exception:
            with self._lock:
                self.counts["failed"] += 1
            raise

    def _land(self, holding: PeerHolding, rank: int, placed: Callable[[str], None] | None = None) -> None:
        """A share of ``holding`` landed by its one job (``ShareJobs``), from the peers'
        copies unless another asker's job lands it meanwhile; ``placed`` as it lands."""
        from ..tiers.peer_reader import FAILED

        key = (holding.run, holding.step, rank)
        job, _ = self.shares.land(key, functools.partial(holding.sources, rank), FAILED, from_peer=True)
        if placed is not None:
            self.shares.jobs.watch(job, placed)
        job.future.result()

    def _check_claim(self, run: str, step: int | None, claim: str) -> None:
        """A run this node has no owner for is recovered only by the owner its manifests
        name (the newest step's, for ``step`` None); CheckpointError for anyone else."""
        if step is None:
            info = self.tier.latest(run)
            if info is None:
                raise CheckpointNotFound(f"run {run!r} has no step complete in {self.root} or with the peers "
                                         f"({', '.join(self.tier.discovery.endpoints)})")
            step = info.step
        writers = {m.owner for m in self._holding(run, step, again=False).manifests}
        if writers != {claim}:
            raise CheckpointError(
                f"run {run!r} has no owner on this node yet, and its shares were written by "
                f"{' and '.join(sorted(map(describe, writers)))}, not by {describe(claim)}: only the run's owner "
                "recovers it on a node that has not seen it (or root; or set [daemon] shared_runs = true)")

    def _holding(self, run: str, step: int, *, again: bool) -> PeerHolding:
        holding = self._open(run, step, again=again)
        if holding is None:
            raise CheckpointNotFound(f"run {run!r} step {step} is complete neither in {self.root} nor with "
                                     f"the peers ({', '.join(self.tier.discovery.endpoints)}); "
                                     "load another step (ckptd.latest)")
        return holding

    def _open(self, run: str, step: int, *, again: bool) -> PeerHolding | None:
        """The step as the root and the peers hold it; ``again``: asked of the peers anew,
        else what a reader's open found a moment ago (its landing asks follow)."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (until, _) in self._opened.items() if until <= now]:
                del self._opened[key]
            cached = None if again else self._opened.get((run, step))
        if cached is not None:
            return cached[1]
        holding = self.tier.open(run, step)
        if holding is not None:
            with self._lock:
                self._opened[(run, step)] = (now + OPENED_S, holding)
        return holding

    def figures(self) -> dict[str, Any]:
        """``asks`` received, ``joined`` to a job under way, ``jobs`` run, ``failed``; the
        shares and bytes fetched from the peers into the root."""
        return {**self.counts, "running": len(self.jobs.running()), **self.tier.fetched}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.shares.close()


def _same_dir(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def _what(key: Key) -> str:
    run, step, ranks, _, _ = key
    if step is None:
        return f"the newest step of run {run!r}"
    return f"run {run!r} step {step}" + (f" rank(s) {list(ranks)}" if ranks is not None else "")
