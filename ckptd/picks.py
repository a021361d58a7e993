"""Which committed steps a copy tier takes (docs/advise.md): the steps its producer's
pick named it due for (a commit that names none: every step), and any step while the
tier holds nothing of that run, so that skipping never leaves it empty. ``Picks``
remembers what each tier took and skipped, for ``ckptd status``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any

SHOWN = 8  # steps taken shown per run
MAX_RUNS = 64


def takes(tier: str, due: tuple[str, ...] | None, holds: bool) -> bool:
    """Whether ``tier`` copies a step whose commit named ``due`` (None: every tier is
    due), given whether it ``holds`` a step of the run already (or is copying one)."""
    return due is None or tier in due or not holds


class Picks:
    """One tier's choices: the last steps it took per run, and how many it skipped."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._taken: OrderedDict[str, deque[int]] = OrderedDict()
        self.skipped = 0
        self._lock = threading.Lock()

    def decide(self, run: str, step: int, due: tuple[str, ...] | None, holds: bool) -> bool:
        """``takes``, remembered."""
        take = takes(self.tier, due, holds)
        with self._lock:
            if not take:
                self.skipped += 1
                return False
            steps = self._taken.setdefault(run, deque(maxlen=SHOWN))
            self._taken.move_to_end(run)
            if step not in steps:
                steps.append(step)
            while len(self._taken) > MAX_RUNS:
                self._taken.popitem(last=False)
        return True

    def figures(self) -> dict[str, Any]:
        with self._lock:
            return {"taken_steps": {run: list(s) for run, s in self._taken.items()},
                    "skipped_steps": self.skipped}


def status_line(figures: dict[str, Any]) -> list[str]:
    """``ckptd status``'s line of what a tier took, from ``Picks.figures``."""
    taken = figures.get("taken_steps") or {}
    if not taken and not figures.get("skipped_steps"):
        return []
    runs = "; ".join(f"{run} {', '.join(map(str, steps))}" for run, steps in taken.items())
    return [f"              steps taken lately: {runs or 'none'}; {figures.get('skipped_steps', 0)} share(s) "
            "skipped (not due for this tier)"]
