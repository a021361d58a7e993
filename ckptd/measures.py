"""What a run measured, kept on disk beside its checkpoints, and what the advice reads of it.

Each daemon keeps ``<root>/<run>/.measures.<host>.json`` per run it served
(``ckptd.daemon.measuring`` writes it): bounded lists of ``saves``, ``uploads``,
``restores`` and ``failures``, and the span the run was watched. ``ckptd advise`` reads
it offline: ``summarise`` turns a run's files into ``ckptd.advise.Inputs``. The
producer's side times its restores (``timed_restore``, ``take_restored``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from . import layout
from .advise import Inputs, recommend

VERSION = 1
PREFIX = ".measures."
MAX_BYTES = 4 * 2**20
KEEP = {"saves": 2000, "uploads": 2000, "restores": 200, "failures": 1000}
RECENT = 20
DEFAULT_MTBF_S = 24 * 3600.0
MIN_FAILURES = 2
# tiers.local.NAME and tiers.bucket.NAME, spelled out: this module sits below the tiers
ROOT = "local"
BUCKET = "remote"
F = TypeVar("F", bound=Callable[..., Any])
_HOST = re.compile(r"[^A-Za-z0-9._-]")


def file_name(host: str | None = None) -> str:
    """This host's measures file name in a run folder."""
    return f"{PREFIX}{_HOST.sub('_', host or socket.gethostname())[:64] or 'host'}.json"


def empty(run: str) -> dict[str, Any]:
    return {"version": VERSION, "run": run, "first_seen": None, "last_seen": None,
            **{k: [] for k in KEEP}}


