"""Access control (docs/security.md): tcp:// only with CurveZMQ keys and an allowlist,
ipc:// by the socket's folder and mode. Real daemons, real sockets, real key files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import CheckpointError, Producer, config
from ckptd.transport import curve
from ckptd.cli import main as cli
from ckptd.config import ConfigError

from conftest import free_port, start_tcp


def producer(endpoint: str, keys: dict[str, Path], who: str = "alice", **options: object) -> Producer:
    return Producer(endpoint, "sec", staging_size="16MiB", timeout=options.pop("timeout", 5),
                    curve_server_key=keys["server"], curve_secret_key=keys[who], **options)


def client_config(tmp_path: Path, endpoint: str, server: Path, secret: Path) -> Path:
    """A config file whose [producer] keys `ckptd status -c` uses, as a producer would."""
    f = tmp_path / f"client-{secret.stem}-{server.stem}.toml"
    f.write_text(f'[daemon]\nendpoint = "{endpoint}"\n[producer]\n'
                 f'curve_server_key = "{server}"\ncurve_secret_key = "{secret}"\n')
    return f


def test_tcp_without_keys_is_refused_at_start(make_daemon) -> None:
    d = make_daemon(start=False, endpoint=f"tcp://127.0.0.1:{free_port()}")
    d.start(wait=False)
    assert d.proc.wait(30) == 1
    lines = [line for line in d.log_text().splitlines() if "error" in line]
    assert len(lines) == 1, d.log_text()
    assert "ckptd keygen" in lines[0] and "curve_secret_key" in lines[0] and "curve_clients" in lines[0]
    assert not d.root.exists()  # refused before the daemon touched anything


def test_an_admitted_producer_saves_and_loads_bit_exactly(make_daemon, keys, tmp_path, capsys) -> None:
    d, endpoint = start_tcp(make_daemon, keys)
    state = {"w": torch.randn(300, 200), "h": torch.randn(64).to(torch.bfloat16), "i": torch.arange(10)}
    with producer(endpoint, keys) as p:
        info = p.save(state, 3, metadata={"loss": 0.5}).wait(30)
        assert p.latest() == info  # a query over the same encrypted connection
    loaded = ckptd.load("sec", root=d.root)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    # the CLI talks to it with the [producer] keys of its config file
    cfg = client_config(tmp_path, endpoint, keys["server"], keys["alice"])
    assert cli(["status", "-c", str(cfg), "--json"]) == 0
    assert f'"endpoint": "{endpoint}"' in capsys.readouterr().out
    assert cli(["latest", "sec", "--endpoint", endpoint, "-c", str(cfg), "--json"]) == 0
    assert '"step": 3' in capsys.readouterr().out


def test_a_strangers_key_cannot_connect(make_daemon, keys, tmp_path, capsys) -> None:
    d, endpoint = start_tcp(make_daemon, keys)
    stranger = producer(endpoint, keys, "mallory", timeout=20)
    began = time.monotonic()
    # The producer watches its handshake too: it says why, without waiting out its timeout.
    with pytest.raises(CheckpointError, match=r"refused this client's public key .*curve_clients"):
        stranger.save({"x": torch.ones(4)}, 1)
    assert time.monotonic() - began < 10  # not the 20 s timeout: the refusal wakes the sender thread
    stranger.close()
    # With the wrong daemon key, the handshake fails on the producer's side: it says so.
    with Producer(endpoint, "sec", staging_size="16MiB", timeout=20, curve_secret_key=keys["alice"],
                  curve_server_key=keys["alice"].with_suffix(".key")) as wrong:
        with pytest.raises(CheckpointError, match="curve_server_key"):
            wrong.save({"x": torch.ones(4)}, 1)
    # The CLI watches its handshake, so it can tell a refusal from silence, and says so at once.
    began = time.monotonic()
    assert cli(["status", "-c", str(client_config(tmp_path, endpoint, keys["server"], keys["mallory"])),
                "--timeout", "20"]) == 1
    assert time.monotonic() - began < 10
    err = capsys.readouterr().err
    assert "refused this client's public key" in err and "curve_clients" in err and err.count("\n") == 1
    # a producer that holds the wrong daemon public key does not get through either
    assert cli(["status", "-c", str(client_config(tmp_path, endpoint, keys["alice"].with_suffix(".key"),
                                                  keys["alice"])), "--timeout", "1"]) == 1
    assert "curve_server_key" in capsys.readouterr().err
    assert "refused a producer whose CurveZMQ public key" in d.log_text()

    # the daemon keeps serving the admitted producer, even with a broken file beside its key
    (keys["clients"] / "broken.key").write_text("curve\n")
    with producer(endpoint, keys) as p:
        p.save({"x": torch.ones(4)}, 1).wait(30)
        # Rotation: a key file removed is refused from its next connection on, without a
        # reload; the connection already open stays (docs/security.md).
        (keys["clients"] / "alice.key").unlink()
        p.save({"x": torch.zeros(4)}, 2).wait(30)
    with pytest.raises(CheckpointError):
        with producer(endpoint, keys, timeout=1.5) as again:
            again.save({"x": torch.ones(4)}, 3)
    assert d.proc.poll() is None
    assert f"ignoring a file of the allowlist: client public key file {keys['clients'] / 'broken.key'}" in d.log_text()
    assert [i.step for i in ckptd.list_checkpoints("sec", root=d.root)] == [1, 2]


def test_missing_or_bad_key_files_are_named(make_daemon, keys, tmp_path) -> None:
    # the daemon: one line naming the file, and it exits before touching the root
    missing = tmp_path / "nope.key_secret"
    d = make_daemon(start=False, endpoint=f"tcp://127.0.0.1:{free_port()}", curve_secret_key=str(missing),
                    curve_clients=str(keys["clients"]))
    d.start(wait=False)
    assert d.proc.wait(30) == 1
    assert f"[daemon] curve_secret_key file {missing} does not exist" in d.log_text()
    assert not d.root.exists()

    def daemon_error(**daemon_keys: object) -> str:
        f = tmp_path / "d.toml"
        f.write_text("[daemon]\nendpoint = \"tcp://127.0.0.1:7400\"\n"
                     + "".join(f'{k} = "{v}"\n' for k, v in daemon_keys.items()))
        with pytest.raises(ConfigError) as exc:
            curve.CurveServer.from_config(config.load(f))
        return str(exc.value)

    good = {"curve_secret_key": keys["server_secret"], "curve_clients": keys["clients"]}
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"\x00\xff not a key\n")
    short = tmp_path / "short.key"
    short.write_text('curve\n    public-key = "abcde"\n')
    assert f"{garbage} holds no CurveZMQ public key" in daemon_error(**{**good, "curve_secret_key": garbage})
    assert "40-character Z85" in daemon_error(**{**good, "curve_secret_key": short})
    assert "not at NAME.key" in daemon_error(**{**good, "curve_secret_key": keys["server"]})  # the public one
    loose = tmp_path / "loose.key_secret"
    loose.write_bytes(keys["server_secret"].read_bytes())
    loose.chmod(0o644)
    assert f"readable by every user on this host; `chmod 600 {loose}`" in daemon_error(
        **{**good, "curve_secret_key": loose})
    assert f"curve_clients folder {tmp_path / 'gone'} does not exist" in daemon_error(
        **{**good, "curve_clients": tmp_path / "gone"})
    (keys["clients"] / "bad.key").write_text("curve\n")
    assert f"{keys['clients'] / 'bad.key'} holds no CurveZMQ public key" in daemon_error(**good)

    # a producer: at construction, before it connects anywhere
    with pytest.raises(ConfigError, match=f"curve_server_key file {tmp_path / 'none.key'} does not exist"):
        Producer("tcp://127.0.0.1:7400", "sec", curve_server_key=tmp_path / "none.key",
                 curve_secret_key=keys["alice"])
    with pytest.raises(ConfigError, match="curve_server_key and curve_secret_key are not set"):
        Producer("tcp://127.0.0.1:7400", "sec")


def test_relative_key_paths_resolve_against_the_config_file(keys, tmp_path, monkeypatch) -> None:
    f = keys["server"].parent / "c.toml"
    f.write_text('[producer]\ncurve_server_key = "daemon.key"\ncurve_secret_key = "alice.key_secret"\n')
    monkeypatch.chdir(tmp_path)  # elsewhere: the file's folder counts, not the current one
    got = curve.client_keys("tcp://127.0.0.1:7400", config.load(f))
    assert got is not None and got.secret_file == keys["alice"]
    assert curve.client_keys("ipc:///tmp/x.sock", config.load(f)) is None  # keys are for tcp:// only


def test_tcp_endpoints_need_host_and_port() -> None:
    assert config.resolve_endpoint("tcp://10.0.0.5:7400", Path("/")) == "tcp://10.0.0.5:7400"
    for bad in ("tcp://10.0.0.5", "tcp://:7400", "tcp://10.0.0.5:0", "udp://x:1"):
        with pytest.raises(ValueError, match="endpoint"):
            config.resolve_endpoint(bad, Path("/"))


def test_keygen_writes_a_private_secret(tmp_path, capsys) -> None:
    assert cli(["keygen", "node7", "--dir", str(tmp_path / "k")]) == 0
    out = capsys.readouterr().out
    public, secret = tmp_path / "k" / "node7.key", tmp_path / "k" / "node7.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert "curve_secret_key" in out and "curve_clients" in out and "curve_server_key" in out
    pub, sec = curve.load_secret(secret, "secret")
    assert curve.load_public(public, "public") == pub and len(sec) == 40
    assert not [p for p in (tmp_path / "k").iterdir() if p.name.startswith(".")]  # no temp left
    # never replaces a key: that would lock every producer out
    assert cli(["keygen", "node7", "--dir", str(tmp_path / "k")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert secret.read_bytes() and curve.load_secret(secret, "secret") == (pub, sec)
    assert cli(["keygen", "../x", "--dir", str(tmp_path / "k")]) == 1


def test_ipc_socket_folder_and_mode(make_daemon, capsys) -> None:
    d = make_daemon(start=False)
    sock = d.sock_dir / "run" / "d.sock"  # a folder the daemon must create itself
    d.endpoint = f"ipc://{sock}"
    d.config.write_text(d.config.read_text().replace(f'"ipc://{d.sock_dir}/d.sock"', f'"{d.endpoint}"'))
    old = os.umask(0o002)  # the daemon inherits a lax umask, which must not loosen either mode
    try:
        d.start()  # ready: the socket is bound and its mode set (between the two it has the umask's)
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660 and stat.S_ISSOCK(sock.stat().st_mode)
        assert "curve" not in d.log_text().lower()  # ipc:// uses no keys
    finally:
        os.umask(old)
    with d.producer() as p:
        p.save({"x": torch.ones(3)}, 1).wait(30)
    assert cli(["status", "--endpoint", d.endpoint, "--json"]) == 0  # no keys asked for, no config read
    assert f'"endpoint": "{d.endpoint}"' in capsys.readouterr().out


# -- a run belongs to whoever created it ([daemon] shared_runs = false) ------------------------
def test_a_run_is_written_only_by_the_key_that_created_it(make_daemon, keys) -> None:
    bob_public, bob_secret = curve.keygen("bob", keys["clients"].parent)
    os.link(bob_public, keys["clients"] / "bob.key")  # admitted, like alice, but not her
    keys["bob"] = bob_secret
    d, endpoint = start_tcp(make_daemon, keys)
    with producer(endpoint, keys) as alice:
        alice.save({"w": torch.ones(3)}, 1).wait(30)
    with producer(endpoint, keys, "bob", retention={"keep_last": 1}) as bob:
        with pytest.raises(CheckpointError, match=r"run 'sec' belongs to the CurveZMQ key .*shared_runs = true"):
            bob.save({"w": torch.zeros(3)}, 2)
    with Producer(endpoint, "bobs", staging_size="16MiB", timeout=5, curve_server_key=keys["server"],
                  curve_secret_key=bob_secret) as bob:
        bob.save({"w": torch.zeros(3)}, 1).wait(30)  # his own run
    assert [i.step for i in ckptd.list_checkpoints("sec", root=d.root)] == [1]
    assert (d.root / "sec" / ".owner").read_text().startswith("key:")
    d.stop()
    shared = make_daemon(start=False, endpoint=endpoint, root=str(d.root), shared_runs=True,
                         curve_secret_key=str(keys["server_secret"]), curve_clients=str(keys["clients"]))
    shared.start(wait=False)
    deadline = time.monotonic() + 30
    while f"serving {endpoint}" not in shared.log_text():
        assert time.monotonic() < deadline, shared.log_text()
        time.sleep(0.05)
    with producer(endpoint, keys, "bob") as bob:  # configured to share: he may
        bob.save({"w": torch.zeros(3)}, 2).wait(30)
    assert [i.step for i in ckptd.list_checkpoints("sec", root=d.root)] == [1, 2]


AS_USER = """
import os, sys, torch
from ckptd import Producer, CheckpointError
# Imports first (the checkout may be unreadable to that user), then become the user.
uid = int(sys.argv[4])
os.setgroups([0])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
with Producer(sys.argv[1], sys.argv[2], staging_size="4MiB", timeout=5) as p:
    try:
        p.save({"w": torch.ones(2)}, int(sys.argv[3])).wait(30)
        print("saved")
    except CheckpointError as exc:
        print("refused:", exc)
"""


def test_over_ipc_a_run_belongs_to_the_unix_user_that_created_it(daemon) -> None:
    # Two unprivileged users who may both reach the socket (group 0, as a shared node's
    # `ckptd` group would): the kernel tells the daemon which is which.
    os.chmod(daemon.sock_dir, 0o750)

    def as_user(uid: int, run: str, step: int) -> str:
        out = subprocess.run([sys.executable, "-c", AS_USER, daemon.endpoint, run, str(step), str(uid)],
                             capture_output=True, text=True, timeout=120, cwd="/")
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert as_user(65534, "theirs", 1) == "saved"
    refused = as_user(65533, "theirs", 2)
    assert refused.startswith("refused:") and "belongs to Unix user 65534" in refused, refused
    assert "this producer is Unix user 65533" in refused
    assert as_user(65533, "mine", 1) == "saved"
    with daemon.producer("theirs", staging_size="4MiB") as p:  # root may write any run
        p.save({"w": torch.ones(2)}, 3).wait(30)
    assert [i.step for i in ckptd.list_checkpoints("theirs", root=daemon.root)] == [1, 3]
