"""Which checkpoints of a run to keep, and deleting the rest without ever leaving a
half-deleted folder that looks complete.

``plan`` is a pure function of the run's complete checkpoints, the policy, the
pins and the time: a checkpoint is kept if any rule keeps it; then ``max_bytes``
removes the oldest ones no pin protects until the run fits. The newest complete
checkpoint is always kept. ``delete`` first renames a step folder to a trash name
(atomic, and invisible to every reader), makes that durable, and only then
removes the files; a crash in between leaves trash that start-up removes.
Deleting works relative to the run folder's descriptor, opened without following
a symlink: a symlink planted in the root is never deleted through.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import layout
from .config import ConfigError, RetentionConfig, build
from .durable import atomic_write, fsync_dir
from .manifest import CheckpointInfo

log = logging.getLogger("ckptd.retention")

_POLICY_LIMIT = 1 << 16  # retention.json: a handful of keys
PIN_FILE = "pinned"  # inside a step folder: protects it from every rule
POLICY_FILE = "retention.json"  # inside a run folder: the run's own overrides
TRASH_PREFIX = ".trash-"
UPLOADING = "its upload to the remote tier has not finished"


@dataclass
class Decision:
    step: int
    keep: bool
    reasons: list[str] = field(default_factory=list)
    nbytes: int = 0


def plan(infos: list[CheckpointInfo], policy: RetentionConfig, *, pinned: set[int], now: float,
         protect: Mapping[int, str] | None = None, newest: int | None = None) -> list[Decision]:
    """Decide, for each complete checkpoint of one run, whether to keep it and why.
    ``protect``: step -> why it is kept whatever the rules say, as pins are (a share
    still to upload, ``UPLOADING``). ``newest``: the step kept as the newest (by
    default the newest of ``infos``)."""
    by_step = {i.step: i for i in infos}
    # a step whose replicas disagree under compare_replicas = "refuse" (docs/training.md) is
    # kept for inspection and counts for no rule: it must not push out the good steps before it
    refused = [Decision(i.step, True, ["refused: its replicated tensors differ across ranks; kept for "
                                       "inspection, counted by no rule"], i.nbytes) for i in infos if i.refused]
    if refused:
        rest = plan([i for i in infos if not i.refused], policy, pinned=pinned, now=now, protect=protect,
                    newest=newest)
        return sorted(rest + refused, key=lambda d: d.step)
    steps = sorted(by_step)
    if not steps:
        return []
    newest = steps[-1] if newest is None else newest
    reasons: dict[int, list[str]] = {s: [] for s in steps}
    if newest in reasons:
        reasons[newest].append("newest")
    for s in pinned & reasons.keys():
        reasons[s].append("pinned")
    protect = protect or {}
    for s in protect.keys() & reasons.keys():
        reasons[s].append(protect[s])
    if policy.keeps_all:
        for s in steps:
            reasons[s].append("no keep rule is set")
    if policy.keep_last:
        for s in steps[-policy.keep_last:]:
            reasons[s].append(f"keep_last={policy.keep_last}")
    if policy.keep_every:
        for s in steps:
            if s % policy.keep_every == 0:
                reasons[s].append(f"keep_every={policy.keep_every}")
    if policy.keep_best:
        scored = [(v, s) for s in steps if (v := _metric(by_step[s], policy.metric)) is not None]
        scored.sort(key=lambda vs: (vs[0] if policy.mode == "min" else -vs[0], -vs[1]))
        for v, s in scored[:policy.keep_best]:
            reasons[s].append(f"keep_best={policy.keep_best} ({policy.metric}={v:g}, {policy.mode})")
    if policy.keep_within:
        for s in steps:
            if by_step[s].time >= now - policy.keep_within:
                reasons[s].append(f"keep_within={policy.keep_within:g}s")
    decisions = {s: Decision(s, bool(reasons[s]), reasons[s] or ["no rule keeps it"], by_step[s].nbytes)
                 for s in steps}
    if policy.max_bytes:
        total = sum(d.nbytes for d in decisions.values() if d.keep)
        for s in steps:  # oldest first
            if total <= policy.max_bytes:
                break
            d = decisions[s]
            if d.keep and s != newest and s not in pinned and s not in protect:
                d.keep = False
                d.reasons = [f"max_bytes={policy.max_bytes}: the run held {total} bytes"]
                total -= d.nbytes
    return [decisions[s] for s in steps]


def _metric(info: CheckpointInfo, key: str) -> float | None:
    value = info.metadata.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def pinned_steps(run_dir: Path, steps: list[int]) -> set[int]:
    base = str(run_dir)  # plain strings: `ckptd list` asks this of every step (pathlib is 4x slower)
    return {s for s in steps if os.path.exists(f"{base}/{layout.step_dir_name(s)}/{PIN_FILE}")}


def set_pin(step_dir: Path, pinned: bool) -> bool:
    """Pin or unpin a step folder; False when it already was as asked (nothing changed)."""
    path = step_dir / PIN_FILE
    if pinned:
        if path.is_file():
            return False
        atomic_write(path, b"pinned by `ckptd pin`; `ckptd unpin` releases it\n")
        return True
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(step_dir)
    return True


def run_policy(base: RetentionConfig, run_dir: Path) -> RetentionConfig:
    """``base`` with the run's own overrides (set by its producer) applied."""
    path = run_dir / POLICY_FILE
    try:
        overrides = json.loads(layout.read_small(path, _POLICY_LIMIT))
    except FileNotFoundError:
        return base
    except OSError as exc:  # a symlink, a FIFO, a huge file: not what save_run_policy writes
        log.warning("%s; using the configured retention", exc.strerror)
        return base
    except (ValueError, RecursionError) as exc:
        log.warning("%s is not valid JSON (%s); using the configured retention", path, exc)
        return base
    try:
        return merge(base, overrides, str(path))
    except ConfigError as exc:
        log.warning("%s; using the configured retention", exc)
        return base


