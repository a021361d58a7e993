"""The daemon's view of the root after commits: the index, the ``latest`` pointers,
retention, and the removal of deleted checkpoints in the background.

Retention runs on the syncer thread after a commit completes a step in this root;
with ``[peer]`` or ``[remote]`` (each node may have its own root) on the
``ckptd-prune`` thread instead, counting the steps complete across the cluster
(``ckptd.tiers.completeness``). ``Upkeep`` also holds the tiers each commit is copied to
(``ckptd.tiers.copy_targets``); retention never removes a step one of them still copies.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .. import retention, tiers
from ..tiers.base import Forgets, Pending, Pulls, Receives, Reports, SendsStaged, Yields
from ..tiers import bucket, completeness
from ..config import Config, ConfigError, RetentionConfig
from ..errors import CheckpointCorrupt
from .. import index
from ..index import Index, write_pointer
from ..manifest import CheckpointInfo
from .share import Share

log = logging.getLogger("ckptd.retention")


class Upkeep:
    def __init__(self, config: Config) -> None:
        self.root = config.root
        self.policy: RetentionConfig = config.retention
        self.index = Index(self.root, config.index, on_latest_change=self._latest_changed)
        self._pointer_lock = threading.Lock()
        self._retention_lock = threading.Lock()  # one pass at a time, also against pins
        self._trash: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
        self._reaper = threading.Thread(target=self._reap, name="ckptd-reaper", daemon=True)
        self.targets = tiers.copy_targets(config, self._keep_last, self._remote_complete)  # docs/tiers.md
        self._peers = completeness.open_peers(config) if config.peer.enabled else None
        self._store = bucket.open_store(None, config) if config.remote.enabled else None
        self._known: dict[str, dict[int, tuple[str, ...]]] = {}  # run -> steps found complete across the cluster
        across = config.peer.enabled or config.remote.enabled
        self._passes = Passes(self.prune, config.daemon.retention_interval) if across else None
        self._alone = Alone(self.root)

    def start(self) -> None:
        """Scan the root (fixing stale pointers), then follow it."""
        self._reaper.start()
        self.index.start()
        logging.getLogger("ckptd.index").info("index: %d run(s) scanned in %.3f s, %s observer",
                 len(self.index.runs()), self.index.last_scan_s, self.index.observer_kind)
        for t in self.targets:
            t.start()
        if self._passes is not None:
            self._passes.start()
        else:
            self._alone.at_start()

    def close(self) -> None:
        if self._passes is not None:
            self._passes.close()
        for t in reversed(self.targets):
            t.close()
        self.index.close()
        self._trash.put(None)
        self._reaper.join()

    def reload(self, policy: RetentionConfig) -> None:
        self.policy = policy
        log.info("retention settings reloaded: %s", policy)

    def latest(self, run: str) -> CheckpointInfo | None:
        return self.index.latest(run)

    def list(self, run: str) -> list[CheckpointInfo]:
        """Every complete checkpoint of ``run``, oldest first, as the index knows them."""
        return self.index.list(run)

    def set_run_policy(self, run: str, overrides: dict[str, Any]) -> None:
        """Validate and store a run's own retention overrides (from its producer's hello)."""
        retention.merge(self.policy, overrides, f"the retention of run {run!r}")  # ConfigError if bad
        try:  # refuses a symlink or a file in place of the run folder (docs/reliability.md)
            retention.save_run_policy(self.root / run, overrides)
        except OSError as exc:  # the producer is told; the daemon serves on
            raise ConfigError(f"cannot store the retention of run {run!r}: {exc.strerror or exc}") from None

    def after_commit(self, share: Share, complete: bool) -> None:
        """On the syncer thread, once a manifest is durable."""
        self.index.refresh_step(share.run, share.step)  # also moves the latest pointer
        if self.targets:
            nbytes = sum(r.nbytes for r in share.records.values())
            for t in self.targets:
                t.committed(share.run, share.step, share.rank, nbytes, share.declared.due)
        if self._passes is not None:  # the peers are asked: off the syncer thread
            self._passes.request(share.run)
        elif complete:  # whoever completes a step applies retention to its run
            self.prune(share.run)
        else:
            self._alone.check(share.run, share.step, share.id.world_size)

    def received(self) -> None:
        """The main loop got tensor bytes: a snapshot is under way, copies hold off."""
        for t in self.targets:
            if isinstance(t, Receives):
                t.received()

    def yield_to(self, busy: Callable[[], bool]) -> None:
        """Copies to the tiers pause while ``busy()`` (a step is received or committed)."""
        for t in self.targets:
            if isinstance(t, Yields):
                t.yield_to(busy)

    def send_staged(self, find: Callable[[Any], Any], sent: Callable[[Any], None]) -> bool:
        """Tiers that send shares take them out of staging where ``find`` holds them;
        whether any tier sends shares (``SendsStaged``)."""
        sends = [t.send_staged(find, sent) for t in self.targets if isinstance(t, SendsStaged)]
        return any(sends)

    def serve_pulls(self, pull: Callable[..., bool]) -> None:
        """Peers' ``pull``s of bucket shares answered by ``pull`` (``Pulls``)."""
        for t in self.targets:
            if isinstance(t, Pulls):
                t.serve_pulls(pull)

    def on_persisted(self, callback: Callable[[str, int, int, float, str], None]) -> None:
        """``callback(run, step, rank, lag_s, tier)`` once a share is in a tier."""
        for t in self.targets:
            if isinstance(t, Reports):
                t.on_persisted(lambda run, step, rank, lag, name=t.name: callback(run, step, rank, lag, name))

    def tier_names(self) -> tuple[str, ...]:
        """The tiers a share reaches here, the root first (the interval advice's)."""
        return (tiers.local.NAME, *(t.name for t in self.targets))

    def tier_figures(self) -> dict[str, dict[str, Any] | None]:
        """Each tier's figures for `ckptd status`, by name (None for one not configured)."""
        return {name: None for name in tiers.target_names()} | {t.name: t.figures() for t in self.targets}

    def _keep_last(self, run: str) -> int:
        return retention.run_policy(self.policy, self.root / run).keep_last

    def _remote_complete(self, run: str, infos: list[CheckpointInfo]) -> None:
        """On the uploader's thread: a step became complete in the bucket; a pass counts
        it (and any another node's upload completed meanwhile)."""
        if self._passes is not None:
            self._passes.request(run)

    def prune(self, run: str) -> None:
        """Apply ``run``'s retention to this root: to the steps complete in it, or with
        ``[peer]``/``[remote]``, to those complete across the cluster (docs/service.md)."""
        run_dir = self.root / run
        policy = retention.run_policy(self.policy, run_dir)
        if not policy.enabled:
            return
        with self._retention_lock:
            # a step with a share still to copy is the copy's source: never removed
            busy = set().union(*(t.pending(run) for t in self.targets if isinstance(t, Pending)))
            if self._passes is None:
                _, trash = retention.apply(run_dir, self.index.list(run), policy, now=time.time(), protect=busy)
            else:
                trash = self._prune_across(run, run_dir, policy, busy)
        steps = [int(t.name.split("-")[2]) for t in trash]
        for step, t in zip(steps, trash):
            self.index.refresh_step(run, step)
            self._trash.put(t)
        if trash:  # the peers drop their copies; the uploader owes them no more
            for target in self.targets:
                if isinstance(target, Forgets):
                    target.dropped(run, steps)

    def _prune_across(self, run: str, run_dir: Path, policy: RetentionConfig, busy: set[int]) -> list[Path]:
        known = self._known.setdefault(run, {})
        s = completeness.survey(run, run_dir, self._peers, self._store, known)
        known.clear()
        known.update(s.complete)
        return completeness.apply(s, run_dir, policy, now=time.time(), protect=busy)[1]

    def _latest_changed(self, run: str, info: CheckpointInfo | None) -> None:
        # readers that run no index follow this pointer (docs/service.md)
        with self._pointer_lock:
            try:
                write_pointer(self.root / run, info.step if info else None)
            except OSError as exc:
                log.warning("cannot update %s/latest: %s", self.root / run, exc.strerror)

    def _reap(self) -> None:
        while (trash := self._trash.get()) is not None:
            retention.remove_trash(trash)


