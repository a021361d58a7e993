"""What the daemon says about itself: systemd's ``STATUS=`` line, the ``status``
message's report (what ``ckptd status`` prints, docs/format.md), and the live
figures the metrics thread reads (docs/service.md).

Each is read from the running ``Daemon``; none changes it.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from .. import tiers

if TYPE_CHECKING:
    from .server import Daemon


def line(d: Daemon) -> str:
    """The one line systemd shows (``systemctl status``)."""
    if d.stopping:
        return (f"stopping: {len(d.committing)} commit(s) in progress, {len(d.open_steps())} "
                "open step(s); new steps are refused")
    runs = sorted({s.run for s in d.sessions.values()})
    text = f"{len(d.sessions)} producer(s)"
    if runs:
        text += f" of run(s) {', '.join(runs[:4])}{', ...' if len(runs) > 4 else ''}"
    text += f"; {d.queued / 2**20:.1f} MiB queued"
    last = d.figures.last_commit
    if last is None:
        return text + "; no commit yet"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["time"]))
    return text + f"; last commit: run {last['run']} step {last['step']} at {when}"


def live_figures(d: Daemon) -> dict[str, Any]:
    """Figures of the moment, for the metrics thread: plain reads, no iteration."""
    return {"queued_bytes": d.queued, "memory_budget": d.cfg.memory_budget,
            "producers": len(d.sessions), "commits_in_progress": len(d.committing),
            "draining": d.stopping, **_tiers(d),
            "advice": d.measuring.all_advice() if d.measuring else {}}


def report(d: Daemon) -> dict[str, Any]:
    """What `ckptd status` prints (the wire's ``report``)."""
    snap, now = d.figures.snapshot(), time.time()
    return {
        "version": d.version, "pid": os.getpid(), "state": "stopping" if d.stopping else "serving",
        "endpoint": d.endpoint, "root": str(d.root), "time": now, "started": snap["started"],
        "metrics": d.metrics.url if d.metrics else None,
        "queued_bytes": d.queued, "memory_budget": d.cfg.memory_budget,
        "commits_in_progress": len(d.committing),
        "producers": [
            {"run": s.run, "rank": s.rank, "world_size": s.world_size, "pid": s.pid, "host": s.host,
             "transport": "shm" if s.shm is not None else "inline",
             "open_steps": sorted(k for k, st in s.steps.items() if st.share.error is None)}
            for s in d.sessions.values()
        ],
        "commits": snap["commits"], "bytes_written": snap["bytes_written"], "bytes_reused": snap["bytes_reused"],
        "errors": snap["errors"],
        "replica_mismatches": snap["replica_mismatches"],  # tensors whose replicas disagreed (ckptd.replicas)
        "commit_seconds": {"sum": snap["latency"]["sum"], "count": snap["latency"]["count"]},
        "last_commit": snap["last_commit"], "recent_commits": snap["recent"],
        "runs": snap["runs"],
        **_tiers(d),  # each tier's: "remote" (the uploads, with [remote]), "peer" (replicas sent and held)
        "advice": d.measuring.all_advice() if d.measuring else {},  # per run (docs/advise.md)
    }


def _tiers(d: Daemon) -> dict[str, Any]:
    """Each tier's figures by its name (docs/tiers.md); null for one not configured."""
    return d.upkeep.tier_figures() if d.upkeep else dict.fromkeys(tiers.replica_names())
