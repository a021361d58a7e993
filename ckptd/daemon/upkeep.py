"""The daemon's view of the root after commits: the index, the ``latest`` pointers,
retention, and the removal of deleted checkpoints in the background.

It runs on the syncer thread after each commit (so nothing is deleted before
the commit that triggered the pass is durable), on the index thread when the
watcher notices a change, and on the ``ckptd-reaper`` thread that removes trash.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

from .. import retention
from ..config import Config, ConfigError, RetentionConfig
from ..index import Index, write_pointer
from ..manifest import CheckpointInfo
from .writer import Share

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

    def start(self) -> None:
        """Scan the root (fixing stale pointers), then follow it."""
        self._reaper.start()
        self.index.start()
        logging.getLogger("ckptd.index").info("index: %d run(s) scanned in %.3f s, %s observer",
                 len(self.index.runs()), self.index.last_scan_s, self.index.observer_kind)

    def close(self) -> None:
        self.index.close()
        self._trash.put(None)
        self._reaper.join()

    def reload(self, policy: RetentionConfig) -> None:
        self.policy = policy
        log.info("retention settings reloaded: %s", policy)

    def latest(self, run: str) -> CheckpointInfo | None:
        return self.index.latest(run)

    def set_run_policy(self, run: str, overrides: dict[str, Any]) -> None:
        """Validate and store a run's own retention overrides (from its producer's hello)."""
        retention.merge(self.policy, overrides, f"the retention of run {run!r}")  # ConfigError if bad
        try:  # refuses a symlink or a file in place of the run folder (DESIGN §7.4)
            retention.save_run_policy(self.root / run, overrides)
        except OSError as exc:  # the producer is told; the daemon serves on
            raise ConfigError(f"cannot store the retention of run {run!r}: {exc.strerror or exc}") from None

    def after_commit(self, share: Share, complete: bool) -> None:
        """On the syncer thread, once a manifest is durable."""
        self.index.refresh_step(share.run, share.step)  # also moves the latest pointer
        if complete:  # whoever completes a step applies retention to its run
            self.prune(share.run)

    def prune(self, run: str) -> None:
        run_dir = self.root / run
        policy = retention.run_policy(self.policy, run_dir)
        if not policy.enabled:
            return
        with self._retention_lock:
            _, trash = retention.apply(run_dir, self.index.list(run), policy, now=time.time())
        for t in trash:
            self.index.refresh_step(run, int(t.name.split("-")[2]))
            self._trash.put(t)

    def _latest_changed(self, run: str, info: CheckpointInfo | None) -> None:
        # readers that run no index follow this pointer (DESIGN §5)
        with self._pointer_lock:
            try:
                write_pointer(self.root / run, info.step if info else None)
            except OSError as exc:
                log.warning("cannot update %s/latest: %s", self.root / run, exc.strerror)

    def _reap(self) -> None:
        while (trash := self._trash.get()) is not None:
            retention.remove_trash(trash)
