"""The local root (``[daemon] root``): where the daemon commits, and what every other
tier is read into or measured against. First in the chain, always there."""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Callable

from .. import index, layout
from ..config import default_root
from ..errors import CheckpointCorrupt
from ..manifest import CheckpointInfo
from ..names import check_run
from .base import missing_manifests

NAME = "local"
TABLE = "daemon"  # its table in config.toml


def run_dir(run: str, root: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    """The checkpoint root and the run's folder in it; CheckpointCorrupt for a symlink in
    place of the run's folder (the root itself may be one)."""
    check_run(run)
    base = default_root(root)
    path = base / run
    if os.path.islink(path):
        raise CheckpointCorrupt(
            f"{path} is a symlink; ckptd never reads through symlinks below the checkpoint "
            "root: put the run's folder itself there, or pass its parent as the root"
        )
    return base, path


def newest_in(path: Path) -> CheckpointInfo | None:
    """The newest step complete in the run folder ``path``: the ``<run>/latest`` pointer
    the daemon keeps, else a scan of its step folders (the pointer missing or naming a
    step no longer complete)."""
    return index.latest_from_pointer(path) or index.latest_by_scan(path, warn=True)


class LocalTier:
    name = NAME
    durable = True  # as durable as the root's file system: a shared one outlives the node
    unreachable: tuple[type[BaseException], ...] = ()

    def __init__(self, root: str | os.PathLike[str] | None, poll_interval: float) -> None:
        self.root = root
        self.base = default_root(root)
        self.where = f"under {self.base}"
        self.poll_interval = poll_interval

    def latest(self, run: str) -> CheckpointInfo | None:
        return newest_in(run_dir(run, self.root)[1])

    def list(self, run: str) -> builtins.list[CheckpointInfo]:
        _, path = run_dir(run, self.root)
        steps = index.scan_run(path, warn=True)
        return [steps[s] for s in sorted(steps)]

    def find(self, run: str, step: int) -> None:
        """The root is read in place (``ckptd.reader.finding.find``): never a holding."""
        return None

    def complete(self, run: str, step: int,
                 world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        path = layout.step_dir(self.base, run, step)
        info = index.step_info(path)
        try:
            names = os.listdir(path)
        except OSError:
            names = []
        return info, lambda timeout: missing_manifests(run, step, str(self.base), names, timeout)
