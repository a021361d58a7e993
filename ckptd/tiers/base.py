"""What every tier is to the rest of ckptd (docs/tiers.md): ``Tier`` to the reader,
``Holding`` for a step one of them holds, ``Replica`` to the daemon. Nothing outside
``ckptd.tiers`` asks which tier it talks to.
"""

from __future__ import annotations

import builtins
import dataclasses
from typing import Any, Callable, Iterable, Protocol

from .. import layout
from ..manifest import CheckpointInfo, Manifest, TensorRecord


class Holding(Protocol):
    """A step complete in a tier other than the local root (``Tier.find``)."""

    url: str  # where, in messages
    manifests: list[Manifest]
    # whether loads that read local files (the whole state, mmap=True) fetch its shares
    # into the root first: the peers' memory is near; a bucket's whole step is not
    fills_root: bool
    # whether ``read_tensors`` reads into the caller's tensors (``load(out=)`` straight
    # from the tier, nothing written to the root)
    reads_into: bool

    def fill(self, ranks: Iterable[int] | None = None) -> None:
        """Fetch the shares of ``ranks`` (None: every share the local root lacks) into it."""

    def read_tensors(self, manifest: Manifest, records: dict[str, TensorRecord],
                     local: Callable[[dict[str, TensorRecord]], dict[str, Any]],
                     into: dict[str, Any] | None = None) -> dict[str, Any]:
        """``records`` of ``manifest``'s share (its replicated tensors included) read into
        memory, every checksum checked; ``local`` reads those of shares in the local root.
        ``into`` (where ``reads_into``): tensors by name to read into instead of new memory."""


class Tier(Protocol):
    """One place a step can be complete in, as a reader sees it. The chain
    (``ckptd.tiers.chain``) holds them in the order reads try them, the local root first."""

    name: str  # in CheckpointInfo.tiers, the measures file and `ckptd status`
    where: str  # in messages: "under /ckpt", "with its peers", "in s3://b/p"
    # whether a step complete here survives the loss of the node: `wait_complete` waits
    # for the last durable tier of the chain when it is not given one
    durable: bool
    poll_interval: float  # how often `wait_complete` looks
    # the errors that mean "out of reach": `latest` leaves the tier out once another
    # tier besides the root answered (docs/tiers.md)
    unreachable: tuple[type[BaseException], ...]

    def latest(self, run: str) -> CheckpointInfo | None:
        """The newest step complete here (a tier may count the tiers before it in: the
        peers count the shares of the local root)."""

    def list(self, run: str) -> builtins.list[CheckpointInfo]:
        """Every step complete here, ascending."""

    def find(self, run: str, step: int) -> Holding | None:
        """The step if it is complete here, else None; CheckpointNotFound saying why
        where the tier can tell more than "not here"."""

    def complete(self, run: str, step: int,
                 world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        """For ``wait_complete``: the step's info once every rank's share is here (else
        None), and what says, given the seconds waited, what is missing."""


class Replica(Protocol):
    """One tier as the daemon feeds it: each share it commits is copied there (uploaded,
    replicated) after the local commit, on the tier's own threads. ``Upkeep`` holds a
    list of them (``ckptd.tiers.replicas``)."""

    name: str  # the key of its figures in `ckptd status --json` and of its measures

    def start(self) -> None: ...

    def close(self) -> None: ...

    def committed(self, run: str, step: int, rank: int, nbytes: int) -> None:
        """A share is durable in the local root (the syncer thread: must not wait)."""

    def dropped(self, run: str, steps: list[int]) -> None:
        """Local retention removed these steps."""

    def pending(self, run: str) -> set[int]:
        """Steps with a share still to copy: local retention must keep them."""

    def received(self) -> None:
        """A producer sent tensor bytes: a snapshot is under way."""

    def yield_to(self, busy: Callable[[], bool]) -> None:
        """Copy only while ``busy()`` is false (the daemon receives or commits a step)."""

    def on_persisted(self, callback: Callable[[str, int, int, float], None]) -> None:
        """``callback(run, step, rank, lag_s)`` once a share is in this tier."""

    def figures(self) -> dict[str, Any]: ...


def merge(infos: list[CheckpointInfo], more: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """One info per step, ascending, naming every tier that holds it (the first's where
    both have it: the local copy's path where there is one, it is what a reader reads)."""
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
    """What `wait_complete` says of a step whose manifests are not all in ``where`` (a
    folder or a bucket whose entries are ``names``) after ``timeout`` seconds."""
    have = sorted(int(m.group(1)) for n in names if (m := layout.MANIFEST.fullmatch(n)))
    return (f"step {step} of run {run!r} is not complete in {where} after {timeout:g} s: the manifests of rank(s) "
            f"{have or 'none'} are there; every rank's must be (is each node's daemon running and uploading? "
            "see `ckptd status`)")
