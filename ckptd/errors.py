"""Every exception ckptd raises on purpose, in one place.

    CheckpointError                  daemon unreachable, timeout, failed commit
    ├── CheckpointNotFound           (also LookupError) no such run or step
    ├── CheckpointCorrupt            a checksum or file does not match its manifest
    ├── ProtocolError                a wire message that breaks the protocol
    └── RemoteError                  the object store ([remote]) refused or failed a request
        └── RemoteAuthError          it refused the credentials: retrying cannot help
    ConfigError (ValueError)         a bad config key or value, naming key and file

Bad arguments are plain ``ValueError``; values ckptd cannot store are ``TypeError``
(docs/reliability.md). Errors from libraries are translated where the library is called.

The rest are signals between ckptd's own parts, caught inside the daemon and turned
into one of the errors above (or a reply naming what to do) before a user sees them.
A class private to one module (``_NotThere``) stays in that module: it never leaves it.
Each is still importable from where it was first defined.
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


class RemoteError(CheckpointError):
    """The object store refused or failed a request."""


class RemoteAuthError(RemoteError):
    """The object store refused the credentials: retrying cannot help."""


class ConfigError(ValueError):
    """A config file key or value is invalid; the message names both and the file."""


# -- signals between ckptd's own parts ---------------------------------------------------


class NotOwner(Exception):
    """The producer may not write this run; the message says whose it is and what to do
    (daemon/owners.py; the daemon replies with it)."""


class StepError(Exception):
    """A message that fails one step (not the session): reply, then drop the step
    (daemon/assembly.py)."""


class Failpoint(RuntimeError):
    """Raised at an armed failpoint (daemon/failpoints.py; tests only)."""


class HandoffRefused(Exception):
    """The daemon received the staging descriptor and refused it; the message says why
    (transport/handoff.py)."""


class PeerDown(Exception):
    """A peer did not answer in time (slow, full of backlog, or dead) (peer/messages.py)."""


class PeerRefused(Exception):
    """A peer answered with an error (peer/messages.py)."""


class PeerMemoryFull(Exception):
    """No room for a replica within ``[peer] memory`` (peer/holder.py, as ``Full``)."""


class PeerNotOwner(Exception):
    """A peer asked to write, replace or drop a replica that another node's key owns
    (peer/holder.py, as ``NotYours``)."""
