"""What a tier is to the rest of ckptd: ``Tier`` and ``Holding`` to the readers,
``CopyTarget`` (with its optional abilities) to the daemon, ``TierUnavailable`` the one
error a tier lets out when it cannot be reached. Start at ``Tier``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from .. import layout
from ..manifest import CheckpointInfo, Manifest, TensorRecord


class Holding(Protocol):
    """A step complete in one tier (``Tier.open``). It alone decides whether it reads
    into memory or lands shares in the local root first."""

    where: str
    path: Path
    manifests: list[Manifest]

    def read(self, manifest: Manifest, records: dict[str, TensorRecord], into: dict[str, Any] | None = None, *,
             verify: bool = False, mapped: bool = False,
             convert: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
        """``records`` of ``manifest``'s share read and checked; ``into``: the caller's
        tensors by name to read into; ``mapped``: mapped where the format can;
        ``convert(name, tensor)`` turns each as it is read."""

    def materialize(self, ranks: Iterable[int] | None = None) -> None:
        """The shares of ``ranks`` (None: every rank) as files in the local root."""


class Tier(Protocol):
    """One place a step can be complete in, as a reader sees it; ``ckptd.tiers.chain``
    holds them in the order reads try them."""

    name: str
    where: str
    durable: bool  # a step complete here outlives the node: `wait_complete`'s default
    poll_interval: float

    def latest(self, run: str) -> CheckpointInfo | None:
        """The newest step complete here."""

    def steps(self, run: str) -> list[CheckpointInfo]:
        """Every step complete here, ascending."""

    def open(self, run: str, step: int) -> Holding | None:
        """The step if it is complete here, else None (or CheckpointNotFound saying why)."""

    def completion(self, run: str, step: int,
                   world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        """The step's info once every rank's share is here (else None), and what says,
        given the seconds waited, what is missing."""


class CopyTarget(Protocol):
    """Where the daemon copies each share it commits, on the target's own threads."""

    name: str

    def start(self) -> None: ...

    def close(self) -> None: ...

    def committed(self, run: str, step: int, rank: int, nbytes: int, due: tuple[str, ...] | None) -> None:
        """A share is durable in the local root (on the syncer thread: must not wait);
        ``due``: the tiers its commit named it due for (None: all; ``picks.takes``)."""

    def figures(self) -> dict[str, Any]: ...


@runtime_checkable
class Forgets(Protocol):
    def dropped(self, run: str, steps: list[int]) -> None:
        """Local retention removed these steps."""


@runtime_checkable
class Pending(Protocol):
    def pending(self, run: str) -> set[int]:
        """Steps with a share still to copy: local retention keeps them."""


@runtime_checkable
class Receives(Protocol):
    def received(self) -> None:
        """A producer sent tensor bytes: a snapshot is under way."""


@runtime_checkable
class Yields(Protocol):
    def yield_to(self, busy: Callable[[], bool]) -> None:
        """Copy only while ``busy()`` is false."""


@runtime_checkable
class SendsStaged(Protocol):
    def send_staged(self, find: Callable[[tuple[str, int, int]], Any],
                    sent: Callable[[tuple[str, int, int]], None]) -> bool:
        """Send a share out of its producer's staging where ``find((run, step, rank))``
        gives it (a ``ckptd.daemon.stagehold.Hold``), else from its files; ``sent(key)``
        once done with it. Whether this tier sends shares at all."""


@runtime_checkable
class Pulls(Protocol):
    def serve_pulls(self, pull: Callable[..., bool]) -> None:
        """Answer peers' ``pull``s with ``pull(run, step, rank, asked=True)``: whether that
        bucket share is in the root (else its download starts); ``asked=False`` when a
        waiting pull is looked at again (not counted as one more)."""


@runtime_checkable
class Reports(Protocol):
    def on_persisted(self, callback: Callable[[str, int, int, float], None]) -> None:
        """``callback(run, step, rank, lag_s)`` once a share is in this tier."""


def merge(infos: list[CheckpointInfo], more: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """One info per step, ascending, naming every tier that holds it (the first's where
    both have it: the local copy's path is what a reader reads)."""
    by_step = {i.step: i for i in more}
    for i in infos:
        other = by_step.get(i.step)
        by_step[i.step] = with_tiers(i, other.tiers if other else ())
    return [by_step[s] for s in sorted(by_step)]


def newest(first: CheckpointInfo | None, then: CheckpointInfo | None) -> CheckpointInfo | None:
    """The newer of two infos; of the same step, the first, naming the tiers of both."""
    if first is None or then is None:
        return first or then
    if first.step == then.step:
        return with_tiers(first, then.tiers)
    return first if first.step > then.step else then


def with_tiers(info: CheckpointInfo, more: tuple[str, ...]) -> CheckpointInfo:
    tiers = info.tiers + tuple(t for t in more if t not in info.tiers)
    return info if tiers == info.tiers else dataclasses.replace(info, tiers=tiers)


def missing_manifests(run: str, step: int, where: str, names: Iterable[str], timeout: float) -> str:
    """What `wait_complete` says of a step whose manifests are not all in ``where``."""
    have = sorted(int(m.group(1)) for n in names if (m := layout.MANIFEST.fullmatch(n)))
    return (f"step {step} of run {run!r} is not complete in {where} after {timeout:g} s: the manifests of rank(s) "
            f"{have or 'none'} are there; every rank's must be (is each node's daemon running and uploading? "
            "see `ckptd status`)")
