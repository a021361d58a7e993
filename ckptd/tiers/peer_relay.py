"""The peer tier as a reader sees it (``RelayTier``): a reader holds no key to the peer
port, so it asks its node's daemon (``recover`` on the daemon's endpoint, answered by
``ckptd.daemon.relay``), which asks the peers with its own key and lands their shares
in the root; the reader then reads them there. Start at ``RelayTier.open``.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

from .. import layout
from ..config import Config, ConfigError
from ..errors import CheckpointError, CheckpointNotFound, DaemonUnreachable, TierUnavailable
from ..manifest import CheckpointInfo, Manifest, TensorRecord
from . import landing
from .files import read_tensors
from .peer import NAME

log = logging.getLogger("ckptd.peer")

ASK_S = 30.0  # an ask not answered within this long: the daemon is gone (it answers every few seconds)
_SEQ = itertools.count(1)


class RelayTier:
    """The peers' memory and disks through this node's daemon (``[daemon] endpoint``),
    the local root's shares counted in."""

    name = NAME
    where = "with its peers"
    durable = False  # memory: gone with the partners' daemons
    poll_interval = 0.2

    def __init__(self, config: Config, base: Path) -> None:
        self.config, self.base = config, base
        self._warned: set[str] = set()
        self._before_seen = False

    def ask(self, run: str, step: int | None, ranks: list[int] | None = None, *,
            memory: bool = False, landed: Callable[[list[str]], bool] | None = None) -> dict[str, Any]:
        """The daemon's ``recovered`` answer once done; its progress logged meanwhile, and
        the data files it names as in place told to ``landed``, which answers whether the
        reader has all it wants (then the last answer, the share still landing). DaemonUnreachable
        when it does not answer; CheckpointError with its refusal."""
        from ..transport import curve, wire
        from ..transport.oneshot import request

        endpoint = self.config.endpoint
        try:
            keys = curve.client_keys(endpoint, self.config)
        except ConfigError as exc:
            raise DaemonUnreachable(f"cannot reach this node's daemon at {endpoint}: {exc}") from None
        seen = 0
        while True:
            fields = {"seq": next(_SEQ), "run": run, "step": step, "ranks": ranks, "root": str(self.base),
                      "memory": memory, **({"seen": seen} if landed is not None and not self._before_seen else {})}
            try:
                reply = request(endpoint, wire.encode("recover", **fields), ASK_S, keys)
            except CheckpointError as exc:
                if "seen" not in fields or "unknown fields ['seen']" not in str(exc):
                    raise
                self._before_seen = True
                continue
            if reply["done"]:
                return reply
            if reply["landed"]:
                seen += len(reply["landed"])
                if landed(reply["landed"]):  # type: ignore[misc]
                    return reply
            else:
                log.info("peer tier: %s", reply["progress"])

    def _quiet(self, exc: CheckpointError) -> None:
        """A WARNING logged once: a reader polling the tier would repeat it every poll."""
        text = f"peer tier: not asked, it holds nothing for this process: {exc}"
        if text not in self._warned:
            self._warned.add(text)
            log.warning("%s", text)

    def latest(self, run: str) -> CheckpointInfo | None:
        """The newest step complete in the root and the peers together, as the daemon sees it."""
        try:
            info = self.ask(run, None)["info"]
        except TierUnavailable:
            raise  # the peers silent: "none" would be a guess
        except CheckpointError as exc:
            self._quiet(exc)
            return None
        return CheckpointInfo.from_dict(info) if info else None

    def steps(self, run: str) -> list[CheckpointInfo]:
        """None listed: the peers hold only the newest steps, for ``latest`` and loads."""
        return []

    def open(self, run: str, step: int) -> RelayHolding | None:
        """The step, if the root and the peers hold it together (its manifests from the
        daemon); None, with one warning, when the daemon cannot be reached."""
        try:
            reply = self.ask(run, step)
        except DaemonUnreachable as exc:
            self._quiet(exc)
            return None
        except CheckpointNotFound:
            return None
        manifests = [Manifest.from_json(m, f"a manifest from the daemon at {self.config.endpoint}")
                     for m in reply["manifests"] or ()]
        return RelayHolding(self, run, step, manifests) if manifests else None

    def completion(self, run: str, step: int,
                   world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        """Every rank's share in some peer's memory (the root and the peers' disks do not count)."""
        try:
            reply = self.ask(run, step, memory=True)
        except CheckpointError as exc:
            why = str(exc)
            return None, lambda timeout: f"after {timeout:g} s, step {step} of run {run!r}: {why}"
        info = CheckpointInfo.from_dict(reply["info"]) if reply["info"] else None
        return info, lambda timeout: reply["progress"].replace("after 0 s", f"after {timeout:g} s")


class RelayHolding:
    """A step the local root and the peers hold together: the shares the root lacks are
    landed there by the daemon, once a node however many readers ask, then read there."""

    where = "the peers' memory"

    def __init__(self, tier: RelayTier, run: str, step: int, manifests: list[Manifest]) -> None:
        self.tier, self.run, self.step, self.manifests = tier, run, step, manifests
        self.path = layout.step_dir(tier.base, run, step)

    def read(self, manifest: Manifest, records: dict[str, TensorRecord], into: dict[str, Any] | None = None, *,
             verify: bool = False, mapped: bool = False,
             convert: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
        """``records`` from the root, those of shares it lacks read file by file as the
        daemon lands them there (each in place and checked), while it lands the next."""
        pending = dict(records)
        out: dict[str, Any] = {}

        def take(files: Iterable[str] | None) -> bool:
            ready = {n: rec for n, rec in pending.items() if files is None or rec.file in files}
            for name in ready:
                del pending[name]
            got = read_tensors(self.path, ready, verify=verify, into=into, mapped=mapped)
            out.update(got if convert is None else {n: convert(n, t) for n, t in got.items()})
            return not any(layout.file_rank(rec.file) in missing for rec in pending.values())

        ranks = sorted({r for rec in records.values() if (r := layout.file_rank(rec.file)) is not None})
        missing = [r for r in ranks if landing.read_share(self.path, r) is None]
        if missing:
            self.tier.ask(self.run, self.step, missing, landed=lambda files: take(set(files)))
        take(None)
        return {n: out[n] for n in records}

    def materialize(self, ranks: Iterable[int] | None = None) -> None:
        """The shares of ``ranks`` (None: every rank) the root lacks, landed by the daemon."""
        wanted = range(len(self.manifests)) if ranks is None else sorted(set(ranks))
        missing = [r for r in wanted if landing.read_share(self.path, r) is None]
        if missing:
            self.tier.ask(self.run, self.step, missing)
