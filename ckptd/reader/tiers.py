"""Where a step is complete, when it is not in the local root: the tiers behind one
small interface (docs/tiers.md), so that a load does not ask which tier answered.

Local disk first, then the peers' memory (``ckptd.peer.tier.PeerSource``), then the
remote tier (``RemoteSource``, a bucket): ``find.find_in_tiers`` returns the first
that holds the step. A ``Source`` reads one rank's tensors into memory, or fetches
shares into the local root so that they are read as local files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from ..manifest import Manifest, TensorRecord
from ..remote import fetch
from ..remote.store import Store


class Source(Protocol):
    """A step complete in another tier than the local root."""

    url: str  # where, in messages
    manifests: list[Manifest]
    # whether loads that read local files (the whole state, out=, mmap=True) fetch its
    # shares into the root first: the peers' memory is near; a bucket's whole step is not
    fills_root: bool

    def fill(self, ranks: Iterable[int] | None = None) -> None:
        """Fetch the shares of ``ranks`` (None: every share the local root lacks) into it."""

    def read_tensors(self, manifest: Manifest, records: dict[str, TensorRecord],
                     local: Callable[[dict[str, TensorRecord]], dict[str, Any]]) -> dict[str, Any]:
        """``records`` of ``manifest``'s share (its replicated tensors included) read into
        memory, every checksum checked; ``local`` reads those of shares in the local root."""


class RemoteSource:
    """A step complete in the remote tier (``ckptd.remote``)."""

    fills_root = False

    def __init__(self, store: Store, run: str, step: int, manifests: list[Manifest], base: Path) -> None:
        self.store, self.run, self.step, self.base = store, run, step, base
        self.manifests = manifests
        self.url = store.url

    def fill(self, ranks: Iterable[int] | None = None) -> None:
        for r in sorted(range(len(self.manifests)) if ranks is None else ranks):
            fetch.fetch_share(self.store, self.run, self.step, r, self.base)

    def read_tensors(self, manifest: Manifest, records: dict[str, TensorRecord],
                     local: Callable[[dict[str, TensorRecord]], dict[str, Any]]) -> dict[str, Any]:
        return fetch.read_tensors(self.store, manifest, records)  # checksums always checked
