"""The CurveZMQ keys a daemon's peer tier serves and dials with (docs/tiers.md)."""

from __future__ import annotations

from ..config import Config, ConfigError
from ..transport.curve import ClientKeys, CurveServer, load_secret


def daemon_curve(config: Config) -> tuple[CurveServer | None, ClientKeys | None]:
    """With ``[daemon] curve_secret_key``: the peer socket is a CurveZMQ server with the
    daemon's keys, admitting the keys in ``curve_clients``; and this daemon reaches its
    peers with the same key pair, expecting it as theirs (the nodes of a job share
    one daemon key, whose public half is in every curve_clients folder: docs/tiers.md)."""
    d = config.daemon
    if not d.curve_secret_key:
        return None, None
    path = config.resolve_path(d.curve_secret_key)
    public, secret = load_secret(path, "[daemon] curve_secret_key file")
    clients = config.resolve_path(d.curve_clients) if d.curve_clients else None
    if clients is None:
        raise ConfigError("[peer] with [daemon] curve_secret_key needs [daemon] curve_clients too: the folder "
                          "of public keys admitted (the daemons' own and the producers')")
    return CurveServer(config.peer.listen, public, secret, clients), ClientKeys(public, public, secret, path)
