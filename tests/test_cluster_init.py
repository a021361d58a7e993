"""``ckptd keygen NAME DIR`` and ``ckptd cluster init/check``: N nodes' keys and configs from
one list of hosts, started as real daemons on 127.0.0.1 that replicate to each other."""

from __future__ import annotations

import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from ckptd.cli import main as cli
from ckptd.config import load as load_config
from conftest import Daemon, free_port
from test_peer import _held, _save, _wait


def test_keygen_takes_the_folder_as_the_docs_write_it(tmp_path, capsys) -> None:
    assert cli(["keygen", "10.0.0.1-7701", str(tmp_path / "curve")]) == 0
    assert (tmp_path / "curve/10.0.0.1-7701.key").is_file()
    assert stat.S_IMODE((tmp_path / "curve/10.0.0.1-7701.key_secret").stat().st_mode) == 0o600
    assert cli(["keygen", "b", str(tmp_path / "same"), "--dir", str(tmp_path / "same")]) == 0
    capsys.readouterr()
    assert cli(["keygen", "c", str(tmp_path / "one"), "--dir", str(tmp_path / "two")]) == 1
    err = capsys.readouterr().err
    assert "one" in err and "two" in err and not (tmp_path / "one").exists() and not (tmp_path / "two").exists()


@pytest.fixture
def out() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="ckc", dir="/tmp"))  # short: a socket path holds 107 bytes
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_init_writes_what_check_accepts_and_check_names_each_fault(out, capsys) -> None:
    hosts = "10.0.0.1,10.0.0.2,10.0.0.3"
    assert cli(["cluster", "init", "--hosts", hosts, "--port", "7701", "--out", str(out),
                "--bucket", "s3://ckpt/job"]) == 0
    for i in (1, 2, 3):
        cfg = load_config(out / f"10.0.0.{i}/config.toml")
        assert cfg.peer.listen == f"tcp://10.0.0.{i}:7701"
        assert set(cfg.peer.peers) == {f"tcp://10.0.0.{j}:7701" for j in (1, 2, 3) if j != i}
        assert cfg.resolve_path(cfg.daemon.curve_secret_key).is_file() and cfg.remote.url == "s3://ckpt/job"
        assert (out / f"public/10.0.0.{i}-7701.key").is_file()
    assert cli(["cluster", "check", "--hosts", hosts, "--out", str(out)]) == 0
    assert capsys.readouterr().out.count(": ok") == 3
    assert cli(["cluster", "init", "--hosts", hosts, "--out", str(out)]) == 1  # nothing is replaced
    shutil.copyfile(out / "public/10.0.0.1-7701.key", out / "10.0.0.2/curve/peers/10.0.0.3-7701.key")
    capsys.readouterr()
    assert cli(["cluster", "check", "--hosts", hosts + ",10.0.0.4", "--out", str(out)]) == 1
    report = capsys.readouterr().out
    node2 = report.split("tcp://10.0.0.2:7701:")[1].split("tcp://10.0.0.3:7701:")[0]
    assert "10.0.0.3-7701.key is not the public half of tcp://10.0.0.3:7701's secret key" in node2
    assert "[peer] peers lacks tcp://10.0.0.4:7701" in node2
    assert "10.0.0.4/config.toml does not exist" in report.split("tcp://10.0.0.4:7701:")[1]


def test_two_generated_nodes_replicate_to_each_other_with_curve(out) -> None:
    ports = [free_port(), free_port()]
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    assert cli(["cluster", "init", "--hosts", hosts, "--out", str(out), "--endpoint", "ipc://d.sock",
                "--root", "ckpt"]) == 0
    nodes = []
    try:
        for port in ports:
            folder = out / f"127.0.0.1-{port}"
            generated = (folder / "config.toml").read_text()
            assert load_config(folder / "config.toml").daemon.curve_secret_key  # CurveZMQ, not plaintext
            node = Daemon(folder, endpoint=f"ipc://{folder}/d.sock", root="ckpt")
            node.config.write_text(generated)  # the daemon runs on exactly what `cluster init` wrote
            nodes.append(node.start())
        a, b = nodes
        _save(a, range(1, 3), rank=0, world=2)
        _save(b, range(1, 3), rank=1, world=2)
        _wait(lambda: _held(b).get((2, 0)) == "memory", "A's newest share held by B")
        _wait(lambda: _held(a).get((2, 1)) == "memory", "B's newest share held by A")
        assert "plaintext" not in a.log.read_text() + b.log.read_text()
    finally:
        for n in nodes:
            n.cleanup()
