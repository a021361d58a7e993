"""How often to checkpoint: the interval that loses the least time, from measured inputs.

Pure functions, no I/O (docs/advise.md has the model, its inputs and its limits):

- ``daly(C, M)``: Daly's higher-order estimate of the optimum interval between the
  ends of two checkpoints, for a checkpoint that blocks training ``C`` seconds and a
  mean time between failures ``M``; Young's first-order ``sqrt(2CM)`` is ``young``.
- ``inflight_floor``: CheckFreq's floor (FAST '21): a save starts only once the
  previous one is durable, so the interval is at least ``(persist - stall) / step``
  steps.
- ``waste``: the expected fraction of the job's time lost at interval ``T``:
  ``C/T`` (training blocked by saves) ``+ (T/2 + P)/M`` (work redone after a failure:
  half an interval on average, plus the time the last save took to become durable)
  ``+ R/M`` (the resume itself).
- ``recommend``: all of it for one set of ``Inputs``, as the ``Advice`` that
  ``ckptd advise``, ``ckptd status`` and the metrics show, one per tier;
  ``most_frequent`` is the interval ``should_save`` follows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

INPUTS = ("stall_s", "persist_s", "step_s", "restore_s", "mtbf_s", "failures")


def young(c: float, m: float) -> float:
    """Young (1974): ``sqrt(2·C·M)`` seconds between checkpoints."""
    return math.sqrt(2.0 * c * m)


def daly(c: float, m: float) -> float:
    """Daly (2006, "A higher order estimate of the optimum checkpoint interval for
    restart dumps", FGCS 22): ``sqrt(2CM)·[1 + ⅓·sqrt(C/2M) + C/18M] − C`` for
    ``C < 2M``, else ``M``. The restart time does not enter the optimum (it is paid
    once per failure whatever the interval); it enters the waste."""
    if c <= 0:
        return 0.0
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return young(c, m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def inflight_floor(persist_s: float, stall_s: float, step_s: float) -> int:
    """CheckFreq's floor: the fewest steps between saves such that a save never starts
    while the previous one is still being made durable (at least 1)."""
    if step_s <= 0:
        return 1
    return max(1, math.ceil((persist_s - stall_s) / step_s - 1e-9))


@dataclass(frozen=True)
class Waste:
    """The expected fraction of the job lost at one interval, by cause."""

    stall: float  # C/T: training blocked while saves snapshot
    rework: float  # (T/2 + P)/M: work after the last durable checkpoint, redone after a failure
    restore: float  # R/M: resuming after a failure

    @property
    def total(self) -> float:
        return self.stall + self.rework + self.restore

    @property
    def dominant(self) -> str:
        """The cause that costs the most: "stall", "rework" or "restore"."""
        parts = {"stall": self.stall, "rework": self.rework, "restore": self.restore}
        return max(parts, key=lambda k: parts[k])


def waste(t: float, c: float, p: float, r: float, m: float) -> Waste:
    """Expected fraction lost checkpointing every ``t`` seconds (see the module's docstring)."""
    if t <= 0 or m <= 0:
        raise ValueError(f"interval {t!r} and mean time between failures {m!r} must be positive")
    return Waste(stall=c / t, rework=(t / 2.0 + p) / m, restore=r / m)


@dataclass
class Inputs:
    """What the advice is figured from; seconds, or None where neither measured nor assumed."""

    stall_s: float | None = None  # C: the training loop blocked per save (slowest rank)
    persist_s: float | None = None  # P: hand-over to durable per save (slowest rank)
    step_s: float | None = None  # one training step, from the times and steps of saves
    restore_s: float | None = None  # R: a resume (slowest rank's load)
    mtbf_s: float | None = None  # M: mean time between failures
    failures: int | None = None  # failures seen (None: no history of the run at all)
    assumed: list[str] = field(default_factory=list)  # inputs from the config or a default
    notes: list[str] = field(default_factory=list)  # where each assumed or odd input came from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Advice:
    interval_steps: int | None  # None: step time not measured yet
    interval_seconds: float | None  # None: nothing measured to advise on yet
    expected_waste: float | None  # fraction of the job lost at that interval
    waste: dict[str, float] | None  # by cause: stall, rework, restore
    dominant: str | None  # the cause that costs the most
    current: dict[str, Any] | None  # the interval the run saves at now, and what it costs
    inputs: Inputs

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = self.inputs.to_dict()
        return d


def recommend(inputs: Inputs, current_steps: int | None = None) -> Advice:
    """The interval to save at for ``inputs``, and what it (and ``current_steps``) costs."""
    c, p, s, r, m = inputs.stall_s, inputs.persist_s, inputs.step_s, inputs.restore_s, inputs.mtbf_s
    if c is None or p is None or m is None:
        return Advice(None, None, None, None, None, None, inputs)
    r = r or 0.0
    t = daly(max(c, 1e-6), m)
    if s:
        steps = max(1, round(t / s), inflight_floor(p, c, s))
        seconds = steps * s
    else:  # seconds only, the floor in seconds
        steps, seconds = None, max(t, p - c)
    w = waste(seconds, c, p, r, m)
    current = None
    if current_steps and s:
        cw = waste(current_steps * s, c, p, r, m)
        current = {"interval_steps": current_steps, "interval_seconds": current_steps * s,
                   "expected_waste": cw.total}
    return Advice(steps, seconds, w.total, {"stall": w.stall, "rework": w.rework, "restore": w.restore},
                  w.dominant, current, inputs)


def most_frequent(advice: dict[str, Any] | None) -> float | None:
    """The interval of the tier the advice saves to most often: ``should_save``'s."""
    if not advice:
        return None
    every = [t["interval_seconds"] for t in (advice.get("tiers") or {}).values() if t.get("interval_seconds")]
    return min(every) if every else advice.get("interval_seconds")


def seconds(v: float | None) -> str:
    """``0.00203 s``, ``9.35 s``, ``21600 s (6h 00m)``; None: "not measured"."""
    from .units import duration

    if v is None:
        return "not measured"
    return f"{v:.3g} s" if v < 60 else f"{v:.0f} s ({duration(v)})"


def render(run: str, advice: dict[str, Any]) -> list[str]:
    """``ckptd advise``'s text: the advice, the inputs and what was assumed."""
    i = advice["inputs"]
    sec = seconds

    lines = [f"run {run}:"]
    if advice["interval_seconds"] is None:
        lines.append("  no advice yet: no save of this run was measured (a daemon records each save's "
                     "stall and persist time)")
    else:
        every = (f"every {advice['interval_steps']} steps (~{sec(advice['interval_seconds'])})"
                 if advice["interval_steps"] is not None else f"every {sec(advice['interval_seconds'])}")
        lines.append(f"  checkpoint {every}")
        w = advice["waste"]
        lines.append(f"  expected loss: {advice['expected_waste']:.2%} of the job's time (stall {w['stall']:.2%}, "
                     f"rework {w['rework']:.2%}, restore {w['restore']:.2%}); {advice['dominant']} dominates")
        cur = advice["current"]
        if cur:
            lines.append(f"  now: every {cur['interval_steps']} steps (~{sec(cur['interval_seconds'])}), "
                         f"expected loss {cur['expected_waste']:.2%}")
    lines.append(f"  inputs: stall {sec(i['stall_s'])}, persist {sec(i['persist_s'])}, step {sec(i['step_s'])}, "
                 f"restore {sec(i['restore_s'])}, MTBF {sec(i['mtbf_s'])}, failures "
                 f"{'not measured' if i['failures'] is None else i['failures']}")
    if i["assumed"]:
        lines.append(f"  assumed (not measured): {', '.join(i['assumed'])}")
    lines += [f"  note: {n}" for n in i["notes"]]
    return lines + tier_lines(advice)[1:]  # the root's is the advice above


def tier_lines(advice: dict[str, Any], indent: str = "  ") -> list[str]:
    """One line per tier: its interval, what it protects against, its own inputs."""
    lines = []
    for tier, t in (advice.get("tiers") or {}).items():
        if t["interval_seconds"] is None:
            continue
        every = (f"{t['interval_steps']} steps" if t["interval_steps"] is not None
                 else seconds(t["interval_seconds"]))
        assumed = f"; assumed: {', '.join(t['assumed'])}" if t.get("assumed") else ""
        took = f"; took steps {', '.join(map(str, t['took']))}" if t.get("took") else ""
        lines.append(f"{indent}tier {tier}: every {every} (against {t.get('protects', 'a failure')}; persist "
                     f"{seconds(t['persist_s'])}, restore {seconds(t.get('restore_s'))}, MTBF "
                     f"{seconds(t.get('mtbf_s'))}{assumed}), expected loss {t['expected_waste']:.2%}{took}")
    return lines
