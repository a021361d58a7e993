"""A reader's bucket shares landed by its node's daemon (``fetch`` on the daemon's
endpoint, answered by ``ckptd.daemon.bucket_relay``): local ranks restoring the same
step from the bucket download each share once a node, not once a rank. Without a
daemon serving this root and bucket, the reader reads the bucket itself. Start at
``DaemonLanding.land``.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from ..config import Config, ConfigError
from ..errors import CheckpointError, DaemonUnreachable

log = logging.getLogger("ckptd.remote")

ASK_S = 30.0
UNREACHABLE_QUIET_S = 60.0
_SEQ = itertools.count(1)


class DaemonLanding:
    """This node's daemon (``[daemon] endpoint``), where its ``[remote] url`` is the
    bucket read (``url``)."""

    def __init__(self, config: Config, base: Path, url: str) -> None:
        self.config, self.base, self.url = config, base, url
        self._quiet_until = 0.0

    def land(self, run: str, step: int, ranks: list[int]) -> bool:
        """Whether the daemon landed ``ranks``' shares of ``step`` in the root; False
        (logged) where it cannot: the caller then reads the bucket itself. A daemon that
        does not answer (within ``ASK_S``: it answers every few seconds) is not asked
        again through this tier for ``UNREACHABLE_QUIET_S``."""
        endpoint = self.config.endpoint
        if self.config.remote.url.rstrip("/") != self.url or time.monotonic() < self._quiet_until:
            return False
        try:
            self._ask(endpoint, run, step, ranks)
        except DaemonUnreachable as exc:
            self._quiet_until = time.monotonic() + UNREACHABLE_QUIET_S
            log.info("bucket: reading %s without this node's daemon: %s", self.url, exc)
            return False
        except CheckpointError as exc:
            log.warning("bucket: this node's daemon did not land run %r step %d rank(s) %s (%s); reading %s "
                        "directly", run, step, ranks, exc, self.url)
            return False
        return True

    def _ask(self, endpoint: str, run: str, step: int, ranks: list[int]) -> None:
        from ..transport import curve, wire
        from ..transport.oneshot import request

        try:
            keys = curve.client_keys(endpoint, self.config)
        except ConfigError as exc:
            raise DaemonUnreachable(f"cannot reach this node's daemon at {endpoint}: {exc}") from None
        while True:
            header = wire.encode("fetch", seq=next(_SEQ), run=run, step=step, ranks=sorted(set(ranks)),
                                 root=str(self.base), url=self.url)
            reply = request(endpoint, header, ASK_S, keys)
            if reply["done"]:
                return
            log.info("bucket: %s", reply["progress"])
