"""What the daemon says about itself: systemd's ``STATUS=`` line, the ``status``
message's report (what ``ckptd status`` prints), and the live figures the metrics
thread reads. Each reads the daemon's parts (``Reporter``); none changes them.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..config import Config
from ..version import __version__
from .ledger import Ledger
from .lifecycle import Lifecycle
from .sessions import Sessions
from .upkeep import Upkeep


class Reporter:
    def __init__(self, config: Config, lifecycle: Lifecycle, sessions: Sessions, ledger: Ledger,
                 upkeep: Upkeep) -> None:
        self._config = config
        self._lifecycle = lifecycle
        self._sessions = sessions
        self._ledger = ledger
        self._upkeep = upkeep

    def line(self) -> str:
        """The one line systemd shows (``systemctl status``)."""
        sessions, ledger = self._sessions, self._ledger
        if self._lifecycle.stopping:
            return (f"stopping: {ledger.commits} commit(s) in progress, {len(sessions.open_steps())} "
                    "open step(s); new steps are refused")
        runs = sorted({s.run for s in sessions})
        text = f"{len(sessions)} producer(s)"
        if runs:
            text += f" of run(s) {', '.join(runs[:4])}{', ...' if len(runs) > 4 else ''}"
        text += f"; {ledger.queued / 2**20:.1f} MiB queued"
        last = ledger.figures.last_commit
        if last is None:
            return text + "; no commit yet"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["time"]))
        return text + f"; last commit: run {last['run']} step {last['step']} at {when}"

    def live_figures(self) -> dict[str, Any]:
        """Figures of the moment, for the metrics thread: plain reads, no iteration."""
        ledger = self._ledger
        return {"queued_bytes": ledger.queued, "memory_budget": ledger.memory_budget,
                "producers": len(self._sessions), "commits_in_progress": ledger.commits,
                "draining": self._lifecycle.stopping, **self._upkeep.tier_figures(),
                "advice": ledger.measuring.all_advice()}

    def report(self) -> dict[str, Any]:
        """What `ckptd status` prints (the wire's ``report``)."""
        ledger, config = self._ledger, self._config
        snap, now = ledger.figures.snapshot(), time.time()
        return {
            "version": __version__, "pid": os.getpid(),
            "state": "stopping" if self._lifecycle.stopping else "serving",
            "endpoint": config.endpoint, "root": str(config.root), "time": now, "started": snap["started"],
            "metrics": self._lifecycle.metrics_url,
            "queued_bytes": ledger.queued, "memory_budget": ledger.memory_budget,
            "commits_in_progress": ledger.commits,
            "producers": [
                {"run": s.run, "rank": s.rank, "world_size": s.world_size, "pid": s.pid, "host": s.host,
                 "transport": "shm" if s.shm is not None else "inline",
                 "open_steps": sorted(k for k, st in s.steps.items() if st.share.error is None)}
                for s in self._sessions
            ],
            "commits": snap["commits"], "bytes_written": snap["bytes_written"], "bytes_reused": snap["bytes_reused"],
            "errors": snap["errors"], "replica_mismatches": snap["replica_mismatches"],
            "commit_seconds": {"sum": snap["latency"]["sum"], "count": snap["latency"]["count"]},
            "last_commit": snap["last_commit"], "recent_commits": snap["recent"],
            "runs": snap["runs"],
            **self._upkeep.tier_figures(),
            "advice": ledger.measuring.all_advice(),
        }
