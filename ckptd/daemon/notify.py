"""The daemon's side of two systemd protocols, without libsystemd.

``Notifier`` sends sd_notify(3) datagrams (READY=1, STATUS=, WATCHDOG=1, STOPPING=1,
EXTEND_TIMEOUT_USEC=) to ``NOTIFY_SOCKET`` from the main process, a no-op outside
systemd; ``use_journal_priorities`` prefixes log lines with their syslog priority when
stderr is the journal, so that ``journalctl -p warning`` finds ckptd's warnings.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import MutableMapping

log = logging.getLogger("ckptd.daemon")


class Notifier:
    """Sends state changes to the service manager, if there is one.

    Reads (and removes, as ``sd_notify(unset_environment=1)`` does, so nothing
    this process starts inherits them) ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and
    ``WATCHDOG_PID`` from ``environ``.
    """

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = _address(env.pop("NOTIFY_SOCKET", ""))
        self.watchdog_s = _watchdog_interval(env.pop("WATCHDOG_USEC", ""), env.pop("WATCHDOG_PID", ""))
        self._sock: socket.socket | None = None
        self._warned = False
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # A service manager that stops reading must not stall the main loop for long.
            self._sock.settimeout(1.0)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False if there is no manager or it failed."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self.address)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify the service manager at %s: %s", _shown(self.address), exc)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def status_line(text: str) -> str:
    """``STATUS=`` holds one line."""
    return "STATUS=" + " ".join(text.split())


def _address(value: str) -> str | bytes | None:
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    if value:
        log.warning("ignoring NOTIFY_SOCKET=%r: only paths and @abstract names are supported", value)
    return None


def _watchdog_interval(usec: str, pid: str) -> float | None:
    """Seconds within which systemd wants ``WATCHDOG=1``, or None when it wants none."""
    if not usec:
        return None
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not a whole number of microseconds", usec)
        return None
    return value / 1e6 if value > 0 else None


def _shown(address: str | bytes | None) -> str:
    if isinstance(address, bytes):
        return "@" + address[1:].decode(errors="replace")
    return str(address)



_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JournalFormatter(logging.Formatter):
    """Prefixes every line of a record with its syslog priority, ``<4>`` for a warning."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self._inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 3 if record.levelno > logging.ERROR else 6)
        text = self._inner.format(record)
        return "\n".join(f"<{prio}>{line}" for line in text.split("\n"))


def stderr_is_journal(environ: MutableMapping[str, str] | None = None) -> bool:
    """True when stderr is the stream systemd connected to journald (``JOURNAL_STREAM``)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def use_journal_priorities() -> None:
    """If stderr is the journal, give the root logger's handlers priority prefixes."""
    if stderr_is_journal():
        for handler in logging.getLogger().handlers:
            if not isinstance(handler.formatter, JournalFormatter):
                handler.setFormatter(JournalFormatter(handler.formatter))
