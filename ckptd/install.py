"""``ckptd install-systemd``: the shipped unit, made to run this host's ckptd.

The units in the package's ``systemd/`` folder are the templates; installing changes one
line, ``ExecStart=``, to this Python, so what runs is what the tests check with
``systemd-analyze``. What this host needs beyond that goes into drop-ins: a Python under
/root or /home (which the sandbox hides), and the addresses the config reaches
(``unitnet``). A config file is written only where there is none. Start at ``install``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import env, unitnet
from .durable import replacing

SOURCE = Path(__file__).resolve().parent / "systemd"
SYSTEM_UNIT = Path("/etc/systemd/system/ckptd.service")
SYSTEM_DROPIN = Path("/etc/systemd/system/ckptd.service.d/ckptd-python.conf")
SYSTEM_NETWORK_DROPIN = Path("/etc/systemd/system/ckptd.service.d/ckptd-network.conf")
SYSTEM_SYSUSERS = Path("/etc/sysusers.d/ckptd.conf")
SYSTEM_CONFIG = Path("/etc/ckptd/config.toml")
SYSTEM_ROOT = Path("/var/lib/ckptd")  # StateDirectory=ckptd
SYSTEM_SOCKET = Path("/run/ckptd/ckptd.sock")  # RuntimeDirectory=ckptd
_PLACEHOLDER = "/opt/ckptd/.venv/bin/python"  # the templates' ExecStart interpreter
_HOMES = ("/home", "/root", "/run/user")  # what ProtectHome=yes hides
_TMPS = ("/tmp", "/var/tmp")  # what PrivateTmp=yes hides

_DROPIN = """\
# Written by `ckptd install-systemd`: this host's Python (or ckptd itself) lives
# under a home folder, which the unit's ProtectHome=yes would hide. The service
# instead sees empty home folders with only these in them, read-only.
[Service]
ProtectHome=tmpfs
BindReadOnlyPaths={paths}
"""

_TMP_DROPIN = """\
# This host's Python (or ckptd itself) lives under /tmp or /var/tmp, which the
# unit's PrivateTmp=yes would replace with an empty folder: keep the host's (still
# read-only, under ProtectSystem=strict). Installing from a permanent folder is better.
PrivateTmp=no
"""

_CONFIG = """\
# ckptd's configuration{what}, written by `ckptd install-systemd`.
# The daemon reads it, and so do producers given CKPTD_CONFIG={path}.
# Every key and its meaning: config.toml in ckptd's source tree. After a change:
# `systemctl{user} reload ckptd` applies log_level and [retention];
# `systemctl{user} restart ckptd` the rest (the daemon drains first).

[daemon]
endpoint = "ipc://{socket}"
root = "{root}"
# Prometheus metrics at http://127.0.0.1:9464/metrics:
# metrics = "127.0.0.1:9464"
"""


def template(*, user: bool) -> Path:
    path = SOURCE / ("user/ckptd.service" if user else "ckptd.service")
    if not path.is_file():
        raise FileNotFoundError(
            f"the unit template {path} is missing from this ckptd's package: reinstall ckptd "
            "(pip install --force-reinstall ckptd, or bash scripts/setup.sh in a checkout)"
        )
    return path


def render_unit(*, user: bool, python: str | None = None) -> str:
    """The unit for this host: the template with ``ExecStart=`` running ``python``."""
    python = python or sys.executable
    text = template(user=user).read_text()
    prefix = f"ExecStart={_PLACEHOLDER} "
    lines = text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    if len(hits) != 1:
        raise ValueError(f"{template(user=user)} must have exactly one line starting with {prefix!r}")
    lines[hits[0]] = f"ExecStart={_exec_word(python)} " + lines[hits[0]][len(prefix):]
    return "".join(lines)


def _exec_word(path: str) -> str:
    """``path`` as one word of a systemd command line."""
    word = path.replace("%", "%%")  # % starts a specifier
    if any(c in word for c in ' \t"\'\\'):
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def user_paths() -> dict[str, Path]:
    """Where the user unit's files go, per the XDG base directory variables."""
    home = Path.home()
    config = Path(env.xdg("XDG_CONFIG_HOME", str(home / ".config")))
    state = Path(env.xdg("XDG_STATE_HOME", str(home / ".local/state")))
    runtime = env.xdg("XDG_RUNTIME_DIR", f"/run/user/{os.getuid()}")
    return {
        "unit": config / "systemd/user/ckptd.service",
        "config": config / "ckptd/config.toml",  # %E/ckptd/config.toml in the unit
        "root": state / "ckptd",
        "socket": Path(runtime) / "ckptd/ckptd.sock",  # RuntimeDirectory=ckptd
    }


