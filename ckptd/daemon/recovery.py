"""Start-up clean-up (``remove_orphans``): remove what a crash left behind.

A step's files that no manifest names are garbage. Only names ckptd writes are
touched, and everything is opened and removed relative to descriptors of folders
opened without following symlinks: nothing outside the root is read or removed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from pathlib import Path

from .. import layout
from ..manifest import MAX_MANIFEST_BYTES
from ..names import RUN_ID_PATTERN
from ..retention import TRASH_PREFIX, remove_trash_at

log = logging.getLogger("ckptd.recovery")

_MARKER_LIMIT = 4096


def remove_orphans(root: Path) -> int:
    """Remove unreferenced ckptd files under ``root``; return how many were removed."""
    removed = 0
    for run in _real_dirs(root):
        if not RUN_ID_PATTERN.fullmatch(run):
            continue
        try:
            run_fd = layout.open_real_dir(root / run)
        except OSError as exc:
            log.warning("skipped %s: %s", root / run, exc.strerror)
            continue
        try:
            for name in _real_dirs(run_fd):
                if layout.parse_step_dir(name) is not None:
                    removed += _clean_step(run_fd, root / run / name)
                elif name.startswith(TRASH_PREFIX):
                    remove_trash_at(run_fd, name, root / run)
                    log.info("removed %s, a deletion interrupted by a crash", root / run / name)
            removed += _remove_temps(run_fd, root / run)
        finally:
            os.close(run_fd)
    return removed


def _remove_temps(run_fd: int, run_path: Path) -> int:
    """Temp files that this host's daemon left in a run folder when it died while
    replacing a file there (the latest pointer, the run's retention settings):
    ``.<name>~<host>-<pid>.tmp``. Other hosts' may be in use and are left alone."""
    mine = f"~{socket.gethostname()}-"
    removed = 0
    for name in os.listdir(run_fd):
        if not (name.startswith(".") and name.endswith(".tmp") and mine in name):
            continue
        try:
            if stat.S_ISREG(os.stat(name, dir_fd=run_fd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=run_fd)
                removed += 1
                log.info("removed orphan %s", run_path / name)
        except OSError as exc:
            log.warning("cannot remove orphan %s: %s", run_path / name, exc.strerror)
    return removed


def _real_dirs(path: Path | int) -> list[str]:
    """Names of the real folders (not symlinks to folders) in ``path`` or a descriptor."""
    try:
        with os.scandir(path) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _clean_step(run_fd: int, step_path: Path) -> int:
    try:
        fd = layout.open_real_dir(step_path.name, dir_fd=run_fd)
    except OSError as exc:
        log.warning("skipped %s: %s", step_path, exc.strerror)
        return 0
    try:
        return _clean_step_at(fd, run_fd, step_path)
    finally:
        os.close(fd)


def _clean_step_at(fd: int, run_fd: int, step_path: Path) -> int:
    names = os.listdir(fd)
    referenced = _claimed_elsewhere(fd, step_path, names)
    for name in names:
        if layout.MANIFEST.fullmatch(name):
            try:
                tensors = json.loads(layout.read_small(name, MAX_MANIFEST_BYTES, dir_fd=fd))["tensors"]
                referenced.update(t["file"] for t in tensors.values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                # a damaged manifest: keep everything so `ckptd verify` can report it
                log.warning("%s: unreadable manifest, left as is: %s", step_path / name, exc)
                return 0
            referenced.add(name)
    removed = 0
    for name in names:
        if name in referenced or not layout.is_ckptd_file(name) or layout.MANIFEST.fullmatch(name):
            continue
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                continue
            os.unlink(name, dir_fd=fd)
            removed += 1
            log.info("removed orphan %s", step_path / name)
        except OSError as exc:
            log.warning("cannot remove orphan %s: %s", step_path / name, exc.strerror)
    if not any(layout.MANIFEST.fullmatch(n) for n in names) and not referenced:
        try:
            os.rmdir(step_path.name, dir_fd=run_fd)
        except OSError:
            pass
    return removed


def _claimed_elsewhere(fd: int, step_path: Path, names: list[str]) -> set[str]:
    """Files of ranks that another host's daemon is writing right now (shared storage):
    its ``r<rank>.writing`` marker names that host. This host's markers are from a
    crash, since this daemon holds this host's lock."""
    others = set()
    for name in names:
        if layout.WRITING.fullmatch(name):
            try:
                text = layout.read_small(name, _MARKER_LIMIT, dir_fd=fd).decode("utf-8", "replace")
            except OSError as exc:
                if not isinstance(exc, FileNotFoundError):
                    log.warning("%s: unreadable writing marker, its rank's files are left: %s",
                                step_path / name, exc.strerror)
                others.add(layout.file_rank(name))
                continue
            # empty: the daemon died before writing its host into it; taken as this host's
            if text.split("\n", 1)[0] not in ("", socket.gethostname()):
                others.add(layout.file_rank(name))
    return {n for n in names if layout.file_rank(n) in others}
