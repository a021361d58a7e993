"""The daemon's live figures, and the Prometheus endpoint that serves them.

``Figures`` holds what happened (commits, bytes, latencies, errors, each run's last
commit). Only the main loop changes it, next to the log line of the same event;
``snapshot()`` gives a consistent copy to ``ckptd status`` and to the scrape.
Figures of the moment (queued bytes, producers) are read from the daemon when
asked, through a ``live`` callable.

``MetricsServer`` answers ``GET /metrics`` on its own thread, ``ckptd-metrics``,
building the exposition at scrape time from a snapshot, so the main loop does no
Prometheus work at all. ``prometheus_client`` is imported here only.
"""

from __future__ import annotations

import bisect
import http.server
import logging
import socket
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Iterator

from ..config import split_host_port
from ..errors import CheckpointError
from ..tiers import bucket, peer

log = logging.getLogger("ckptd.daemon")

# Seconds from a step's first tensor to its durable manifest: from a small model on
# a fast disk to tens of GiB on a slow one.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
ERROR_KINDS = ("protocol", "step", "commit")  # a bad message; a step failed before commit; a failed commit
MAX_RUNS = 1000  # runs whose last commit is remembered (the most recent ones)


RECENT = 20  # commits that `ckptd status` figures its recent throughput from


class Figures:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the scrape thread reads while the main loop writes
        self.started = time.time()
        self.commits = 0
        self.bytes_written = 0
        self.bytes_reused = 0
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self._latency_sum = 0.0
        self._runs: OrderedDict[str, dict[str, Any]] = OrderedDict()  # oldest commit first
        self.last_commit: dict[str, Any] | None = None
        self._recent: deque[tuple[int, float]] = deque(maxlen=RECENT)  # (bytes, seconds) of the last commits
        self.replica_mismatches = 0  # tensors of completed steps whose replicas disagreed (ckptd.replicas)

    def committed(self, run: str, step: int, rank: int, nbytes: int, seconds: float, reused: int = 0) -> None:
        """A share committed: ``nbytes`` of tensor data written, ``reused`` referring to
        an earlier step's stored copy (daemon.reuse)."""
        now = time.time()
        last = {"run": run, "step": step, "rank": rank, "time": now, "bytes": nbytes, "seconds": seconds,
                "reused": reused}
        with self._lock:
            self.commits += 1
            self.bytes_written += nbytes
            self.bytes_reused += reused
            self._buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self._latency_sum += seconds
            self._runs.pop(run, None)
            self._runs[run] = {"step": step, "time": now}
            if len(self._runs) > MAX_RUNS:
                self._runs.popitem(last=False)
            self.last_commit = last
            self._recent.append((nbytes, seconds))

    def replica_mismatch(self, tensors: int) -> None:
        with self._lock:
            self.replica_mismatches += tensors

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """Plain data (msgpack- and JSON-ready): totals, latency histogram, runs."""
        with self._lock:
            cumulative, total = [], 0
            for count in self._buckets:
                total += count
                cumulative.append(total)
            return {
                "started": self.started,
                "commits": self.commits,
                "bytes_written": self.bytes_written,
                "bytes_reused": self.bytes_reused,
                "errors": dict(self.errors),
                "replica_mismatches": self.replica_mismatches,
                "latency": {"buckets": list(LATENCY_BUCKETS), "cumulative": cumulative,
                            "sum": self._latency_sum, "count": total},
                "runs": {run: dict(v) for run, v in self._runs.items()},
                "last_commit": dict(self.last_commit) if self.last_commit else None,
                # the last commits' bytes over their time from first byte to durable
                "recent": {"commits": len(self._recent), "bytes": sum(b for b, _ in self._recent),
                           "seconds": sum(t for _, t in self._recent)},
            }


