"""The addresses the system unit lets ckptd reach: a drop-in for ``ckptd install-systemd``.

The shipped system unit allows IP only on loopback (``IPAddressAllow=localhost``,
``IPAddressDeny=any``). A config that reaches other hosts needs those hosts allowed,
each from what the config names:

- ``[peer] peers``: each partner's address (a host name resolved now, as systemd
  takes addresses only), for the replicas this daemon sends and receives;
- ``[remote] url``: the object store's host, ``AWS_ENDPOINT_URL(_S3)``'s for an
  ``s3://`` bucket with an endpoint of its own (resolved as above). A cloud provider's
  own endpoint (no endpoint set, or ``gs://``, ``az://``) has addresses that change
  with no notice: the drop-in then allows any address, and says so;
- ``[daemon] endpoint`` on ``tcp://`` and ``[daemon] metrics`` on an address other
  than loopback: the producers and the scraper connect from the networks of the
  interface the daemon listens on (every interface's, for a wildcard address), which
  ``ip -j addr`` lists.

Every allowed address comes with a comment and a line of ``install-systemd``'s output
saying where it came from. A name that does not resolve is an error naming it: a
drop-in without it would leave the service unable to reach it, silently.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from . import env
from .config import Config, split_host_port

_HEADER = """\
# Written by `ckptd install-systemd` from {config}: the unit allows IP only on
# loopback (IPAddressDeny=any); these are the addresses that config reaches. Run
# install-systemd again after changing [peer], [remote], endpoint or metrics (or when
# a name below resolves to other addresses), then systemctl daemon-reload and restart.
[Service]
"""

_IP_ADDRESS = "local"  # what `ip -j addr` calls an interface's own address (not a tier's name)


@dataclass
class Allowed:
    """The addresses to allow, each with why; and notes for the operator."""

    entries: list[tuple[str, str]] = field(default_factory=list)  # (address or prefix, why)
    notes: list[str] = field(default_factory=list)

    def add(self, addresses: list[str], why: str) -> None:
        for a in addresses:
            if a not in [e for e, _ in self.entries]:
                self.entries.append((a, why))

    def render(self, config: str) -> str | None:
        if not self.entries:
            return None
        lines = [f"# {why}\nIPAddressAllow={address}\n" for address, why in self.entries]
        return _HEADER.format(config=config) + "".join(lines)


def allowed(cfg: Config) -> Allowed:
    """What ``cfg``'s daemon must reach beyond loopback."""
    out = Allowed()
    for peer in cfg.peer.peers:
        host = urlsplit(peer).hostname or ""
        out.add(_resolve(host, f"[peer] peers: {peer}"), f"[peer] peers: {peer}{_resolved_note(host)}")
    if cfg.remote.url:
        _remote(cfg.remote.url, out)
    if cfg.daemon.endpoint.startswith("tcp://"):
        host = urlsplit(cfg.daemon.endpoint).hostname or ""
        _listening(host, f"[daemon] endpoint {cfg.daemon.endpoint} (its producers)", out)
    if cfg.daemon.metrics:
        host, _ = split_host_port(cfg.daemon.metrics)
        _listening(host, f"[daemon] metrics {cfg.daemon.metrics} (its scraper)", out)
    return out


def _remote(url: str, out: Allowed) -> None:
    scheme = urlsplit(url).scheme
    if scheme in ("file", "memory"):
        return
    endpoint = env.s3_endpoint() if scheme == "s3" else ""
    if endpoint:
        host = urlsplit(endpoint).hostname or ""
        why = f"[remote] url {url} at AWS_ENDPOINT_URL {endpoint}"
        out.add(_resolve(host, why), why + _resolved_note(host))
        out.notes.append("note: the service reads AWS_ENDPOINT_URL and the bucket's credentials from its own "
                         "environment: add them with `systemctl edit ckptd` ([Service] Environment= or "
                         "EnvironmentFile=)")
        return
    out.add(["any"], f"[remote] url {url}: the provider's own endpoint, whose addresses change without notice")
    out.notes.append(f"note: [remote] url {url} is served by its provider's endpoints, whose addresses change: "
                     "the drop-in allows any address (IPAddressAllow=any); to narrow it, list the provider's "
                     "published ranges with `systemctl edit ckptd`, or set AWS_ENDPOINT_URL to a store of known "
                     "address and install again")


def _resolve(host: str, what: str) -> list[str]:
    """Every non-loopback address of ``host`` (the unit allows loopback already)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{what}: cannot resolve {host!r} ({exc}); systemd's IPAddressAllow= takes addresses "
                         "only: fix the name (or write an address) in the config and run install-systemd again") from None
    found = sorted({str(info[4][0]).split("%")[0] for info in infos}, key=lambda a: (":" in a, a))  # no scope
    return [a for a in found if not ipaddress.ip_address(a).is_loopback]


def _resolved_note(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        return f" ({host} resolved now)"


def _listening(host: str, what: str, out: Allowed) -> None:
    """Clients of a socket bound to ``host`` come from the networks of its interface."""
    try:
        bound = ipaddress.ip_address(host)
    except ValueError:
        addresses = _resolve(host, what)
        if not addresses:
            return  # a name for loopback
        bound = ipaddress.ip_address(addresses[0])
    if bound.is_loopback:
        return
    networks = _local_networks()
    if networks is None:
        out.notes.append(f"note: {what}: `ip -j addr` (iproute2) is not here to tell the networks its clients "
                         "come from: allow them with `systemctl edit ckptd`: [Service] IPAddressAllow=PREFIX")
        return
    wanted = [n for n in networks if (n.version == bound.version and bound.is_unspecified) or bound in n]
    if not wanted:
        held = "no interface here has an address but loopback" if bound.is_unspecified \
            else f"no interface here holds {bound}"
        out.notes.append(f"note: {what}: {held}: allow its clients' network with `systemctl edit ckptd`: "
                         "[Service] IPAddressAllow=PREFIX")
    out.add([str(n) for n in wanted], f"{what}: the network{'s' if len(wanted) > 1 else ''} of "
                                      f"{'every interface' if bound.is_unspecified else 'its interface'}")


def _local_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network] | None:
    """The networks of this host's interfaces, loopback and link-local left out."""
    ip = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)
    if ip is None:
        return None
    r = subprocess.run([ip, "-j", "addr"], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        return None
    out = []
    for link in json.loads(r.stdout or "[]"):
        for a in link.get("addr_info", []):
            net = ipaddress.ip_interface(f"{a[_IP_ADDRESS]}/{a['prefixlen']}").network
            if not (net.is_loopback or net.is_link_local) and net not in out:
                out.append(net)
    return out