class Passes:
    """The ``ckptd-prune`` thread: retention passes that ask the peers (the network),
    one run at a time; requests for a run already waiting are one pass. Every run seen
    is passed again every ``interval_s`` (``[daemon] retention_interval``): a step another
    node completes after this node's last commit is counted without waiting for its next one."""

    def __init__(self, prune: Callable[[str], None], interval_s: float) -> None:
        self._prune = prune
        self.interval_s = interval_s
        self._wanted: dict[str, None] = {}
        self._seen: dict[str, None] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="ckptd-prune", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request(self, run: str) -> None:
        with self._cond:
            self._wanted[run] = self._seen[run] = None
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _next(self) -> str | None:
        with self._cond:
            if not self._wanted and not self._closing and not self._cond.wait(self.interval_s):
                self._wanted.update(self._seen)
            if self._closing or not self._wanted:
                return None
            run = next(iter(self._wanted))
            del self._wanted[run]
            return run

    def _run(self) -> None:
        while not self._closing:
            run = self._next()
            if run is None:
                continue
            try:
                self._prune(run)
            except Exception:  # the next commit tries again; the daemon serves on
                log.exception("retention of run %r failed", run)


class Alone:
    """Warns, once a run, where no step can ever complete: each node has its own root
    (the root never holds every rank's share) and there are no peers nor bucket to
    complete the steps across (docs/service.md, "Retention across nodes")."""

    SEEN = 3  # steps of the same ranks, none complete, before this root counts as one node's

    def __init__(self, root: Path) -> None:
        self.root = root
        self._decided: set[str] = set()

    def at_start(self) -> None:
        """The runs already in the root: a root per node shows in their newest steps."""
        try:
            runs = [e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)
                    and not e.name.startswith(".")]
        except OSError:
            return
        for run in runs:
            steps = index.step_dirs(self.root / run)
            ranks = completeness.committed_ranks(steps[0][1]) if steps else []
            try:
                share = index.read_share(steps[0][1], ranks[0]) if ranks else None
            except (CheckpointCorrupt, OSError):
                share = None
            if share is not None:
                self.check(run, steps[0][0] + 1, share.world_size)

    def check(self, run: str, step: int, world_size: int) -> None:
        """After a commit of ``step`` that left it incomplete here (the syncer thread)."""
        if run in self._decided or world_size <= 1:
            return
        newest = index.step_dirs(self.root / run)[:2 * self.SEEN]
        held = {s: completeness.committed_ranks(p) for s, p in newest}
        if any(len(ranks) >= world_size for ranks in held.values()):
            self._decided.add(run)  # a step completes here: a shared root
            return
        ranks = {frozenset(r) for s, r in held.items() if s < step}
        if len([s for s in held if s < step]) < self.SEEN or len(ranks) != 1:
            return
        self._decided.add(run)
        log.warning(
            "run %r: no step ever completes in %s: it holds only rank(s) %s of %d, as a root per node does, and "
            "this daemon has no [peer] and no [remote] to complete the steps across the nodes. Retention then "
            "removes nothing and the disk fills. Fix: give the nodes a shared root, or add a [peer] table "
            "(docs/tiers.md) or a [remote] bucket to each node's config", run, self.root,
            sorted(next(iter(ranks))), world_size)
