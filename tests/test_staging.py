from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from ckptd.errors import CheckpointError
from ckptd.producer import sizing
from ckptd.producer.staging import ALIGN, LARGE, PAGE, Arena

from conftest import REPO

MiB = 2**20


def test_ring_wraps_and_frees_in_order() -> None:
    a = Arena(4096)
    r1 = a.alloc(1700, timeout=1, block=False, what="r1")
    r2 = a.alloc(1700, timeout=1, block=False, what="r2")
    r1.seq, r2.seq = 1, 2
    assert (r1.start, r2.start) == (0, 1728)  # aligned
    with pytest.raises(CheckpointError, match="staging memory is full"):
        a.alloc(1200, timeout=1, block=False, what="r3")
    a.release_through(1)
    r3 = a.alloc(1200, timeout=1, block=False, what="r3")  # wraps to the start
    assert r3.start == 0
    r3.seq = 3
    a.release_through(3)
    assert a.alloc(4096, timeout=1, block=False, what="all").start == 0  # empty again: all of it
    a.close()


def test_a_wait_for_staging_asks_back_only_the_oldest_regions_it_needs() -> None:
    """Before it waits, ``alloc`` tells the daemon the newest seq it needs given back
    (regions come back oldest first): the fewest, and none that was never sent."""
    a = Arena(4 * PAGE)
    regions = [a.alloc(PAGE, timeout=1, block=False, what=f"r{i}") for i in range(4)]
    for seq, r in zip((5, 6, 9), regions):
        r.seq = seq  # the fourth is not sent yet
    asked: list[int | None] = []

    def on_wait(through: int | None) -> None:
        asked.append(through)
        a.release_through(through if through is not None else -1)

    assert a.alloc(2 * PAGE, timeout=1, block=True, what="x", on_wait=on_wait).start == 0
    assert asked == [6]
    with pytest.raises(CheckpointError, match="waited 0.1 s for staging memory"):
        a.alloc(2 * PAGE, timeout=0.1, block=True, what="y", on_wait=on_wait)  # behind the unsent one
    assert asked == [6, 9]
    a.close()


