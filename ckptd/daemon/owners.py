"""Who may write a run through the daemon (``[daemon] shared_runs = false``).

A run belongs to whoever first wrote it: the Unix user of the producer over ipc://,
its CurveZMQ key over tcp:// (``principal``), recorded in ``<root>/<run>/.owner``.
``Owners.check`` refuses anyone else's producer at hello. root and the daemon's own
user are trusted with every run and claim none.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .. import layout
from ..durable import atomic_write
from ..errors import NotOwner

log = logging.getLogger("ckptd.daemon")
OWNER_FILE = ".owner"
_OWNER_LIMIT = 1024


def principal(frame: Any, *, tcp: bool) -> str | None:
    """``"uid:N"`` (ipc://) or ``"key:Z85"`` (tcp:// with CurveZMQ) of the peer that sent
    ``frame``, or None where the transport does not say."""
    try:
        if tcp:
            user = frame.get("User-Id")
            return f"key:{user}" if user else None
        parts = frame.get("Peer-Address").split(":")  # host:uid:gid:pid
        return f"uid:{int(parts[-3])}" if len(parts) >= 4 else None
    except Exception:
        return None


class Owners:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.trusted = {"uid:0", f"uid:{os.getuid()}"}
        self._known: dict[str, str] = {}

    def check(self, run: str, who: str | None) -> None:
        """Let ``who`` write ``run`` (claiming it if nobody has), or raise NotOwner."""
        if who is None or who in self.trusted:
            return
        owner = self.owner_of(run)
        if owner is None:
            self._claim(run, who)
            return
        if owner != who:
            raise NotOwner(
                f"run {run!r} belongs to {describe(owner)}, and this producer is {describe(who)}: a run is "
                "written only by the user (or key) whose producer created it; use another run id, or set "
                "[daemon] shared_runs = true to let every producer write every run"
            )

    def owner_of(self, run: str) -> str | None:
        """Who owns ``run`` here (``principal``'s form), None if nobody has claimed it."""
        if run not in self._known:
            text = recorded_owner(self.root, run)
            if text is None:
                return None
            self._known[run] = text
        return self._known[run]

    def _claim(self, run: str, who: str) -> None:
        run_dir = self.root / run
        layout.ensure_real_dir(run_dir, self.root)
        atomic_write(run_dir / OWNER_FILE, f"{who}\n".encode())
        self._known[run] = who
        log.info("run %s now belongs to %s", run, describe(who))


def recorded_owner(root: Path, run: str) -> str | None:
    """The owner ``<root>/<run>/.owner`` records, None without one."""
    try:
        fd = layout.open_real_dir(root / run)
    except FileNotFoundError:
        return None
    try:
        text = layout.read_small(OWNER_FILE, _OWNER_LIMIT, dir_fd=fd).decode().strip()
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    return text or None


def manifest_owner(root: Path, run: str) -> str | None:
    """``recorded_owner`` for a commit's manifest: None where it cannot be read, which
    only narrows who may recover the run on another node (root alone)."""
    try:
        return recorded_owner(root, run)
    except (OSError, ValueError):
        return None


def describe(who: str | None) -> str:
    if who is None:
        return "no one recorded (root, the daemon's own user, or a ckptd that did not record owners)"
    kind, _, value = who.partition(":")
    return f"Unix user {value}" if kind == "uid" else f"the CurveZMQ key {value}"
