"""The daemon's view of the root after commits: the index, the ``latest`` pointers,
retention, and the removal of deleted checkpoints in the background.

It runs on the syncer thread after each commit (so nothing is deleted before
the commit that triggered the pass is durable), on the index thread when the
watcher notices a change, and on the ``ckptd-reaper`` thread that removes trash.
It also holds the tiers each commit is copied to (``ckptd.tiers.replicas``: the
bucket's ``ckptd-uploader`` thread, the peers' send and serve threads), each behind
one interface: each commit is handed to every one, local retention never removes a
step with a share one of them still has to copy, and tells each what it removed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .. import retention, tiers
from ..config import Config, ConfigError, RetentionConfig
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
        self.replicas = tiers.replicas(config, self._keep_last, self._remote_complete)  # docs/tiers.md

    def start(self) -> None:
        """Scan the root (fixing stale pointers), then follow it."""
        self._reaper.start()
        self.index.start()
        logging.getLogger("ckptd.index").info("index: %d run(s) scanned in %.3f s, %s observer",
                 len(self.index.runs()), self.index.last_scan_s, self.index.observer_kind)
        for r in self.replicas:
            r.start()

    def close(self) -> None:
        for r in reversed(self.replicas):
            r.close()
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
        if self.replicas:
            nbytes = sum(r.nbytes for r in share.records.values())
            for r in self.replicas:
                r.committed(share.run, share.step, share.rank, nbytes)
        if complete:  # whoever completes a step applies retention to its run
            self.prune(share.run)

    def received(self) -> None:
        """The main loop got tensor bytes: a snapshot is under way, copies hold off."""
        for r in self.replicas:
            r.received()

    def yield_to(self, busy: Callable[[], bool]) -> None:
        """Copies to the tiers pause while ``busy()`` (a step is received or committed)."""
        for r in self.replicas:
            r.yield_to(busy)

    def on_persisted(self, callback: Callable[[str, int, int, float, str], None]) -> None:
        """``callback(run, step, rank, lag_s, tier)`` once a share is in a tier."""
        for r in self.replicas:
            r.on_persisted(lambda run, step, rank, lag, name=r.name: callback(run, step, rank, lag, name))

    def tier_names(self) -> tuple[str, ...]:
        """The tiers a share reaches here, the root first (the interval advice's)."""
        return (tiers.local.NAME, *(r.name for r in self.replicas))

    def tier_figures(self) -> dict[str, dict[str, Any] | None]:
        """Each tier's figures for `ckptd status`, by name (None for one not configured)."""
        return {name: None for name in tiers.replica_names()} | {r.name: r.figures() for r in self.replicas}

    def _keep_last(self, run: str) -> int:
        return retention.run_policy(self.policy, self.root / run).keep_last

    def _remote_complete(self, run: str, infos: list[CheckpointInfo]) -> None:
        """On a tier's thread (the uploader's): a step became complete there. Where each
        node has its own root, no step is ever complete locally; local retention then
        counts the steps complete in the bucket."""
        self.prune(run, remote=infos)

    def prune(self, run: str, remote: list[CheckpointInfo] = ()) -> None:
        run_dir = self.root / run
        policy = retention.run_policy(self.policy, run_dir)
        if not policy.enabled:
            return
        with self._retention_lock:
            infos = {i.step: i for i in remote}
            if infos:
                here = {s for s, _ in index.step_dirs(run_dir)}
                infos = {s: i for s, i in infos.items() if s in here}
            infos.update((i.step, i) for i in self.index.list(run))
            # a step with a share still to copy is the copy's source: never removed
            busy = set().union(*(r.pending(run) for r in self.replicas))
            _, trash = retention.apply(run_dir, [infos[s] for s in sorted(infos)], policy, now=time.time(),
                                       protect=busy)
        for t in trash:
            self.index.refresh_step(run, int(t.name.split("-")[2]))
            self._trash.put(t)
        if trash:  # the peers drop their replicas of these steps
            for r in self.replicas:
                r.dropped(run, [int(t.name.split("-")[2]) for t in trash])

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
