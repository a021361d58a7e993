"""Start-up clean-up: remove what a crash left behind.

A step's files that no manifest names were being written when a daemon died;
they are garbage (DESIGN §4). Only names ckptd itself writes are touched, and
symlinks are never followed, so nothing outside the root is removed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

from .. import layout
from ..names import RUN_ID_PATTERN
from ..retention import TRASH_PREFIX, remove_trash

log = logging.getLogger("ckptd.recovery")


def remove_orphans(root: Path) -> int:
    """Remove unreferenced ckptd files under ``root``; return how many were removed."""
    removed = 0
    for run in _real_dirs(root):
        if not RUN_ID_PATTERN.fullmatch(run.name):
            continue
        for step_path in _real_dirs(run):
            if layout.parse_step_dir(step_path.name) is not None:
                removed += _clean_step(step_path)
            elif step_path.name.startswith(TRASH_PREFIX):
                # a deletion that was made invisible, then interrupted
                remove_trash(step_path)
                log.info("removed %s, a deletion interrupted by a crash", step_path)
    return removed


def _real_dirs(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _clean_step(step_path: Path) -> int:
    names = os.listdir(step_path)
    referenced = _claimed_elsewhere(step_path, names)
    for name in names:
        if layout.MANIFEST.fullmatch(name):
            try:
                tensors = json.loads((step_path / name).read_bytes())["tensors"]
                referenced.update(t["file"] for t in tensors.values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                # a damaged manifest: keep everything so `ckptd verify` can report it
                log.warning("%s: unreadable manifest, left as is: %s", step_path / name, exc)
                return 0
            referenced.add(name)
    removed = 0
    for name in names:
        if name in referenced or not layout.is_ckptd_file(name) or layout.MANIFEST.fullmatch(name):
            continue
        try:
            os.unlink(step_path / name)
            removed += 1
            log.info("removed orphan %s", step_path / name)
        except OSError as exc:
            log.warning("cannot remove orphan %s: %s", step_path / name, exc.strerror)
    if not any(layout.MANIFEST.fullmatch(n) for n in names) and not referenced:
        try:
            os.rmdir(step_path)
        except OSError:
            pass  # not empty: files ckptd did not write
    return removed


def _claimed_elsewhere(step_path: Path, names: list[str]) -> set[str]:
    """Files of ranks that another host's daemon is writing right now (shared storage):
    its ``r<rank>.writing`` marker names that host. This host's markers are from a
    crash, since this daemon holds this host's lock."""
    others = set()
    for name in names:
        if layout.WRITING.fullmatch(name):
            try:
                host = (step_path / name).read_text().split("\n", 1)[0]
            except OSError:
                continue
            if host != socket.gethostname():
                others.add(layout.file_rank(name))
    return {n for n in names if layout.file_rank(n) in others}
