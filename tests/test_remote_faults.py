"""The remote tier under faults, with a real S3 server (SeaweedFS) and a real daemon:
the server killed mid-upload, the daemon killed mid-upload; retention in both tiers."""

from __future__ import annotations

import json
import re
import time

import torch

import ckptd
from ckptd import layout
from ckptd.remote import catalog
from ckptd.remote.store import Store
from conftest import cli  # ckptd.cli.main in this process

URL = "s3://ckptd/faults"
NFILES = 16
FILE_BYTES = 4 * 2**20


def _daemon(make_daemon, monkeypatch, retention: dict | None = None, remote_retention: dict | None = None,
            start: bool = True):
    tables: dict = {"remote": {"url": URL, "part_bytes": "5MiB", "max_retry_s": 1}}
    if remote_retention:
        tables["remote.retention"] = remote_retention
    if retention:
        tables["retention"] = retention
    d = make_daemon(start=start, tables=tables, chunk_size="4MiB")
    monkeypatch.setenv("CKPTD_CONFIG", str(d.config))
    return d


def _state(step: int) -> dict:
    """NFILES tensors of FILE_BYTES: as many chunk files, uploaded one after another."""
    return {f"t{i}": torch.full((FILE_BYTES // 4,), float(step * 100 + i)) for i in range(NFILES)}


def _status(d) -> dict:
    r = cli("status", "-c", str(d.config), "--json")  # ckptd.cli.main in this process
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["remote"]


def _watch_until_partly_uploaded(store: Store, run: str, step: int, timeout: float = 60) -> dict[str, int]:
    """Poll the bucket while the step uploads; return its objects once some, but at most
    half, of its data files are there. Meanwhile the manifest must never be there
    before every data file is (the remote copy is never listed before it is complete)."""
    prefix = catalog.step_prefix(run, step)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        objects = {k[len(prefix):]: v for k, v in store.list(prefix).items()}
        data = [n for n in objects if n.endswith(".safetensors")]
        if layout.manifest_name(0) in objects:
            assert len(data) == NFILES, objects
            raise AssertionError("the upload finished before it could be interrupted")
        assert catalog.latest(store, run) is None
        if 0 < len(data) <= NFILES // 2:
            return objects
        time.sleep(0.01)
    raise AssertionError("the upload never started")


def _check_complete(store: Store, run: str, step: int, tmp_path) -> None:
    info = ckptd.latest(run, root=tmp_path / "empty", remote=URL)
    assert info is not None and info.step == step
    out = ckptd.load(run, root=tmp_path / "empty", remote=URL)
    want = _state(step)
    assert all(torch.equal(out[k], want[k]) for k in want)


def test_server_killed_mid_upload_then_back(s3, make_daemon, monkeypatch, tmp_path) -> None:
    d = _daemon(make_daemon, monkeypatch)
    store = Store(URL)
    with d.producer("s") as p:
        p.save(_state(1), 1).wait(60)
        before = _watch_until_partly_uploaded(store, "s", 1)
        s3.proc.kill()  # the server dies mid-upload
        s3.proc.wait()
        # the daemon keeps committing locally while the bucket is away
        p.save(_state(2), 2).wait(60)
        deadline = time.monotonic() + 30
        while _status(d)["failures"] == 0:
            assert time.monotonic() < deadline, "the uploader never noticed the server was gone"
            time.sleep(0.2)
        figures = _status(d)
        assert figures["pending_shares"] == 2 and figures["lag_seconds"] > 0
        s3.start()  # same ports, same data folder
        assert p.wait_complete(1, timeout=120).step == 1
        assert p.wait_complete(2, timeout=120).step == 2
    _check_complete(store, "s", 2, tmp_path)
    assert ckptd.load("s", 1, root=tmp_path / "empty", remote=URL)["t3"][0].item() == 103.0
    figures = _status(d)
    present = sum(v for n, v in before.items() if n.endswith(".safetensors"))
    total = 2 * NFILES * FILE_BYTES
    # what was in the bucket before the crash was not sent again; at most the files in
    # flight when the server died were
    assert figures["bytes_skipped"] >= present
    assert figures["bytes_uploaded"] + figures["bytes_skipped"] <= total + 4 * 2 * FILE_BYTES
    assert figures["pending_shares"] == 0 and figures["shares_uploaded"] == 2
    assert "upload to s3://ckptd/faults failed" in d.log_text()


def test_daemon_killed_mid_upload_resumes_after_restart(s3, make_daemon, monkeypatch, tmp_path) -> None:
    d = _daemon(make_daemon, monkeypatch)
    store = Store(URL)
    p = d.producer("k")
    try:
        p.save(_state(1), 1).wait(60)
        before = _watch_until_partly_uploaded(store, "k", 1)
        d.kill()  # kill -9 mid-upload: the queue was never stored anywhere
    finally:
        p.close()
    assert catalog.latest(store, "k") is None
    d.start()
    deadline = time.monotonic() + 120
    while catalog.latest(store, "k") is None:
        assert time.monotonic() < deadline, d.log_text()[-3000:]
        time.sleep(0.2)
    _check_complete(store, "k", 1, tmp_path)
    figures = _status(d)
    present = sum(v for n, v in before.items() if n.endswith(".safetensors"))
    assert figures["shares_uploaded"] == 1 and figures["bytes_skipped"] >= present > 0
    assert figures["bytes_uploaded"] + figures["bytes_skipped"] == NFILES * FILE_BYTES + _small_files(store, "k", 1)
    assert "uploads to resume: 1 share(s)" in d.log_text()


def _small_files(store: Store, run: str, step: int) -> int:
    """Bytes of the step's data objects beyond the tensors' (safetensors headers)."""
    prefix = catalog.step_prefix(run, step)
    return sum(v for k, v in store.list(prefix).items() if k.endswith(".safetensors")) - NFILES * FILE_BYTES


def test_remote_retention_removes_only_what_it_may(s3, make_daemon, monkeypatch, tmp_path) -> None:
    store = Store(URL)
    # another node's upload of step 0, still under way: data, no manifest yet
    store.put_bytes(catalog.key("r", 0, "r00001-000000.safetensors"), b"x" * 100)
    d = _daemon(make_daemon, monkeypatch, remote_retention={"keep_last": 2})
    small = {"w": torch.ones(1000)}
    with d.producer("r") as p:
        for step in (1, 2, 3, 4):
            p.save({**small, "step": step}, step).wait(30)
            p.wait_complete(step, timeout=60)
    deadline = time.monotonic() + 30
    while [i.step for i in catalog.list_checkpoints(store, "r")] != [3, 4]:
        assert time.monotonic() < deadline, [i.step for i in catalog.list_checkpoints(store, "r")]
        time.sleep(0.2)
    assert sorted(catalog.run_objects(store, "r")) == [0, 3, 4]  # removed whole; the step under way kept
    assert [i.step for i in ckptd.list_checkpoints("r", root=d.root, remote="")] == [1, 2, 3, 4]  # local: its own set
    assert "retention (remote): removed run=r step=1" in d.log_text()


def test_local_retention_keeps_copies_not_yet_uploaded(s3, make_daemon, monkeypatch, tmp_path) -> None:
    s3.stop()  # the bucket is unreachable while the checkpoints are made
    d = _daemon(make_daemon, monkeypatch, retention={"keep_last": 1})
    with d.producer("l") as p:
        for step in (1, 2, 3):
            p.save({"w": torch.full((1000,), float(step))}, step).wait(30)
    local = lambda: [i.step for i in ckptd.list_checkpoints("l", root=d.root, remote="")]  # noqa: E731
    assert local() == [1, 2, 3]  # keep_last = 1, but none is uploaded yet
    assert _status(d)["pending_shares"] == 3
    s3.start()
    store = Store(URL)
    deadline = time.monotonic() + 60
    while local() != [3]:  # once uploaded, local retention applies again
        assert time.monotonic() < deadline, (local(), d.log_text()[-2000:])
        time.sleep(0.2)
    assert [i.step for i in catalog.list_checkpoints(store, "l")] == [1, 2, 3]


def test_a_step_local_retention_removes_is_no_longer_owed_to_the_bucket(s3, make_daemon, monkeypatch) -> None:
    """With a rule in [remote.retention], a bucket out of reach fills no disk: local retention
    removes what it does not keep, which is then not uploaded, but for the steps the bucket's
    keep_every picks; once the bucket is back, the newest step goes first."""
    d = _daemon(make_daemon, monkeypatch, retention={"keep_last": 1}, remote_retention={"keep_last": 5, "keep_every": 2})
    store = Store(URL)
    local = lambda: [i.step for i in ckptd.list_checkpoints("o", root=d.root, remote="")]  # noqa: E731
    with d.producer("o") as p:
        p.save({"w": torch.full((1000,), 1.0)}, 1).wait(30)
        deadline = time.monotonic() + 30
        while [i.step for i in catalog.list_checkpoints(store, "o")] != [1] or _status(d)["pending_shares"]:
            assert time.monotonic() < deadline, d.log_text()[-2000:]
            time.sleep(0.1)
        s3.stop()
        for step in (2, 3, 4, 5):
            p.save({"w": torch.full((1000,), float(step))}, step).wait(30)
        deadline = time.monotonic() + 30
        while local() != [2, 4, 5]:  # keep_last = 1; 2 and 4 owed to the bucket's keep_every
            assert time.monotonic() < deadline, (local(), d.log_text()[-2000:])
            time.sleep(0.1)
        assert _status(d)["pending_shares"] == 3
        assert "run=o step=3 rank=0: removed by local retention before its upload; no longer owed" in d.log_text()
        s3.start()
        deadline = time.monotonic() + 60
        while local() != [5]:  # once uploaded, local retention removes the owed steps too
            assert time.monotonic() < deadline, (local(), d.log_text()[-2000:])
            time.sleep(0.2)
    assert [i.step for i in catalog.list_checkpoints(Store(URL), "o")] == [1, 2, 4, 5]
    sent = [int(s) for s in re.findall(r"uploaded run=o step=(\d+)", d.log_text())]
    assert sent == [1, 5, 4, 2], sent
