"""Agreeing on the step a job resumes from: every rank of a process group ends with the
same step, or the same None, or raises the same error. Each rank looks in its own
tiers, which can differ for a moment (an upload or a peer copy in flight, a node that
replaced a lost one); the agreed step is the newest that every rank can read. Only
int64 and uint8 tensors cross the group (one ``all_gather`` a round, on the backend's
device: gloo and NCCL alike); nothing is pickled: an error crosses as its place in
``_ERROR_CLASSES`` and its text, and is raised anew. Start at ``agreed``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ..errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, TierUnavailable
from ..manifest import CheckpointInfo

NO_STEP, LOOKUP_FAILED = -1, -2
MESSAGE_BYTES = 1024
_ERROR_CLASSES: tuple[type[Exception], ...] = (CheckpointNotFound, CheckpointCorrupt, TierUnavailable,
                                               CheckpointError, ValueError, OSError, RuntimeError, Exception)

Lookup = Callable[[int | None], CheckpointInfo | None]


def group() -> Any | None:
    """``torch.distributed`` when a process group of more than one rank is up, else None.
    Never imports torch: a program that did not is not in a group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist if dist.get_world_size() > 1 else None


def agreed(run: str, newest: Lookup) -> CheckpointInfo | None:
    """This rank's info of the newest step every rank of the group can read (``newest(bound)``:
    this rank's newest complete step at most ``bound``, None: any), or None on every rank
    when none has a step; without a group, ``newest(None)``. Collective: every rank calls
    it. Some ranks with a step and some without is ``CheckpointNotFound`` on every rank,
    naming them; a rank whose lookup failed makes every rank raise its error. Each round
    lowers the bound to the oldest answer, until every rank answers it: this ends."""
    dist = group()
    if dist is None:
        return newest(None)
    bound: int | None = None
    while True:
        info, failure = _look(newest, bound)
        steps = _gather(dist, [LOOKUP_FAILED if failure else NO_STEP if info is None else info.step])
        if LOOKUP_FAILED in steps:
            raise _shared_failure(dist, run, steps, failure)
        if len(set(steps)) == 1:
            return info
        if NO_STEP in steps:
            raise CheckpointNotFound(_not_everywhere(run, steps, bound))
        bound = min(steps)


def _look(newest: Lookup, bound: int | None) -> tuple[CheckpointInfo | None, Exception | None]:
    """The lookup's answer or its error: a rank that failed still takes part in the gather."""
    try:
        return newest(bound), None
    except Exception as exc:
        return None, exc


def _gather(dist: Any, row: list[int], dtype: str = "int64") -> list[Any]:
    """Every rank's ``row`` (same length on each), in rank order; a one-element row as its value."""
    import torch

    backend = str(dist.get_backend()).lower()
    device: Any = "cpu"
    if "gloo" not in backend and "nccl" in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(row, dtype=getattr(torch, dtype), device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    out = torch.stack(rows).cpu().tolist()
    return [r[0] for r in out] if len(row) == 1 else out


def _shared_failure(dist: Any, run: str, steps: list[int], failure: Exception | None) -> Exception:
    """The first failing rank's error, its text gathered from it, as every rank raises it."""
    text = b""
    if failure is not None:
        code = next(i for i, c in enumerate(_ERROR_CLASSES) if isinstance(failure, c))
        text = bytes([code]) + f"{type(failure).__name__}: {failure}".encode()[:MESSAGE_BYTES - 1]
    rows = _gather(dist, list(text.ljust(MESSAGE_BYTES, b"\0")), "uint8")
    failed = [r for r, s in enumerate(steps) if s == LOOKUP_FAILED]
    first = bytes(rows[failed[0]]).rstrip(b"\0")
    others = f" (and {_ranks(failed[1:])} failed too)" if len(failed) > 1 else ""
    error = _ERROR_CLASSES[first[0]](f"rank {failed[0]} could not look up the newest step of run {run!r}{others}, "
                               f"so no rank resumes: {first[1:].decode(errors='replace')}")
    error.__cause__ = failure
    return error


def _not_everywhere(run: str, steps: list[int], bound: int | None) -> str:
    """Some ranks read a step (at most ``bound``) and some none: who, and what to do."""
    none = [r for r, s in enumerate(steps) if s == NO_STEP]
    found = sorted({s for s in steps if s != NO_STEP}, reverse=True)
    by_step = "; ".join(f"{_ranks([r for r, s in enumerate(steps) if s == step])} found step {step}"
                        for step in found[:4])
    below = "" if bound is None else f" at or below step {bound}"
    return (f"run {run!r}: {_ranks(none)} found no complete checkpoint{below}, while {by_step}: every rank "
            "must resume from the same step, and no step is complete for all of them. Point every rank at "
            "the same checkpoints (CKPTD_ROOT / CKPTD_CONFIG on each node; a node that lost its disk reads "
            "from the peers or the bucket, docs/tiers.md), or pass the step to load on every rank")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown
