"""CurveZMQ for ``tcp://`` endpoints: key files, the daemon's allowlist, ``ckptd keygen``.

A TCP port is open to every host that can route to it, so ``tcp://`` is CurveZMQ only
(docs/security.md): encrypted, the producer checks the daemon's public key, and the
daemon admits only the public keys in its ``curve_clients`` folder (``CurveServer``).
Both transport ends call it with one line each (``secure_client``). Key files are
pyzmq's: ``NAME.key`` the public key, ``NAME.key_secret`` both.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from ..config import Config, ConfigError, resolve_path

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("ckptd.curve")

ZAP_DOMAIN = b"ckptd"
HOW_TO_MAKE = "make keys with `ckptd keygen NAME` (docs/security.md)"
_KEYGEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_REFUSAL_LOG_S = 60.0


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def _z85_key(text: bytes, path: Path, which: str) -> bytes:
    try:
        raw = z85.decode(text)
    except (ValueError, KeyError):  # z85.decode raises KeyError on a stray character
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"key file {path}: its {which} key is not a 40-character Z85 CurveZMQ key; "
                          f"{HOW_TO_MAKE}")
    return text


def _read_key_file(path: Path, what: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate file; ConfigError naming ``path``."""
    if not os.path.lexists(path):
        raise ConfigError(f"{what} {path} does not exist; {HOW_TO_MAKE}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise ConfigError(f"{what} {path} holds no CurveZMQ public key; {HOW_TO_MAKE}") from None
    return _z85_key(public, path, "public"), (_z85_key(secret, path, "secret") if secret else None)


def load_secret(path: Path, what: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``NAME.key_secret`` file that only its owner (and
    group) may read: a secret readable by every user protects nothing."""
    _, secret = _read_key_file(path, what)
    if secret is None:
        raise ConfigError(
            f"{what} {path} holds no secret key: point it at the NAME.key_secret file "
            "that `ckptd keygen NAME` made, not at NAME.key"
        )
    if os.stat(path).st_mode & stat.S_IROTH:
        raise ConfigError(f"{what} {path} is readable by every user on this host; `chmod 600 {path}`")
    return zmq.curve_public(secret), secret


def load_public(path: Path, what: str) -> bytes:
    public, _ = _read_key_file(path, what)
    return public


def allowed_keys(folder: Path,
                 on_bad_file: Callable[[ConfigError], None] | None = None) -> dict[bytes, Path]:
    """The public keys of the ``*.key`` files in ``folder`` -> the file. ConfigError naming
    the folder, or the first file that is unreadable or malformed; with ``on_bad_file``,
    such a file is handed to it and skipped instead."""
    try:
        files = sorted(p for p in folder.iterdir() if p.name.endswith(".key"))
    except FileNotFoundError:
        raise ConfigError(f"[daemon] curve_clients folder {folder} does not exist") from None
    except NotADirectoryError:
        raise ConfigError(f"[daemon] curve_clients {folder} is not a folder of NAME.key files") from None
    except OSError as exc:
        raise ConfigError(f"cannot read [daemon] curve_clients folder {folder}: {exc.strerror}") from None
    keys = {}
    for p in files:
        try:
            keys[load_public(p, "client public key file")] = p
        except ConfigError as exc:
            if on_bad_file is None:
                raise
            on_bad_file(exc)
    return keys


@dataclass(eq=False)
class CurveServer:
    """The daemon's CurveZMQ: its keys, and the ZAP handler (thread ``ckptd-zap``) that
    admits a producer only if its public key is in the ``curve_clients`` folder.

    Off (every method a no-op) for an ``ipc://`` endpoint. The folder is read at each
    handshake, not once: a key file removed is refused from the next connection on,
    without a reload.

    ``secret``: never in a log line or a traceback
    ``_logged``: refused key -> when last logged"""

    endpoint: str
    public: bytes = b""
    secret: bytes = field(default=b"", repr=False)
    clients: Path | None = None
    _auth: ThreadAuthenticator | None = None
    admits = "producer"
    _logged: dict[bytes, float] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.secret)

    @classmethod
    def from_config(cls, config: Config) -> "CurveServer":
        """Check and load the keys a ``tcp://`` endpoint needs; ConfigError naming what is
        missing or which file is wrong. Called before the daemon touches anything."""
        endpoint = config.endpoint
        d = config.daemon
        if not is_tcp(endpoint):
            if d.curve_secret_key or d.curve_clients:
                log.warning("[daemon] curve_secret_key/curve_clients are used for tcp:// endpoints only; "
                            "who may connect to %s is decided by its folder's permissions", endpoint)
            return cls(endpoint)
        missing = [k for k in ("curve_secret_key", "curve_clients") if not getattr(d, k)]
        if missing:
            where = f" in {config.path}" if config.path else ""
            raise ConfigError(
                f"[daemon] endpoint {endpoint!r} is tcp://, which needs CurveZMQ keys, but "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set{where}: "
                "run `ckptd keygen daemon`, set curve_secret_key to daemon.key_secret and curve_clients "
                "to a folder of the producers' public NAME.key files (docs/security.md)"
            )
        public, secret = load_secret(config.resolve_path(d.curve_secret_key), "[daemon] curve_secret_key file")
        clients = config.resolve_path(d.curve_clients)
        if not allowed_keys(clients):
            log.warning("no producer public keys (*.key) in %s: no producer can connect until one is added",
                        clients)
        return cls(endpoint, public, secret, clients)

    def secure(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CurveZMQ server, and start the ZAP handler."""
        if not self.enabled:
            return
        sock.setsockopt(zmq.IPV6, 1)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN
        # fail closed: without a handler, libzmq would let every peer in
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        from zmq.auth.thread import ThreadAuthenticator  # here: it imports asyncio, which producers need not

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("ckptd.curve.zap"))
        auth.start()
        auth.thread.name = "ckptd-zap"
        auth.configure_curve_callback(ZAP_DOMAIN.decode(), self)
        self._auth = auth
        log.info("CurveZMQ on %s: daemon public key %s; %ss admitted: the *.key files in %s",
                 self.endpoint, self.public.decode(), self.admits, self.clients)

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question (pyzmq calls it so, in thread ``ckptd-zap``): may the
        producer with public key ``key`` (Z85) connect?"""
        assert self.clients is not None
        try:
            allowed = allowed_keys(self.clients, self._bad_file)
        except ConfigError as exc:  # the folder itself is gone: refuse everyone, loudly, keep serving
            if self._log_now(b""):
                log.error("refusing every %s: %s", self.admits, exc)
            return False
        if key in allowed:
            log.debug("admitted a %s with public key %s (%s)", self.admits, key.decode(), allowed[key])
            return True
        if self._log_now(key):
            log.warning("refused a %s whose CurveZMQ public key %s is not in %s", self.admits, key.decode(),
                        self.clients)
        return False

    def _bad_file(self, exc: ConfigError) -> None:
        if self._log_now(str(exc).encode()):
            log.error("ignoring a file of the allowlist: %s", exc)

    def _log_now(self, key: bytes) -> bool:
        """True at most once a minute per key: a refused peer retries every 100 ms."""
        now = time.monotonic()
        if now - self._logged.get(key, -_REFUSAL_LOG_S) < _REFUSAL_LOG_S:
            return False
        if len(self._logged) > 1000:
            self._logged.clear()
        self._logged[key] = now
        return True

    def close(self) -> None:
        """Stop the ZAP handler; before its ZeroMQ context terminates (which waits for it)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


@dataclass(frozen=True)
class ClientKeys:
    """A producer's CurveZMQ keys for one tcp:// daemon.

    ``server``: the daemon's public key: the producer talks to that daemon or to nobody
    ``secret``: never in a log line or a traceback
    ``secret_file``: for messages"""

    server: bytes
    public: bytes
    secret: bytes = field(repr=False)
    secret_file: Path


def client_keys(endpoint: str, config: Config, options: Mapping[str, Any] | None = None) -> ClientKeys | None:
    """The keys to reach a ``tcp://`` endpoint: ``[producer] curve_server_key`` and
    ``curve_secret_key`` from ``options`` (Producer keywords; relative paths resolve
    against the current folder) or else ``config`` (against the config file's folder).
    None for other endpoints; ConfigError if a key is missing or a file is wrong."""
    if not is_tcp(endpoint):
        return None
    paths: dict[str, Path | None] = {}
    for key in ("curve_server_key", "curve_secret_key"):
        if options and options.get(key):
            paths[key] = resolve_path(os.fspath(options[key]), Path.cwd())
        else:
            value = getattr(config.producer, key)
            paths[key] = config.resolve_path(value) if value else None
    missing = [k for k, p in paths.items() if p is None]
    if missing:
        raise ConfigError(
            f"endpoint {endpoint!r} is tcp://, which needs CurveZMQ keys, but [producer] "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: curve_server_key is "
            "the daemon's public key file (its NAME.key), curve_secret_key this producer's secret key file "
            "made by `ckptd keygen NAME`, whose NAME.key goes into the daemon's curve_clients folder "
            "(docs/security.md)"
        )
    server_file, secret_file = paths["curve_server_key"], paths["curve_secret_key"]
    assert server_file is not None and secret_file is not None
    server = load_public(server_file, "[producer] curve_server_key file")
    public, secret = load_secret(secret_file, "[producer] curve_secret_key file")
    return ClientKeys(server, public, secret, secret_file)


class Handshake:
    """Watches one client socket's handshakes (a libzmq socket monitor), so that a
    refusal can be told from silence. Read from the socket's own thread."""

    _ids = itertools.count()

    def __init__(self, sock: zmq.Socket | None = None, keys: ClientKeys | None = None) -> None:
        self._keys = keys
        self._monitor: zmq.Socket | None = None
        if sock is not None:
            events = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            name = f"inproc://ckptd-handshake-{os.getpid()}-{next(self._ids)}"
            self._monitor = sock.get_monitor_socket(events, name)

    @property
    def monitor(self) -> zmq.Socket | None:
        """The monitor socket, to poll beside the client socket: it becomes readable when
        a handshake fails (None: nothing is watched, or the handshake is done)."""
        return self._monitor

    def refusal(self, endpoint: str) -> str | None:
        """Why the handshake with ``endpoint`` failed, if it did: a one-line message."""
        why = None
        while self._monitor is not None and self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            why = _explain(event["event"], event["value"], endpoint, self._keys)
        return why

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None


def _explain(event: int, value: int, endpoint: str, keys: ClientKeys | None) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        who = f"this client's public key {keys.public.decode()} ({keys.secret_file})" if keys else "this client"
        return (f"the ckptd daemon at {endpoint} refused {who}: copy the matching NAME.key file into "
                "the daemon's [daemon] curve_clients folder")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (f"the CurveZMQ handshake with {endpoint} failed: is [producer] curve_server_key the public "
                "key of that daemon's curve_secret_key (both from the same `ckptd keygen`)?")
    return f"the ZeroMQ handshake with {endpoint} failed (protocol error {value:#x}): is it a ckptd daemon?"


def secure_client(sock: zmq.Socket, keys: ClientKeys | None, *, watch: bool = False) -> Handshake:
    """Make ``sock`` (before it connects) a CurveZMQ client with ``keys``; nothing for
    None (an ``ipc://`` endpoint). ``watch``: report refusals through the Handshake."""
    if keys is None:
        return Handshake()
    sock.setsockopt(zmq.IPV6, 1)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server
    return Handshake(sock, keys) if watch else Handshake()


def keygen(name: str, folder: str | os.PathLike[str] = ".") -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (secret, 0600) into
    ``folder``; never replaces a file. Returns their paths."""
    if not _KEYGEN_NAME.fullmatch(name):
        raise ValueError(f"key name {name!r}: use letters, digits, '.', '_' and '-' (such as the host or user)")
    folder = Path(folder).expanduser().absolute()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for p in (public, secret):
        if os.path.lexists(p):
            raise FileExistsError(f"{p} already exists; remove it first or choose another NAME")
    # written in a private folder, then linked into place: the secret is never readable by others
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder))
    try:
        made_public, made_secret = (Path(p) for p in zmq.auth.create_certificates(tmp, name))
        os.chmod(made_secret, 0o600)
        os.chmod(made_public, 0o644)
        os.link(made_secret, secret)  # link, not rename: fails rather than replace a file
        try:
            os.link(made_public, public)
        except BaseException:
            secret.unlink()
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public, secret


def keygen_instructions(public: Path, secret: Path) -> list[str]:
    """What ``ckptd keygen`` prints: where each file goes, for either role."""
    return [
        f"wrote {public} (the public key: hand out copies) and {secret} (the secret key, mode 0600: "
        "keep it on this host)",
        "As the daemon's key:",
        f"  its config:         [daemon] curve_secret_key = \"{secret}\"",
        f"  each producer's:    [producer] curve_server_key = a copy of {public}",
        "As a producer's key:",
        f"  its config:         [producer] curve_secret_key = \"{secret}\"  (or Producer(curve_secret_key=...))",
        f"  the daemon's host:  copy {public} into its [daemon] curve_clients folder",
    ]
