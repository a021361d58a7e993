"""A writer that dies in the middle of a save from several ranks is reported, within a
bound, on every path a training script may take to learn of it (``handle.wait()``,
``flush()``, ``close()``), and the next save after a restart works: the daemon killed
with SIGKILL, and the daemon's writer thread raising (a bug), for both formats."""

from __future__ import annotations

import time

import pytest
import torch

import ckptd
from ckptd import CheckpointError

RANKS = 3
HANG_S = 15.0  # a bound against hangs: the daemon's death is seen through its pidfd, not the 60 s timeout


def state(rank: int, step: int, n: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"r{rank}.w{i}": torch.randn(2**18, generator=g) for i in range(n)}  # 1 MiB each


def producers(d) -> list[ckptd.Producer]:
    return [d.producer(rank=r, world_size=RANKS, timeout=60, heartbeat=0.2) for r in range(RANKS)]


def learn_of_failure(ps: list[ckptd.Producer], handles: list, match: str) -> None:
    """Rank 0 learns through its handle, rank 1 through flush(), rank 2 through close():
    each raises, naming what happened, within the bound."""
    ways = [lambda: handles[0].wait(60), lambda: ps[1].flush(60), ps[2].close]
    for rank, way in enumerate(ways):
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=match):
            way()
            pytest.fail(f"rank {rank} was not told")
        took = time.monotonic() - t0
        assert took < HANG_S, f"rank {rank} took {took:.1f} s to hear of the failure"


def save_and_check(d, ps: list[ckptd.Producer], step: int) -> None:
    handles = [p.save(state(r, step), step) for r, p in enumerate(ps)]
    for h in handles:
        h.wait(60)
    for r in range(RANKS):
        got = ckptd.load("t", step, root=d.root, rank=r, verify=True)
        want = state(r, step)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_daemon_killed_mid_save_every_rank_hears_and_the_next_save_works(make_daemon, fmt) -> None:
    d = make_daemon(chunk_size="1MiB", format=fmt, write_rate="8MiB")  # slow: the kill lands mid-save
    ps = producers(d)
    save_and_check(d, ps, 1)
    handles = [p.save(state(r, 2), 2) for r, p in enumerate(ps)]
    step_dir = d.root / "t" / "step-000000000002"
    deadline = time.monotonic() + 30
    while not (step_dir.is_dir() and any(step_dir.iterdir())):
        assert time.monotonic() < deadline, "the daemon never started writing step 2"
        time.sleep(0.005)
    d.kill()
    learn_of_failure(ps, handles, "lost contact with the ckptd daemon")
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [1]
    d.start()
    ps[2] = d.producer(rank=2, world_size=RANKS, timeout=60, heartbeat=0.2)
    save_and_check(d, ps, 3)  # ranks 0 and 1 reconnect by themselves
    for p in ps:
        p.close()
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [1, 3]


@pytest.mark.parametrize("fmt, writers, point", [
    ("chunk", 1, "writer.chunk"), ("chunk", 2, "writer.chunk"), ("hdf5", 1, "writer.hdf5"),
    ("hdf5", 2, "writer.hdf5_data"), ("hdf5", 1, "writer.hdf5_data"),
    ("chunk", 2, "writer.hash"), ("hdf5", 2, "writer.hash"),
])
def test_writer_thread_raising_fails_the_step_by_name(make_daemon, monkeypatch, fmt, writers, point) -> None:
    """``writers`` 2: chunk files, and HDF5 datasets' bytes, are written on the pool's
    threads, and the error names the thread that waited for them, as the writer's own
    threads do; ``writer.hash``: a batch is written before its checksums are known, and
    their failure still fails the step."""
    monkeypatch.setenv("CKPTD_FAILPOINTS", point)  # every batch of small tensors: one a rank
    d = make_daemon(chunk_size="1MiB", format=fmt, writer_threads=writers)
    ps = producers(d)
    handles = [p.save(state(r, 1, n=3) | {f"r{r}.small": torch.arange(10)}, 1) for r, p in enumerate(ps)]
    learn_of_failure(ps, handles, f"internal error in the daemon's .* thread: Failpoint: failpoint {point}")
    assert ckptd.list_checkpoints("t", root=d.root) == []  # nothing committed without its tensors
    assert "Traceback" in d.log_text()  # the log has the whole story
    d.stop()
    monkeypatch.delenv("CKPTD_FAILPOINTS")
    d.start()
    ps[2] = d.producer(rank=2, world_size=RANKS, timeout=60, heartbeat=0.2)
    save_and_check(d, ps, 2)
    for p in ps:
        p.close()
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [2]
