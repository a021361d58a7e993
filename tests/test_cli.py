"""The ckptd command line against a real checkpoint root."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptd
from ckptd import CheckpointCorrupt
from conftest import cli


def real_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real command, in a process of its own: what a terminal shows (Python's own
    warnings included), and ``serve``. Other tests here call ``ckptd.cli.main`` in this
    process (conftest.cli), the same code without ~2 s of imports each."""
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


@pytest.fixture
def two_steps(daemon):
    with daemon.producer() as p:
        p.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 1}, 100, metadata={"loss": 0.5}).wait(30)
        p.save({"model": {"w": torch.ones(4)}, "epoch": 2}, 200).wait(30)
    return daemon


def test_latest_and_list(two_steps) -> None:
    root = str(two_steps.root)
    r = cli("latest", "t", "--root", root, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["step"] == 200 and info["ntensors"] == 1 and info["nbytes"] == 16 and info["format"] == "chunk"
    assert set(info) == {"run", "step", "path", "time", "nbytes", "ntensors", "format", "metadata",
                         "world_size", "rank", "tiers", "diverged", "refused"}
    assert info["rank"] is None and info["world_size"] == 1  # the whole step, not one rank's share
    assert info["diverged"] is None and info["refused"] is False  # one rank: nothing replicated to compare
    assert info["tiers"] == ["local"]
    r = cli("list", "t", "--root", root, "--json")
    assert [i["step"] for i in json.loads(r.stdout)] == [100, 200]
    assert json.loads(r.stdout)[0]["metadata"] == {"loss": 0.5}
    r = cli("list", "t", "--root", root)
    assert r.returncode == 0 and "STEP" in r.stdout and "TENSORS" in r.stdout
    assert [line.split()[0] for line in r.stdout.splitlines()[1:]] == ["100", "200"]
    # the root can come from the environment instead
    r = cli("latest", "t", env={"CKPTD_ROOT": root})
    assert r.returncode == 0 and "step 200" in r.stdout


def test_list_from_the_daemons_index_is_the_list_read_from_the_root(two_steps) -> None:
    """`ckptd list RUN --endpoint EP` asks the daemon's index (no manifest read): the same
    output, text and JSON, pins included, as reading every manifest under the root."""
    root, endpoint = str(two_steps.root), two_steps.endpoint
    with two_steps.producer("u") as p:  # another run, and a step with no metadata
        p.save({"w": torch.ones(2)}, 7).wait(30)
    assert cli("pin", "t", "100", "--root", root).returncode == 0
    for run in ("t", "u"):
        for json_flag in ([], ["--json"]):
            from_root = cli("list", run, "--root", root, *json_flag)
            from_daemon = cli("list", run, "--endpoint", endpoint, *json_flag)
            assert from_daemon.returncode == 0, from_daemon.stderr
            assert from_daemon.stdout == from_root.stdout and from_daemon.stderr == from_root.stderr
    listed = json.loads(cli("list", "t", "--endpoint", endpoint, "--json").stdout)
    assert [(i["step"], i["pinned"]) for i in listed] == [(100, True), (200, False)]
    none = cli("list", "nope", "--endpoint", endpoint)  # a run without checkpoints: said the same way
    assert none.returncode == 0 and none.stdout == "" and none.stderr == cli("list", "nope", "--root", root).stderr
    bad = cli("list", "../x", "--endpoint", endpoint)
    assert bad.returncode == 1 and "../x" in bad.stderr and bad.stdout == ""
    no_run = cli("list", "--endpoint", endpoint)
    assert no_run.returncode == 1 and "--endpoint lists one run" in no_run.stderr


def test_plain_list_asks_the_daemon_serving_that_root(two_steps, monkeypatch, tmp_path) -> None:
    """`ckptd list RUN` without --endpoint takes the listing from this host's daemon
    (CKPTD_ENDPOINT, else the config's) when that daemon serves the root being read, and
    reads the root itself otherwise: the same output either way."""
    root, endpoint = str(two_steps.root), two_steps.endpoint
    from_root = cli("list", "t", "--root", root, "--json")
    from ckptd import reader

    def no_reading(*args, **kwargs):
        raise AssertionError("read every manifest though the daemon serving this root could answer")

    with monkeypatch.context() as m:
        m.setattr(reader, "list_checkpoints", no_reading)
        asked = cli("list", "t", "--root", root, "--json", env={"CKPTD_ENDPOINT": endpoint})
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout == from_root.stdout and [i["step"] for i in json.loads(asked.stdout)] == [100, 200]
    # a daemon that serves another root is not asked about this one: its listing would be wrong
    other = tmp_path / "other"
    (other / "t").mkdir(parents=True)
    r = cli("list", "t", "--root", str(other), env={"CKPTD_ENDPOINT": endpoint})
    assert r.returncode == 0 and r.stdout == "" and str(other) in r.stderr
    # and a daemon that is gone: the root is read, at once
    two_steps.kill()
    r = cli("list", "t", "--root", root, "--json", env={"CKPTD_ENDPOINT": endpoint})
    assert r.returncode == 0 and r.stdout == from_root.stdout


def test_show(two_steps) -> None:
    r = cli("show", "t", "100", "--root", str(two_steps.root))
    assert r.returncode == 0 and "model.w  float32[2x3]" in r.stdout
    r = cli("show", "t", "--root", str(two_steps.root), "--json")
    assert json.loads(r.stdout)["ranks"][0]["tensors"]["model.w"]["shape"] == [4]


def test_failures_are_one_line_and_non_zero(two_steps) -> None:
    root = str(two_steps.root)
    for args in (["latest", "nope"], ["show", "t", "150"], ["verify", "nope"], ["latest", "../x"]):
        r = real_cli(*args, "--root", root)
        assert r.returncode != 0, args
        assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr, (args, r.stderr)
    r = real_cli("show", "t", "150", "--root", root)
    assert "complete steps: 100, 200" in r.stderr


def test_verify_names_damage(two_steps) -> None:
    root = two_steps.root
    assert cli("verify", "t", "--root", str(root)).returncode == 0
    step = root / "t" / "step-000000000100"
    manifest = json.loads((step / "manifest-r00000.json").read_text())
    rec = manifest["tensors"]["model.w"]
    chunk = step / rec["file"]
    data = bytearray(chunk.read_bytes())
    data[rec["offset"] + 5] ^= 0x40  # one flipped bit in the tensor's data
    chunk.write_bytes(bytes(data))

    r = cli("verify", "t", "100", "--root", str(root))
    assert r.returncode == 1 and "model.w" in r.stderr and rec["file"] in r.stderr
    r = cli("verify", "t", "100", "--root", str(root), "--json")
    assert json.loads(r.stdout)["ok"] is False
    with pytest.raises(CheckpointCorrupt, match="model.w"):
        ckptd.load("t", 100, root=root, verify=True)
    ckptd.load("t", 100, root=root)  # without verify, the flipped bit goes unnoticed

    chunk.write_bytes(bytes(data[: rec["offset"] + 3]))  # truncated
    with pytest.raises(CheckpointCorrupt, match="truncated"):
        ckptd.load("t", 100, root=root)
    chunk.unlink()
    r = cli("verify", "t", "100", "--root", str(root))
    assert r.returncode == 1 and "cannot open" in r.stderr


def test_help_and_usage_errors() -> None:
    for cmd in ("serve", "latest", "list", "show", "verify"):
        r = cli(cmd, "--help")
        assert r.returncode == 0 and "usage:" in r.stdout
    assert cli("latest").returncode == 2  # argparse: RUN is required


def test_serve_rejects_a_bad_config(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\nchunk_size = "lots"\n')
    r = real_cli("serve", "-c", str(bad))
    assert r.returncode == 1 and "chunk_size" in r.stderr and str(bad) in r.stderr


def test_second_daemon_on_the_same_root_refuses(daemon) -> None:
    r = real_cli("serve", "-c", str(daemon.config))
    assert r.returncode == 1 and "already serving" in r.stderr
    assert daemon.proc.poll() is None


def test_sigterm_exits_zero(daemon) -> None:
    with daemon.producer() as p:
        p.save({"w": torch.ones(3)}, 1).wait(30)
    assert daemon.stop() == 0
    assert not (daemon.sock_dir / "d.sock").exists()
