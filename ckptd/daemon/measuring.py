"""The daemon's side of the interval advice: it records, per run, what each save cost
and which attempts of the job failed, and keeps ``<root>/<run>/.measures.<host>.json``
current (the format is ``ckptd.measures``'s; the model is docs/advise.md's).

The main loop calls ``hello``, ``committed`` and ``ended``; the uploader thread calls
``uploaded``; the metrics thread and ``ckptd status`` call ``advice``: one lock
guards the records. Files are written on the ``ckptd-measures`` thread, at most
once a second per run, so the main loop never waits on a disk for them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .. import layout, measures
from ..durable import atomic_write
from ..names import check_run

log = logging.getLogger("ckptd.daemon")
WRITE_EVERY_S = 1.0
MAX_RUNS = 1000  # runs whose records stay in memory (and in `ckptd status`, the metrics)


def parse_timing(value: Any) -> tuple[float | None, float | None]:
    """A commit's ``timing`` map (docs/format.md): (stall seconds, restore seconds); a
    missing or bad value is None (the timing informs the advice, it never fails a commit)."""
    if not isinstance(value, dict):
        return None, None

    def seconds(key: str) -> float | None:
        v = value.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9:
            return float(v)
        return None

    return seconds("stall_s"), seconds("restore_s")


class Measuring:
    def __init__(self, root: Path, mtbf: float | None, tiers: tuple[str, ...] = ("local",)) -> None:
        self.root = root
        self.mtbf = mtbf
        self.tiers = tiers
        self.file = measures.file_name()
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, dict[str, Any]] = OrderedDict()  # this host's records, per run, last used last
        self._dirty: set[str] = set()
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}  # run -> (monotonic time, advice)
        # producers without attempt: one failure per generation, and a hello after it starts the next
        self._none_gen: dict[str, tuple[int, bool]] = {}  # run -> (generation, failed already)
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._write_loop, name="ckptd-measures", daemon=True)
        self._thread.start()

    # -- events (the main loop; the uploader) ---------------------------------------------------
    def hello(self, run: str, attempt: str | None) -> None:
        with self._lock:
            m = self._run(run)
            now = time.time()
            if m["first_seen"] is None:
                m["first_seen"] = now
            m["last_seen"] = now
            gen, failed = self._none_gen.get(run, (0, False))
            if attempt is None and failed:
                self._none_gen[run] = (gen + 1, False)
            self._dirty.add(run)

    def committed(self, run: str, rank: int, step: int, attempt: str | None, timing: Any,
                  persist_s: float) -> None:
        stall, restore = parse_timing(timing)
        now = time.time()
        with self._lock:
            m = self._run(run)
            m["last_seen"] = now
            if m["first_seen"] is None:
                m["first_seen"] = now
            m["saves"].append({"step": step, "rank": rank, "attempt": attempt, "time": now,
                               "stall_s": stall, "persist_s": persist_s})
            if len(m["saves"]) == 1:  # an answer cached before any save (the welcome's) measured nothing
                self._cache.pop(run, None)
            if restore is not None:
                m["restores"].append({"attempt": attempt, "rank": rank, "time": now, "seconds": restore})
            self._trim(m)
            self._dirty.add(run)
        self._wake.set()

    def uploaded(self, run: str, step: int, rank: int, lag_s: float, tier: str = "remote") -> None:
        """A share reached ``tier`` (the remote tier: the uploader thread; "peer": its
        partners' memory, the peer sender thread) ``lag_s`` after its local commit."""
        with self._lock:
            m = self._run(run)
            local = next((r.get("persist_s") or 0.0 for r in reversed(m["saves"])
                          if r["step"] == step and r["rank"] == rank), 0.0)
            m["uploads"].append({"step": step, "rank": rank, "time": time.time(), "persist_s": local + lag_s,
                                 "tier": tier})
            self._trim(m)
            self._dirty.add(run)
        self._wake.set()

    def ended(self, run: str, attempt: str | None, why: str) -> None:
        """A producer of ``run`` ended without saying goodbye: its attempt failed (once)."""
        with self._lock:
            m = self._run(run)
            key = None
            if attempt is None:  # no attempt to tell failures apart: one per generation
                key, failed = self._none_gen.get(run, (0, False))
                if failed:
                    return
                self._none_gen[run] = (key, True)
            if any(f.get("attempt") == attempt and f.get("key") == key for f in m["failures"]):
                return
            now = time.time()
            m["failures"].append({"attempt": attempt, "key": key, "time": now, "why": why})
            m["last_seen"] = now
            self._trim(m)
            self._dirty.add(run)
        log.info("run %s: attempt %s failed (%s); %d failure(s) recorded", run, attempt, why, len(m["failures"]))
        self._wake.set()

    # -- the advice (any thread) -----------------------------------------------------------------
    def advice(self, run: str, max_age: float = 0.0) -> dict[str, Any] | None:
        """The run's advice, with one entry per tier under ``tiers``; None if never seen.
        ``max_age``: an answer figured this many seconds ago will do (a commit's reply:
        many ranks commit at once, the figures barely move between them)."""
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(run)
            if cached is not None and now - cached[0] <= max_age:
                return cached[1]
            m = self._runs.get(run)
            if m is None:
                return None
            a = measures.advice(m, self.mtbf, self.tiers)
            self._cache[run] = (now, a)
            return a

    def all_advice(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            runs = list(self._runs)
        return {run: a for run in runs if (a := self.advice(run)) is not None}

    # -- the files ------------------------------------------------------------------------------------
    def _run(self, run: str) -> dict[str, Any]:
        """This host's records of ``run``: from its file at first use (they survive a restart)."""
        m = self._runs.get(run)
        if m is not None:
            self._runs.move_to_end(run)
        else:
            check_run(run)
            mine = [d for d in _read_own(self.root / run, self.file)]
            m = measures.merge(mine, run) if mine else measures.empty(run)
            m["version"] = measures.VERSION
            failed = [f["key"] for f in m["failures"] if f.get("attempt") is None and isinstance(f.get("key"), int)]
            if failed:
                self._none_gen[run] = (max(failed) + 1, False)
            self._runs[run] = m
            while len(self._runs) > MAX_RUNS:  # the least recently used: its file keeps it
                old = next(r for r in self._runs if r != run)
                if old in self._dirty:
                    break  # written first; dropped at a later call
                del self._runs[old]
                self._cache.pop(old, None)
        return m

    @staticmethod
    def _trim(m: dict[str, Any]) -> None:
        for k, n in measures.KEEP.items():
            if len(m[k]) > n:
                del m[k][: len(m[k]) - n]

    def _write_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                self._write_dirty()
                return
            self._write_dirty()
            time.sleep(WRITE_EVERY_S)

    def _write_dirty(self) -> None:
        with self._lock:
            todo = {run: json.dumps(self._runs[run], separators=(",", ":")).encode() for run in self._dirty}
            self._dirty.clear()
        for run, data in todo.items():
            run_dir = self.root / run
            if not run_dir.is_dir() or run_dir.is_symlink():  # a run with no step on disk: nothing to put beside
                with self._lock:
                    self._dirty.add(run)  # written once its folder exists
                continue
            try:
                atomic_write(run_dir / self.file, data, fsync=False)  # figures, not checkpoints
            except OSError as exc:
                log.warning("cannot write %s: %s", run_dir / self.file, exc.strerror or exc)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(10)


def _read_own(run_dir: Path, name: str) -> list[dict[str, Any]]:
    try:
        d = json.loads(layout.read_small(run_dir / name, measures.MAX_BYTES))
    except (OSError, ValueError):
        return []
    return [d] if isinstance(d, dict) and d.get("version") == measures.VERSION else []

