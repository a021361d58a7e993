"""A full disk, for real: the daemon runs in its own mount namespace on a small tmpfs."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import CheckpointError


def tensors(step: int, mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(2**18, generator=g) for i in range(mib)}


@pytest.fixture
def small_disk_daemon(make_daemon):
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:  # needs root; CI here runs as root
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}")
    d = make_daemon(start=False, chunk_size="1MiB")
    d.root.mkdir(parents=True)
    mount = f"mount -t tmpfs -o size=12m,mode=0755 tmpfs {shlex.quote(str(d.root))}"
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
