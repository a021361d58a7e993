"""Which tiers a save is due for (docs/advise.md): ``should_save`` saves at the most
frequent tier's interval; each other tier takes a save once its own advised interval
(``interval_steps``) has passed since the last save it took. Rank 0 decides and one
broadcast gives every rank its answer; the commit carries it (``tiers``).
"""

from __future__ import annotations

from typing import Any, Callable

from ..manifest import TIERS


class TierPlan:
    """One producer's picks: the last step each tier took."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def pick(self, step: int, advice: dict[str, Any] | None, agree: Callable[[float], float]) -> tuple[str, ...] | None:
        """The tiers ``step``'s save is due for, rank 0's on every rank (each rank calls
        ``agree``, whatever its own advice); None where rank 0 has no advice per tier
        (the save goes to every tier)."""
        tiers = (advice or {}).get("tiers")
        mask = -1
        if isinstance(tiers, dict) and tiers:
            mask = sum(1 << i for i, name in enumerate(TIERS) if self._due(step, name, tiers))
        mask = int(agree(float(mask)))
        if mask < 0:
            self.took(step)
            return None
        return self.took(step, tuple(name for i, name in enumerate(TIERS) if mask >> i & 1))

    def took(self, step: int, due: tuple[str, ...] = TIERS) -> tuple[str, ...]:
        """``step`` was saved for ``due`` (every tier: a notice's save)."""
        for name in due:
            self.last[name] = step
        return due

    def _due(self, step: int, name: str, tiers: dict[str, Any]) -> bool:
        """Due: a tier the daemon does not copy to is not; one without an interval in
        steps yet, or that took nothing (or a later step: a resume), is."""
        advice = tiers.get(name)
        if name == TIERS[0]:  # the root: every save is committed there
            return True
        if not isinstance(advice, dict):
            return False
        every, last = advice.get("interval_steps"), self.last.get(name)
        if not isinstance(every, int) or last is None or step <= last:
            return True
        return step - last >= every
