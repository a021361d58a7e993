"""Sharded and replicated tensors through a real daemon, without torch.distributed:
pieces emitted by hand, replicated state written once, loads that follow both."""

from __future__ import annotations

import json

import pytest
import torch

import ckptd
from ckptd.completion import wait_complete
import ckptd.reader.export
import ckptd.reader


def _manifest(daemon, step: int, rank: int) -> dict:
    path = daemon.root / "t" / f"step-{step:012d}" / f"manifest-r{rank:05d}.json"
    return json.loads(path.read_text())


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_hand_sharded_pieces_are_recorded_with_their_place(daemon, fmt: str) -> None:
    w = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    producers = [daemon.producer(rank=r, world_size=2, format=fmt) for r in (0, 1)]
    try:
        producers[0].emit("w", w[:4], step=1, global_shape=[7, 3], offset=[0, 0])
        producers[1].emit("w", w[4:], step=1, global_shape=(7, 3), offset=(4, 0))
        for p in producers:
            p.emit("bias", torch.ones(2), step=1)
        handles = [p.commit(1) for p in producers]
        for h in handles:
            h.wait(30)
        with pytest.raises(ValueError, match="does not fit global_shape"):
            producers[0].emit("x", w, step=2, global_shape=[7, 3], offset=[1, 0])
        with pytest.raises(ValueError, match="pass both global_shape= and offset="):
            producers[0].emit("x", w, step=2, global_shape=[7, 3])
    finally:
        for p in producers:
            p.close()
    m1 = _manifest(daemon, 1, 1)
    assert m1["format_version"] == 2
    assert m1["tensors"]["w"]["shape"] == [3, 3]
    assert m1["tensors"]["w"]["shard"] == {"global_shape": [7, 3], "offsets": [4, 0]}
    assert "shard" not in m1["tensors"]["bias"]
    assert torch.equal(ckptd.load("t", root=daemon.root, rank=1)["w"], w[4:])  # the rank's own piece
    whole = ckptd.load("t", root=daemon.root, verify=True)  # no rank, no $RANK: assembled
    assert torch.equal(whole["w"], w) and torch.equal(whole["bias"], torch.ones(2))
    # plain targets filled from both ranks' pieces, read in part or (verify) whole
    target = {"w": torch.zeros(7, 3), "bias": torch.zeros(2)}
    for verify in (False, True):
        target["w"].zero_()
        ckptd.load_into(target, "t", root=daemon.root, verify=verify)
        assert torch.equal(target["w"], w) and torch.equal(target["bias"], torch.ones(2))
    _, problems = ckptd.reader.verify("t", root=daemon.root)
    assert problems == []


def test_replicated_state_is_written_once_and_loads_on_every_rank(daemon) -> None:
    state = {"big": torch.arange(1000.0), "small": torch.zeros(10), "mid": torch.ones(500), "epoch": 3}
    producers = [daemon.producer(rank=r, world_size=2) for r in (0, 1)]
    try:
        handles = [p.save(state, 5, replicated=True) for p in producers]
        for h in handles:
            h.wait(30)  # each rank's own share is durable; the step is complete once both are
        info = wait_complete("t", 5, timeout=30, root=daemon.root, remote="")
    finally:
        for p in producers:
            p.close()
    raw = sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
    assert info.nbytes == raw  # one copy, not two
    m0, m1 = _manifest(daemon, 5, 0), _manifest(daemon, 5, 1)
    # size-balanced: the largest to rank 0, the next two to rank 1
    assert sorted(m0["tensors"]) == ["big"] and m0["replicas"] == {"mid": 1, "small": 1}
    assert sorted(m1["tensors"]) == ["mid", "small"] and m1["replicas"] == {"big": 0}
    for rank in (0, 1):
        out = ckptd.load("t", root=daemon.root, rank=rank, verify=True)
        assert out["epoch"] == 3
        for k in ("big", "small", "mid"):
            assert torch.equal(out[k], state[k])
    # rank 1's share, exported, holds what rank 0 wrote for it
    from safetensors.torch import load_file

    exported = ckptd.reader.export.export("t", None, daemon.root.parent / "r1.safetensors", root=daemon.root, rank=1)
    assert torch.equal(load_file(str(exported))["big"], state["big"])


def test_pieces_that_overlap_or_leave_a_gap_are_refused(daemon) -> None:
    producers = [daemon.producer(rank=r, world_size=2) for r in (0, 1)]
    try:
        # rows 0..3 twice in part (0..3 and 2..5), row 6 never: as many elements as the whole
        producers[0].emit("w", torch.zeros(4, 2), step=1, global_shape=[7, 2], offset=[0, 0])
        producers[1].emit("w", torch.ones(3, 2), step=1, global_shape=[7, 2], offset=[2, 0])
        producers[0].emit("v", torch.zeros(3), step=1, global_shape=[5], offset=[0])
        producers[1].emit("v", torch.zeros(1), step=1, global_shape=[5], offset=[4])
        for h in [p.commit(1) for p in producers]:
            h.wait(30)
    finally:
        for p in producers:
            p.close()
    with pytest.raises(ckptd.CheckpointCorrupt, match=r"tensor 'w': the pieces stored by ranks 0 and 1 overlap"):
        ckptd.load("t", root=daemon.root, names=["w"])
    with pytest.raises(ckptd.CheckpointCorrupt, match=r"tensor 'v': the stored pieces cover 4 of the 5 elements"):
        ckptd.load_into({"v": torch.zeros(5)}, "t", root=daemon.root)
    assert torch.equal(ckptd.load("t", root=daemon.root, rank=1)["v"], torch.zeros(1))  # a rank's share still loads


def test_overlap_spans_match_brute_force() -> None:
    """``byte_span`` names exactly the bytes of a piece that hold an overlap."""
    import random

    from ckptd.sharding import Box, byte_span, intersect

    rng = random.Random(12)
    for _ in range(300):
        ndim = rng.randint(1, 3)
        whole = [rng.randint(1, 6) for _ in range(ndim)]

        def box() -> Box:
            lo = [rng.randint(0, n - 1) for n in whole]
            return Box(tuple(lo), tuple(rng.randint(1, n - o) for o, n in zip(lo, whole)))

        piece, target = box(), box()
        both = intersect(piece, target)
        index = torch.arange(piece.numel).reshape(piece.sizes)  # element numbers in the piece's storage
        if both is None:
            assert any(p + n <= t or t + m <= p for p, n, t, m in
                       zip(piece.offsets, piece.sizes, target.offsets, target.sizes))
            continue
        inside = index[tuple(slice(o - p, o - p + n) for o, p, n in zip(both.offsets, piece.offsets, both.sizes))]
        start, length, rows = byte_span(both, piece, 4)
        assert start == int(inside.min()) * 4 and start + length == (int(inside.max()) + 1) * 4
        runs = (inside.reshape(-1)[1:] - inside.reshape(-1)[:-1] != 1).sum().item() + 1
        assert rows == runs
