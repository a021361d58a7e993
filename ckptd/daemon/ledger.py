"""The daemon's ledger: bytes held for producers, commits under way, and what each cost.

``Ledger`` is changed by the main loop only; ``figures`` (``metrics.Figures``) and
``measuring`` (``measuring.Measuring``) are the books it keeps for ``ckptd status``,
the metrics and the interval advice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .measuring import Measuring
    from .metrics import Figures

CommitKey = tuple[str, int, int]


class Ledger:
    def __init__(self, memory_budget: int, figures: Figures, measuring: Measuring) -> None:
        self.memory_budget = memory_budget
        self.figures = figures
        self.measuring = measuring
        self.queued = 0  # bytes received and not yet written
        self._commits: dict[CommitKey, Any] = {}
        self.newest: dict[str, int] = {}  # run -> the newest step a commit made durable here

    def hold(self, nbytes: int) -> None:
        self.queued += nbytes

    def free(self, nbytes: int) -> None:
        self.queued -= nbytes

    @property
    def over_budget(self) -> bool:
        """Whether the daemon holds ``memory_budget`` or more: it stops reading until freed."""
        return self.queued >= self.memory_budget

    def begin_commit(self, key: CommitKey, timing: Any) -> None:
        self._commits[key] = timing

    def end_commit(self, key: CommitKey) -> Any:
        """The commit ``key`` is durable or failed; the timing its producer sent with it."""
        return self._commits.pop(key, None)

    def durable(self, run: str, step: int) -> None:
        self.newest[run] = max(step, self.newest.get(run, step))

    def finished(self) -> str:
        """The newest step committed of each run, for the drain's last log line."""
        return ", ".join(f"{run} step {step}" for run, step in sorted(self.newest.items())) or "no step"

    @property
    def commits(self) -> int:
        return len(self._commits)

    def committing(self, run: str, rank: int | None = None, step: int | None = None) -> bool:
        """Whether a commit of ``run`` (of that rank's ``step``, if given) is under way."""
        if step is not None:
            return (run, rank, step) in self._commits
        return any(r == run for r, _, _ in self._commits)

    def busy(self) -> bool:
        """Whether a step is being received or committed (copies to the tiers wait)."""
        return self.queued > 0 or bool(self._commits)
