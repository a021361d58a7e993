"""Replica comparison (ckptd.replicas, docs/training.md): every holder of a replicated
piece digests its copy, and the step names the ranks whose copy differs.

These run three producers of one run in this process against a real daemon; the
torchrun jobs of DDP, HSDP and TP are in tests/test_replicas_training.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ckptd
from ckptd import replicas
from ckptd.completion import wait_complete
from ckptd.manifest import Manifest
from conftest import cli


def _flip(t: torch.Tensor, index: int = 0, bit: int = 3) -> torch.Tensor:
    """A copy of ``t`` with one bit of one element flipped: what a bad core does."""
    out = t.clone()
    out.view(-1).view(torch.uint8)[index * t.element_size()] ^= 1 << bit
    return out


def _save(daemon, states: list[dict], step: int, world: int, **options) -> ckptd.CheckpointInfo:
    producers = [daemon.producer(rank=r, world_size=world, **options) for r in range(world)]
    try:
        for h in [p.save(s, step, replicated=True) for p, s in zip(producers, states)]:
            h.wait(30)
        return wait_complete("t", step, timeout=30, root=daemon.root, remote="")
    finally:
        for p in producers:
            p.close()


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "optim": {"step": torch.tensor(7)}, "epoch": 2}


def test_a_flipped_bit_on_one_rank_names_the_tensor_and_the_rank(daemon) -> None:
    good = _state()
    bad = {**good, "model": {**good["model"], "w": _flip(good["model"]["w"], 100, 6)}}
    assert _save(daemon, [good, good, good], 1, 3).diverged == {}
    info = _save(daemon, [good, good, bad], 2, 3)
    assert info.diverged == {"model.w": [2]}
    assert not info.refused  # "warn", the default: it is the latest all the same
    assert ckptd.latest("t", root=daemon.root).step == 2
    # every rank digested every replicated tensor it holds but does not write; the writer's
    # digest is its record's checksum (test_the_writers_digest_is_its_records_checksum)
    for m in _manifests(daemon, 2, 3):
        assert sorted(m.replica_digests) == sorted({"model.b", "model.w", "optim.step"} - set(m.tensors))
        assert m.host
    listed = ckptd.list_checkpoints("t", root=daemon.root)
    assert [i.diverged for i in listed] == [{}, {"model.w": [2]}]
    # verify fails naming the tensor and the rank (and its host)
    r = cli("verify", "t", "2", "--root", str(daemon.root))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "model.w" in r.stderr and "rank 2 (host " in r.stderr
    assert cli("verify", "t", "1", "--root", str(daemon.root)).returncode == 0
    # the daemon that completed the step logged it at ERROR and counted it
    assert "replicas of tensor 'model.w' disagree: rank 2" in daemon.log_tail(400)
    status = json.loads(cli("status", "--json", "--endpoint", daemon.endpoint).stdout)
    assert status["replica_mismatches"] == 1, status


def _manifests(daemon, step: int, world: int) -> list[Manifest]:
    folder = daemon.root / "t" / f"step-{step:012d}"
    return [Manifest.from_json((folder / f"manifest-r{r:05d}.json").read_bytes(), "here") for r in range(world)]


def test_the_writers_digest_is_its_records_checksum(daemon) -> None:
    """Under xxh3 the rank that writes a replicated tensor does not digest it (the
    daemon's checksum of what it wrote is the same function over the same bytes): its
    manifest has no digest for it, and a bit flipped on that rank is named all the same."""
    good = _state()
    _save(daemon, [good] * 3, 1, 3)
    writer = {name: m.rank for m in _manifests(daemon, 1, 3) for name in m.tensors}
    w = writer["model.w"]
    for m in _manifests(daemon, 1, 3):
        if m.rank == w:
            assert "model.w" not in m.replica_digests
        else:  # the others' digests of their copies are the writer's record's checksum
            assert m.replica_digests["model.w"] == _manifests(daemon, 1, 3)[w].tensors["model.w"].checksum
    states = [good] * 3
    states[w] = {**good, "model": {**good["model"], "w": _flip(good["model"]["w"], 7, 1)}}
    info = _save(daemon, states, 2, 3)
    assert info.diverged == {"model.w": [w]}
    r = cli("verify", "t", "2", "--root", str(daemon.root))
    assert r.returncode == 1 and f"rank {w} (host " in r.stderr, r.stdout + r.stderr


def test_xxh3_digests_are_written_as_checksums_are() -> None:
    """A replica digest and a record's checksum of the same bytes are the same text,
    leading zeros included (the writer's digest is its checksum)."""
    from ckptd.manifest import checksum

    small = 0
    for seed in range(200):
        t = torch.randn(9, generator=torch.Generator().manual_seed(seed))
        raw = t.view(torch.uint8).numpy().tobytes()
        ours = replicas.digest_pieces([("x", t, None)], replicas.XXH3)["x"]
        assert ours == checksum([raw])
        small += ours.startswith("xxh3_64:0")
    assert small  # some digests had a leading zero to pad (1 in 16)


def test_an_optimizer_step_right_after_save_waits_for_the_digests(daemon) -> None:
    """The ranks that do not write a replicated tensor digest it after ``save`` returned;
    an optimizer's step, which changes it in place, waits until it was read: every
    rank's digest is of the bytes saved, and the step compares them all."""
    models = [torch.nn.Linear(256, 256) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in models]
    producers = [daemon.producer(rank=r, world_size=3) for r in range(3)]
    try:
        handles = []
        for m, opt, p in zip(models, opts, producers):
            handles.append(p.save({"model": m.state_dict()}, 1, replicated=True))
            for q in m.parameters():
                q.grad = torch.ones_like(q)
            opt.step()  # at once: the digests of this rank may still be being taken
        for h in handles:
            h.wait(30)
    finally:
        for p in producers:
            p.close()
    assert wait_complete("t", 1, timeout=30, root=daemon.root, remote="").diverged == {}
    for m in _manifests(daemon, 1, 3):
        assert sorted(m.replica_digests) == sorted({"model.weight", "model.bias"} - set(m.tensors))


def test_a_tensor_changed_in_place_before_its_digest_is_left_out(caplog) -> None:
    """A copy changed in place after save returned, before the digest thread read it, is
    no longer the one saved: it is left out of the step's comparison, with a warning,
    rather than reported as diverged."""
    kept, moved = torch.ones(8), torch.ones(8)
    pending = replicas.start({"kept": (kept, None), "moved": (moved, None)}, "warn")
    assert pending is not None and pending.later
    moved.add_(1)
    with caplog.at_level("WARNING", logger="ckptd.replicas"):
        got = pending.result()
    assert got == replicas.digest_pieces([("kept", torch.ones(8), None)], replicas.XXH3)
    assert "moved" in caplog.text and "not compared this step" in caplog.text
    # where a piece has no version counter (a numpy array) the digests are taken during save
    assert not replicas.start({"a": (np.ones(8), None)}, "warn").later


def test_two_copies_that_differ_name_both_ranks(daemon) -> None:
    good = _state()
    bad = {**good, "model": {**good["model"], "b": _flip(good["model"]["b"])}}
    info = _save(daemon, [good, bad], 1, 2)
    assert info.diverged == {"model.b": [0, 1]}


def test_refuse_keeps_the_step_but_never_picks_it(daemon) -> None:
    good = _state()
    bad = {**good, "model": {**good["model"], "w": _flip(good["model"]["w"])}}
    _save(daemon, [good] * 3, 1, 3, compare_replicas="refuse")
    info = _save(daemon, [good, bad, good], 2, 3, compare_replicas="refuse")
    assert info.diverged == {"model.w": [1]} and info.refused
    assert ckptd.latest("t", root=daemon.root).step == 1
    assert ckptd.latest("t", root=daemon.root, verify=True).step == 1
    assert (daemon.root / "t" / "latest").read_text().strip() == "step-000000000001"
    assert torch.equal(ckptd.load("t", root=daemon.root, rank=0)["model"]["w"], good["model"]["w"])
    target = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "optim": {"step": torch.tensor(0)}}
    assert ckptd.load_into(target, "t", root=daemon.root).step == 1
    # kept on disk, loadable by its step, and marked in the list
    assert ckptd.load("t", 2, root=daemon.root, rank=0)["epoch"] == 2
    assert [i.step for i in ckptd.list_checkpoints("t", root=daemon.root)] == [1, 2]
    out = cli("list", "t", "--root", str(daemon.root)).stdout
    line2 = next(line for line in out.splitlines() if "2" in line.split()[:1])
    assert "refused" in line2, out
    assert "refused" not in next(line for line in out.splitlines() if "1" in line.split()[:1])


def test_off_compares_nothing(daemon) -> None:
    good = _state()
    bad = {**good, "model": {**good["model"], "w": _flip(good["model"]["w"])}}
    info = _save(daemon, [good, bad], 1, 2, compare_replicas="off")
    assert info.diverged is None
    m = json.loads((daemon.root / "t" / "step-000000000001" / "manifest-r00000.json").read_text())
    assert "replica_digests" not in m


def test_words64_is_the_documented_formula_on_cpu() -> None:
    """The GPU digest's kernel, run on CPU tensors: the formula docs/training.md gives,
    computed independently with Python integers, for sizes that are and are not a
    multiple of 8 bytes, and across the kernel's blocks."""
    def reference(t: torch.Tensor) -> str:
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        nbytes = len(raw)
        raw += b"\0" * (-len(raw) % 4)
        words = np.frombuffer(raw, dtype="<i4").astype(np.int64).view(np.uint64)
        i = np.arange(len(words), dtype=np.uint64)
        total = int((words * ((i * np.uint64(2) + np.uint64(1)) * np.uint64(replicas.K))).sum(dtype=np.uint64))
        x = ((total ^ nbytes) + replicas.K) % 2**64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
        return f"words64:{x ^ (x >> 31):016x}"

    g = torch.Generator().manual_seed(1)
    cases = [torch.randn(1000, 7, generator=g), torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
             torch.randn(5, generator=g).to(torch.bfloat16), torch.tensor(3.5)]
    for t in cases:
        assert replicas.digest_pieces([("x", t, None)], replicas.WORDS64) == {"x": reference(t)}
    # a tensor of several blocks, and a view at an odd byte offset
    big = torch.randint(-2**30, 2**30, (3 * replicas._BLOCK + 5,), dtype=torch.int32, generator=g)
    assert replicas.digest_pieces([("x", big, None)], replicas.WORDS64) == {"x": reference(big)}
    odd = torch.randint(0, 255, (41,), dtype=torch.uint8, generator=g)[3:]
    assert odd.storage_offset() % 4
    assert replicas.digest_pieces([("x", odd, None)], replicas.WORDS64) == {"x": reference(odd)}


@pytest.mark.parametrize("function", replicas.FUNCTIONS)
def test_every_single_bit_flip_changes_the_digest(function: str) -> None:
    t = torch.randn(33, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    base = replicas.digest_pieces([("x", t, None)], function)["x"]
    seen = {base}
    for byte in range(t.numel() * 8):
        for bit in range(8):
            flipped = t.clone()
            flipped.view(torch.uint8)[byte] ^= 1 << bit
            seen.add(replicas.digest_pieces([("x", flipped, None)], function)["x"])
    assert len(seen) == 1 + t.numel() * 64  # each flip its own digest, none the original's


def test_majority_and_ties() -> None:
    assert replicas._odd_ones({0: "a", 1: "a", 2: "b"}) == [2]
    assert replicas._odd_ones({0: "a", 1: "b"}) == [0, 1]
    assert replicas._odd_ones({0: "a", 1: "a", 2: "b", 3: "b"}) == [0, 1, 2, 3]
    assert replicas._odd_ones({0: "a", 1: "a", 2: "b", 3: "c"}) == [2, 3]
    assert replicas._odd_ones({0: "a", 1: "a"}) == []


def test_a_refused_step_pushes_no_good_step_out_of_retention() -> None:
    """keep_last=1 with a refused newest step: the good step before it stays (it is what a
    restart resumes from), and the refused one is kept too, counted by no rule."""
    from ckptd import retention
    from ckptd.config import RetentionConfig

    def info(step: int, refused: bool) -> ckptd.CheckpointInfo:
        return ckptd.CheckpointInfo("t", step, f"/x/{step}", float(step), 10, 1, "chunk",
                                    diverged={"w": [1]} if refused else {}, refused=refused)

    decisions = retention.plan([info(1, False), info(2, False), info(3, True)], RetentionConfig(keep_last=1),
                               pinned=set(), now=10.0)
    assert [(d.step, d.keep) for d in decisions] == [(1, False), (2, True), (3, True)]
    assert decisions[2].reasons[0].startswith("refused")
