"""Every exception ckptd raises on purpose, in one place: ``CheckpointError`` and its
kinds (``CheckpointNotFound``, ``CheckpointCorrupt``, ``ProtocolError``, ``TierUnavailable``,
``DaemonUnreachable``, ``RemoteError``, ``RemoteAuthError``), and ``ConfigError`` (a ``ValueError``) for a bad config key.

Bad arguments are plain ``ValueError``; values ckptd cannot store are ``TypeError``.
The rest are signals between ckptd's own parts, turned into one of the above (or a
reply naming what to do) before a user sees them; each is still importable from the
module that raises it.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be written, committed, found or read."""


class CheckpointNotFound(CheckpointError, LookupError):
    """The run or step asked for has no complete checkpoint."""


class CheckpointCorrupt(CheckpointError):
    """Bytes on disk do not match what the manifest recorded."""


class ProtocolError(CheckpointError):
    """A wire message that cannot be decoded or breaks the protocol."""


class TierUnavailable(CheckpointError):
    """A tier cannot be reached; each tier maps its own errors to this at its edge."""


class DaemonUnreachable(CheckpointError):
    """No ckptd daemon answers at the endpoint asked."""


class RemoteError(CheckpointError):
    """The object store refused or failed a request."""


class RemoteAuthError(RemoteError):
    """The object store refused the credentials: retrying cannot help."""


class ConfigError(ValueError):
    """A config file key or value is invalid; the message names both and the file."""


class NotOwner(Exception):
    """The producer may not write this run; the message says whose it is and what to do
    (daemon/owners.py; the daemon replies with it)."""


class StepError(Exception):
    """A message that fails one step (not the session): reply, then drop the step
    (daemon/assembly.py)."""


class Failpoint(RuntimeError):
    """Raised at an armed failpoint (failpoints.py; tests only)."""


class HandoffRefused(Exception):
    """The daemon received the staging descriptor and refused it; the message says why
    (transport/handoff.py)."""


class PeerDown(Exception):
    """A peer did not answer in time (slow, full of backlog, or dead) (peer/messages.py)."""


class PeerRefused(Exception):
    """A peer answered with an error (peer/messages.py)."""


class SealBroken(Exception):
    """A peer-port connection broke the protocol, or a box of it did not open: it is
    closed (transport/sealed.py)."""


class PeerVersion(PeerRefused):
    """A peer that speaks a newer protocol version than this node's."""


class PeerRequestRefused(ProtocolError):
    """A peer request refused with an error ``code`` the asker acts on (peer/messages.py,
    as ``Refused``)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class PeerMemoryFull(Exception):
    """No room for a copy within ``[peer] memory`` (peer/holder.py, as ``Full``)."""


class PeerNotOwner(Exception):
    """A peer asked to write, replace or drop a copy that another node's key owns
    (peer/holder.py, as ``NotYours``)."""
