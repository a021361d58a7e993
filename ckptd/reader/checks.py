"""Checking a step: every tensor's bytes against its checksum and its file's own
structure (the format's check, docs/format.md), each saved structure, each
replicated tensor's writer. ``ckptd verify``, ``load(verify=True)`` and
``latest(verify=True)`` use these.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path
from typing import Any, Callable

from .. import layout, state as state_mod
from ..errors import CheckpointCorrupt
from ..manifest import Manifest, TensorRecord
from ..tiers.files import each_tensor


def check(step_path: Path, manifests: list[Manifest], progress: Callable[[int], None] | None = None) -> list[str]:
    """Every problem of a step whose manifests were read: each tensor's bytes against
    its checksum and its file's own header, and each saved structure. ``progress`` is
    called with each tensor's bytes once it is checked."""
    problems = []
    for manifest in manifests:
        try:
            with closing(each_tensor(step_path, manifest.tensors, verify=True)) as it:
                for name, _, error in it:
                    if error is not None:
                        problems.append(f"rank {manifest.rank}: {error}")
                    if progress is not None:
                        progress(manifest.tensors[name].nbytes)
            check_structure(step_path, manifest)
            share_records(step_path, manifests, manifest)
        except CheckpointCorrupt as exc:
            problems.append(f"rank {manifest.rank}: {exc}")
    return problems


def check_structure(step_path: Path, manifest: Manifest) -> None:
    """CheckpointCorrupt if the manifest's saved structure cannot be rebuilt (a node
    ckptd does not write, a reference to a tensor it does not list, ...)."""
    if manifest.state is not None:
        unflatten_state(step_path, manifest, dict.fromkeys([*manifest.tensors, *manifest.written_by]))


def unflatten_state(path: Path, manifest: Manifest, values: dict[str, Any]) -> Any:
    """The manifest's saved structure with ``values`` (by tensor name) in place of its
    tensors; CheckpointCorrupt naming the manifest if it cannot be rebuilt."""
    def lookup(name: Any) -> Any:
        if not isinstance(name, str) or name not in values:
            raise KeyError(f"it refers to a tensor {name!r} that the manifest does not list")
        return values[name]

    try:
        return state_mod.unflatten(manifest.state, lookup)
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError, RecursionError) as exc:
        where = path / layout.manifest_name(manifest.rank)
        raise CheckpointCorrupt(f"{where}: the saved structure (\"state\") is malformed: "
                                f"{exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}") from None


def share_records(step_path: Path, manifests: list[Manifest], manifest: Manifest) -> dict[str, TensorRecord]:
    """The records of one rank's share: its own tensors, and each replicated tensor it
    lists under ``replicas`` from the manifest of the rank that wrote it."""
    if not manifest.written_by:
        return manifest.tensors
    records = dict(manifest.tensors)
    for name, writer in manifest.written_by.items():
        rec = manifests[writer].tensors.get(name)
        if rec is None:
            raise CheckpointCorrupt(
                f"{step_path / layout.manifest_name(manifest.rank)}: replicated tensor {name!r} is listed as "
                f"written by rank {writer}, whose manifest has no such tensor (were the ranks saved with "
                "different replicated= or different tensors?)")
        records[name] = rec
    return records
