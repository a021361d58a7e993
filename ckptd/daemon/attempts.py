"""Saving a step again: what becomes of a rank's share already on disk (``resave``).

A complete step is never overwritten; a share an earlier attempt of the job committed
in a step that never became complete is replaced by the new attempt's
(``Writer.replace_earlier``); a second save by the same attempt is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import index, layout
from ..errors import CheckpointCorrupt
from ..manifest import MAX_MANIFEST_BYTES, Manifest


@dataclass(frozen=True)
class Verdict:
    error: str | None = None
    replace: bool = False


GO = Verdict()


def resave(step_dir: Path, run: str, rank: int, step: int, attempt: str | None, *, in_flight: bool) -> Verdict:
    """What to do with a new share of ``step`` for ``rank`` by ``attempt``."""
    name = layout.manifest_name(rank)
    if in_flight:
        return Verdict(f"step {step} of run {run!r}: a commit of rank {rank}'s share of it is still being "
                       "written; a committed share is never overwritten; save a later step instead")
    if not (step_dir / name).exists():
        return GO
    try:
        complete = index.read_manifests(step_dir)
        earlier = read_manifest(step_dir, name)
    except (CheckpointCorrupt, OSError) as exc:
        return Verdict(f"step {step} of run {run!r} has a share of rank {rank} already, and it cannot be told "
                       f"whether it may be replaced: {exc}; save under a new step number")
    if complete is not None:
        by = f" (attempt {complete[0].attempt})" if complete[0].attempt else ""
        return Verdict(
            f"step {step} of run {run!r} is already committed by every rank{by}: it is complete, and a complete "
            f"checkpoint is never overwritten; ckptd.latest({run!r}) (or `ckptd latest {run}`) tells the newest "
            "complete step: resume from it and save the steps after it, or save under a new step number")
    if earlier is None:
        return GO
    if attempt is None or earlier.attempt == attempt:
        hint = ("; a restarted job's producers need an attempt of their own (torchrun gives one; elsewhere "
                "pass Producer(attempt=...)) for their share to replace the failed attempt's"
                if attempt is None else f" by this attempt of the job ({attempt}); save each step once per attempt "
                "(a new launch that has the same attempt, e.g. torchrun on several nodes without --rdzv-id, needs "
                "one of its own: [producer] attempt)")
        return Verdict(f"step {step} of run {run!r} is already committed for rank {rank}{hint}; a committed "
                       "share is never overwritten")
    return Verdict(replace=True)


def read_manifest(step_dir: Path, name: str) -> Manifest | None:
    """One manifest of a step folder (never through a symlink), or None if there is none."""
    try:
        fd = layout.open_step_dir(step_dir)
    except FileNotFoundError:
        return None
    try:
        data = layout.read_small(name, MAX_MANIFEST_BYTES, dir_fd=fd)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    return Manifest.from_json(data, str(step_dir / name))
