"""Every file a manifest vouches for, and every file ckptd installs, reaches the disk
before it is renamed into place (docs/reliability.md): fsync the file, rename, fsync the
folder. A kill -9 cannot tell a missing fsync from a present one (the page cache
survives it), so these tests watch the real system calls as they happen."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckptd import install
from ckptd.errors import CheckpointCorrupt
from ckptd.remote import catalog
from ckptd.tiers.bucket import fetch_share
from ckptd.remote.store import Store


class Syscalls:
    """Records, in order, the inodes ``os.fsync`` flushed and the renames ``os.replace``
    made, while calling the real functions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, object]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            st = os.fstat(fd)
            real_fsync(fd)
            self.events.append(("fsync", st.st_ino))

        def replace(src, dst, **kw) -> None:  # type: ignore[no-untyped-def]
            real_replace(src, dst, **kw)
            self.events.append(("replace", Path(os.fspath(dst))))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def index(self, event: tuple[str, object]) -> int:
        assert event in self.events, f"{event} never happened; saw {self.events}"
        return self.events.index(event)

    def assert_durable_before(self, path: Path, later: Path) -> None:
        """``path`` was fsynced, renamed into place and its folder fsynced, all before
        ``later`` was renamed into place."""
        ino = path.stat().st_ino
        flushed = self.index(("fsync", ino))
        renamed = self.index(("replace", path))
        folder = next((i for i, e in enumerate(self.events)
                       if i > renamed and e == ("fsync", path.parent.stat().st_ino)), None)
        assert flushed < renamed, f"{path.name} was renamed into place before it was fsynced"
        assert folder is not None, f"the folder of {path.name} was never fsynced after the rename"
        assert folder < self.index(("replace", later)), f"{later.name} came before {path.name} was durable"


def test_files_fetched_from_the_remote_tier_are_durable_before_their_manifest(
        s3, make_daemon, monkeypatch, tmp_path) -> None:
    url = "s3://ckptd/durable"
    d = make_daemon(tables={"remote": {"url": url}}, chunk_size="1MiB")
    monkeypatch.setenv("CKPTD_CONFIG", str(d.config))
    state = {"w": torch.randn(512, 1024), "b": torch.arange(9, dtype=torch.bfloat16)}
    with d.producer("f") as p:
        p.save(state, 3).wait(30)
        p.wait_complete(3, timeout=60)
    fresh = tmp_path / "fresh-node"
    fresh.mkdir()
    calls = Syscalls(monkeypatch)
    manifest = fetch_share(Store(url), "f", 3, 0, fresh)
    step_dir = fresh / "f" / "step-000000000003"
    files = sorted({rec.file for rec in manifest.tensors.values()})
    assert len(files) >= 2  # a 2 MiB tensor in 1 MiB chunks: several files to vouch for
    for name in files:
        calls.assert_durable_before(step_dir / name, step_dir / "manifest-r00000.json")
    assert not [p.name for p in step_dir.iterdir() if p.name.startswith(".")]  # no temp file left


def test_a_file_that_fails_its_checksum_leaves_nothing_behind(s3, make_daemon, monkeypatch, tmp_path) -> None:
    url = "s3://ckptd/bad"
    d = make_daemon(tables={"remote": {"url": url}})
    monkeypatch.setenv("CKPTD_CONFIG", str(d.config))
    with d.producer("g") as p:
        p.save({"w": torch.ones(1000)}, 1).wait(30)
        p.wait_complete(1, timeout=60)
    store = Store(url)
    objects = catalog.run_objects(store, "g")[1]
    name = next(n for n in objects if n.endswith(".safetensors"))
    key = catalog.key("g", 1, name)
    data = bytearray(store.get(key, objects[name]))
    data[-1] ^= 0xFF  # the last byte of the last tensor
    store.put_bytes(key, bytes(data))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(CheckpointCorrupt, match="does not match its checksum"):
        fetch_share(store, "g", 1, 0, fresh)
    left = list((fresh / "g" / "step-000000000001").iterdir())
    assert left == [], f"a failed fetch left {left}"


def test_installed_files_are_durable(monkeypatch, tmp_path) -> None:
    calls = Syscalls(monkeypatch)
    target = tmp_path / "unit" / "ckptd.service"
    done: list[str] = []
    install._write(target, "[Unit]\nDescription=x\n", done)
    marker = tmp_path / "unit" / "after"
    os.replace(_touch(tmp_path / "m"), marker)
    calls.assert_durable_before(target, marker)
    assert target.stat().st_mode & 0o777 == 0o644 and done == [f"wrote {target}"]


def _touch(path: Path) -> Path:
    path.write_text("")
    return path