class _Collector:
    """Turns a snapshot (and the live figures) into Prometheus metric families."""

    def __init__(self, figures: Figures, live: Callable[[], dict[str, Any]]) -> None:
        self._figures = figures
        self._live = live

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap, live, now = self._figures.snapshot(), self._live(), time.time()
        yield CounterMetricFamily("ckptd_commits", "Checkpoint shares (one rank of one step) committed durably.",
                                  value=snap["commits"])
        yield CounterMetricFamily("ckptd_bytes_written", "Tensor bytes of the checkpoints committed.",
                                  value=snap["bytes_written"])
        yield CounterMetricFamily("ckptd_bytes_reused", "Tensor bytes of the checkpoints committed that were "
                                  "not written again: they refer to an earlier step's stored copy.",
                                  value=snap["bytes_reused"])
        yield CounterMetricFamily("ckptd_replica_mismatch", "Replicated tensors whose copies on different "
                                  "ranks disagreed, in the steps this daemon completed (docs/training.md).",
                                  value=snap["replica_mismatches"])
        lat = snap["latency"]
        buckets = [(_le(b), c) for b, c in zip(lat["buckets"], lat["cumulative"])]
        buckets.append(("+Inf", lat["count"]))
        yield HistogramMetricFamily(
            "ckptd_commit_duration_seconds",
            "Seconds from a step's first tensor received to its manifest being durable.",
            buckets=buckets, sum_value=lat["sum"])
        errors = CounterMetricFamily(
            "ckptd_errors", "Errors reported to producers: protocol (a bad message), step (a step failed "
            "before its commit), commit (a commit failed).", labels=["kind"])
        for kind, n in snap["errors"].items():
            errors.add_metric([kind], n)
        yield errors
        yield GaugeMetricFamily("ckptd_queued_bytes", "Bytes received and not yet written.",
                                value=live["queued_bytes"])
        yield GaugeMetricFamily("ckptd_memory_budget_bytes", "Queued bytes above which the daemon stops reading.",
                                value=live["memory_budget"])
        yield GaugeMetricFamily("ckptd_producers", "Producers connected.", value=live["producers"])
        yield GaugeMetricFamily("ckptd_commits_in_progress", "Commits received and not yet durable.",
                                value=live["commits_in_progress"])
        yield GaugeMetricFamily("ckptd_draining", "1 while the daemon is stopping and finishing its work.",
                                value=1 if live["draining"] else 0)
        yield GaugeMetricFamily("ckptd_start_time_seconds", "When the daemon started (Unix time).",
                                value=snap["started"])
        stamp = GaugeMetricFamily("ckptd_last_commit_timestamp_seconds",
                                  "Unix time of each run's last commit by this daemon.", labels=["run"])
        age = GaugeMetricFamily("ckptd_last_commit_age_seconds",
                                "Seconds since each run's last commit by this daemon.", labels=["run"])
        step = GaugeMetricFamily("ckptd_last_commit_step", "Step of each run's last commit by this daemon.",
                                 labels=["run"])
        for run, v in snap["runs"].items():
            stamp.add_metric([run], v["time"])
            age.add_metric([run], max(0.0, now - v["time"]))
            step.add_metric([run], v["step"])
        yield stamp
        yield age
        yield step
        for tier, families in _TIER_FAMILIES.items():  # the tiers the config has (their figures: not None)
            if live.get(tier):
                yield from families(live[tier])
        if live.get("advice"):
            yield from _advice_families(live["advice"])


def _advice_families(advice: dict[str, Any]) -> Iterator[Any]:
    """Each run's checkpoint interval advice, per tier (docs/advise.md); a run with no
    advice yet (nothing measured) has no sample."""
    from prometheus_client.core import GaugeMetricFamily

    seconds = GaugeMetricFamily("ckptd_advice_interval_seconds", "Recommended seconds between checkpoints "
                                "(Daly's optimum with CheckFreq's in-flight floor), per run and tier.",
                                labels=["run", "tier"])
    steps = GaugeMetricFamily("ckptd_advice_interval_steps", "Recommended training steps between checkpoints, "
                              "per run and tier.", labels=["run", "tier"])
    waste = GaugeMetricFamily("ckptd_advice_expected_waste_ratio", "Expected fraction of the job's time lost "
                              "to checkpoints, rework and restores at the recommended interval.",
                              labels=["run", "tier"])
    current = GaugeMetricFamily("ckptd_advice_current_waste_ratio", "Expected fraction of the job's time lost "
                                "at the interval the run saves at now.", labels=["run"])
    failures = GaugeMetricFamily("ckptd_advice_failures", "Failed attempts of the run seen (restarts, producers "
                                 "that died).", labels=["run"])
    for run, a in advice.items():
        for tier, t in a["tiers"].items():
            if t["interval_seconds"] is not None:
                seconds.add_metric([run, tier], t["interval_seconds"])
                waste.add_metric([run, tier], t["expected_waste"])
            if t["interval_steps"] is not None:
                steps.add_metric([run, tier], t["interval_steps"])
        if a["current"]:
            current.add_metric([run], a["current"]["expected_waste"])
        if a["inputs"]["failures"] is not None:
            failures.add_metric([run], a["inputs"]["failures"])
    yield from (seconds, steps, waste, current, failures)


