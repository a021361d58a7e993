"""A full disk, for real: the daemon runs in its own mount namespace on a small tmpfs."""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import CheckpointError, measures
from ckptd.transport import wire
from ckptd.transport.oneshot import request


def tensors(step: int, mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(2**18, generator=g) for i in range(mib)}


@pytest.fixture
def small_disk_daemon(make_daemon):
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:  # needs root; CI here runs as root
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}")
    return start_on_tmpfs(make_daemon(start=False, chunk_size="1MiB"), "12m")


def start_on_tmpfs(d, size: str):
    """Start daemon ``d`` in a mount namespace of its own, its root a tmpfs of ``size``."""
    d.root.mkdir(parents=True)
    mount = f"mount -t tmpfs -o size={size},mode=0755 tmpfs {shlex.quote(str(d.root))}"
    d.wrap = ["unshare", "-m", "sh", "-c", f'{mount} && exec "$0" "$@"']
    d.start()
    # the tmpfs is visible only inside the daemon's namespace: read it through /proc
    d.view = Path(f"/proc/{d.proc.pid}/root") / d.root.relative_to("/")
    return d


def test_disk_full_fails_the_commit_and_loses_nothing(small_disk_daemon) -> None:
    d = small_disk_daemon
    with d.producer(staging_size="32MiB") as p:
        p.save(tensors(1, 4), 1).wait(30)
        with pytest.raises(CheckpointError, match="No space left on device"):
            p.save(tensors(2, 10), 2).wait(30)
        # the earlier checkpoint is intact and still the newest complete one
        assert [i.step for i in ckptd.list_checkpoints("t", root=d.view)] == [1]
        loaded = ckptd.load("t", root=d.view, verify=True)
        assert all(torch.equal(loaded[k], v) for k, v in tensors(1, 4).items())
        # the failed step's files are gone, so the space is free again: the next
        # checkpoint succeeds with nothing restarted
        assert p.save(tensors(3, 4), 3).wait(30).step == 3
        p.flush()  # the failure was raised by wait() already: not again
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.view)] == [1, 3]
    assert ckptd.load("t", 3, root=d.view, verify=True).keys() == tensors(3, 4).keys()
    assert d.proc.poll() is None
    assert "No space left on device" in d.log_text()


# -- more of it: retention, emit-built steps, freed space, every point of a commit ---------
@pytest.fixture
def make_small_disk(small_disk_daemon, make_daemon):
    """``make_small_disk(size, tables=None, **keys)``: like ``small_disk_daemon``, with a
    tmpfs of ``size`` and daemon settings of the test's own."""
    def make(size: str, tables: dict | None = None, **keys: object):
        return start_on_tmpfs(make_daemon(start=False, tables=tables, **{"chunk_size": "1MiB", **keys}), size)
    return make


def fill(root: Path, leave: int = 0) -> Path:
    """Fill the filesystem of ``root`` with one file, so that about ``leave`` bytes stay free."""
    st = os.statvfs(root)
    want = max(0, st.f_bavail * st.f_frsize - leave)
    filler = root / "filler"
    with open(filler, "wb") as f:
        try:
            while want > 0:
                want -= f.write(bytes(min(want, 2**20)))
            f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def queued_bytes(d) -> int:
    return request(d.endpoint, wire.encode("status", seq=1), 10.0)["status"]["queued_bytes"]


def test_disk_full_keeps_earlier_checkpoints_retention_deletes_nothing_freed_space_works(make_small_disk) -> None:
    d = make_small_disk("12m", tables={"retention": {"keep_last": 2}})
    pid = d.proc.pid
    with d.producer(staging_size="32MiB") as p:
        for step in (1, 2):
            p.save(tensors(step, 2), step).wait(30)
        filler = fill(d.view)
        with pytest.raises(CheckpointError, match="No space left on device"):
            p.save(tensors(3, 2), 3).wait(30)
        with p.checkpoint(4) as handle:  # an emit-built step: the write error comes before the commit
            for name, t in tensors(4, 2).items():
                p.emit(name, t)
        with pytest.raises(CheckpointError, match="No space left on device"):
            handle.wait(30)
        # every earlier checkpoint is intact and listed: keep_last = 2 deleted nothing for the failures
        assert [i.step for i in ckptd.list_checkpoints("t", root=d.view)] == [1, 2]
        for step in (1, 2):
            loaded = ckptd.load("t", step, root=d.view, verify=True)
            assert all(torch.equal(loaded[k], v) for k, v in tensors(step, 2).items())
        assert ckptd.latest("t", root=d.view).step == 2
        for step in (3, 4):  # removed on the I/O thread, which may come just after the error reply
            left = d.view / "t" / f"step-{step:012d}"
            deadline = time.monotonic() + 10
            while left.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not left.exists(), f"left behind: {sorted(os.listdir(left))}"

        assert queued_bytes(d) == 0  # the failed steps' bytes were let go of
        filler.unlink()  # space is freed: the next checkpoint succeeds, nothing restarted
        assert p.save(tensors(5, 2), 5).wait(30).step == 5
        p.flush()  # the failures were raised by wait() already
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.view)] == [2, 5]  # keep_last works again
    assert ckptd.latest("t", root=d.view).step == 5
    assert d.proc.poll() is None and d.proc.pid == pid


def small_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(3000, generator=g), "b": torch.randn(5000, generator=g),
            "c": torch.randint(0, 9, (1000,), generator=g)}  # about 40 KiB: 10 pages and a bit


def test_disk_full_at_every_point_of_a_commit(make_small_disk) -> None:
    """Leave 0, 1, 2, ... pages free and commit: each attempt fails cleanly (the producer is
    told, nothing is listed, no file is left) or commits wholly (it loads bit-exactly and is
    the latest). Somewhere in between the data fits and the manifest, or the latest
    pointer, does not."""
    d = make_small_disk("8m")
    outcomes = []
    with d.producer(staging_size="8MiB") as p:
        for step, pages in enumerate(range(0, 20), start=1):
            filler = fill(d.view, pages * 4096)
            try:
                p.save(small_state(step), step).wait(30)
                ok = True
            except CheckpointError as exc:
                assert "No space left on device" in str(exc)
                ok = False
            filler.unlink()
            listed = [i.step for i in ckptd.list_checkpoints("t", root=d.view)]
            if ok:
                assert step in listed
                loaded = ckptd.load("t", step, root=d.view, verify=True)
                assert all(torch.equal(loaded[k], v) for k, v in small_state(step).items())
                assert ckptd.latest("t", root=d.view).step == step, f"stale latest with {pages} pages free"
            else:
                assert step not in listed
                assert not (d.view / "t" / f"step-{step:012d}").exists(), f"files left with {pages} pages free"
            # the daemon's measures file (docs/advise.md) and its temp file while it is being
            # replaced, which its writer thread may be doing at this moment
            mine = measures.file_name()
            others = sorted(n for n in os.listdir(d.view / "t")
                            if not n.startswith("step-") and n != mine and not n.startswith(f".{mine}~"))
            assert others in ([], ["latest"])
            outcomes.append(ok)
        p.flush()
    assert not outcomes[0] and outcomes[-1]  # the sweep crossed from "does not fit" to "fits"
    assert d.proc.poll() is None
