"""The local root (``[daemon] root``): where the daemon commits and what the other
tiers land shares in. ``LocalTier`` is first in the chain; ``LocalHolding`` reads a
step's files in place (``files``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

from .. import index, layout
from ..config import default_root
from ..errors import CheckpointCorrupt
from ..manifest import CheckpointInfo, Manifest, TensorRecord
from ..names import check_run
from .base import missing_manifests
from .files import read_tensors

NAME = "local"
TABLE = "daemon"


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
    the daemon keeps, else a scan of its step folders."""
    return index.latest_from_pointer(path) or index.latest_by_scan(path, warn=True)


class LocalTier:
    name = NAME
    durable = True  # a shared root's file system outlives the node

    def __init__(self, root: str | os.PathLike[str] | None, poll_interval: float = 1.0) -> None:
        self.root = root
        self.base = default_root(root)
        self.where = f"under {self.base}"
        self.poll_interval = poll_interval

    def latest(self, run: str) -> CheckpointInfo | None:
        return newest_in(run_dir(run, self.root)[1])

    def steps(self, run: str) -> list[CheckpointInfo]:
        _, path = run_dir(run, self.root)
        found = index.scan_run(path, warn=True)
        return [found[s] for s in sorted(found)]

    def open(self, run: str, step: int) -> LocalHolding | None:
        """The step's folder and manifests, None when it is not complete here;
        CheckpointCorrupt when its manifests are another step's."""
        base, _ = run_dir(run, self.root)
        path = layout.step_dir(base, run, step)
        manifests = index.read_manifests(path)
        if manifests is None:
            return None
        first = manifests[0]
        if first.run != run or first.step != step:
            raise CheckpointCorrupt(f"{path}: its manifests are those of run {first.run!r} step {first.step}")
        return LocalHolding(path, manifests)

    def completion(self, run: str, step: int,
                   world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        path = layout.step_dir(self.base, run, step)
        info = index.step_info(path)
        try:
            names = os.listdir(path)
        except OSError:
            names = []
        return info, lambda timeout: missing_manifests(run, step, str(self.base), names, timeout)


class LocalHolding:
    """A step complete in the local root, read in place."""

    def __init__(self, path: Path, manifests: list[Manifest]) -> None:
        self.path, self.manifests = path, manifests
        self.where = str(path)

    def read(self, manifest: Manifest, records: dict[str, TensorRecord], into: dict[str, Any] | None = None, *,
             verify: bool = False, mapped: bool = False,
             convert: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
        return read_tensors(self.path, records, verify=verify, into=into, mapped=mapped, convert=convert)

    def materialize(self, ranks: Iterable[int] | None = None) -> None:
        """Nothing: its files are there."""