def _remote_families(r: dict[str, Any]) -> Iterator[Any]:
    """The uploads to the remote tier (ckptd/remote/uploader.py)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("ckptd_remote_pending_shares", "Shares committed locally and not yet uploaded.",
                            value=r["pending_shares"])
    yield GaugeMetricFamily("ckptd_remote_pending_bytes", "Tensor bytes committed locally and not yet uploaded "
                            "(local retention keeps them: a full disk shows here first).", value=r["pending_bytes"])
    yield GaugeMetricFamily("ckptd_remote_lag_seconds", "Age of the oldest commit not yet uploaded.",
                            value=r["lag_seconds"])
    yield CounterMetricFamily("ckptd_remote_uploaded_shares", "Shares uploaded (manifest last).",
                              value=r["shares_uploaded"])
    yield CounterMetricFamily("ckptd_remote_uploaded_bytes", "File bytes uploaded to the remote tier.",
                              value=r["bytes_uploaded"])
    yield CounterMetricFamily("ckptd_remote_copied_bytes", "File bytes copied inside the bucket instead of "
                              "uploaded: files an earlier step's upload holds already (daemon/reuse.py).",
                              value=r.get("bytes_copied", 0))
    yield CounterMetricFamily("ckptd_remote_upload_seconds", "Seconds spent uploading (bytes / seconds: "
                              "throughput).", value=r["upload_seconds"])
    yield CounterMetricFamily("ckptd_remote_failures", "Upload attempts that failed (each is retried).",
                              value=r["failures"])


def _peer_families(p: dict[str, Any]) -> Iterator[Any]:
    """The peer tier (ckptd/peer/): replicas sent and held."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("ckptd_peer_under_replicated", "Shares committed here with fewer replicas in "
                            "peers' memory than [peer] replicas.", value=p["under_replicated"])
    yield GaugeMetricFamily("ckptd_peer_held_bytes", "Bytes of other nodes' replicas held in memory.",
                            value=p["held_bytes"])
    yield GaugeMetricFamily("ckptd_peer_held_shares", "Other nodes' shares held in memory.", value=p["held_shares"])
    yield CounterMetricFamily("ckptd_peer_replicated_bytes", "File bytes sent to partners' memory.",
                              value=p["replicated_bytes"])
    yield CounterMetricFamily("ckptd_peer_failures", "Transfers a partner did not take (slow, full, dead).",
                              value=p["failures"])
    yield CounterMetricFamily("ckptd_peer_replicas_lost", "Replicas of this node's shares that a partner no "
                              "longer held (dead, restarted, evicted), sent again to the next peer.",
                              value=p.get("replicas_lost", 0))
    yield GaugeMetricFamily("ckptd_peer_partners_down", "Partners that did not answer, skipped for now "
                            "(backed off: heartbeat, 2x, 4x ... up to 12 heartbeats).", value=len(p.get("down", ())))
    yield CounterMetricFamily("ckptd_peer_drop_messages", "Batched drop messages sent to partners (retention's "
                              "deletions, one per partner per heartbeat).", value=p.get("drop_messages", 0))
    yield CounterMetricFamily("ckptd_peer_evicted", "Replicas held that made room for newer ones.",
                              value=p["evicted"])
    yield CounterMetricFamily("ckptd_peer_rejected", "Replicas received whose bytes did not match their "
                              "checksums (never held).", value=p["rejected"])
    yield CounterMetricFamily("ckptd_peer_thread_restarts", "Peer tier threads (serve, send) that failed and "
                              "were started again.", value=p.get("thread_restarts", 0))


# each tier's families, by its name in the live figures (ckptd.tiers.replica_names)
_TIER_FAMILIES: dict[str, Callable[[dict[str, Any]], Iterator[Any]]] = {
    bucket.NAME: _remote_families, peer.NAME: _peer_families,
}


def _le(bound: float) -> str:
    return repr(float(bound))


class MetricsServer:
    """``GET /metrics`` over HTTP, answered one request at a time on ``ckptd-metrics``."""

    def __init__(self, address: str, figures: Figures, live: Callable[[], dict[str, Any]]) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import MetricsHandler

        host, port = split_host_port(address)
        registry = CollectorRegistry()
        registry.register(_Collector(figures, live))
        handler = type("Handler", (MetricsHandler,), {"registry": registry, "timeout": 5.0})
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            server_cls = type("Server", (http.server.HTTPServer,), {"address_family": family})
            self._server = server_cls((host, port), handler)
        except OSError as exc:
            raise CheckpointError(
                f"cannot serve metrics on {address}: {exc.strerror or exc}; "
                "choose another [daemon] metrics address, or \"\" to turn metrics off"
            ) from None
        bound = self._server.server_address
        shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
        self.url = f"http://{shown}:{bound[1]}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="ckptd-metrics", daemon=True)
        self._thread.start()
        log.info("metrics at %s", self.url)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

