"""The shipped units, checked by systemd's own tools and run by a real systemd.

``systemd-analyze`` verifies both units and rates the system unit's sandbox. Then a
real ``systemd --user`` manager, in a private mount namespace that leaves the host
untouched, runs the units: start waits for READY=1, a checkpoint goes through, a
stopped main loop trips the watchdog and systemd restarts the daemon, reload
keeps the producers, and stop drains.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch

import ckptd
from ckptd import Producer
from ckptd.install import SYSTEM_DROPIN, render_dropin, render_unit
from conftest import free_port

REPO = Path(__file__).resolve().parent.parent
UNITS = {"system": REPO / "systemd/ckptd.service", "user": REPO / "systemd/user/ckptd.service"}
MAX_EXPOSURE = 2.0  # the bar for the system unit; --threshold counts tenths


def analyze(*args: str, user: bool = False, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if user:  # a user-mode analysis looks up the runtime folder of a user manager
        rt = cwd / "rt"
        rt.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(rt)
    return subprocess.run(["systemd-analyze", *(["--user"] if user else []), *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


def rendered(kind: str, tmp_path: Path, *, dropin: bool = False) -> Path:
    """The unit as `ckptd install-systemd` writes it (ExecStart= runs this Python),
    with ``dropin``, also the drop-in it writes on a host whose Python is under a
    home folder (systemd-analyze reads the ``ckptd.service.d/`` beside the unit)."""
    path = tmp_path / kind / "ckptd.service"
    path.parent.mkdir(exist_ok=True)
    path.write_text(render_unit(user=kind == "user"))
    if dropin and render_dropin() is not None:
        (path.parent / "ckptd.service.d").mkdir()
        (path.parent / "ckptd.service.d" / SYSTEM_DROPIN.name).write_text(render_dropin())
    return path


@pytest.mark.parametrize("kind", ["system", "user"])
def test_install_changes_only_execstart(kind: str, tmp_path: Path) -> None:
    shipped = UNITS[kind].read_text().splitlines()
    out = subprocess.run([sys.executable, "-m", "ckptd", "install-systemd", "--print",
                          *(["--user"] if kind == "user" else [])],
                         capture_output=True, text=True, check=True).stdout
    # what this host needs beyond that (a Python under /root or /home) is a drop-in
    out, _, dropin = out.partition(f"\n### drop-in {SYSTEM_DROPIN}\n")
    assert dropin == (render_dropin() or "" if kind == "system" else "")
    out = out.splitlines()
    changed = [(a, b) for a, b in zip(shipped, out) if a != b]
    assert len(out) == len(shipped)
    assert len(changed) == 1
    before, after = changed[0]
    assert before.startswith("ExecStart=/opt/ckptd/.venv/bin/python -m ckptd serve -c ")
    assert after == before.replace("/opt/ckptd/.venv/bin/python", sys.executable)


@pytest.mark.parametrize("kind", ["system", "system+dropin", "user"])
@pytest.mark.needs("systemd-analyze")
def test_verify_passes_without_a_warning(kind: str, tmp_path: Path) -> None:
    unit = rendered(kind.split("+")[0], tmp_path, dropin=kind.endswith("+dropin"))
    r = analyze("verify", str(unit), user=kind == "user", cwd=tmp_path)
    # verify reports unknown keys and the like on stderr with exit status 0
    assert r.returncode == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("dropin", [False, True], ids=["unit", "unit+dropin"])
@pytest.mark.needs("systemd-analyze")
def test_system_unit_exposure(dropin: bool, tmp_path: Path) -> None:
    unit = rendered("system", tmp_path, dropin=dropin)
    r = analyze("security", "--offline=true", f"--threshold={round(MAX_EXPOSURE * 10)}", str(unit), cwd=tmp_path)
    assert r.stderr == ""
    m = re.search(r"Overall exposure level for ckptd\.service: (\d+\.\d)", r.stdout)
    assert m, r.stdout
    assert float(m.group(1)) <= MAX_EXPOSURE, r.stdout
    assert r.returncode == 0, r.stdout


@pytest.mark.needs("systemd-analyze")
def test_user_unit_applies_every_filter_an_unprivileged_manager_can(tmp_path: Path) -> None:
    """A user manager without privileges cannot set up namespaces, but it can install
    seccomp filters: all of those are on."""
    unit = rendered("user", tmp_path)
    r = analyze("security", "--offline=true", "--json=short", str(unit), user=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    items = {i["json_field"]: i["set"] for i in json.loads(r.stdout)}
    wanted = ["NoNewPrivileges", "SystemCallArchitectures", "MemoryDenyWriteExecute", "LockPersonality",
              "RestrictRealtime", "RestrictSUIDSGID", "RestrictAddressFamilies_AF_PACKET",
              "RestrictAddressFamilies_AF_NETLINK", "RestrictAddressFamilies_OTHER"]
    wanted += [k for k in items if k.startswith("RestrictNamespaces_")]
    wanted += [k for k in items if k.startswith("SystemCallFilter_") and k != "SystemCallFilter_resources"]
    assert len(wanted) > 20
    assert [k for k in wanted if items.get(k) is not True] == []


INSTALL = r"""
set -eu
mount -t tmpfs tmpfs /etc  # this namespace's /etc only: the host's is untouched
echo "=== first"; "$PYTHON" -m ckptd install-systemd
tail -n +1 /etc/systemd/system/ckptd.service /etc/sysusers.d/ckptd.conf /etc/ckptd/config.toml \
    /etc/systemd/system/ckptd.service.d/* 2>/dev/null || true
sed -i 's|^root = .*|root = "/data/ckpt"|' /etc/ckptd/config.toml
echo "=== second"; "$PYTHON" -m ckptd install-systemd
echo "=== config"; cat /etc/ckptd/config.toml
"""


def test_system_install_writes_unit_user_and_config() -> None:
    refused = _namespaces_refused()
    if refused:
        pytest.skip(f"cannot make a private mount namespace: {refused}")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", INSTALL],
                       capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=60)
    assert r.returncode == 0, r.stderr
    first, rest = r.stdout.split("=== first\n")[1].split("=== second\n")
    second, config = rest.split("=== config\n")
    files = {name: text.rstrip("\n")
             for name, text in re.findall(r"==> (\S+) <==\n(.*?)(?=\n==> |\Z)", first, re.S)}
    dropin = render_dropin()  # only for a Python under /root, /home or /tmp, as in CI
    assert [line for line in first.splitlines() if line.startswith(("wrote ", "next: "))] == [
        "wrote /etc/systemd/system/ckptd.service",
        *([f"wrote {SYSTEM_DROPIN}"] if dropin else []),
        "wrote /etc/sysusers.d/ckptd.conf",
        "wrote /etc/ckptd/config.toml",
        "next: systemd-sysusers && systemctl daemon-reload && systemctl enable --now ckptd",
    ]
    assert files["/etc/systemd/system/ckptd.service"] == render_unit(user=False).rstrip("\n")
    assert files.get(str(SYSTEM_DROPIN), "") == (dropin or "").rstrip("\n")
    assert files["/etc/sysusers.d/ckptd.conf"] == (REPO / "systemd/ckptd.sysusers").read_text().rstrip("\n")
    cfg = tomllib_loads(files["/etc/ckptd/config.toml"])
    assert cfg == {"daemon": {"endpoint": "ipc:///run/ckptd/ckptd.sock", "root": "/var/lib/ckptd"}}
    # a second install keeps the operator's config and says what its sandbox needs
    assert "wrote /etc/ckptd/config.toml" not in second
    assert ("note: [daemon] root in /etc/ckptd/config.toml is outside /var/lib/ckptd; the sandbox makes it "
            "read-only: allow it with `systemctl edit ckptd`: [Service] ReadWritePaths=/data/ckpt") in second
    assert 'root = "/data/ckpt"' in config


NETWORK_CONFIG = """
[daemon]
endpoint = "tcp://0.0.0.0:7400"
metrics = "127.0.0.1:9464"
[peer]
listen = "tcp://10.9.0.5:7701"
peers = ["tcp://10.9.0.6:7701", "tcp://[fd00::7]:7701", "tcp://localhost:7702"]
[remote]
url = "s3://bucket/ckpt"
"""


def _local_networks() -> list[str]:
    out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout
    nets = [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
            for link in json.loads(out) for a in link["addr_info"]]
    return list(dict.fromkeys(str(n) for n in nets if n.version == 4 and not (n.is_loopback or n.is_link_local)))


def test_network_dropin_allows_exactly_what_the_config_reaches(tmp_path: Path, monkeypatch) -> None:
    """[peer] peers (loopback left to the unit), the bucket's endpoint, and the networks
    a tcp endpoint on every interface takes producers from: each allowed, with why."""
    from ckptd.install import render_network_dropin

    config = tmp_path / "config.toml"
    config.write_text(NETWORK_CONFIG)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://10.9.0.9:8333")
    text, notes = render_network_dropin(config)
    assert text is not None
    allowed = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("IPAddressAllow=")]
    assert allowed == ["10.9.0.6", "fd00::7", "10.9.0.9", *_local_networks()]
    assert "# [peer] peers: tcp://10.9.0.6:7701\nIPAddressAllow=10.9.0.6" in text
    assert "# [remote] url s3://bucket/ckpt at AWS_ENDPOINT_URL http://10.9.0.9:8333\n" in text
    assert f"from {config}" in text and "[Service]" in text
    assert any("Environment=" in n for n in notes)  # the service needs the endpoint and keys too
    # a provider's own endpoint has no fixed address: any, said so
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    text, notes = render_network_dropin(config)
    assert "IPAddressAllow=any" in text and any("IPAddressAllow=any" in n for n in notes)
    # a name that does not resolve is an error naming it, not a drop-in without it
    config.write_text('[peer]\nlisten = "tcp://10.9.0.5:7701"\npeers = ["tcp://no-such-peer.invalid:7701"]\n')
    with pytest.raises(ValueError, match=r"\[peer\] peers: tcp://no-such-peer.invalid:7701: cannot resolve "
                       r"'no-such-peer.invalid'.*write an address"):
        render_network_dropin(config)
    # loopback only: nothing to allow beyond the unit's own
    config.write_text('[daemon]\nmetrics = "127.0.0.1:9464"\n[remote]\nurl = "file:///srv/bucket"\n')
    assert render_network_dropin(config) == (None, [])


@pytest.mark.needs("systemd-analyze")
def test_network_dropin_passes_verify(tmp_path: Path, monkeypatch) -> None:
    from ckptd.install import SYSTEM_NETWORK_DROPIN, render_network_dropin

    config = tmp_path / "config.toml"
    config.write_text(NETWORK_CONFIG)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://10.9.0.9:8333")
    unit = rendered("system", tmp_path, dropin=True)
    dropins = unit.parent / "ckptd.service.d"
    dropins.mkdir(exist_ok=True)
    (dropins / SYSTEM_NETWORK_DROPIN.name).write_text(render_network_dropin(config)[0])
    r = analyze("verify", str(unit), cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    # the addresses allowed keep the sandbox under the bar
    r = analyze("security", "--offline=true", str(unit), cwd=tmp_path)
    m = re.search(r"Overall exposure level for ckptd\.service: (\d+\.\d)", r.stdout)
    assert m and float(m.group(1)) <= MAX_EXPOSURE, r.stdout


WHEEL_INSTALL = r"""
set -eu
hosts=$(cat /etc/hosts)  # the names the config's peers resolve by
mount -t tmpfs tmpfs /etc  # this namespace's /etc only: the host's is untouched
printf '%s\n' "$hosts" > /etc/hosts
mkdir /etc/ckptd && cp "$CONFIG" /etc/ckptd/config.toml
cd / && "$VENV/bin/python" -m ckptd install-systemd
cp -r /etc/systemd/system/ckptd.service /etc/systemd/system/ckptd.service.d "$OUT/"
"""


@pytest.mark.slow  # builds a wheel
@pytest.mark.needs("systemd-analyze")
def test_install_from_a_wheel_writes_units_that_verify(tmp_path: Path) -> None:
    """``pip install ckptd`` ships the unit templates: a wheel installed into a scratch
    environment (no checkout beside it) installs the unit and the network drop-in for a
    config with peers and a bucket; systemd-analyze accepts them."""
    refused = _namespaces_refused()
    if refused:
        pytest.skip(f"cannot make a private mount namespace: {refused}")
    src, wheels = tmp_path / "src", tmp_path / "wheels"  # built from a copy: no build/ left in the checkout
    shutil.copytree(REPO / "ckptd", src / "ckptd", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("ckptd-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--no-deps",
                    "-q", str(wheel)], check=True, capture_output=True, timeout=300)
    # ckptd's dependencies from this environment, but not its ckptd (an editable install, not a .pth line)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = next(p for p in sys.path if p.endswith("site-packages") and (Path(p) / "zmq").is_dir())
    (site / "ckptd-test-deps.pth").write_text(deps + "\n")
    where = subprocess.run([str(venv / "bin/python"), "-c", "import ckptd.install as i; print(i.SOURCE)"],
                           capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    assert where == str(site / "ckptd/systemd"), where
    config = tmp_path / "config.toml"
    config.write_text(NETWORK_CONFIG.replace('"tcp://0.0.0.0:7400"', '"ipc:///run/ckptd/ckptd.sock"'))
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, VENV=str(venv), CONFIG=str(config), OUT=str(out), AWS_ENDPOINT_URL="http://10.9.0.9:8333")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", WHEEL_INSTALL],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("wrote /etc/systemd/system/ckptd.service.d/ckptd-network.conf (the unit allows IP only on loopback): "
            "10.9.0.6, fd00::7, 10.9.0.9") in r.stdout, r.stdout
    unit = out / "ckptd.service"
    assert f"ExecStart={venv}/bin/python -m ckptd serve" in unit.read_text()
    assert (out / "ckptd.service.d/ckptd-network.conf").is_file()
    v = analyze("verify", str(unit), cwd=tmp_path)
    assert v.returncode == 0 and v.stderr == "", v.stderr


def tomllib_loads(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


@pytest.mark.needs("systemd-sysusers")
def test_sysusers_entry_is_valid(tmp_path: Path) -> None:
    conf = tmp_path / "ckptd.conf"
    shutil.copy(REPO / "systemd/ckptd.sysusers", conf)
    r = subprocess.run(["systemd-sysusers", "--dry-run", str(conf)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "ckptd" in r.stdout + r.stderr and "Failed" not in r.stderr


# -- a real systemd --------------------------------------------------------------------------------

# systemd --user expects what PID 1 provides; all of it is made inside a private mount
# namespace. The manager runs in a cgroup of its own, so that it does not take the
# host's root cgroup for its own; accounting is off, so it touches no other hierarchy.
NAMESPACE = r"""
set -eu
mount --bind /run /run
mount -t tmpfs -o mode=0755 tmpfs /run/systemd
mkdir /run/systemd/system /run/systemd/inaccessible /run/systemd/user.conf.d
cd /run/systemd/inaccessible
mkdir dir; touch reg; mkfifo fifo; mknod chr c 0 0; mknod blk b 0 0
"$PYTHON" -c 'import socket; socket.socket(socket.AF_UNIX).bind("sock")'
chmod 0000 dir reg fifo sock chr blk
printf '[Manager]\nDefaultCPUAccounting=no\nDefaultMemoryAccounting=no\nDefaultTasksAccounting=no\nDefaultIOAccounting=no\nDefaultIPAccounting=no\n' \
    > /run/systemd/user.conf.d/ckptd-test.conf
mount --bind "$BASE" /srv
for dir in $CGROUPS; do mkdir -p "$dir" && echo $$ > "$dir/cgroup.procs"; done
grep -q "/$CGROUP_NAME\$" /proc/self/cgroup  # never start it in the host's cgroup
cd /
export XDG_RUNTIME_DIR=/srv/rt XDG_CONFIG_HOME=/srv/config XDG_STATE_HOME=/srv/state
exec /lib/systemd/systemd --user --log-target=null  # no journal here; keep the host's kmsg clean
"""
INSIDE = {"XDG_RUNTIME_DIR": "/srv/rt", "XDG_CONFIG_HOME": "/srv/config", "XDG_STATE_HOME": "/srv/state"}


def _own_cgroups(name: str) -> list[Path]:
    """A new child of this process's cgroup in each hierarchy systemd tracks processes in."""
    dirs = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        mount = {"name=systemd": "/sys/fs/cgroup/systemd", "": "/sys/fs/cgroup/unified"}.get(controllers)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            mount = "/sys/fs/cgroup"  # the unified hierarchy alone
        if mount and Path(mount).is_dir():
            dirs.append(Path(mount + path.rstrip("/")) / name)
    return dirs


def _cgroup_text() -> str:
    return Path("/proc/self/cgroup").read_text()


def _die_with_parent() -> None:
    """In the child: SIGTERM (which stops the manager and its units) if pytest dies first."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class UserManager:
    """``systemd --user`` in a private mount namespace; ``/srv`` there is ``base`` here."""

    def __init__(self, base: Path) -> None:
        self.base = base
        for d in ("rt", "config/systemd/user", "state", "log"):
            (base / d).mkdir(parents=True, exist_ok=True)
        os.chmod(base / "rt", 0o700)
        name = f"ckptd-test-{os.getpid()}-{base.name}"
        self.cgroups = _own_cgroups(name)
        # In the host's cgroup, a manager takes it for its own and moves every process
        # of the host into its init.scope: never start one without a cgroup of its own.
        assert self.cgroups, f"no cgroup hierarchy to give systemd --user a cgroup of its own: {_cgroup_text()}"
        env = dict(os.environ, BASE=str(base), PYTHON=sys.executable,
                   CGROUPS=" ".join(map(str, self.cgroups)), CGROUP_NAME=name)
        with open(base / "log/manager.log", "wb") as log:
            self.proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "bash", "-c", NAMESPACE],
                                         env=env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 30
        while self.inside("systemctl", "--user", "is-system-running").stdout.strip() not in ("running", "degraded"):
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.05)

    def inside(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the manager's mount namespace, with its XDG variables."""
        env = [f"{k}={v}" for k, v in INSIDE.items()]
        return subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "--", "env", *env, *cmd],
                              capture_output=True, text=True, timeout=timeout)

    def systemctl(self, *args: str) -> str:
        r = self.inside("systemctl", "--user", "--no-pager", *args, timeout=120)
        if r.returncode != 0:
            status = self.inside("systemctl", "--user", "--no-pager", "status", "ckptd").stdout
            raise AssertionError(f"systemctl {' '.join(args)}: {r.stderr}\n{status}\n{self.log()}")
        return r.stdout

    def show(self, unit: str = "ckptd") -> dict[str, str]:
        out = self.systemctl("show", unit, "-p", "ActiveState,SubState,MainPID,NRestarts,Result,"
                             "ExecMainStatus,StatusText")
        return dict(line.split("=", 1) for line in out.splitlines())

    def log(self) -> str:
        return "".join((self.base / "log" / f).read_text(errors="replace")
                       for f in ("manager.log", "daemon.log") if (self.base / "log" / f).exists())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the manager stops its units, then exits
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for top in self.cgroups:  # whatever is left (nothing, normally), then the cgroups
            if not top.exists():
                continue
            for d in sorted(top.rglob("*"), key=lambda p: -len(p.parts)) + [top]:
                if not d.is_dir():
                    continue
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                for _ in range(50):
                    try:
                        d.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)  # killed processes leave the cgroup a moment later


def _namespaces_refused() -> str | None:
    try:
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                "mount --bind /run /run && mount -t tmpfs tmpfs /run/systemd"],
                               capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        return str(exc)
    return None if probe.returncode == 0 else probe.stderr.strip()


@pytest.fixture
def manager() -> Iterator[UserManager]:
    refused = _namespaces_refused()
    if refused:  # needs root (or CAP_SYS_ADMIN); CI here runs as root
        pytest.skip(f"cannot make a private mount namespace for a systemd user manager: {refused}")
    base = Path(tempfile.mkdtemp(prefix="cks", dir="/tmp"))  # short: ipc paths are limited
    m = UserManager(base)
    try:
        yield m
    finally:
        m.close()
        print(m.log())  # shown when the test failed
        shutil.rmtree(base, ignore_errors=True)


def state(seed: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(2**18, generator=g) for i in range(mib)}, "step": seed}


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and a["model"].keys() == b["model"].keys() and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def wait_for(what: str, predicate, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{log()}"
        time.sleep(0.1)


@pytest.mark.needs("/lib/systemd/systemd")
def test_user_unit_under_systemd(manager: UserManager) -> None:
    m = manager
    out = m.inside(sys.executable, "-m", "ckptd", "install-systemd", "--user")
    assert out.returncode == 0, out.stderr
    assert "wrote /srv/config/systemd/user/ckptd.service" in out.stdout
    assert "wrote /srv/config/ckptd/config.toml" in out.stdout
    # The test's own timing and log file; everything else is the unit as installed.
    dropin = m.base / "config/systemd/user/ckptd.service.d/test.conf"
    dropin.parent.mkdir()
    dropin.write_text("[Service]\nWatchdogSec=4s\nTimeoutAbortSec=3s\nRestartSec=200ms\n"
                      "StandardOutput=append:/srv/log/daemon.log\nStandardError=inherit\n")
    m.systemctl("daemon-reload")

    # start returns once the daemon said READY=1: listening, start-up scan done
    m.systemctl("start", "ckptd")
    sock = m.base / "rt/ckptd/ckptd.sock"
    assert sock.is_socket()
    shown = m.show()
    assert (shown["ActiveState"], shown["SubState"]) == ("active", "running")
    assert "0 producer(s)" in shown["StatusText"]
    first_pid = int(shown["MainPID"])

    endpoint = f"ipc://{sock}"
    root = m.base / "state/ckptd"
    with Producer(endpoint, "sd", staging_size="32MiB", timeout=10) as p:
        info = p.save(state(1, 4), 1).wait(60)
        assert info.step == 1
        # STATUS= follows within a second
        wait_for("STATUS=", lambda: "1 producer(s) of run(s) sd" in m.show()["StatusText"]
                 and "last commit: run sd step 1 at" in m.show()["StatusText"], 10, m.log)
        # reload: a new log level applies; the producer's session carries on
        config = m.base / "config/ckptd/config.toml"
        config.write_text(config.read_text().replace('root = ', 'log_level = "debug"\nroot = '))
        m.systemctl("reload", "ckptd")
        wait_for("the reload", lambda: "reloaded /srv/config/ckptd/config.toml: log_level = debug" in m.log(),
                 30, m.log)
        assert p.save(state(2, 4), 2).wait(60).step == 2
    assert same(ckptd.load("sd", 2, root=root, verify=True), state(2, 4))
    assert m.log().count("producer connected") == 1

    # A hung main loop stops the watchdog pings: systemd kills and restarts the daemon.
    os.kill(first_pid, signal.SIGSTOP)
    wait_for("a restart", lambda: m.show()["MainPID"] not in ("0", str(first_pid))
             and m.show()["SubState"] == "running", 60, m.log)
    # the watchdog's SIGABRT: faulthandler printed where every thread was
    # (which thread takes the signal varies: "Current thread" is only there when it is a Python one)
    assert m.log().count("Fatal Python error: Aborted") == 1 and "(most recent call first)" in m.log()
    assert int(m.show()["NRestarts"]) == 1

    # stop drains: a checkpoint begun before systemd sends SIGTERM completes
    big = state(3, 24)
    with Producer(endpoint, "sd", staging_size="16MiB", timeout=10) as p:
        with p.checkpoint(3) as handle:
            names = list(big["model"])
            for name in names[:12]:
                p.emit(name, big["model"][name])
            p.latest()  # answered after those tensors: step 3 is open in the daemon
            stop = threading.Thread(target=m.systemctl, args=("stop", "ckptd"))  # returns once it exited
            stop.start()
            wait_for("SIGTERM", lambda: m.show()["ActiveState"] == "deactivating", 30, m.log)
            for name in names[12:]:
                p.emit(name, big["model"][name])
        assert handle.wait(60).step == 3
        stop.join(60)
        assert not stop.is_alive()
    shown = m.show()
    assert (shown["ActiveState"], shown["Result"], shown["ExecMainStatus"]) == ("inactive", "success", "0")
    assert re.search(r"stopping on SIGTERM: finishing 0 commit\(s\) in progress; "
                     r"waiting up to 60 s for 1 open step", m.log()), m.log()
    loaded = ckptd.load("sd", 3, root=root, verify=True)
    assert loaded.keys() == big["model"].keys() and all(torch.equal(loaded[k], v) for k, v in big["model"].items())
    assert not sock.exists()
    assert m.log().count("Fatal Python error: Aborted") == 1  # the watchdog fired once, when it should


@pytest.mark.needs("/lib/systemd/systemd")
def test_system_unit_sandbox_runs_the_daemon(manager: UserManager) -> None:
    """The system unit's whole sandbox, applied by a real systemd to a real daemon.

    A user manager cannot switch to the user ckptd, so User= and Group= go; and the
    config lives under /srv here. Every other line is the system unit as installed."""
    m = manager
    unit = render_unit(user=False)
    unit = "".join(line for line in unit.splitlines(keepends=True) if not line.startswith(("User=", "Group=")))
    (m.base / "config/systemd/user/ckptd.service").write_text(unit)
    dropins = m.base / "config/systemd/user/ckptd.service.d"
    dropins.mkdir()
    if render_dropin() is not None:  # as install-systemd writes it for this host
        (dropins / SYSTEM_DROPIN.name).write_text(render_dropin())
    # The test's config and log; its checkpoint root is outside the (user-mode)
    # StateDirectory=, so it is allowed as docs/service.md says.
    (dropins / "test.conf").write_text(
        "[Service]\nExecStart=\n"
        f"ExecStart={sys.executable} -m ckptd serve -c /srv/config/ckptd/config.toml\n"
        "ReadWritePaths=/srv/state\nStandardOutput=append:/srv/log/daemon.log\nStandardError=inherit\n")
    (m.base / "config/ckptd").mkdir()
    (m.base / "config/ckptd/config.toml").write_text(
        '[daemon]\nendpoint = "ipc:///srv/rt/ckptd/ckptd.sock"\nroot = "/srv/state/ckptd"\n'
        'metrics = "127.0.0.1:0"\n')
    m.systemctl("daemon-reload")
    m.systemctl("start", "ckptd")
    sock = m.base / "rt/ckptd/ckptd.sock"
    root = m.base / "state/ckptd"
    with Producer(f"ipc://{sock}", "sys", staging_size="32MiB", timeout=10) as p:
        p.save(state(5, 2), 5).wait(60)
    status = json.loads(subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "--endpoint",
                                        f"ipc://{sock}"], capture_output=True, text=True, check=True).stdout)
    assert status["commits"] == 1
    metrics = urllib.request.urlopen(status["metrics"], timeout=10).read().decode()
    assert re.search(r"^ckptd_commits_total 1\.0$", metrics, re.M)
    assert same(ckptd.load("sys", root=root, verify=True), state(5, 2))
    # UMask=0027: checkpoints are readable by the group, not by others; the socket
    # admits the group (the folder, RuntimeDirectoryMode=0750, admits nobody else)
    step = root / "sys/step-000000000005"
    assert {oct(f.stat().st_mode & 0o777) for f in step.iterdir()} == {"0o640"}
    assert oct(step.stat().st_mode & 0o777) == "0o750"
    assert oct(sock.stat().st_mode & 0o777) == "0o660"
    assert oct(sock.parent.stat().st_mode & 0o777) == "0o750"
    m.systemctl("stop", "ckptd")
    shown = m.show()
    assert (shown["Result"], shown["ExecMainStatus"]) == ("success", "0"), m.log()


def _system_unit(m: UserManager, config: str) -> Path:
    """The system unit as installed, run by ``m`` on ``config``: as in the test above,
    User= and Group= go (a user manager cannot switch users) and the config lives in /srv."""
    unit = "".join(line for line in render_unit(user=False).splitlines(keepends=True)
                   if not line.startswith(("User=", "Group=")))
    (m.base / "config/systemd/user/ckptd.service").write_text(unit)
    dropins = m.base / "config/systemd/user/ckptd.service.d"
    dropins.mkdir()
    if render_dropin() is not None:
        (dropins / SYSTEM_DROPIN.name).write_text(render_dropin())
    (dropins / "test.conf").write_text(
        "[Service]\nExecStart=\n"
        f"ExecStart={sys.executable} -m ckptd serve -c /srv/config/ckptd/config.toml\n"
        "ReadWritePaths=/srv/state\nStandardOutput=append:/srv/log/daemon.log\nStandardError=inherit\n")
    (m.base / "config/ckptd").mkdir()
    (m.base / "config/ckptd/config.toml").write_text(
        '[daemon]\nendpoint = "ipc:///srv/rt/ckptd/ckptd.sock"\nroot = "/srv/state/ckptd"\n' + config)
    m.systemctl("daemon-reload")
    return dropins


@pytest.mark.needs("/lib/systemd/systemd")
def test_the_daemon_names_each_address_the_unit_blocks_and_the_fix(manager: UserManager) -> None:
    """Installed before the config named a peer: the unit's IPAddressDeny=any blocks it,
    and the daemon says so at start, with the command that writes the drop-in; with the
    drop-in install-systemd writes from that config, nothing is blocked."""
    from ckptd.install import SYSTEM_NETWORK_DROPIN, render_network_dropin

    m = manager
    peer = "198.51.100.7"  # reached through the default route; nobody answers there
    dropins = _system_unit(m, f'[peer]\nlisten = "tcp://127.0.0.1:{free_port()}"\npeers = ["tcp://{peer}:7701"]\n')
    m.systemctl("start", "ckptd")
    wait_for("the start-up line", lambda: "is blocked on this host" in m.log(), 30, m.log)
    line = next(t for t in m.log().splitlines() if "is blocked on this host" in t)
    assert line.startswith(f"ERROR ckptd.daemon: {peer} is blocked on this host ([peer] peers: tcp://{peer}:7701)")
    assert "sudo ckptd install-systemd && sudo systemctl daemon-reload && sudo systemctl restart ckptd" in line
    m.systemctl("stop", "ckptd")
    text, _ = render_network_dropin(m.base / "config/ckptd/config.toml")
    (dropins / SYSTEM_NETWORK_DROPIN.name).write_text(text)
    m.systemctl("daemon-reload")
    m.systemctl("start", "ckptd")
    m.systemctl("stop", "ckptd")
    assert m.log().count("is blocked on this host") == 1, m.log()


SAVE_AS = """
import json, sys, torch
from ckptd import CheckpointError, Producer
for line in sys.stdin:
    run, step = line.split()
    try:
        with Producer(sys.argv[1], run, transport="inline", staging_size="1MiB", timeout=10) as p:
            p.save({"w": torch.ones(4)}, int(step)).wait(30)
        print(json.dumps("saved"), flush=True)
    except CheckpointError as exc:
        print(json.dumps(f"refused: {exc}"), flush=True)
"""


@pytest.fixture
def two_users() -> Iterator[tuple[str, str, str]]:
    """Two real non-root users in a group of their own: (group, alice, bob)."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("making two users needs root and useradd")
    tag = f"{os.getpid() % 100000}"
    group, users = f"ckt{tag}", [f"cka{tag}", f"ckb{tag}"]
    subprocess.run(["groupadd", group], check=True)
    try:
        for user in users:
            subprocess.run(["useradd", "-M", "-N", "-g", group, "-s", "/bin/false", user], check=True)
        yield group, users[0], users[1]
    finally:
        for user in users:
            subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


@pytest.mark.needs("/lib/systemd/systemd")
def test_two_users_own_their_runs_separately_under_the_system_unit(manager: UserManager, two_users) -> None:
    """Run ownership comes from the producers' uids (SO_PEERCRED): under the unit as
    installed, each user's run refuses the other user's producer."""
    m = manager
    group, alice, bob = two_users
    _system_unit(m, "")
    m.systemctl("start", "ckptd")
    sock = m.base / "rt/ckptd/ckptd.sock"
    for path in (m.base, m.base / "rt"):  # the test's folders: the users may pass through
        os.chmod(path, 0o711)
    shutil.chown(sock.parent, group=group)  # the system service's group, RuntimeDirectoryMode=0750
    shutil.chown(sock, group=group)

    env = {"PATH": os.environ["PATH"], "HOME": "/tmp", "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
           "CKPTD_CONFIG": "none"}
    # one process per user (both start at once: each imports torch), each save a producer
    # of its own. CAP_DAC_READ_SEARCH: the checkout may sit in a folder only root may enter
    # (a CI clone in a 0700 temp dir); it reads the interpreter's files whatever their mode,
    # and changes neither the uid the daemon sees nor the right to write the socket
    procs = {user: subprocess.Popen(
        ["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups", "--inh-caps=+dac_read_search",
         "--ambient-caps=+dac_read_search", sys.executable, "-c", SAVE_AS, f"ipc://{sock}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/")
        for user in (alice, bob)}

    def save(user: str, run: str, step: int) -> str:
        proc = procs[user]
        proc.stdin.write(f"{run} {step}\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            raise AssertionError(f"{user}'s save of {run} {step}: no answer in 120 s, or it ended: "
                                 f"{proc.communicate()[1][-4000:]}")
        return json.loads(line)

    try:
        assert save(alice, "alices", 1) == "saved"
        assert save(bob, "bobs", 1) == "saved"
        theirs = save(bob, "alices", 2)
        assert theirs.startswith("refused:") and "run 'alices' belongs to" in theirs, theirs
        assert save(alice, "bobs", 2).startswith("refused:")
        root = m.base / "state/ckptd"
        uid = {u: subprocess.run(["id", "-u", u], capture_output=True, text=True, check=True).stdout.strip()
               for u in (alice, bob)}
        assert (root / "alices/.owner").read_text().strip() == f"uid:{uid[alice]}"
        assert (root / "bobs/.owner").read_text().strip() == f"uid:{uid[bob]}"
        for user, proc in procs.items():
            proc.stdin.close()
            assert proc.wait(60) == 0, f"{user}: {proc.stderr.read()[-4000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    m.systemctl("stop", "ckptd")


def test_network_dropin_allows_the_peers_network_and_the_resolvers_of_a_name(tmp_path: Path) -> None:
    """[peer] listen on an interface: its whole network, so a node replaced at a new address
    there needs no new drop-in on the others; a peer named by name: the resolvers too."""
    from ckptd.install import render_network_dropin
    from ckptd.unitnet import resolvers

    out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout
    own = next(ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}") for link in json.loads(out)
               for a in link["addr_info"] if a["family"] == "inet" and not a["local"].startswith("127."))
    name = socket.gethostname()
    config = tmp_path / "config.toml"
    config.write_text(f'[peer]\nlisten = "tcp://{own.ip}:7701"\npeers = ["tcp://{name}:7701"]\n')
    text, _ = render_network_dropin(config)
    assert f"# [peer] listen tcp://{own.ip}:7701 (its peers, at any address): the network of its interface\n" \
           f"IPAddressAllow={own.network}\n" in text, text
    servers = [a for a in resolvers() if not ipaddress.ip_address(a).is_loopback]
    for server in servers:
        assert f"IPAddressAllow={server}\n" in text and f"/etc/resolv.conf, for {name}" in text, text
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("# a comment\nnameserver 10.1.2.3\nnameserver fe80::1%eth0\nsearch example\nnameserver bad\n")
    assert resolvers(str(resolv)) == ["10.1.2.3", "fe80::1"]
