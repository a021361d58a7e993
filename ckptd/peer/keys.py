"""The CurveZMQ keys a daemon's peer tier serves and dials with, and who may do what on
the peer port (docs/security.md). With ``[peer] curve_peers`` each node has its own key
pair and the port admits only the nodes' keys, each named for its ``listen``
(``key_name``); without it, one key pair shared by every node, of which only the daemon
key is served (a producer's key only pings). Without keys, a ``listen`` off
loopback is refused unless ``[peer] allow_plaintext = true``. Start at ``PeerKeys``.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from ..config import Config, ConfigError
from ..transport.curve import ClientKeys, CurveServer, load_public, load_secret
from .partners import host_of

log = logging.getLogger("ckptd.peer")

_KEY_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9.-]")


def key_name(endpoint: str) -> str:
    """The name of the public key file of the daemon listening on ``endpoint``:
    ``tcp://10.0.0.5:7701`` -> ``10.0.0.5-7701`` (``ckptd keygen 10.0.0.5-7701``)."""
    host = host_of(endpoint)
    port = endpoint.rsplit(":", 1)[-1]
    return f"{_KEY_NAME_UNSAFE.sub('_', host)}-{port}"


def is_loopback(endpoint: str) -> bool:
    host = host_of(endpoint)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(eq=False)
class PeerCurveServer(CurveServer):
    """The peer port's CurveZMQ server; ``shared``: every node has the same key pair
    (only that key may write), else every admitted key is a peer's."""

    shared: bool = False
    admits = "peer"

    def may_write(self, user: str | None) -> bool:
        """Whether the sender with CurveZMQ User-Id ``user`` (its Z85 public key) may
        read and write replicas: a peer daemon's key, never a producer's."""
        if not self.enabled:
            return True  # plaintext: loopback, or allow_plaintext
        if user is None:
            return False
        return user == self.public.decode() if self.shared else True


@dataclass(frozen=True)
class PeerKeys:
    """This daemon's key pair, dialing each peer with the public key named for its
    endpoint in ``folder`` (one key pair per node)."""

    public: bytes
    secret: bytes = field(repr=False)
    folder: Path
    secret_file: Path

    def for_endpoint(self, endpoint: str) -> ClientKeys:
        """The keys to dial ``endpoint``; ConfigError naming the key file it lacks."""
        path = self.folder / f"{key_name(endpoint)}.key"
        server = load_public(path, f"[peer] curve_peers key of {endpoint}")
        return ClientKeys(server, self.public, self.secret, self.secret_file)


def daemon_curve(config: Config) -> tuple[PeerCurveServer | None, ClientKeys | PeerKeys | None]:
    """The peer socket's CurveZMQ server and this daemon's keys to dial its peers; (None,
    None) for plaintext. ConfigError when a listen address other than loopback has no
    keys and ``allow_plaintext`` is not set, or when a key file is missing."""
    d, p = config.daemon, config.peer
    if not d.curve_secret_key:
        _plaintext(config)
        return None, None
    path = config.resolve_path(d.curve_secret_key)
    public, secret = load_secret(path, "[daemon] curve_secret_key file")
    if p.curve_peers:
        folder = config.resolve_path(p.curve_peers)
        own = folder / f"{key_name(p.listen)}.key"
        if own.exists() and load_public(own, "[peer] curve_peers key") != zmq.curve_public(secret):
            raise ConfigError(f"[peer] curve_peers file {own} is not the public half of [daemon] curve_secret_key "
                              f"{path}: copy this node's NAME.key there as {own.name}")
        return (PeerCurveServer(p.listen, public, secret, folder, shared=False),
                PeerKeys(public, secret, folder, path))
    clients = config.resolve_path(d.curve_clients) if d.curve_clients else None
    if clients is None:
        raise ConfigError("[peer] with [daemon] curve_secret_key needs [peer] curve_peers: a folder of every node's "
                          "public key named HOST-PORT.key for its [peer] listen (docs/tiers.md, \"Keys\")")
    log.warning("[peer] curve_peers is not set: the nodes share one key pair and the peer port admits the keys in "
                "[daemon] curve_clients (only the shared key is served); give each node its "
                "own key pair and set [peer] curve_peers (docs/tiers.md, \"Keys\")")
    return PeerCurveServer(p.listen, public, secret, clients, shared=True), ClientKeys(public, public, secret, path)


def _plaintext(config: Config) -> None:
    p = config.peer
    if is_loopback(p.listen):
        return
    if not p.allow_plaintext:
        where = f" in {config.path}" if config.path else ""
        raise ConfigError(
            f"[peer] listen {p.listen!r}{where} is not a loopback address and no CurveZMQ keys are set: anyone "
            "who reaches that port could read every share and write replicas. Set [daemon] curve_secret_key "
            "(this node's NAME.key_secret from `ckptd keygen`) and [peer] curve_peers (a folder of every node's "
            "public key named HOST-PORT.key), docs/tiers.md \"Keys\"; or, on a network you trust, "
            "[peer] allow_plaintext = true")
    log.warning("[peer] listen %s runs in plaintext ([peer] allow_plaintext = true): anyone who reaches it can read "
                "every share this node holds or wrote, and write replicas; set CurveZMQ keys (docs/tiers.md)",
                p.listen)
