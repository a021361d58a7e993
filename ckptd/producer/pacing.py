"""``should_save(step)``: whether the advised interval has passed since the last save.

The interval comes with the daemon's welcome and commit replies (no round trip); the
step time is measured from the calls. Every rank answers the same for the same step: at
a *plan* (the first call, and the one after each save) rank 0's figures fix the next
save's step and one broadcast shares it. With no advice yet the answer is True; the
bounds (``min_steps`` ... ``max_seconds``) always win over the advice.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable


def check_bounds(min_steps: int | None, max_steps: int | None, min_seconds: float | None,
                 max_seconds: float | None) -> None:
    for name, v in (("min_steps", min_steps), ("max_steps", max_steps)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"should_save({name}={v!r}): a number of steps, 1 or more, or None")
    for name, sec in (("min_seconds", min_seconds), ("max_seconds", max_seconds)):
        if sec is not None and (not isinstance(sec, (int, float)) or isinstance(sec, bool) or not sec > 0
                                or math.isinf(sec)):
            raise ValueError(f"should_save({name}={sec!r}): a positive number of seconds, or None")
    if min_steps is not None and max_steps is not None and min_steps > max_steps:
        raise ValueError(f"should_save(min_steps={min_steps}, max_steps={max_steps}): min_steps is above max_steps")
    if min_seconds is not None and max_seconds is not None and min_seconds > max_seconds:
        raise ValueError(f"should_save(min_seconds={min_seconds}, max_seconds={max_seconds}): "
                         "min_seconds is above max_seconds")


class Pacer:
    """One producer's ``should_save`` state."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.anchor: int | None = None
        self.next_step: float | None = None
        self.last_call: tuple[int, float] | None = None
        self.step_s: float | None = None
        self.saved = False
        self._just_saved = False  # the time to the next call holds the save's stall: not a step time

    def should_save(self, step: int, interval_s: float | None, agree: Callable[[float], float],
                    bounds: tuple[int | None, int | None, float | None, float | None]) -> bool:
        now = self.clock()
        if self.last_call is not None and step > self.last_call[0] and not self._just_saved:
            sample = (now - self.last_call[1]) / (step - self.last_call[0])
            self.step_s = sample if self.step_s is None else 0.7 * self.step_s + 0.3 * sample
        self.last_call, self._just_saved = (step, now), False
        if self.anchor is None:
            self.anchor = step
        if self.next_step is None:
            self.next_step = agree(self._plan(interval_s, bounds))
        if math.isnan(self.next_step):
            self.next_step = None
            return False
        due = step >= self.next_step
        if due:
            self.anchor, self.next_step, self.saved, self._just_saved = step, None, True, True
        return due

    def _plan(self, interval_s: float | None,
              bounds: tuple[int | None, int | None, float | None, float | None]) -> float:
        """The step of the next save, or NaN: not decidable yet (no advice since the first
        save, or seconds to turn into steps and no step timed yet)."""
        assert self.anchor is not None
        min_steps, max_steps, min_seconds, max_seconds = bounds
        s = self.step_s
        if s is None and (min_seconds is not None or max_seconds is not None):
            return math.nan
        lo = max(min_steps or 0, math.ceil(min_seconds / s) if min_seconds is not None and s else 0)
        hi = min(max_steps or math.inf, max(1, math.floor(max_seconds / s)) if max_seconds is not None and s
                 else math.inf)
        want: float
        if interval_s is None and not self.saved:
            want = 0
        elif interval_s is None or s is None:
            if hi == math.inf:
                return math.nan
            want = hi
        else:
            want = max(1, round(interval_s / s))
        return self.anchor + min(max(want, lo), hi)


def collective(world_size: int, dtype: str, apply: Callable[[Any, Any], None]) -> Callable[[float], float]:
    """A function that puts a value through ``apply(dist, tensor)`` (one collective over a
    one-element tensor of ``dtype``) when ``torch.distributed`` is initialised over
    ``world_size`` ranks, and returns the result; else it returns the value itself."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return lambda v: v
    if world_size <= 1 or not dist.is_available() or not dist.is_initialized() \
            or dist.get_world_size() != world_size:
        return lambda v: v

    def agree(value: float) -> float:
        device: Any = "cpu"
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([value], dtype=getattr(torch, dtype), device=device)
        apply(dist, t)
        return float(t.item())

    return agree


def broadcast_from_rank0(world_size: int) -> Callable[[float], float]:
    """A function that returns rank 0's value on every rank (one broadcast)."""
    return collective(world_size, "float64", lambda dist, t: dist.broadcast(t, src=0))