def install(*, user: bool) -> list[str]:
    """Write the unit (and what else it needs); return lines telling what was done and what next."""
    python = sys.executable
    done: list[str] = []
    if user:
        paths = user_paths()
        unit, config = paths["unit"], paths["config"]
        _write(unit, render_unit(user=True, python=python), done)
        if not config.exists():
            _write(config, _CONFIG.format(what=" for the user service", path=config, user=" --user",
                                          socket=paths["socket"], root=paths["root"]), done)
        done.append("next: systemctl --user daemon-reload && systemctl --user enable --now ckptd")
        done.append("(to keep it running while you are logged out: loginctl enable-linger)")
        done.append(f"producers: export CKPTD_CONFIG={config}")
        return done
    network, notes = render_network_dropin()  # a name that does not resolve fails before anything is written
    _write(SYSTEM_UNIT, render_unit(user=False, python=python), done)
    dropin = render_dropin(python)
    if dropin is not None:
        _write(SYSTEM_DROPIN, dropin, done)
    elif SYSTEM_DROPIN.exists():  # left by an earlier install from another Python
        SYSTEM_DROPIN.unlink()
        done.append(f"removed {SYSTEM_DROPIN}")
    _write(SYSTEM_SYSUSERS, (SOURCE / "ckptd.sysusers").read_text(), done)
    if not SYSTEM_CONFIG.exists():
        _write(SYSTEM_CONFIG, _CONFIG.format(what=" for the system service", path=SYSTEM_CONFIG, user="",
                                             socket=SYSTEM_SOCKET, root=SYSTEM_ROOT), done)
    else:
        done.extend(_outside_sandbox(SYSTEM_CONFIG))
    if network is not None:
        _write(SYSTEM_NETWORK_DROPIN, network, done)
        done[-1] += " (the unit allows IP only on loopback): " + ", ".join(
            line[len("IPAddressAllow="):] for line in network.splitlines() if line.startswith("IPAddressAllow="))
    elif SYSTEM_NETWORK_DROPIN.exists():  # left by an install whose config reached other hosts
        SYSTEM_NETWORK_DROPIN.unlink()
        done.append(f"removed {SYSTEM_NETWORK_DROPIN}")
    done.extend(notes)
    done.append("next: systemd-sysusers && systemctl daemon-reload && systemctl enable --now ckptd")
    done.append(f"producers: members of group ckptd, with CKPTD_CONFIG={SYSTEM_CONFIG}")
    return done


def _needed(python: str | None) -> set[str]:
    """Folders the service runs from: the interpreter, its standard library, the
    environment, ckptd's source."""
    python = python or sys.executable
    return {sys.prefix, sys.base_prefix, str(Path(os.path.realpath(python)).parent.parent),
            str(Path(__file__).resolve().parent.parent)}


def _under(path: str, tops: tuple[str, ...]) -> bool:
    return any(path == t or path.startswith(t + "/") for t in tops)


def hidden_paths(python: str | None = None) -> list[str]:
    """Folders the service runs from that the system unit's ProtectHome=yes would hide."""
    hidden = sorted(p for p in _needed(python) if _under(p, _HOMES))
    return [p for p in hidden if not any(p.startswith(q + "/") for q in hidden)]  # outermost only


def render_dropin(python: str | None = None) -> str | None:
    """A drop-in showing the service the folders it runs from, or None if it sees them."""
    parts = []
    paths = hidden_paths(python)
    if paths:
        parts.append(_DROPIN.format(paths=" ".join(_exec_word(p) for p in paths)))
    if any(_under(p, _TMPS) for p in _needed(python)):
        # A private /tmp would hide them, and a bind mount cannot reach under it.
        parts.append(_TMP_DROPIN if paths else "[Service]\n" + _TMP_DROPIN)
    return "".join(parts) or None


def render_network_dropin(config_path: Path = SYSTEM_CONFIG) -> tuple[str | None, list[str]]:
    """The drop-in allowing the addresses the system service's config reaches beyond
    loopback (None if it reaches none, or has no config yet), and notes for the operator."""
    from .config import load

    if not config_path.exists():
        return None, []
    found = unitnet.allowed(load(config_path))
    return found.render(str(config_path)), found.notes


def _outside_sandbox(config_path: Path) -> list[str]:
    """Notes for an existing config whose paths the unit's ProtectSystem=strict makes read-only."""
    from .config import load

    cfg = load(config_path)
    notes = []
    places = [("root", cfg.root, SYSTEM_ROOT)]
    if cfg.endpoint.startswith("ipc://"):
        places.append(("endpoint", Path(cfg.endpoint[len("ipc://"):]).parent, SYSTEM_SOCKET.parent))
    for key, path, allowed in places:
        if not path.is_relative_to(allowed):
            notes.append(f"note: [daemon] {key} in {config_path} is outside {allowed}; the sandbox makes it "
                         f"read-only: allow it with `systemctl edit ckptd`: [Service] ReadWritePaths={path}")
    return notes


def _write(path: Path, text: str, done: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:  # the one durable path: fsync, rename, fsync the folder
        tmp.write_text(text)
        os.chmod(tmp, 0o644)  # whatever the umask: systemd reads units as any user
    done.append(f"wrote {path}")
