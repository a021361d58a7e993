"""The daemon's figures (``Figures``) and the Prometheus endpoint (``MetricsServer``).

Only the main loop changes ``Figures``; ``snapshot()`` gives a consistent copy to
``ckptd status`` and to the scrape, which ``ckptd-metrics`` answers at scrape time.
``prometheus_client`` is imported here only.
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

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
ERROR_KINDS = ("protocol", "step", "commit")  # a bad message; a step failed before commit; a failed commit
MAX_RUNS = 1000


RECENT = 20


class Figures:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.commits = 0
        self.bytes_written = 0
        self.bytes_reused = 0
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._runs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.last_commit: dict[str, Any] | None = None
        self._recent: deque[tuple[int, float]] = deque(maxlen=RECENT)
        self.replica_mismatches = 0

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
        yield from _families(_TOTALS, snap)
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
        yield from _families(_NOW, {**live, "started": snap["started"]})
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
        for tier, table in _TIER_FAMILIES.items():
            if live.get(tier):
                yield from _families(table, live[tier])
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


_TOTALS = (
    ("c", "ckptd_commits", "Checkpoint shares (one rank of one step) committed durably.", "commits"),
    ("c", "ckptd_bytes_written", "Tensor bytes of the checkpoints committed.", "bytes_written"),
    ("c", "ckptd_bytes_reused", "Tensor bytes of the checkpoints committed that were not written again: they "
     "refer to an earlier step's stored copy.", "bytes_reused"),
    ("c", "ckptd_replica_mismatch", "Replicated tensors whose copies on different ranks disagreed, in the steps "
     "this daemon completed (docs/reliability.md).", "replica_mismatches"),
)
_NOW = (
    ("g", "ckptd_queued_bytes", "Bytes received and not yet written.", "queued_bytes"),
    ("g", "ckptd_memory_budget_bytes", "Queued bytes above which the daemon stops reading.", "memory_budget"),
    ("g", "ckptd_producers", "Producers connected.", "producers"),
    ("g", "ckptd_commits_in_progress", "Commits received and not yet durable.", "commits_in_progress"),
    ("g", "ckptd_draining", "1 while the daemon is stopping and finishing its work.", "draining"),
    ("g", "ckptd_start_time_seconds", "When the daemon started (Unix time).", "started"),
)
# (kind, name, help, key): a counter ("c") or gauge ("g") of a tier's figure ``key``
_REMOTE = (
    ("g", "ckptd_remote_pending_shares", "Shares committed locally and not yet uploaded.", "pending_shares"),
    ("g", "ckptd_remote_pending_bytes", "Tensor bytes committed locally and not yet uploaded (local retention "
     "keeps them: a full disk shows here first).", "pending_bytes"),
    ("g", "ckptd_remote_lag_seconds", "Age of the oldest commit not yet uploaded.", "lag_seconds"),
    ("c", "ckptd_remote_uploaded_shares", "Shares uploaded (manifest last).", "shares_uploaded"),
    ("c", "ckptd_remote_uploaded_bytes", "File bytes uploaded to the remote tier.", "bytes_uploaded"),
    ("c", "ckptd_remote_copied_bytes", "File bytes copied inside the bucket instead of uploaded: files an "
     "earlier step's upload holds already (daemon/reuse.py).", "bytes_copied"),
    ("c", "ckptd_remote_upload_seconds", "Seconds spent uploading (bytes / seconds: throughput).", "upload_seconds"),
    ("c", "ckptd_remote_failures", "Upload attempts that failed (each is retried).", "failures"),
)
_PEER = (
    ("g", "ckptd_peer_under_replicated", "Shares committed here with fewer copies in partners' memory than "
     "[peer] replicas asks for.", "under_replicated"),
    ("g", "ckptd_peer_held_bytes", "Bytes of other nodes' copies held in memory.", "held_bytes"),
    ("g", "ckptd_peer_held_shares", "Other nodes' shares held in memory.", "held_shares"),
    ("c", "ckptd_peer_replicated_bytes", "File bytes sent to partners' memory.", "replicated_bytes"),
    ("c", "ckptd_peer_failures", "Transfers a partner did not take (slow, full, dead).", "failures"),
    ("c", "ckptd_peer_replicas_lost", "Copies of this node's shares that a partner no longer held (dead, "
     "restarted, evicted), sent again to the next peer.", "replicas_lost"),
    ("g", "ckptd_peer_partners_down", "Partners that did not answer, skipped for now (backed off: heartbeat, "
     "2x, 4x ... up to 12 heartbeats).", "down"),
    ("c", "ckptd_peer_drop_messages", "Batched drop messages sent to partners (retention's deletions, one per "
     "partner per heartbeat).", "drop_messages"),
    ("c", "ckptd_peer_evicted", "Copies held that made room for newer ones.", "evicted"),
    ("c", "ckptd_peer_rejected", "Copies received whose bytes did not match their checksums (never held).",
     "rejected"),
    ("c", "ckptd_peer_thread_restarts", "Peer tier threads (serve, send) that failed and were started again.",
     "thread_restarts"),
)


def _families(table: tuple[tuple[str, str, str, str], ...], figures: dict[str, Any]) -> Iterator[Any]:
    """A tier's figures as metric families; a list counts its members, a figure absent is 0."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for kind, name, text, key in table:
        value = figures.get(key, 0)
        if isinstance(value, (list, tuple, set, dict)):
            value = len(value)
        yield (CounterMetricFamily if kind == "c" else GaugeMetricFamily)(name, text, value=float(value))


_TIER_FAMILIES = {bucket.NAME: _REMOTE, peer.NAME: _PEER}


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

