from __future__ import annotations

import threading
import time

import pytest

from ckptd.errors import CheckpointError
from ckptd.producer.staging import ALIGN, LARGE, PAGE, Arena


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
