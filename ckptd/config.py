"""Typed configuration, loaded from ``config.toml``: one keyword-only dataclass per table.

Every key has a default; an unknown key or a bad value is a ``ConfigError`` naming the
key and the file. Relative paths resolve against the config file's folder (or the current
directory when no file is used). Which file: ``discover``, the one rule every entry point
uses (``-c``, ``$CKPTD_CONFIG``, a ``./config.toml`` whose tables are all ckptd's, the
user's, ``/etc/ckptd/config.toml``, the built-in defaults). Start reading at ``load``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from . import env as environment
from .errors import ConfigError
from .records import CODECS
# the storage formats of new checkpoints ([daemon] format, Producer(format=)): format/'s one list
from .format import FORMATS as FORMATS
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")


def parse_size(value: object) -> int:
    """``4096`` or ``"256MiB"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, str):
        m = _QUANTITY.fullmatch(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            size = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if size < float("inf"):  # "9" * 400 is a float overflow, not a size
                return int(size)
    raise ValueError(f"{value!r} is not a size; write bytes as an integer or a string like \"256MiB\"")


def parse_duration(value: object) -> float:
    """``30``, ``2.5`` or ``"30s"``/``"500ms"``/``"6h"`` -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        m = _QUANTITY.fullmatch(value)
        if m and m.group(2).lower() in _DURATION_UNITS:
            return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    raise ValueError(f"{value!r} is not a duration; write seconds or a string like \"30s\"")


def _choice(*allowed: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if value not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(map(repr, allowed))}")
        return value  # type: ignore[return-value]

    return parse


def _string(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{value!r} is not a non-empty string")
    return value


def _positive(parse: Callable[[object], Any]) -> Callable[[object], Any]:
    def check(value: object) -> Any:
        parsed = parse(value)
        if parsed <= 0:
            raise ValueError(f"{value!r} must be greater than zero")
        return parsed

    return check


def _attempt(value: object) -> str:
    from .attempt import check_attempt

    return "" if value == "" else check_attempt(value)  # type: ignore[arg-type]


def _opt(default: Any, parse: Callable[[object], Any]) -> Any:
    return field(default=default, metadata={"parse": parse})


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """``[daemon]``; each key, its unit and default: docs/configuration.md."""

    endpoint: str = _opt("ipc://var/run/ckptd.sock", _string)
    root: str = _opt("var/checkpoints", _string)
    format: str = _opt("chunk", _choice(*FORMATS))
    chunk_size: int = _opt(64 * 2**20, _positive(parse_size))
    memory_budget: int = _opt(2 * 2**30, _positive(parse_size))
    max_frame: int = _opt(256 * 2**20, _positive(parse_size))
    session_timeout: float = _opt(60.0, _positive(parse_duration))
    fsync: bool = _opt(True, lambda v: _bool(v))
    nice: int | str = _opt(19, lambda v: _nice(v))
    log_level: str = _opt("info", _choice("debug", "info", "warning", "error"))
    metrics: str = _opt("", lambda v: _listen_address(v))
    drain_timeout: float = _opt(60.0, parse_duration)
    retention_interval: float = _opt(30.0, _positive(parse_duration))
    direct_io: bool = _opt(True, lambda v: _bool(v))
    write_rate: int = _opt(0, parse_size)
    writer_threads: int = _opt(0, lambda v: _threads(v))
    shared_runs: bool = _opt(False, lambda v: _bool(v))
    reuse_unchanged: bool = _opt(True, lambda v: _bool(v))
    curve_secret_key: str = _opt("", lambda v: _path(v))
    curve_clients: str = _opt("", lambda v: _path(v))


@dataclass(frozen=True, kw_only=True)
class ProducerConfig:
    """``[producer]``; each key, its unit and default: docs/configuration.md."""

    timeout: float = _opt(10.0, _positive(parse_duration))
    staging_size: int | None = _opt(None, lambda v: _auto(v, _positive(parse_size)))
    staging_limit: int | None = _opt(None, lambda v: _auto(v, _positive(parse_size)))
    expected_bytes: int = _opt(0, parse_size)
    on_no_daemon: str = _opt("warn", _choice("warn", "raise"))
    on_full: str = _opt("block", _choice("block", "raise"))
    emit_timeout: float = _opt(300.0, _positive(parse_duration))
    heartbeat: float = _opt(2.0, _positive(parse_duration))
    transport: str = _opt("auto", _choice("auto", "shm", "inline"))
    gpu_snapshot: str = _opt("host", _choice("host", "device"))
    curve_server_key: str = _opt("", lambda v: _path(v))
    curve_secret_key: str = _opt("", lambda v: _path(v))
    attempt: str = _opt("", _attempt)
    compare_replicas: str = _opt("warn", _choice("off", "warn", "refuse"))
    preempt_signals: tuple[str, ...] = _opt(("SIGTERM", "SIGUSR1"), lambda v: _signal_names(v))
    preempt_grace: float = _opt(30.0, _positive(parse_duration))


def _signal_names(value: object) -> tuple[str, ...]:
    import signal

    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{value!r} is not a list of signal names such as [\"SIGTERM\", \"SIGUSR1\"]")
    for name in value:
        if not isinstance(name, str) or not name.startswith("SIG") or not hasattr(signal, name) \
                or name in ("SIGKILL", "SIGSTOP") or name.startswith("SIG_"):
            raise ValueError(f"{name!r} is not a signal a process can catch; name one such as \"SIGTERM\", "
                             "or give [] to hear no signal")
    return tuple(value)


def _auto(value: object, parse: Callable[[object], Any]) -> Any:
    """``"auto"`` -> None (ckptd decides), anything else through ``parse``."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse(value)


def _nice(value: object) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "idle":
        return "idle"
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
        raise ValueError(f"{value!r} is not a niceness from 0 to 19, or \"idle\" (nice 19 and SCHED_IDLE)")
    return value


def _threads(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
        raise ValueError(f"{value!r} is not a number of threads from 1 to 64, or 0 (a quarter of the cores)")
    return value


def writer_threads(configured: int) -> int:
    """``[daemon] writer_threads``, with 0 resolved: a quarter of the cores, 2 to 4. Two
    even on 2 cores: the threads mostly wait on the device, and two files in flight beat
    one on both 2-core VMs measured (1 GiB durable: 0.60 / 0.80 GB/s, and 1.6 / 2.3-2.7
    GB/s, at 1 / 2 threads: docs/performance.md)."""
    return configured or max(2, min(4, (os.cpu_count() or 1) // 4))


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a whole number >= 0")
    return value


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _path(value: object) -> str:
    """A file or folder path, kept as written (resolved where used); "" for none."""
    if isinstance(value, os.PathLike):  # Producer(curve_secret_key=Path(...))
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a path: write a string, or \"\" for none")
    return value


def split_host_port(address: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"`` or ``"[::1]:9464"`` -> (host, port); ValueError if malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not HOST:PORT (such as \"127.0.0.1:9464\" or \"[::1]:9464\")")
    return host, int(port)


def _listen_address(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string: write \"HOST:PORT\", or \"\" for off")
    if value:
        split_host_port(value)
    return value


@dataclass(frozen=True, kw_only=True)
class RetentionConfig:
    """Which complete checkpoints of a run to keep; 0 switches a rule off. A checkpoint
    is kept if any rule keeps it; with no rule on, every checkpoint is kept."""

    keep_last: int = _opt(0, _count)
    keep_every: int = _opt(0, _count)
    keep_best: int = _opt(0, _count)
    metric: str = _opt("metric", _string)
    mode: str = _opt("min", _choice("min", "max"))
    keep_within: float = _opt(0.0, parse_duration)
    max_bytes: int = _opt(0, parse_size)

    @property
    def keeps_all(self) -> bool:
        return not (self.keep_last or self.keep_every or self.keep_best or self.keep_within)

    @property
    def enabled(self) -> bool:
        return not self.keeps_all or bool(self.max_bytes)


def _level(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 9:
        raise ValueError(f"{value!r} is not a gzip level from 1 to 9")
    return value


@dataclass(frozen=True, kw_only=True)
class Hdf5Config:
    """How ``format = "hdf5"`` files are written (docs/format.md). The defaults favour
    speed: contiguous, unfiltered datasets, whose bytes go straight to their place
    in the file and which readers load with one ``preadv``."""

    compression: str = _opt("none", _choice("none", "gzip", "lzf"))
    level: int = _opt(4, _level)
    chunk_shape: str = _opt("none", _choice("auto", "none"))
    fletcher32: bool = _opt(False, lambda v: _bool(v))

    def __post_init__(self) -> None:
        if self.chunk_shape == "none" and self.filtered:
            what = f"compression = {self.compression!r}" if self.compression != "none" else "fletcher32 = true"
            raise ValueError(f"{what} needs chunk_shape = \"auto\": HDF5 applies filters to chunked datasets only")

    @property
    def filtered(self) -> bool:
        return self.compression != "none" or self.fletcher32


@dataclass(frozen=True, kw_only=True)
class IndexConfig:
    """``[index]``: how the index follows the root (docs/configuration.md)."""

    observer: str = _opt("auto", _choice("auto", "inotify", "polling"))
    poll_interval: float = _opt(1.0, _positive(parse_duration))
    rescan_interval: float = _opt(300.0, _positive(parse_duration))


def _url(value: object) -> str:
    """An object-store URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``file:///``), or "" for none."""
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string: write a URL such as \"s3://bucket/prefix\", or \"\" for none")
    if value and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^\s]+", value):
        raise ValueError(f"{value!r} is not a URL such as \"s3://bucket/prefix\"")
    return value.rstrip("/")


def _compression(value: object) -> str:
    """``[remote] compression``: "none" (or "off") or a codec of ckptd.remote.codec."""
    if value == "off":
        return "none"
    if value != "none" and value not in CODECS:
        raise ValueError(f"{value!r} is not one of 'none', 'off', {', '.join(map(repr, CODECS))}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """The remote tier (docs/tiers.md): every committed share is uploaded to ``url``
    in the background; ``retention`` ([remote.retention]) is the bucket's own policy."""

    url: str = _opt("", _url)
    part_bytes: int = _opt(16 * 2**20, _positive(parse_size))
    concurrency: int = _opt(8, _positive(lambda v: _count(v)))
    max_retry_s: float = _opt(30.0, _positive(parse_duration))
    poll_interval: float = _opt(0.5, _positive(parse_duration))
    compression: str = _opt("none", _compression)
    retention: RetentionConfig = RetentionConfig()

    @property
    def enabled(self) -> bool:
        return bool(self.url)


def _peer_endpoint(value: object) -> str:
    """A ``tcp://HOST:PORT`` endpoint of the peer tier, or "" (listen: off)."""
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string: write \"tcp://HOST:PORT\"")
    if value:
        if not value.startswith("tcp://"):
            raise ValueError(f"{value!r} is not a tcp:// endpoint such as \"tcp://10.0.0.5:7701\"")
        _, port = split_host_port(value[len("tcp://"):])
        if port == 0:
            raise ValueError(f"{value!r}: choose a port; 0 would pick one that no peer could know")
    return value


def _peer_list(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{value!r} is not a list of endpoints such as [\"tcp://10.0.0.6:7701\"]")
    out = []
    for item in value:
        if not _peer_endpoint(item):
            raise ValueError("an empty endpoint in the list")
        out.append(item)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """The peer tier (docs/tiers.md): this daemon replicates each share it commits into
    the memory of ``replicas`` of ``peers``, and holds theirs within ``memory`` bytes."""

    listen: str = _opt("", _peer_endpoint)
    peers: tuple[str, ...] = _opt((), _peer_list)
    replicas: int = _opt(1, _positive(lambda v: _count(v)))
    memory: int = _opt(4 * 2**30, _positive(parse_size))
    frame: int = _opt(4 * 2**20, _positive(parse_size))
    window: int = _opt(8, _positive(lambda v: _count(v)))
    stall: float = _opt(10.0, _positive(parse_duration))
    timeout: float = _opt(1.0, _positive(parse_duration))
    heartbeat: float = _opt(5.0, _positive(parse_duration))
    allow_plaintext: bool = _opt(False, lambda v: _bool(v))
    curve_peers: str = _opt("", lambda v: _path(v))
    rate: int = _opt(0, parse_size)
    placement: str = _opt("ring", _choice("ring", "rendezvous"))
    domain: int = _opt(1, _positive(lambda v: _count(v)))

    @property
    def enabled(self) -> bool:
        return bool(self.listen)


def _mtbf(value: object) -> float | None:
    """A duration, or "" / 0 for none (the run's measured failures, else a default)."""
    if value in ("", 0):
        return None
    d = parse_duration(value)
    if d <= 0:
        raise ValueError(f"{value!r}: a mean time between failures must be positive, or \"\" for none")
    return d


@dataclass(frozen=True, kw_only=True)
class AdviseConfig:
    """The checkpoint interval advice (docs/advise.md)."""

    mtbf: float | None = _opt(None, _mtbf)


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig = DaemonConfig()
    producer: ProducerConfig = ProducerConfig()
    retention: RetentionConfig = RetentionConfig()
    index: IndexConfig = IndexConfig()
    hdf5: Hdf5Config = Hdf5Config()
    remote: RemoteConfig = RemoteConfig()
    peer: PeerConfig = PeerConfig()
    advise: AdviseConfig = AdviseConfig()
    path: Path | None = None  # the file these values came from, if any
    origin: str = "built-in defaults"  # how that file was found (config.discover)

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    def resolve_path(self, value: str) -> Path:
        return resolve_path(value, self.base_dir)

    @property
    def root(self) -> Path:
        return self.resolve_path(self.daemon.root)

    @property
    def endpoint(self) -> str:
        return resolve_endpoint(self.daemon.endpoint, self.base_dir)


_TABLES: dict[str, type] = {
    "daemon": DaemonConfig, "producer": ProducerConfig, "retention": RetentionConfig, "index": IndexConfig,
    "hdf5": Hdf5Config, "remote": RemoteConfig, "peer": PeerConfig, "advise": AdviseConfig,
}


def tables() -> dict[str, type]:
    """Every table the config file takes, by name, sub-tables as ``"remote.retention"``:
    its dataclass, whose fields with a ``parse`` are its keys (what
    tests/test_config_docs.py checks config.toml and docs/configuration.md against)."""
    out: dict[str, type] = {}
    for name, cls in _TABLES.items():
        out[name] = cls
        for f in dataclasses.fields(cls):
            if "parse" not in f.metadata:  # a sub-table ([remote.retention])
                out[f"{name}.{f.name}"] = type(f.default)
    return out


def build(cls: type, values: dict[str, Any], where: str) -> Any:
    """Make a ``cls`` from raw TOML (or keyword) values, naming ``where`` in errors."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, raw in values.items():
        f = fields.get(key)
        if f is None:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {key!r} in {where}; known keys: {known}")
        if "parse" not in f.metadata:  # a sub-table, built by the caller ([remote.retention])
            if not dataclasses.is_dataclass(raw):
                raise ConfigError(f"{key!r} in {where} must be a table: write it as [{where[1:].split(']')[0]}.{key}]")
            kwargs[key] = raw
            continue
        try:
            kwargs[key] = f.metadata["parse"](raw)
        except ValueError as exc:
            raise ConfigError(f"bad value for {key!r} in {where}: {exc}") from None
    try:
        return cls(**kwargs)
    except ValueError as exc:  # keys that are valid alone but not together
        raise ConfigError(f"{where}: {exc}") from None


SYSTEM_CONFIG = Path("/etc/ckptd/config.toml")


def user_config() -> Path:
    """``$XDG_CONFIG_HOME/ckptd/config.toml``, where ``ckptd install-systemd --user`` writes."""
    try:
        home = Path.home() / ".config"
    except RuntimeError:  # no home folder to be found (a bare service environment)
        home = Path("/nonexistent")
    return Path(environment.xdg("XDG_CONFIG_HOME", str(home))) / "ckptd" / "config.toml"


def discover(path: str | os.PathLike[str] | None = None) -> tuple[Path | None, str]:
    """The config file the discovery rule picks, and why (for the start-up log line):
    ``path``, else ``$CKPTD_CONFIG`` (``none``: the defaults, searching nothing), else
    ``./config.toml`` when every table in it is ckptd's (a training project's own is
    passed over, and the reason says so), else ``user_config()``, else ``SYSTEM_CONFIG``.

    An explicit ``path`` or ``$CKPTD_CONFIG`` must exist (``load`` says so when it does
    not); the places searched after them are used only when a file is there."""
    if path is not None:
        return Path(path).expanduser().absolute(), "given with -c"
    env = environment.config_path()
    if env == "none":  # a job (or a test) that wants the defaults whatever files lie about
        return None, "CKPTD_CONFIG=none: built-in defaults"
    if env:
        return Path(env).expanduser().absolute(), "named by $CKPTD_CONFIG"
    here = Path.cwd() / "config.toml"
    passed_over = _not_ours(here) if here.is_file() else ""
    if here.is_file() and not passed_over:
        return here.absolute(), "found in the current folder"
    for candidate, why in ((user_config(), "the user's config"), (SYSTEM_CONFIG, "the system config")):
        try:
            if candidate.is_file():
                return candidate.absolute(), why + passed_over
        except OSError:  # an unreadable home folder, say: not there for us
            continue
    return None, "no config file found (-c, $CKPTD_CONFIG, ./config.toml, " \
                 f"{user_config()}, {SYSTEM_CONFIG}){passed_over}: built-in defaults"


def _not_ours(path: Path) -> str:
    """Why ``path`` is not ckptd's config (a table of another program, or not TOML), or ""."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return f"; {path} passed over: not a TOML file this user can read"
    foreign = [name for name, table in data.items() if name not in _TABLES or not isinstance(table, dict)]
    return f"; {path} passed over: [{foreign[0]}] is not a ckptd table" if foreign else ""


def describe(cfg: Config) -> str:
    """One line for the start-up log: which file the values came from."""
    return f"config {cfg.path} ({cfg.origin})" if cfg.path else f"config: {cfg.origin}"


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Load ``path``, else the file the discovery rule finds (module docstring), else
    the built-in defaults. ``Config.path`` and ``Config.origin`` say which."""
    file, origin = discover(path)
    if file is None:
        return Config(origin=origin)
    try:
        with open(file, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {file} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
    tables = {}
    for name, table in data.items():
        cls = _TABLES.get(name)
        if cls is None or not isinstance(table, dict):
            raise ConfigError(
                f"unknown table [{name}] in {file}; known tables: "
                + ", ".join(f"[{t}]" for t in _TABLES)
            )
        if cls is RemoteConfig and isinstance(table.get("retention"), dict):
            # [remote.retention] takes the [retention] keys, for the bucket
            table = dict(table, retention=build(RetentionConfig, table["retention"], f"[remote.retention] of {file}"))
        tables[name] = build(cls, table, f"[{name}] of {file}")
    return Config(path=file, origin=origin, **tables)


def resolve_path(value: str, base: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def resolve_endpoint(endpoint: str, base: Path) -> str:
    """Make an ``ipc://`` path absolute; other transports pass through."""
    if endpoint.startswith("ipc://"):
        return "ipc://" + str(resolve_path(endpoint[len("ipc://"):], base))
    if endpoint.startswith("tcp://"):
        # docs/security.md: only with CurveZMQ keys, which the daemon and producers load and
        # require where they open the socket (ckptd/transport/curve.py, docs/security.md).
        try:
            _, port = split_host_port(endpoint[len("tcp://"):])
        except ValueError as exc:
            raise ValueError(f"endpoint {endpoint!r}: {exc}") from None
        if port == 0:  # the daemon would listen on a port no producer could know
            raise ValueError(f"endpoint {endpoint!r}: choose a port; 0 would pick one that producers cannot know")
        return endpoint
    raise ValueError(f"endpoint {endpoint!r} must start with ipc:// (a socket on this host) "
                     "or tcp:// (with CurveZMQ keys)")


def default_root(root: str | os.PathLike[str] | None = None) -> Path:
    """``root`` if given, else ``$CKPTD_ROOT``, else the config's root."""
    if root is not None:
        return Path(root).expanduser().absolute()
    env = environment.root()
    if env:
        return Path(env).expanduser().absolute()
    return load().root