def read(run_dir: Path) -> list[dict[str, Any]]:
    """Every host's measures of the run in ``run_dir`` (none: []); a damaged file is skipped."""
    out = []
    try:
        names = sorted(n for n in os.listdir(run_dir) if n.startswith(PREFIX) and n.endswith(".json"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:
        try:
            d = json.loads(layout.read_small(run_dir / name, MAX_BYTES))
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and d.get("version") == VERSION:
            out.append(d)
    return out


def merge(files: list[dict[str, Any]], run: str) -> dict[str, Any]:
    """One run's measures from several hosts' files."""
    m = empty(run)
    for d in files:
        for k in KEEP:
            m[k] += [r for r in d.get(k, []) if isinstance(r, dict)]
        for k, pick in (("first_seen", min), ("last_seen", max)):
            vals = [v for v in (m[k], d.get(k)) if isinstance(v, (int, float))]
            m[k] = pick(vals) if vals else None
    m["saves"].sort(key=lambda r: r.get("time", 0))
    return m


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


def by_step(saves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Saves grouped per (attempt, step), oldest first: the slowest rank's stall and
    persist (the job waits for it), the earliest time a rank's save returned."""
    steps: dict[tuple[Any, int], dict[str, Any]] = {}
    for r in saves:
        step, t = r.get("step"), _num(r.get("time"))
        if not isinstance(step, int) or t is None:
            continue
        s = steps.setdefault((r.get("attempt"), step), {"attempt": r.get("attempt"), "step": step, "time": t,
                                                        "stall_s": None, "persist_s": None})
        s["time"] = min(s["time"], t)
        for k in ("stall_s", "persist_s"):
            v = _num(r.get(k))
            if v is not None:
                s[k] = v if s[k] is None else max(s[k], v)
    return sorted(steps.values(), key=lambda s: s["time"])


def _step_time(steps: list[dict[str, Any]]) -> tuple[float | None, int | None]:
    """(seconds per step, steps between the last saves) from consecutive saves of one
    attempt: the time between two saves returning, less the later one's stall, over
    the steps between them."""
    secs = n = 0.0
    gaps = []
    for a, b in zip(steps, steps[1:]):
        if a["attempt"] != b["attempt"] or b["step"] <= a["step"]:
            continue
        gaps.append(b["step"] - a["step"])
        secs += max(0.0, b["time"] - a["time"] - (b["stall_s"] or 0.0))
        n += b["step"] - a["step"]
    if not n:
        return None, None
    return (secs / n if secs > 0 else None), int(statistics.median_low(gaps[-RECENT:]))


def summarise(m: dict[str, Any], mtbf: float | None = None, *, now: float | None = None,
              tier: str | None = None) -> tuple[Inputs, int | None]:
    """The advice's inputs from a run's merged measures, and the interval (in steps) it
    saves at now. ``mtbf``: ``[advise] mtbf``, or None. ``tier``: None for the local root
    (persist = durable there), else the tier a share's copy reached (its ``uploads``:
    persist = uploaded to the bucket, held in ``[peer] replicas`` partners' memory)."""
    inputs = Inputs()
    steps = by_step(m["saves"])
    recent = steps[-RECENT:]
    stalls = [s["stall_s"] for s in recent if s["stall_s"] is not None]
    inputs.stall_s = statistics.median(stalls) if stalls else None
    if tier is not None:
        got = [_num(u.get("persist_s")) for u in m["uploads"][-RECENT * 8:] if upload_tier(u) == tier]
        ups = [u for u in got if u is not None]
        inputs.persist_s = statistics.median(ups) if ups else None
    else:
        persists = [s["persist_s"] for s in recent if s["persist_s"] is not None]
        inputs.persist_s = statistics.median(persists) if persists else None
    inputs.step_s, current = _step_time(steps[-(RECENT + 1):])

    restores: dict[Any, float] = {}
    for r in m["restores"]:
        v = _num(r.get("seconds"))
        if v is not None:
            restores[r.get("attempt")] = max(restores.get(r.get("attempt"), 0.0), v)
    if restores:
        inputs.restore_s = statistics.mean(list(restores.values())[-5:])
    elif inputs.persist_s is not None:
        inputs.restore_s = inputs.persist_s
        inputs.assumed.append("restore_s")
        inputs.notes.append("no resume measured yet: restore_s is assumed to take as long as a save's persist")

    seen = m["first_seen"] is not None or bool(steps)
    failures = len({(f.get("attempt"), f.get("key")) for f in m["failures"]})
    inputs.failures = failures if seen else None
    start = m["first_seen"] if m["first_seen"] is not None else (steps[0]["time"] if steps else None)
    ends = [m["last_seen"], steps[-1]["time"] if steps else None, *(_num(f.get("time")) for f in m["failures"])]
    span = max(0.0, max((v for v in ends if v is not None), default=start) - start) if start is not None else 0.0
    _mtbf(inputs, failures, span, mtbf)
    if not steps:
        inputs.notes.append("no save of this run was measured")
    return inputs, current


def _mtbf(inputs: Inputs, failures: int, span: float, mtbf: float | None) -> None:
    """The mean time between failures: measured from two failures on; before, the prior
    (``[advise] mtbf``, else ``DEFAULT_MTBF_S``), named as assumed."""
    if failures >= MIN_FAILURES:
        inputs.mtbf_s = max(span, 1.0) / failures
    else:  # one failure is no rate: the prior, until a second one
        inputs.mtbf_s = mtbf if mtbf is not None else DEFAULT_MTBF_S
        inputs.assumed.append("mtbf_s")
        if mtbf is not None:
            inputs.notes.append(f"mtbf_s is [advise] mtbf from the config: {failures} failure(s) seen, fewer "
                                f"than the {MIN_FAILURES} needed to measure it")
        elif failures:
            inputs.notes.append(f"mtbf_s is assumed to be {DEFAULT_MTBF_S / 3600:.0f} h: {failures} failure seen, "
                                f"fewer than the {MIN_FAILURES} needed to measure it; set [advise] mtbf to your "
                                "cluster's figure")
        else:
            inputs.notes.append(f"no failure seen and no [advise] mtbf in the config: mtbf_s is assumed to be "
                                f"{DEFAULT_MTBF_S / 3600:.0f} h; set [advise] mtbf to your cluster's figure")


def upload_tier(u: dict[str, Any]) -> str:
    """The tier an ``uploads`` entry's share reached: ones recorded before the peer tier
    (without "tier") are the bucket's."""
    return str(u.get("tier", BUCKET))


# what losing each tier's copies takes: the root's survive a process's crash, the
# peers' and the bucket's the loss of the node
PROTECTS = {ROOT: "a process crash"}
NODE_LOST = "a node lost"


def advice(m: dict[str, Any], mtbf: float | None, tiers: tuple[str, ...] = (ROOT,)) -> dict[str, Any]:
    """The advice (``ckptd.advise.Advice`` as a dict) from a run's merged measures: the
    root's (``tiers[0]``) at the top level, and each tier's own under ``tiers``, from
    its own persist and recovery time."""
    per_tier = {}
    for i, tier in enumerate(tiers):
        inputs, current = summarise(m, mtbf, tier=tier if i else None)
        if i:
            _recover_from(tier, inputs)
        per_tier[tier] = recommend(inputs, current).to_dict()
    out = dict(per_tier[tiers[0]])
    out["tiers"] = {t: {k: a[k] for k in ("interval_steps", "interval_seconds", "expected_waste", "dominant")}
                    | {k: a["inputs"][k] for k in ("persist_s", "restore_s", "mtbf_s", "assumed")}
                    | {"protects": PROTECTS.get(t, NODE_LOST), "took": took(m, t, i == 0)}
                    for i, (t, a) in enumerate(per_tier.items())}
    return out


def took(m: dict[str, Any], tier: str, root: bool, n: int = 8) -> list[int]:
    """The last ``n`` steps a share of reached ``tier`` (the root: every save), ascending."""
    records = m["saves"] if root else [u for u in m["uploads"] if upload_tier(u) == tier]
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    return sorted(set(steps[-n * 16:]))[-n:]


def _recover_from(tier: str, inputs: Inputs) -> None:
    """A node lost resumes from ``tier``: at least a copy's time back, where the resumes
    measured (from the root, mostly) were faster."""
    p, r = inputs.persist_s, inputs.restore_s
    if p is not None and r is not None and p > r:
        inputs.restore_s = p
        if "restore_s" not in inputs.assumed:
            inputs.assumed.append("restore_s")
        inputs.notes.append(f"a resume from {tier} is assumed to take as long as a copy there (persist_s)")


_restored: dict[str, float] = {}
_local = threading.local()
_lock = threading.Lock()


@contextmanager
def restoring(run: str) -> Iterator[None]:
    """Time a load of ``run``; the producer of this process reports the total with its
    next save (a load inside another, such as ``load_into``'s, counts once)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    start = time.monotonic()
    ok = False
    try:
        yield
        ok = True
    finally:
        _local.depth = depth
        if ok and depth == 0:
            with _lock:
                _restored[run] = _restored.get(run, 0.0) + time.monotonic() - start


def timed_restore(run_arg: int) -> Callable[[F], F]:
    """Decorate a load function whose positional argument ``run_arg`` is the run: its
    time counts as a restore (``restoring``)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            run = args[run_arg] if len(args) > run_arg else kwargs.get("run")
            if not isinstance(run, str):
                return fn(*args, **kwargs)
            with restoring(run):
                return fn(*args, **kwargs)
        return timed  # type: ignore[return-value]
    return wrap


def take_restored(run: str) -> float | None:
    """Seconds this process spent loading ``run`` since the last call, or None."""
    with _lock:
        return _restored.pop(run, None)
