"""Every exception ckptd raises on purpose, in one place.

    CheckpointError                  daemon unreachable, timeout, failed commit
    ├── CheckpointNotFound           (also LookupError) no such run or step
    ├── CheckpointCorrupt            a checksum or file does not match its manifest
    └── ProtocolError                a wire message that breaks the protocol
    ConfigError (ValueError)         a bad config key or value, naming key and file

Bad arguments are plain ``ValueError``; values ckptd cannot store are ``TypeError``
(docs/errors.md). Errors from libraries are translated where the library is called.
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


class ConfigError(ValueError):
    """A config file key or value is invalid; the message names both and the file."""
