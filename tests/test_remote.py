"""The remote tier against a real S3 server (SeaweedFS on 127.0.0.1): uploads after each
commit, the manifest last; reading back on a node with an empty disk; the CLI."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

import ckptd
from ckptd.remote import catalog
from ckptd.tiers.bucket import fetch_share
from ckptd.remote.store import RemoteAuthError, Store
from conftest import cli as in_process_cli  # ckptd.cli.main in this process

URL = "s3://ckptd/ckpts"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(2048, 1024, generator=g), "b": torch.arange(7, dtype=torch.bfloat16)},
            "step": step}


def _remote_daemon(make_daemon, monkeypatch, url: str = URL, retention: dict | None = None, **keys):
    tables = {"remote": {"url": url, "part_bytes": "5MiB"}}
    if retention:
        tables["remote.retention"] = retention
    d = make_daemon(tables=tables, **keys)
    monkeypatch.setenv("CKPTD_CONFIG", str(d.config))  # the producer's wait_complete reads [remote]
    return d


def test_upload_then_resume_on_an_empty_disk(s3, make_daemon, monkeypatch, tmp_path) -> None:
    d = _remote_daemon(make_daemon, monkeypatch, chunk_size="1MiB")
    with d.producer("r") as p:
        for step in (1, 2):
            p.save(_state(step), step).wait(30)
            info = p.wait_complete(step, timeout=60)
            assert info.step == step and info.tiers == ("remote",)
            assert info.path == f"{URL}/r/step-{step:012d}"
    store = Store(URL)
    objects = catalog.run_objects(store, "r")
    assert sorted(objects) == [1, 2]
    assert len([n for n in objects[2] if n.endswith(".safetensors")]) > 1  # several chunk files, all there
    empty = tmp_path / "fresh-node"
    empty.mkdir()
    assert ckptd.latest("r", root=empty, remote="") is None  # the local root alone has nothing
    info = ckptd.latest("r", root=empty, remote=URL)
    assert (info.step, info.tiers) == (2, ("remote",))
    out = ckptd.load("r", root=empty, remote=URL)
    want = _state(2)
    assert out["step"] == 2 and torch.equal(out["model"]["w"], want["model"]["w"])
    assert torch.equal(out["model"]["b"], want["model"]["b"]) and out["model"]["b"].dtype == torch.bfloat16
    only = ckptd.load("r", 1, root=empty, remote=URL, names=["model.b"])
    assert list(only) == ["model.b"]
    assert not any(empty.iterdir())  # read into memory: nothing written on the fresh node
    # files instead (for readers that want them): one rank's share, manifest last, checked
    fetch_share(store, "r", 2, 0, empty)
    assert torch.equal(ckptd.load("r", root=empty, remote="")["model"]["w"], want["model"]["w"])
    assert ckptd.latest("r", root=empty, remote=URL).tiers == ("local", "remote")
    # on the node that wrote it both tiers hold both steps, and the local copy is read
    both = ckptd.list_checkpoints("r", root=d.root, remote=URL)
    assert [(i.step, i.tiers) for i in both] == [(1, ("local", "remote")), (2, ("local", "remote"))]
    assert both[1].path == str(d.root / "r" / "step-000000000002")
    status = in_process_cli("status", "-c", str(d.config), "--json")
    remote = json.loads(status.stdout)["remote"]
    assert remote["shares_uploaded"] == 2 and remote["pending_shares"] == 0 and remote["failures"] == 0
    assert remote["bytes_uploaded"] > 2 * 2048 * 1024 * 4  # 8 MiB tensors: multipart uploads
    text = in_process_cli("status", "-c", str(d.config)).stdout
    assert f"remote:       {URL}: 2 share(s) uploaded" in text and "0 pending" in text


def test_cli_reads_the_remote_tier(s3, make_daemon, monkeypatch, tmp_path) -> None:
    d = _remote_daemon(make_daemon, monkeypatch)
    with d.producer("c") as p:
        p.save(_state(5), 5).wait(30)
        p.wait_complete(5, timeout=60)
    monkeypatch.delenv("CKPTD_CONFIG")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return in_process_cli(*args, "--root", str(tmp_path / "none"))

    got = cli("latest", "c", "--remote", URL, "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["step"] == 5 and json.loads(got.stdout)["tiers"] == ["remote"]
    listed = cli("list", "c", "--remote", URL, "--json")
    assert [i["step"] for i in json.loads(listed.stdout)] == [5]
    shown = cli("show", "c", "--remote", URL)
    assert "model.w" in shown.stdout, shown.stderr
    ok = cli("verify", "c", "--remote", URL)
    assert ok.returncode == 0 and "ok:" in ok.stdout, ok.stderr
    # a damaged object in the bucket: verify names it and fails
    store = Store(URL)
    key = next(k for k in store.list("c/") if k.endswith(".safetensors"))
    data = bytearray(store.get(key, 1 << 30))
    data[-1] ^= 0xFF
    store.put_bytes(key, bytes(data))
    bad = cli("verify", "c", "--remote", URL)
    assert bad.returncode == 1 and "does not match its checksum" in bad.stderr


def test_wrong_credentials_are_a_clear_error(s3, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(RemoteAuthError, match="refused the credentials.*AWS_ACCESS_KEY_ID"):
        ckptd.latest("x", root=tmp_path, remote=URL)


def test_load_into_on_an_empty_disk_fetches_only_the_shares_it_reads(s3, make_daemon, monkeypatch, tmp_path) -> None:
    """A sharded step complete only in the bucket: load_into fetches the shares whose
    pieces overlap its targets, and no other."""
    d = _remote_daemon(make_daemon, monkeypatch)
    whole = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    own = {0: ("a", torch.full((3,), 7.0)), 1: ("b", torch.full((5,), 9.0))}  # a tensor only each rank has
    producers = [d.producer("sh", rank=r, world_size=2) for r in (0, 1)]
    try:
        for r, p in enumerate(producers):  # rows 0-1 by rank 0, rows 2-3 by rank 1
            p.emit("w", whole[2 * r:2 * r + 2].clone(), step=3, global_shape=[4, 6], offset=[2 * r, 0])
            p.emit(*own[r], step=3)
        for h in [p.commit(3) for p in producers]:
            h.wait(30)
        producers[0].wait_complete(3, timeout=60)
    finally:
        for p in producers:
            p.close()
    fresh = tmp_path / "fresh-node"
    fresh.mkdir()
    target = torch.zeros(4, 6)
    info = ckptd.load_into({"w": target}, "sh", root=fresh, remote=URL)
    assert info.step == 3 and torch.equal(target, whole)  # pieces of both ranks
    manifests = sorted(p.name for p in (fresh / "sh" / "step-000000000003").glob("manifest-r*.json"))
    assert manifests == ["manifest-r00000.json", "manifest-r00001.json"]
    other = tmp_path / "another-node"
    other.mkdir()
    b = torch.zeros(5)
    ckptd.load_into({"b": b}, "sh", 3, root=other, remote=URL)  # only rank 1 wrote it
    assert torch.equal(b, own[1][1])
    assert sorted(p.name for p in (other / "sh" / "step-000000000003").iterdir()
                  if p.name.startswith("manifest")) == ["manifest-r00001.json"]


def test_a_frozen_base_is_copied_inside_the_bucket_not_uploaded_again(s3, make_daemon, monkeypatch,
                                                                      tmp_path) -> None:
    """Steps that hard-link the base's files (daemon.reuse) upload only what changed;
    the bucket still holds each step whole, which an empty disk loads bit-exact."""
    d = _remote_daemon(make_daemon, monkeypatch, URL + "-frozen", chunk_size="1MiB", metrics="127.0.0.1:0")
    g = torch.Generator().manual_seed(3)
    base = {f"layer{i}": torch.randn(2**18, generator=g) for i in range(4)}  # 4 MiB
    states = {}
    with d.producer("f") as p:
        for step in (1, 2, 3):
            states[step] = {"base": base, "lora": torch.full((256,), float(step)), "step": step}
            p.save(states[step], step, frozen=["base.*"]).wait(30)
            p.wait_complete(step, timeout=60)
    remote = json.loads(in_process_cli("status", "-c", str(d.config), "--json").stdout)["remote"]
    base_bytes = sum(t.nbytes for t in base.values())
    assert remote["shares_uploaded"] == 3 and remote["failures"] == 0
    assert remote["bytes_copied"] >= 2 * base_bytes  # steps 2 and 3: copied in the bucket
    assert remote["bytes_uploaded"] < 1.5 * base_bytes  # the base once, then the adapters
    from test_metrics import scrape, status

    assert scrape(status(d)["metrics"])[("ckptd_remote_copied_bytes_total", ())] == remote["bytes_copied"]
    empty = tmp_path / "fresh-node"
    empty.mkdir()
    for step in (1, 2, 3):
        out = ckptd.load("f", step, root=empty, remote=URL + "-frozen", verify=True)
        assert all(torch.equal(out["base"][k], v) for k, v in base.items())
        assert torch.equal(out["lora"], states[step]["lora"]) and out["step"] == step


def test_wait_complete_takes_a_tier_by_its_name(tmp_path, monkeypatch) -> None:
    """``tier=`` is resolved inside ckptd.tiers: any tier's name; an unknown one is a
    ValueError listing them, one the config lacks a CheckpointError naming its table."""
    from ckptd.completion import wait_complete
    from ckptd.errors import CheckpointError

    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("CKPTD_CONFIG", str(tmp_path / "config.toml"))  # no [remote], no [peer]
    with pytest.raises(ValueError, match="a tier is one of 'local', 'peer', 'remote', or None"):
        wait_complete("r", 1, root=tmp_path, tier="bucket")
    for name, table in (("remote", "remote"), ("peer", "peer")):
        with pytest.raises(CheckpointError, match=rf"tier='{name}' needs a \[{table}\] table in the config"):
            wait_complete("r", 1, root=tmp_path, tier=name, timeout=0)
    (tmp_path / "r" / "step-000000000001").mkdir(parents=True)
    for name in ("local", None):  # the root, named or as the last durable tier without a bucket
        with pytest.raises(CheckpointError, match=rf"not complete in {tmp_path} after 0 s: the manifests of "
                                                  r"rank\(s\) none are there"):
            wait_complete("r", 1, root=tmp_path, tier=name, timeout=0)