def test_large_regions_start_on_a_page_and_the_arena_is_a_sealed_memfd() -> None:
    import fcntl
    import os

    a = Arena(8 * 2**20)
    small = a.alloc(100, timeout=1, block=False, what="small")
    large = a.alloc(LARGE + 3, timeout=1, block=False, what="large")
    assert small.start == 0 and large.start == PAGE  # O_DIRECT can write it as it is
    seals = fcntl.fcntl(a.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW  # the daemon's mapping stays valid
    with pytest.raises(PermissionError):
        os.ftruncate(a.fd, PAGE)
    assert os.readlink(f"/proc/self/fd/{a.fd}").startswith("/memfd:ckptd-staging")  # no name anywhere
    a.close()


def test_regions_never_overlap_under_random_use() -> None:
    import random

    rng = random.Random(0)
    a = Arena(10_000)
    live, seq = [], 0
    for _ in range(5000):
        n = rng.randint(1, 4000)
        try:
            r = a.alloc(n, timeout=0, block=False, what="x")
        except CheckpointError:
            k = rng.randint(1, len(live))
            a.release_through(live[k - 1].seq)
            live = live[k:]
            continue
        seq += 1
        r.seq = seq
        for o in live:
            assert r.start + r.nbytes <= o.start or o.start + o.nbytes <= r.start
        assert r.start % ALIGN == 0 and r.start + r.nbytes <= a.capacity
        live.append(r)
    a.close()


def test_block_waits_for_release_and_break_wakes_waiters() -> None:
    a = Arena(4096)
    r = a.alloc(4096, timeout=1, block=True, what="x")
    r.seq = 1
    threading.Timer(0.2, a.release_through, args=(1,)).start()
    t0 = time.monotonic()
    a.alloc(4096, timeout=5, block=True, what="y").seq = 2
    assert 0.1 < time.monotonic() - t0 < 2 and a.blocked_s > 0.1
    threading.Timer(0.2, a.break_, args=("daemon gone",)).start()
    with pytest.raises(CheckpointError, match="daemon gone"):
        a.alloc(10, timeout=5, block=True, what="z")
    a.close()


def test_shrink_gives_back_the_end_of_the_newest_region_only() -> None:
    a = Arena(8192)
    r1 = a.alloc(4000, timeout=1, block=False, what="r1")
    a.shrink(r1, 100)  # the newest: its end comes back
    assert r1.nbytes == ALIGN * 2
    r2 = a.alloc(3000, timeout=1, block=False, what="r2")
    assert r2.start == r1.start + r1.nbytes
    a.shrink(r1, 10)  # no longer the newest: nothing moves under r2
    assert r1.nbytes == ALIGN * 2
    a.shrink(r2, 0)  # never empty (an empty newest region would read as an empty ring)
    assert r2.nbytes == ALIGN
    a.close()


# -- a producer waiting for staging waits only for bytes the daemon is writing -------------------
# The daemon gives shared staging back once it has written it, and writes small tensors
# when their chunk is full or at the commit; a large tensor sends the open batch of small
# ones, and the next small one took a fresh batch region. In a state_dict()'s order (a
# weight, its bias, ...) those regions filled staging while the daemon, still gathering
# their chunk, held them all: the save hung until emit_timeout.
EMIT_TIMEOUT_S = 20  # a wait for staging that never ends fails within this, not 300 s


def _alternating(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    state = {}
    for i in range(n):
        state[f"layer{i}.weight"] = torch.randn(100, 256, generator=g)  # 100 KiB: not batched, chunked
        state[f"layer{i}.bias"] = torch.randn(16, generator=g)  # batched
    return state


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_alternating_large_and_small_emits_with_4mib_staging(make_daemon, fmt: str) -> None:
    import ckptd

    d = make_daemon(format=fmt, chunk_size="64MiB")  # a chunk never fills: only a commit or a drain writes it
    state = _alternating(8)
    with d.producer(staging_size="4MiB", emit_timeout=EMIT_TIMEOUT_S, transport="shm") as p:
        with p.checkpoint(1) as handle:
            for name, t in state.items():
                p.emit(name, t)
        handle.wait(30)
    got = ckptd.load("t", 1, root=d.root, verify=True)
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


def test_the_drain_alone_keeps_a_save_live(make_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without batches giving back what they do not use, every wait for staging still
    ends: the producer asks the daemon to write out what it holds (``drain``)."""
    import ckptd

    monkeypatch.setattr(Arena, "shrink", lambda self, region, nbytes: None)
    d = make_daemon(chunk_size="64MiB")
    state = _alternating(40)
    with d.producer(staging_size="4MiB", emit_timeout=EMIT_TIMEOUT_S, transport="shm") as p:
        for step in (1, 2):
            p.save(state, step).wait(30)
            assert p.stats()["blocked_seconds"] > 0  # it did wait for staging, and the wait ended
    got = ckptd.load("t", 2, root=d.root, verify=True)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_gpt2_and_adam_save_with_the_shipped_config(make_daemon) -> None:
    """transformers' GPT-2 (4 layers, 22 MB) with its Adam state, under config.toml as
    shipped (staging "auto", starting at 32 MiB), but for emit_timeout."""
    import tomllib

    import ckptd
    from transformers import GPT2Config, GPT2LMHeadModel, logging as hf_logging

    hf_logging.set_verbosity_error()  # (its config warns of token ids outside this small vocabulary)
    shipped = tomllib.loads((REPO / "config.toml").read_text())
    daemon_keys = {k: v for k, v in shipped["daemon"].items() if k not in ("endpoint", "root", "metrics")}
    producer_keys = {k: v for k, v in shipped["producer"].items() if not k.startswith("curve_")}
    producer_keys["emit_timeout"] = f"{EMIT_TIMEOUT_S}s"
    assert producer_keys["staging_size"] == "auto"

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randint(0, 8000, (2, 16)), labels=torch.randint(0, 8000, (2, 16))).loss.backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    d = make_daemon(**daemon_keys)
    with ckptd.Producer(d.endpoint, "gpt2", **producer_keys) as p:
        p.save(state, 1).wait(60)
    from ckptd.state import flatten

    want = flatten(state)[1]
    got = flatten(ckptd.load("gpt2", 1, root=d.root, verify=True))[1]
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


@pytest.mark.slow
def test_fsdp2_dcp_and_producer_saves_of_20_layers_with_4mib_staging(daemon, tmp_path) -> None:
    """Each DTensor piece goes alone and sends the open batch of small tensors: 20 FSDP2
    layers with Adam hung dcp.save, dcp.async_save and Producer.save at 4 MiB of staging."""
    import subprocess
    import sys
    from pathlib import Path

    import ckptd
    from ckptd.reader import verify
    from safetensors.torch import load_file

    job = Path(__file__).resolve().parent / "fsdp_staging_job.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(job),
         daemon.endpoint, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-8000:]
    for run_id in ("dcp", "adcp", "ps"):
        _, problems = verify(run_id, 1, root=daemon.root)
        assert problems == [], (run_id, problems)
    reference = load_file(str(tmp_path / "reference.safetensors"))
    whole = ckptd.load("ps", 1, root=daemon.root, names=list(reference))  # assembled from both ranks
    assert all(torch.equal(whole[k], v) for k, v in reference.items())


# -- the first checkpoint: staging made at its size before it --------------------------------
def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))


@pytest.mark.parametrize("madvise", [True, False], ids=["madvise", "memset"])
def test_a_large_arena_is_prefaulted_by_threads(madvise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.producer import staging

    size = 2 * staging.PREFAULT_SPLIT
    monkeypatch.setattr(staging, "_madvise_refused", not madvise)  # memset: a kernel older than 5.14
    monkeypatch.setattr(staging, "_prefault_threads", lambda n: 3)  # ranges that do not divide evenly
    before = _rss_shmem()
    a = Arena(size + PAGE)
    assert _rss_shmem() - before >= size  # every page is resident before any copy
    if madvise and tuple(map(int, os.uname().release.split(".")[:2])) >= (5, 14):
        assert not staging._madvise_refused  # MADV_POPULATE_WRITE served: no page written from here
    t = a.tensor()
    t[-5:] = 7
    assert int(t[0]) == 0 and int(t[-1]) == 7 and t.numel() == size + PAGE
    del t
    a.close()


def _state(n: int = 24) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return {f"t{i}": torch.rand(2**20, generator=gen) for i in range(n)}  # 4 MiB each


def _loaded_equal(root, run: str, step: int, state: dict[str, torch.Tensor]) -> bool:
    import ckptd

    got = ckptd.load(run, step, root=root)
    return got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())


def test_expected_bytes_makes_staging_at_that_size_before_the_first_save(daemon) -> None:
    state = _state()  # 96 MiB
    with daemon.producer(run="exp", staging_size="auto", expected_bytes="96MiB") as p:
        p._copier.ready()
        need = sizing.room_for([t.nbytes for t in state.values()])
        assert p.stats()["staging_bytes"] >= need  # before the first checkpoint
        p.save(state, 1).wait(60)
        assert p.stats()["blocked_seconds"] == 0  # the whole of it fitted: no wait for the daemon
        p.save(state, 2).wait(60)
        assert p.stats()["staging_bytes"] == sizing.size_for(96 * 2**20, p.stats()["staging_limit"])  # never regrown
    assert _loaded_equal(daemon.root, "exp", 1, state) and _loaded_equal(daemon.root, "exp", 2, state)


def test_prepare_makes_staging_for_the_first_save_and_emit(daemon) -> None:
    import ckptd

    state = _state()
    with daemon.producer(run="prep", staging_size="auto") as p:
        p._connection.wait_started()  # connected with the first, small arena
        assert p.stats()["staging_bytes"] == 32 * 2**20
        room = p.prepare({"model": state, "epoch": 3})
        assert room >= 96 * 2**20
        p.save({"model": state, "epoch": 3}, 1).wait(60)  # takes the arena prepare made (a new connection)
        assert p.stats()["staging_bytes"] >= room and p.stats()["blocked_seconds"] == 0
        assert p.stats()["transport"] == "shm"
        bigger = _state(40)  # 160 MiB, emitted: prepare by size, then a block
        assert p.prepare(160 * 2**20 + 40 * 2 * PAGE) > 0
        with p.checkpoint(2):
            for k, v in bigger.items():
                p.emit(k, v)
        p.flush(60)
        assert p.stats()["staging_bytes"] >= 160 * 2**20 and p.stats()["blocked_seconds"] == 0
        p.prepare({"w": torch.ones(10)})  # a smaller state never shrinks, nor regrows, staging
        assert p.stats()["staging_bytes"] >= 160 * 2**20
        with pytest.raises(ValueError, match="cannot be negative"):
            p.prepare(-1)
        with pytest.raises(TypeError, match="cannot store"):
            p.prepare({"bad": object()})
    assert ckptd.load("prep", 1, root=daemon.root)["epoch"] == 3
    assert _loaded_equal(daemon.root, "prep", 2, bigger)
    with daemon.producer(run="fixed", staging_size="16MiB") as p:  # a size set by hand stays that size
        p.prepare(state)
        p.save(state, 1).wait(60)
        assert p.stats()["staging_bytes"] == 16 * 2**20
    assert _loaded_equal(daemon.root, "fixed", 1, state)


def test_a_small_model_keeps_small_staging_with_prepare(daemon) -> None:
    state = {"w": torch.ones(100), "b": torch.zeros(3)}
    with daemon.producer(run="small", staging_size="auto") as p:
        p.prepare(state)
        p.save(state, 1).wait(30)
        assert p.stats()["staging_bytes"] == 32 * 2**20
    with daemon.producer(run="small2", staging_size="auto", expected_bytes=1000) as p:
        p._copier.ready()
        assert p.stats()["staging_bytes"] == 32 * 2**20


@pytest.mark.parametrize("need, have, limit, made", [
    (40 * MiB, 32 * MiB, 6 * 1024 * MiB, 64 * MiB),  # fits whole in what is made
    (1024 * MiB, 32 * MiB, 6 * 1024 * MiB, 128 * MiB),  # streams through BRIDGE
    (1024 * MiB, 32 * MiB, 48 * MiB, 48 * MiB),  # never past the limit
    (1024 * MiB, 48 * MiB, 48 * MiB, None),  # at the limit already
    (1024 * MiB, 128 * MiB, 6 * 1024 * MiB, None),  # BRIDGE or more already: grown in the background only
    (20 * MiB, 32 * MiB, 6 * 1024 * MiB, None),  # it fits
])
def test_the_arena_made_on_the_spot_for_a_larger_checkpoint(need: int, have: int, limit: int,
                                                            made: int | None) -> None:
    assert sizing.bridge_for(need, have, limit) == made
