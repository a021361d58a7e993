"""The addresses the system unit lets ckptd reach: the drop-in ``install-systemd`` writes,
and the check the daemon makes at start.

The shipped unit allows IP only on loopback (``IPAddressDeny=any``); ``allowed`` lists
what a config reaches beyond it, each with why. ``blocked_lines`` sends one datagram to
each at start and names every address refused, with the command that fixes it.
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
    """What ``cfg``'s daemon must reach beyond loopback: each ``[peer] peers`` address (a
    name resolved now: systemd takes addresses only; one that does not resolve is a
    ValueError naming it); the network of ``[peer] listen``'s interface, so that a node
    replaced at a new address there needs no drop-in rewritten on the others; the bucket's
    endpoint (a provider's own, whose addresses change without notice: any); the networks
    a ``tcp://`` endpoint or off-loopback metrics take clients from (``ip -j addr``); and
    the resolvers of /etc/resolv.conf where any of those is a name."""
    out = Allowed()
    for peer in cfg.peer.peers:
        host = urlsplit(peer).hostname or ""
        out.add(_resolve(host, f"[peer] peers: {peer}"), f"[peer] peers: {peer}{_resolved_note(host)}")
    if cfg.peer.listen:  # a node replaced at a new address on that network needs no new drop-in here
        host = urlsplit(cfg.peer.listen).hostname or ""
        _listening(host, f"[peer] listen {cfg.peer.listen} (its peers, at any address)", out)
    if cfg.remote.url:
        _remote(cfg.remote.url, out)
    if cfg.daemon.endpoint.startswith("tcp://"):
        host = urlsplit(cfg.daemon.endpoint).hostname or ""
        _listening(host, f"[daemon] endpoint {cfg.daemon.endpoint} (its producers)", out)
    if cfg.daemon.metrics:
        host, _ = split_host_port(cfg.daemon.metrics)
        _listening(host, f"[daemon] metrics {cfg.daemon.metrics} (its scraper)", out)
    names = [n for n in _hosts(cfg) if _is_name(n)]
    if names and "any" not in [e for e, _ in out.entries]:
        servers = [a for a in resolvers() if not ipaddress.ip_address(a).is_loopback]
        out.add(servers, f"the DNS resolver{'s' if len(servers) > 1 else ''} of /etc/resolv.conf, for "
                         f"{', '.join(names)}")
    return out


def _hosts(cfg: Config) -> list[str]:
    """Every host the config names, peers, bucket endpoint and listen addresses."""
    urls = [*cfg.peer.peers, cfg.peer.listen]
    if cfg.daemon.endpoint.startswith("tcp://"):
        urls.append(cfg.daemon.endpoint)
    if cfg.remote.url and urlsplit(cfg.remote.url).scheme == "s3":
        urls.append(env.s3_endpoint())
    return list(dict.fromkeys(h for h in (urlsplit(u).hostname for u in urls if u) if h))


def _is_name(host: str) -> bool:
    """Whether ``host`` needs DNS: not an address, and not localhost (/etc/hosts has it)."""
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        return host != "localhost" and not host.endswith(".localhost")


def resolvers(path: str = "/etc/resolv.conf") -> list[str]:
    """The ``nameserver`` addresses of ``path``, scope suffixes left out."""
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    found = [line.split()[1].split("%")[0] for line in lines if line.startswith("nameserver") and len(line.split()) > 1]
    return [a for a in dict.fromkeys(found) if _is_address(a)]


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def blocked(cfg: Config) -> list[tuple[str, str]]:
    """Each (address, why) that ``cfg`` reaches and this process may not: a datagram to it
    is refused with EPERM, as systemd's ``IPAddressDeny=`` (or a firewall) refuses it."""
    try:
        needed = allowed(cfg).entries
    except ValueError as exc:  # a name that does not resolve, perhaps with its resolver blocked
        servers = [a for a in resolvers() if _refused(a)]
        return [(a, f"the DNS resolver, while {exc}") for a in servers] or [("?", str(exc))]
    except (OSError, subprocess.SubprocessError):  # no `ip` to ask: the check cannot tell, start anyway
        return []
    return [(a, why) for a, why in needed if a != "any" and _refused(_probe_address(a))]


def _probe_address(entry: str) -> str:
    """An address to try for an allowed entry: itself, or one inside a network."""
    net = ipaddress.ip_network(entry, strict=False)
    return str(net.network_address + 1) if net.num_addresses > 2 else str(net.network_address)


def _refused(address: str) -> bool:
    """Whether sending one datagram to ``address`` (the discard port) fails with EPERM."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(b"", (address, 9))
        except PermissionError:
            return True
        except OSError:  # unreachable, no route: not the unit's doing
            return False
    return False


def blocked_lines(cfg: Config) -> list[str]:
    """What the daemon logs at start for each address it cannot reach, with the fix."""
    if not env.under_systemd():
        fix = "allow it in this host's firewall"
    else:
        fix = "sudo ckptd install-systemd && sudo systemctl daemon-reload && sudo systemctl restart ckptd"
        if cfg.path is not None and str(cfg.path) != "/etc/ckptd/config.toml":
            fix += f" (install-systemd reads /etc/ckptd/config.toml, not {cfg.path})"
    return [f"{address} is blocked on this host ({why}); to allow every address the config reaches: {fix}"
            for address, why in blocked(cfg)]


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