def merge(base: RetentionConfig, overrides: Any, where: str) -> RetentionConfig:
    if not isinstance(overrides, dict):
        raise ConfigError(f"retention overrides in {where} must be a table of [retention] keys")
    return build(RetentionConfig, {**dataclasses.asdict(base), **overrides}, where)


def save_run_policy(run_dir: Path, overrides: dict[str, Any]) -> None:
    """Store a run's overrides in ``<run>/retention.json``; an ``OSError`` if the run's
    folder is a symlink (nothing is written through one, docs/reliability.md)."""
    layout.ensure_real_dir(run_dir, run_dir.parent)
    path = run_dir / POLICY_FILE
    data = json.dumps(overrides, sort_keys=True).encode()
    try:
        if layout.read_small(path, _POLICY_LIMIT) == data:
            return
    except OSError:  # missing, or not a file we wrote: replaced below (os.replace never follows)
        pass
    atomic_write(path, data)


def delete(run_dir: Path, step: int) -> Path | None:
    """Make a step invisible at once (atomic rename to a trash name, made durable);
    return the trash folder to remove at leisure, or None if the step was gone.
    The run folder is opened without following a symlink and the rename is
    relative to it, so a symlink planted in the root is never deleted through;
    a step folder that is a symlink is left alone."""
    name = layout.step_dir_name(step)
    try:
        run_fd = layout.open_real_dir(run_dir)
    except OSError as exc:
        log.warning("retention: %s; nothing removed", exc.strerror)
        return None
    try:
        try:
            if not stat.S_ISDIR(os.stat(name, dir_fd=run_fd, follow_symlinks=False).st_mode):
                return None
        except FileNotFoundError:
            return None
        trash = f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(name, trash, src_dir_fd=run_fd, dst_dir_fd=run_fd)
        except FileNotFoundError:
            return None  # someone else (another node's daemon, `ckptd prune`) was faster
        os.fsync(run_fd)
    finally:
        os.close(run_fd)
    return run_dir / trash


def remove_trash(trash: Path) -> None:
    """Remove a trash folder that ``delete`` made; never through a symlink."""
    try:
        run_fd = layout.open_real_dir(trash.parent)
    except OSError as exc:
        log.warning("cannot remove %s: %s", trash, exc.strerror)
        return
    try:
        remove_trash_at(run_fd, trash.name, trash.parent)
    finally:
        os.close(run_fd)


def remove_trash_at(run_fd: int, name: str, run_dir: Path) -> None:
    """Remove trash folder ``name`` of the run folder open as ``run_fd``. ``rmtree``
    relative to a descriptor refuses a symlink at the top and never follows one
    below (``shutil.rmtree.avoids_symlink_attacks``), so it deletes a link at most,
    never what the link points to."""
    def failed(_fn: Any, path: str, exc_info: Any) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):  # another node's daemon was faster
            log.warning("cannot remove %s/%s: %s", run_dir, path, exc_info[1])

    shutil.rmtree(name, dir_fd=run_fd, onerror=failed)


def apply(run_dir: Path, infos: list[CheckpointInfo], policy: RetentionConfig, *, now: float,
          dry_run: bool = False, protect: set[int] = frozenset()) -> tuple[list[Decision], list[Path]]:
    """Plan and (unless ``dry_run``) make the deletions invisible; return the
    decisions and the trash folders the caller should remove."""
    decisions = plan(infos, policy, pinned=pinned_steps(run_dir, [i.step for i in infos]), now=now,
                     protect=dict.fromkeys(protect, UPLOADING))
    trash = []
    if not dry_run:
        for d in decisions:
            if not d.keep:
                t = delete(run_dir, d.step)
                if t is not None:
                    trash.append(t)
                    log.info("retention: removed run=%s step=%d (%d bytes): %s",
                             run_dir.name, d.step, d.nbytes, "; ".join(d.reasons))
    return decisions, trash
