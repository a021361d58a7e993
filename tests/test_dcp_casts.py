"""``dcp.load`` through ``ckptd.dcp.StorageReader`` into tensors of another dtype than the
stored one casts, as DCP's own ``FileSystemReader`` does (its ``read_data`` ends in
``target.copy_(stored)``): ported from DCP's ``test_dtype_mismatch_casting``
(test/distributed/checkpoint/test_file_system_checkpoint_cpu.py), both ways, for
floats, ints and float<->int, on each of the reader's paths (straight into the target,
a span copied out, whole records with ``verify=True``, a stand-in for a
non-contiguous target), and from a step saved by ``producer.save`` (synthesized
metadata). ``ckptd.load_into`` keeps refusing another dtype with its clear error;
every value it does load is bit-exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
import ckptd.dcp

PAIRS = [  # (stored, target): narrowing, widening, float <-> int, int <-> int
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16), (torch.float16, torch.float32),
    (torch.float64, torch.float32), (torch.int64, torch.int32), (torch.int32, torch.int64),
    (torch.int8, torch.float32), (torch.float32, torch.int64), (torch.uint8, torch.int16),
]


@pytest.fixture
def daemon(shared_daemon):
    """One daemon for the module: each test writes runs of its own names."""
    return shared_daemon


def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 50).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def state_of(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    return {"w": values(dtype, (64, 33), seed), "b": values(dtype, (33,), seed + 1),
            "s": values(dtype, (), seed + 2)}


@pytest.mark.parametrize("stored,target", PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_dcp_load_casts_to_the_targets_dtype(daemon, stored: torch.dtype, target: torch.dtype) -> None:
    saved = state_of(stored, 1)
    run = f"cast-{stored}-{target}".replace("torch.", "")
    writer = ckptd.dcp.StorageWriter(run=run, step=1, endpoint=daemon.endpoint, staging_size="8MiB", timeout=60)
    dcp.save(saved, storage_writer=writer, no_dist=True)
    want = {k: v.to(target) for k, v in saved.items()}  # what DCP's copy_ gives
    for verify in (False, True):
        into = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(into, storage_reader=ckptd.dcp.StorageReader(run, root=daemon.root, verify=verify), no_dist=True)
        for k, v in want.items():
            assert into[k].dtype == target and torch.equal(into[k], v), (k, verify, into[k].flatten()[:4])
    # a non-contiguous target (read into a stand-in, then copied in)
    t = torch.zeros(33, 64, dtype=target).t()
    dcp.load({"w": t}, storage_reader=ckptd.dcp.StorageReader(run, root=daemon.root), no_dist=True)
    assert torch.equal(t, want["w"])


def test_dcp_load_of_a_producer_save_casts(daemon) -> None:
    saved = state_of(torch.float32, 3)
    with daemon.producer("ps") as p:
        p.save(saved, 1).wait(30)
    into = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in saved.items()}
    dcp.load(into, storage_reader=ckptd.dcp.StorageReader("ps", root=daemon.root), no_dist=True)
    assert all(torch.equal(into[k], v.to(torch.bfloat16)) for k, v in saved.items())


def test_load_into_refuses_another_dtype_and_loads_the_same_exactly(daemon) -> None:
    saved = state_of(torch.float32, 4)
    dcp.save(saved, storage_writer=ckptd.dcp.StorageWriter(run="li", step=1, endpoint=daemon.endpoint,
                                                           staging_size="8MiB", timeout=60), no_dist=True)
    into = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in saved.items()}
    with pytest.raises(ValueError, match=r"tensor 'w' is bfloat16 here, but float32 in the checkpoint; make the "
                       r"target that dtype \(or load it and convert\)"):
        ckptd.load_into(into, "li", root=daemon.root)
    assert all(not v.any() for v in into.values())  # refused before anything was read
    same = {k: torch.zeros_like(v) for k, v in saved.items()}
    ckptd.load_into(same, "li", root=daemon.root)
    assert all(torch.equal(same[k], v) for k, v in saved.items())
