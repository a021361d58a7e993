"""Recovery from the peers on behalf of this node's readers (``recover``, docs/tiers.md
"Recovery"): a trainer holds no key to the peer port, so its daemon asks the peers
with its own and lands their shares in its root, where the trainer reads them. Asks
for the same thing at once join one job; a reader waiting longer than ``WAIT_S`` is
told how far it got and asks again. Start at ``Relay.ask``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..config import Config
from ..errors import CheckpointError, CheckpointNotFound
from ..manifest import CheckpointInfo
from ..transport import wire

if TYPE_CHECKING:
    from ..tiers.peer_reader import PeerHolding
    from .replies import Replies

log = logging.getLogger("ckptd.daemon")

WAIT_S = 2.0  # a reader's ask is answered at least this often, done or not
THREADS = 4
OPENED_S = 10.0  # a step opened for a reader serves the landing asks that follow this long

Key = tuple[str, int | None, tuple[int, ...] | None, bool]


@dataclass
class _Job:
    key: Key
    future: Future[dict[str, Any]]
    started: float = field(default_factory=time.monotonic)
    asks: int = 1


class Relay:
    """The daemon's ``recover`` jobs, run on ``ckptd-relay`` threads with its own peer
    tier (its key pair); ``answer(now)``, on the main loop, sends what is ready."""

    def __init__(self, config: Config, replies: Replies, wake: Callable[[], None]) -> None:
        from ..tiers.peer_reader import PeerTier

        self.root = config.root
        self.tier = PeerTier(config, config.root)
        self.replies, self._wake = replies, wake
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ckptd-relay")
        self._jobs: dict[Key, _Job] = {}
        self._waiting: list[tuple[bytes, int, _Job, float]] = []
        self._lock = threading.Lock()
        self._opened: dict[tuple[str, int], tuple[float, PeerHolding]] = {}
        self.counts = {"asks": 0, "joined": 0, "jobs": 0, "failed": 0}

    def ask(self, identity: bytes, seq: int, run: str, step: int | None, ranks: list[int] | None,
            root: str, memory: bool = False) -> None:
        """Start (or join) the job ``recover`` names; answered by ``answer``."""
        if not _same_dir(root, self.root):
            raise CheckpointError(f"recover: this daemon lands the peers' shares in its root {self.root}, not in "
                                  f"{root}: read without root= (or with root={str(self.root)!r})")
        key: Key = (run, step, None if ranks is None else tuple(sorted(set(ranks))), memory and step is not None)
        self.counts["asks"] += 1
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = _Job(key, self._pool.submit(self._run, key))
            job.future.add_done_callback(lambda _: self._wake())
            self.counts["jobs"] += 1
        else:
            job.asks += 1
            self.counts["joined"] += 1
        self._waiting.append((identity, seq, job, time.monotonic() + WAIT_S))

    def deadline(self) -> float | None:
        """When the first waiting reader is told how far its job got."""
        return min(w[3] for w in self._waiting) if self._waiting else None

    def answer(self, now: float) -> None:
        """Answer each reader whose job is done, or who has waited ``WAIT_S``."""
        waiting = []
        for identity, seq, job, deadline in self._waiting:
            if job.future.done():
                self._finish(identity, seq, job)
            elif now >= deadline:
                self.replies.send(identity, "recovered", seq=seq, done=False, info=None, manifests=None,
                           progress=f"{_what(job.key)}: asking the peers for {now - job.started:.0f} s")
            else:
                waiting.append((identity, seq, job, deadline))
        self._waiting = waiting
        for key, job in list(self._jobs.items()):
            if job.future.done() and not any(w[2] is job for w in waiting):
                del self._jobs[key]

    def _finish(self, identity: bytes, seq: int, job: _Job) -> None:
        exc = job.future.exception()
        if exc is None:
            header = wire.encode("recovered", seq=seq, done=True, **{"progress": None, **job.future.result()})
            if len(header) <= wire.MAX_HEADER_BYTES:
                self.replies.send_encoded(identity, "recovered", header)
                return
            exc = CheckpointError(f"the manifests of {_what(job.key)} take {len(header)} bytes, more than a reply "
                                  f"may ({wire.MAX_HEADER_BYTES}); read it as the daemon's user (ckptd load)")
        if not isinstance(exc, CheckpointError):
            log.error("recover: %s failed: %s: %s", _what(job.key), type(exc).__name__, exc)
        self.replies.send(identity, "error", seq=seq, step=job.key[1], message=f"recover: {exc}",
                   code=wire.NOT_FOUND if isinstance(exc, CheckpointNotFound) else None)

    def _run(self, key: Key) -> dict[str, Any]:
        """One job: the newest step (``step`` None), a step's manifests (``ranks`` None),
        or those ranks' shares landed in the root."""
        run, step, ranks, memory = key
        try:
            if memory:
                assert step is not None
                info, missing = self.tier.completion(run, step, None)
                return {"info": info.to_dict() if info else None, "manifests": None, "progress": missing(0)}
            if step is None:
                info = self.tier.latest(run)
                return {"info": info.to_dict() if info else None, "manifests": None}
            holding = self._open(run, step, again=ranks is None)
            if holding is None:
                raise CheckpointNotFound(f"run {run!r} step {step} is complete neither in {self.root} nor with "
                                         f"the peers ({', '.join(self.tier.discovery.endpoints)}); "
                                         "load another step (ckptd.latest)")
            beyond = [r for r in ranks or () if r >= len(holding.manifests)]
            if beyond:
                raise CheckpointNotFound(f"run {run!r} step {step} has {len(holding.manifests)} ranks: no rank "
                                         f"{beyond}")
            if ranks is None:
                info = CheckpointInfo.from_manifests(str(holding.path), holding.manifests, tiers=("peer",))
                return {"info": info.to_dict(), "manifests": [m.to_json() for m in holding.manifests]}
            holding.materialize(ranks)
            return {"info": None, "manifests": None}
        except Exception:
            with self._lock:
                self.counts["failed"] += 1
            raise

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
        return {**self.counts, "running": len(self._jobs), **self.tier.fetched}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _same_dir(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def _what(key: Key) -> str:
    run, step, ranks, _ = key
    if step is None:
        return f"the newest step of run {run!r}"
    return f"run {run!r} step {step}" + (f" rank(s) {list(ranks)}" if ranks is not None else "")
