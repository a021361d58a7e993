"""Several pieces of one tensor on a rank (a DCP ShardedTensor whose spec gives a rank
several chunks, or pieces emitted by hand), stored and loaded across plans: DCP's
``test_load_with_different_shard_plan`` ported to ckptd.dcp under torchrun (2 ranks,
gloo, CPU; tests/dcp_chunks_job.py), then the same steps read in this process by
``ckptd.load``, ``ckptd.load_into`` and ``dcp.load``; and single-process cases through
``Producer.emit`` (docs/format.md, "Sharded, replicated and multi-attempt steps")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

import ckptd
import ckptd.dcp
import dcp_chunks_job as job
from ckptd.errors import CheckpointCorrupt
from conftest import cli  # ckptd.cli.main in this process


def manifest(root: Path, run: str, step: int, rank: int) -> dict:
    return json.loads((root / run / f"step-{step:012d}" / f"manifest-r{rank:05d}.json").read_text())


@pytest.mark.slow
def test_sharded_tensor_with_several_chunks_per_rank_saves_and_reshards(daemon, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(Path(job.__file__)), daemon.endpoint, str(daemon.root), str(out)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-8000:]
    for i in range(4):
        want = load_file(str(out / f"spec{i}.safetensors"))["st"]
        loaded = ckptd.load(job.RUN, i + 1, root=daemon.root)  # the whole state, "st" assembled
        assert loaded.keys() == {"st", "n"} and loaded["n"] == i and torch.equal(loaded["st"], want)
        into = {"st": torch.zeros(job.SHAPE)}
        ckptd.load_into(into, job.RUN, i + 1, root=daemon.root, verify=True)
        assert torch.equal(into["st"], want)
        into = {"st": torch.zeros(job.SHAPE, dtype=torch.float64), "n": -1}
        dcp.load(into, storage_reader=ckptd.dcp.StorageReader(job.RUN, i + 1, root=daemon.root), no_dist=True)
        assert into["n"] == i and torch.equal(into["st"], want.double())
        assert cli("verify", job.RUN, str(i + 1), "--root", str(daemon.root)).returncode == 0
    want = load_file(str(out / "spec2.safetensors"))["st"]
    assert torch.equal(ckptd.load(job.ASYNC_RUN, 1, root=daemon.root, names=["st"])["st"], want)
    # spec 1: rows 0-2 and 9 on rank 0, 3-5 and 6-8 on rank 1; a rank's later piece has a key of its own
    m0, m1 = manifest(daemon.root, job.RUN, 2, 0), manifest(daemon.root, job.RUN, 2, 1)
    assert m0["format_version"] == m1["format_version"] == 3
    assert {k: (r["shape"], r["shard"]["offsets"], r["shard"].get("tensor")) for k, r in m0["tensors"].items()} \
        == {"st": ([3, 20], [0, 0], None), "st@9,0": ([1, 20], [9, 0], "st")}
    assert {k: r["shard"]["offsets"] for k, r in m1["tensors"].items()} == {"st": [3, 0], "st@6,0": [6, 0]}
    assert manifest(daemon.root, job.RUN, 1, 0)["format_version"] == 2  # one piece a rank: as before
    # the chunk file holds each piece under its record's key, for readers without ckptd
    step = daemon.root / job.RUN / "step-000000000002"
    with safe_open(str(step / m0["tensors"]["st@9,0"]["file"]), "pt") as f:
        assert torch.equal(f.get_tensor("st@9,0"), load_file(str(out / "spec1.safetensors"))["st"][9:])
    with pytest.raises(ValueError, match="rank 0 stored tensor 'st' of step 2 in several pieces"):
        ckptd.load(job.RUN, 2, root=daemon.root, rank=0)
    assert torch.equal(ckptd.load(job.RUN, 1, root=daemon.root, rank=1)["st"], load_file(
        str(out / "spec0.safetensors"))["st"][5:])  # one piece a rank: its share, as before


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_emit_several_pieces_of_a_tensor_on_one_rank(make_daemon, fmt: str) -> None:
    daemon = make_daemon(format=fmt)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(9, 6, generator=g)
    with daemon.producer("hand") as p:
        # three row blocks, out of order, and a plain tensor
        assert p.emit("w", full[6:], step=1, global_shape=[9, 6], offset=[6, 0]) == "w"
        assert p.emit("w", full[:2], step=1, global_shape=[9, 6], offset=[0, 0]) == "w@0,0"
        assert p.emit("w", full[2:6], step=1, global_shape=[9, 6], offset=[2, 0]) == "w@2,0"
        assert p.emit("b", full[0], step=1) == "b"
        with pytest.raises(ValueError, match=r"emit\('w', ...\): the piece at offsets \[1, 0\] of shape \[2, 6\] "
                           r"overlaps the piece at offsets \[0, 0\] of shape \[2, 6\] emitted before in step 1"):
            p.emit("w", full[1:3], step=1, global_shape=[9, 6], offset=[1, 0])
        with pytest.raises(ValueError, match="tensor name 'b' was already emitted in step 1"):
            p.emit("b", full[:1], step=1, global_shape=[9, 6], offset=[0, 0])
        p.commit(1).wait(30)
    m = manifest(daemon.root, "hand", 1, 0)
    assert m["format_version"] == 3 and m["tensors"]["w@2,0"]["shard"]["tensor"] == "w"
    whole = ckptd.load("hand", 1, root=daemon.root)  # a one-rank step: its pieces assembled
    assert whole.keys() == {"w", "b"} and torch.equal(whole["w"], full) and torch.equal(whole["b"], full[0])
    into = {"w": torch.zeros(9, 6), "b": torch.zeros(6)}
    ckptd.load_into(into, "hand", 1, root=daemon.root)
    assert torch.equal(into["w"], full)
    for verify in (False, True):  # DCP's metadata synthesized from the records: three chunks of "w"
        into = {"w": torch.zeros(9, 6, dtype=torch.bfloat16), "b": torch.zeros(6)}
        dcp.load(into, storage_reader=ckptd.dcp.StorageReader("hand", 1, root=daemon.root, verify=verify),
                 no_dist=True)
        assert torch.equal(into["w"], full.bfloat16()) and torch.equal(into["b"], full[0])
    reader = ckptd.dcp.StorageReader("hand", 1, root=daemon.root)
    chunks = reader.read_metadata().state_dict_metadata["w"].chunks
    assert sorted(list(c.offsets) for c in chunks) == [[0, 0], [2, 0], [6, 0]]


def test_a_piece_naming_its_tensor_needs_format_version_3(daemon) -> None:
    full = torch.arange(12.0).reshape(4, 3)
    with daemon.producer("v") as p:
        p.emit("w", full[:2], step=1, global_shape=[4, 3], offset=[0, 0])
        p.emit("w", full[2:], step=1, global_shape=[4, 3], offset=[2, 0])
        p.commit(1).wait(30)
    path = daemon.root / "v" / "step-000000000001" / "manifest-r00000.json"
    m = json.loads(path.read_text())
    m["format_version"] = 2  # what a version-2 writer could never have written: refused, not misread
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointCorrupt, match=r"tensor 'w@2,0': its shard names tensor 'w', which "
                       r"format_version 2 does not have \(a manifest with it is version 3\)"):
        ckptd.load("v", 1, root=daemon.root)
