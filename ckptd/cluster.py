"""``ckptd cluster init`` and ``check``: every node's keys and config from one list of hosts.

``init`` writes, under ``--out DIR``, a folder per node (``DIR/NODE``: ``config.toml``
and ``curve/``, its key pair and every node's public key) to copy to that node's
``/etc/ckptd/``, and ``DIR/public``, the shared folder of public keys. ``check`` reads
such a set-up back and names what is wrong, node by node. The keys are named as
``[peer] curve_peers`` expects them (``peer/keys.py``, ``HOST-PORT.key``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import config as config_mod
from .config import ConfigError, split_host_port
from .peer.keys import key_name
from .transport import curve

KEYS = "curve"  # a node folder's keys, beside its config.toml
PEER_KEYS = f"{KEYS}/peers"  # every node's public key: [peer] curve_peers


@dataclass(frozen=True)
class Node:
    host: str
    port: int
    folder: str  # DIR/<folder>: the host, or HOST-PORT where one host runs several nodes

    @property
    def listen(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def key(self) -> str:
        return key_name(self.listen)


def nodes(hosts: str, port: int) -> list[Node]:
    """``"10.0.0.1,10.0.0.2"`` (or ``HOST:PORT`` items) -> the nodes, in that order."""
    pairs = []
    for item in (h.strip() for h in hosts.split(",")):
        if not item:
            continue
        pairs.append(split_host_port(item) if item.count(":") == 1 or item.startswith("[") else (item, port))
    if len(pairs) < 2:
        raise ValueError(f"--hosts {hosts!r}: name at least two nodes, comma-separated (10.0.0.1,10.0.0.2)")
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"--hosts {hosts!r} names a node twice")
    one_each = len({h for h, _ in pairs}) == len(pairs)
    made = [Node(h, p, "") for h, p in pairs]
    return [Node(n.host, n.port, n.host if one_each else n.key) for n in made]


def render_config(node: Node, every: list[Node], *, endpoint: str, root: str, bucket: str) -> str:
    """The config of ``node``: its socket and root, its key pair, its peers and the bucket."""
    peers = ", ".join(json.dumps(n.listen) for n in every if n != node)
    remote = f'\n[remote]\nurl = {json.dumps(bucket)}\n' if bucket else ""
    return (f"# ckptd node {node.listen} of {len(every)}, written by `ckptd cluster init`. Copy this folder\n"
            f"# to /etc/ckptd/ on {node.host}; paths below are read from the folder this file is in.\n"
            f"[daemon]\nendpoint = {json.dumps(endpoint)}\nroot = {json.dumps(root)}\n"
            f"curve_secret_key = {json.dumps(f'{KEYS}/{node.key}.key_secret')}\n\n"
            f"[peer]\nlisten = {json.dumps(node.listen)}\npeers = [{peers}]\n"
            f"curve_peers = {json.dumps(PEER_KEYS)}\n{remote}")


def init(every: list[Node], out: Path, *, endpoint: str, root: str, bucket: str) -> list[str]:
    """Write every node's folder and ``out/public``; never replaces a key."""
    public = out / "public"
    taken = [out / n.folder / "config.toml" for n in every if (out / n.folder / "config.toml").exists()]
    if taken:
        raise FileExistsError(f"{taken[0]} already exists; remove it first, or check it: `ckptd cluster check`")
    done = []
    for node in every:
        made, _ = curve.keygen(node.key, out / node.folder / KEYS)
        public.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(made, public / made.name)
        done.append(f"{node.listen}: key pair in {made.parent}")
    for node in every:
        peers = out / node.folder / PEER_KEYS
        peers.mkdir(exist_ok=True)
        for n in every:
            shutil.copyfile(public / f"{n.key}.key", peers / f"{n.key}.key")
        config = out / node.folder / "config.toml"
        config.write_text(render_config(node, every, endpoint=endpoint, root=root, bucket=bucket))
        done.append(f"wrote {config}")
    done.append(f"public keys of every node: {public} (each node's {PEER_KEYS} holds a copy)")
    done.append("next, on each node: copy DIR/NODE/ to /etc/ckptd/, run `ckptd install-systemd` and "
                "`systemd-sysusers`, give the group ckptd /etc/ckptd/curve, then `systemctl enable --now ckptd` "
                "(docs/runbook.md)")
    return done


def check(every: list[Node], out: Path) -> dict[str, list[str]]:
    """What is wrong with each node's folder under ``out``, by node (empty lists: sound)."""
    return {node.listen: _problems(node, every, out) for node in every}


def report(found: dict[str, list[str]]) -> tuple[bool, list[str]]:
    """Whether every node is sound, and the lines saying so, node by node."""
    lines = []
    for node, wrong in found.items():
        lines.append(f"{node}: " + ("ok" if not wrong else f"{len(wrong)} problem(s)"))
        lines.extend(f"  {text}" for text in wrong)
    return not any(found.values()), lines


def _problems(node: Node, every: list[Node], out: Path) -> list[str]:
    path = out / node.folder / "config.toml"
    try:
        cfg = config_mod.load(path)
    except ConfigError as exc:
        return [str(exc)]
    p = cfg.peer
    wrong = []
    if p.listen != node.listen:
        wrong.append(f"{path}: [peer] listen is {p.listen!r}, not {node.listen!r}")
    want = {n.listen for n in every if n != node}
    if set(p.peers) != want:
        missing, extra = sorted(want - set(p.peers)), sorted(set(p.peers) - want)
        said = ([f"lacks {', '.join(missing)}"] if missing else []) + \
            ([f"names {', '.join(extra)}, which is not in --hosts"] if extra else [])
        wrong.append(f"{path}: [peer] peers " + "; ".join(said))
    if not cfg.daemon.curve_secret_key or not p.curve_peers:
        return wrong + [f"{path}: set [daemon] curve_secret_key and [peer] curve_peers (`ckptd cluster init`)"]
    return wrong + _key_problems(cfg, node, every, out)


def _key_problems(cfg: config_mod.Config, node: Node, every: list[Node], out: Path) -> list[str]:
    wrong = []
    secret_file = cfg.resolve_path(cfg.daemon.curve_secret_key)
    try:
        own, _ = curve.load_secret(secret_file, "[daemon] curve_secret_key file")
    except (ConfigError, OSError) as exc:
        return [str(exc)]
    folder = cfg.resolve_path(cfg.peer.curve_peers)
    for n in every:
        for place in (folder, out / "public") if n == node else (folder,):
            file = place / f"{n.key}.key"
            try:
                key = curve.load_public(file, f"public key of {n.listen}")
            except (ConfigError, OSError) as exc:
                wrong.append(str(exc))
                continue
            theirs = own if n == node else _own_public(n, out)
            if theirs is not None and key != theirs:
                wrong.append(f"{file} is not the public half of {n.listen}'s secret key: copy "
                             f"{n.folder}/{KEYS}/{n.key}.key there")
    return wrong


def _own_public(node: Node, out: Path) -> bytes | None:
    """``node``'s public key from its own secret key file, where that is under ``out``."""
    try:
        return curve.load_secret(out / node.folder / KEYS / f"{node.key}.key_secret", "secret key")[0]
    except (ConfigError, OSError):
        return None
