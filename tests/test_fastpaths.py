"""The speed paths (docs/performance.md), for correctness: batched small tensors, writer threads,
O_DIRECT HDF5 data, ``load(out=...)``, ``load(mmap=True)``, parallel reads, the parsed
manifest cache. Real daemons, real sockets, real files; speed itself is measured by
benchmarks/limits.py, never here."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptd
from ckptd import CheckpointCorrupt, layout, manifestcache, reader
from ckptd.transport import handoff, wire
from ckptd.errors import ProtocolError
from ckptd.manifest import Manifest
from ckptd.tiers import files as tiers_files

from test_crash import referenced_files_only, wait_for_files


def shm_daemon(make_daemon, **keys: object):
    """A daemon whose shared-memory handoff socket is listening too (it is made just
    after the main socket, which is what the fixture waits for)."""
    d = make_daemon(**keys)
    path = Path(handoff.socket_path(d.endpoint[len("ipc://"):]))
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.01)
    return d


def small_state(seed: int, n: int = 1500) -> dict[str, object]:
    """An optimizer-like state: many small tensors of mixed dtypes and odd sizes (which
    misalign what follows them in a chunk file), empty ones, strided and conjugated
    views, numpy arrays, and a few large tensors between them."""
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8)
    tensors: dict[str, object] = {}
    for i in range(n):
        kind = i % 9
        if kind == 0:
            tensors[f"s{i}"] = torch.rand(i % 7 + 1, generator=g) > 0.5  # 1..7 bytes
        elif kind == 1:
            tensors[f"s{i}"] = torch.empty(0, 3)
        elif kind == 2:
            tensors[f"s{i}"] = torch.randn(13, 9, generator=g).t()  # strided
        elif kind == 3:
            tensors[f"s{i}"] = torch.randn(5, generator=g, dtype=torch.complex64).conj()  # lazily conjugated
        elif kind == 4:
            tensors[f"s{i}"] = np.arange(i % 50 + 1, dtype=np.int32) * seed
        else:
            tensors[f"s{i}"] = (torch.randn(i % 300 + 1, generator=g) * 100).to(dtypes[i % len(dtypes)])
    tensors["big0"] = torch.randn(2**18, generator=g)  # 1 MiB: not batched, between batches
    tensors["big1"] = torch.randn(3 * 2**18 + 5, generator=g)
    return {"optim": tensors, "epoch": seed}


def equal(a: object, b: object) -> bool:
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    b = b.resolve_conj()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8) if a.numel() else a, b.contiguous().reshape(-1).view(torch.uint8) if b.numel() else b)


def mutate(value: object) -> None:
    """Change a tensor in place, as a training step right after ``emit`` would."""
    if isinstance(value, np.ndarray):
        value += 1
    elif isinstance(value, torch.Tensor) and value.numel():
        if value.dtype == torch.bool:
            value.logical_not_()
        else:
            value.add_(1)


def same_state(got: dict, want: dict) -> None:
    assert got["epoch"] == want["epoch"]
    assert got["optim"].keys() == want["optim"].keys()
    for name, v in want["optim"].items():
        assert equal(got["optim"][name], v), name


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_small_tensors_travel_in_batches_bit_exact_and_as_snapshots(make_daemon, fmt: str) -> None:
    d = shm_daemon(make_daemon, format=fmt, chunk_size="256KiB")
    with d.producer("b", transport="shm", staging_size="2MiB") as p:  # small: batches wrap the ring
        want = {}
        for step in (1, 2):
            s = small_state(step)
            want[step] = {"optim": {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy())
                                    for k, v in s["optim"].items()}, "epoch": step}
            seq = p._connection.seq
            if step == 1:
                handle = p.save(s, step)
            else:
                with p.checkpoint(step) as handle:
                    for name, t in s["optim"].items():
                        p.emit(f"optim.{name}", t)
                        mutate(t)  # right after emit: must not reach the checkpoint
            for t in s["optim"].values():
                mutate(t)  # right after save returned
            handle.wait(60)
            assert p._connection.seq - seq < len(s["optim"]) // 10  # one message per batch, not per tensor
    same_state(ckptd.load("b", 1, root=d.root, verify=True), want[1])
    flat = ckptd.load("b", 2, root=d.root, verify=True)
    same_state({"optim": {k.removeprefix("optim."): v for k, v in flat.items()}, "epoch": 2}, want[2])
    assert reader.verify("b", 2, root=d.root)[1] == []


def test_a_batch_that_names_memory_outside_the_arena_fails_its_step_only(make_daemon) -> None:
    daemon = shm_daemon(make_daemon)
    with daemon.producer("bad", transport="shm", staging_size="1MiB") as p:
        p.save({"x": torch.ones(3)}, 1).wait(30)
        seq = p._connection.number()  # a hand-made message through the producer's own connection
        p._connection.transport.send(wire.encode("tensors", seq=seq, step=2,
                                                 items=[["y", "float32", [4], 16, False, 2**40]]))
        with pytest.raises(ckptd.CheckpointError, match="outside the .* bytes of shared staging memory"):
            p.commit(2).wait(30)
        assert p.save({"z": torch.ones(2)}, 3).wait(30).step == 3  # the session serves on


def test_malformed_batches_are_protocol_errors() -> None:
    good = {"seq": 1, "step": 1, "items": [["a", "float32", [2], 8, False, 0]]}
    assert wire.batch_pieces(wire.decode([wire.encode("tensors", **good)])[0])[0]["length"] == 8
    for items in ([["a", "float32", [2], 8, False]], [["a", "float32", [-2], 8, False, 0]],
                  [["a", "float32", [2], 8, "no", 0]], [[1, "float32", [2], 8, False, 0]], "x"):
        with pytest.raises(ProtocolError, match="'tensors' message field 'items' has a bad value"):
            wire.decode([wire.encode("tensors", seq=1, step=1, items=items)])


@pytest.mark.parametrize("threads", [1, 4])
def test_writer_threads_write_chunk_files_side_by_side_bit_exact(make_daemon, threads: int) -> None:
    d = shm_daemon(make_daemon, chunk_size="1MiB", writer_threads=threads)
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(2**16 + i, generator=g) for i in range(40)}  # ~10 MiB, ~10 files
    with d.producer("wt", transport="shm", staging_size="16MiB") as p:
        p.save(state, 1).wait(60)
        p.save({k: v * 2 for k, v in state.items()}, 2).wait(60)
    files = [n for n in os.listdir(d.root / "wt" / "step-000000000001") if layout.CHUNK.fullmatch(n)]
    assert len(files) >= 8
    for step, factor in ((1, 1), (2, 2)):
        got = ckptd.load("wt", step, root=d.root, verify=True)
        assert all(torch.equal(got[k], v * factor) for k, v in state.items())
    referenced_files_only(d.root)


@pytest.mark.parametrize("threads, staging, fmt", [(2, "16MiB", "chunk"), (1, "16MiB", "chunk"),
                                                    (2, "1MiB", "chunk"), (2, "16MiB", "hdf5")])
def test_large_tensors_written_in_pieces_side_by_side_load_bit_exact(make_daemon, threads: int, staging: str,
                                                                       fmt: str) -> None:
    """Tensors of ``chunk_size`` or more that arrive whole (``staging`` holds them) are
    written in pieces of ``chunk_size`` side by side by the pool (``Writer.write_whole``);
    in pieces (1 MiB of staging), or with one writer thread, or in HDF5, they stream.
    Sizes around ``chunk_size``, odd ones (a last partial block), 0-d and empty tensors
    between them; each chunk file is a safetensors file that safetensors reads alone."""
    from safetensors import safe_open

    d = shm_daemon(make_daemon, chunk_size="256KiB", writer_threads=threads)
    g = torch.Generator().manual_seed(7)
    k = 2**18
    state = {"scalar": torch.tensor(2.5), "empty": torch.empty(0, 5), "at": torch.randn(k // 4, generator=g),
             "above": torch.randint(0, 255, (k + 1,), dtype=torch.uint8, generator=g),
             "small": torch.randn(77, generator=g).to(torch.bfloat16),
             "three_and_a_half": torch.randint(0, 255, (7 * k // 2 + 3,), dtype=torch.uint8, generator=g),
             "odd_floats": torch.randn(3 * k // 4 + 1, generator=g), "scalar64": torch.tensor(-1, dtype=torch.int64)}
    with d.producer("big", transport="shm", staging_size=staging, format=fmt) as p:
        for step in (1, 2, 3):  # a general save, then the cached plan's
            p.save(state, step).wait(60)
            got = ckptd.load("big", step, root=d.root, verify=True)
            assert got.keys() == state.keys()
            assert all(equal(got[name], t) for name, t in state.items()), step
            for t in state.values():
                mutate(t)
    folder = d.root / "big" / "step-000000000003"
    manifest = json.loads((folder / "manifest-r00000.json").read_text())["tensors"]
    for name, t in state.items():
        if fmt == "chunk" and t.numel():
            with safe_open(folder / manifest[name]["file"], "pt") as f:
                assert torch.equal(f.get_tensor(name), got[name])
    referenced_files_only(d.root)


def test_a_plan_refused_before_its_first_part_ships_gives_its_staging_back(make_daemon, monkeypatch) -> None:
    """A save whose plan ships parts as it copies (``Plan.SHIP`` scaled down 512x), refused
    at its first part (a name emitted in the step already): a ValueError, and its region
    of staging, which holds one such save, is free again: the plan serves the next save."""
    from ckptd.producer import plan

    monkeypatch.setattr(plan, "SHIP", 2**16)
    d = shm_daemon(make_daemon)
    g = torch.Generator().manual_seed(11)
    state = {f"w{i}": torch.randn(2**15, generator=g) for i in range(8)}  # 8 tensors of 128 KiB
    with d.producer("refused", transport="shm", staging_size="1536KiB", timeout=10) as p:
        p.save(state, 1).wait(60)  # the general way, which makes the plan
        p.save(state, 2).wait(60)
        uses = sum(pl.uses for pl in p._stager.save_plans)
        p.emit("w3", state["w3"], step=3)
        with pytest.raises(ValueError, match="'w3' was already emitted in step 3"):
            p.save(state, 3)  # which aborts step 3
        p.save(state, 4).wait(60)
        assert sum(pl.uses for pl in p._stager.save_plans) == uses + 1
    got = ckptd.load("refused", 4, root=d.root, verify=True)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert [i.step for i in ckptd.list_checkpoints("refused", root=d.root)] == [1, 2, 4]


@pytest.mark.parametrize("point", ["3 files", "after commit sent"])
def test_kill_9_during_pooled_writes_leaves_every_listed_step_loadable(make_daemon, point: str) -> None:
    d = shm_daemon(make_daemon, chunk_size="1MiB", writer_threads=4)
    p = d.producer(staging_size="64MiB", timeout=60, heartbeat=0.2)
    g = torch.Generator().manual_seed(1)
    first = {f"a{i}": torch.randn(2**18, generator=g) for i in range(4)}
    second = {**{f"b{i}": torch.randn(2**18, generator=g) for i in range(24)},
              **{f"s{i}": torch.randn(100, generator=g) for i in range(500)}}  # batched, too
    p.save(first, 1).wait(30)
    handle = p.save(second, 2)
    if point.endswith("files"):
        wait_for_files(d.root / "t" / "step-000000000002", 3)
    d.kill()
    try:
        committed = handle.wait(30).step == 2
    except ckptd.CheckpointError:
        committed = False
    d.start()  # start-up removes what the crash left
    listed = [i.step for i in ckptd.list_checkpoints("t", root=d.root)]
    assert listed == ([1, 2] if committed else [1])
    for step, want in ((1, first), (2, second))[:len(listed)]:
        got = ckptd.load("t", step, root=d.root, verify=True)
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    referenced_files_only(d.root)
    try:
        p.close()
    except ckptd.CheckpointError:
        pass  # step 2's failure, if it failed


def saved(make_daemon, fmt: str, **hdf5: object) -> tuple[object, dict]:
    d = shm_daemon(make_daemon, format=fmt, chunk_size="512KiB", tables={"hdf5": hdf5} if hdf5 else None)
    s = small_state(7, n=200)
    s["optim"].update(w=torch.randn(300, 70), d=torch.randn(999).double())
    contiguous = {"optim": {k: (v.resolve_conj().contiguous() if isinstance(v, torch.Tensor) else v)
                            for k, v in s["optim"].items()}, "epoch": 7}
    with d.producer("o", transport="shm", staging_size="8MiB") as p:
        p.save(contiguous, 1).wait(60)
    return d, contiguous


@pytest.mark.parametrize("fmt,hdf5", [("chunk", {}), ("hdf5", {}), ("hdf5", {"chunk_shape": "auto"})])
def test_load_out_reads_into_the_callers_tensors(make_daemon, fmt: str, hdf5: dict) -> None:
    d, want = saved(make_daemon, fmt, **hdf5)
    out = {"optim": {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v))
                     for k, v in want["optim"].items()}, "epoch": 0}
    got = ckptd.load("o", 1, root=d.root, out=out, verify=True)
    same_state(got, want)
    assert all(got["optim"][k] is t for k, t in out["optim"].items())  # the very same objects, filled
    same_state({"optim": out["optim"], "epoch": 7}, want)
    # a flat {name: tensor} of some of them, also fine
    part = {"optim.w": torch.empty(300, 70)}
    got = ckptd.load("o", 1, root=d.root, out=part)
    assert got["optim"]["w"] is part["optim.w"] and torch.equal(part["optim.w"], want["optim"]["w"])


def test_load_out_refuses_what_cannot_take_the_bytes(make_daemon) -> None:
    d, want = saved(make_daemon, "chunk")
    for bad, why in (({"optim.w": torch.empty(70, 300)}, r"float32 \[300, 70\].*out= holds a cpu tensor of float32 \[70, 300\]"),
                     ({"optim.w": torch.empty(70, 300).t()}, "not contiguous"),
                     ({"optim.w": torch.empty(300, 70, dtype=torch.float64)}, "of float64"),
                     ({"optim.nope": torch.empty(1)}, "has no tensor named 'optim.nope'")):
        with pytest.raises(ValueError, match=why):
            ckptd.load("o", 1, root=d.root, out=bad)
    with pytest.raises(ValueError, match="choose one"):
        ckptd.load("o", 1, root=d.root, out={}, mmap=True)


def _corrupt_one_byte(step_dir: Path, manifest_tensor: str) -> None:
    rec = json.loads((step_dir / "manifest-r00000.json").read_text())["tensors"][manifest_tensor]
    with open(step_dir / rec["file"], "r+b") as f:
        f.seek(rec["offset"] + rec["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_load_out_verify_catches_a_damaged_tensor(make_daemon) -> None:
    d, want = saved(make_daemon, "chunk")
    _corrupt_one_byte(d.root / "o" / "step-000000000001", "optim.w")
    with pytest.raises(CheckpointCorrupt, match="'optim.w': does not match its checksum"):
        ckptd.load("o", 1, root=d.root, out={"optim.w": torch.empty(300, 70)}, verify=True)


def mapped_files(pid: int | str = "self") -> dict[str, list[tuple[int, int]]]:
    spans: dict[str, list[tuple[int, int]]] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            spans.setdefault(parts[5], []).append((lo, hi))
    return spans


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_load_mmap_maps_the_files_copy_on_write(make_daemon, fmt: str) -> None:
    d, want = saved(make_daemon, fmt)
    got = ckptd.load("o", 1, root=d.root, mmap=True, verify=True)
    same_state(got, want)
    spans = [s for path, ss in mapped_files().items() if "/step-000000000001/" in path for s in ss]
    w = got["optim"]["w"]
    assert any(lo <= w.data_ptr() < hi for lo, hi in spans)  # mapped from the file, not read
    w.add_(1)  # copy-on-write: this process's copy changes, the file does not
    same_state(ckptd.load("o", 1, root=d.root, verify=True), want)
    _corrupt_one_byte(d.root / "o" / "step-000000000001", "optim.w")
    with pytest.raises(CheckpointCorrupt, match="does not match its checksum"):
        ckptd.load("o", 1, root=d.root, mmap=True, verify=True)
    with pytest.raises(ValueError, match="mmap=True"):
        ckptd.load("o", 1, root=d.root, mmap=True, map_location="cuda")


@pytest.mark.parametrize("readers", [1, 4])
def test_reads_across_files_in_parallel_are_bit_exact(make_daemon, monkeypatch, readers: int) -> None:
    monkeypatch.setattr(tiers_files, "READERS", readers)
    d, want = saved(make_daemon, "chunk")
    assert len({r.file for r in reader.find("o", 1, d.root)[1][0].tensors.values()}) >= 3
    same_state(ckptd.load("o", 1, root=d.root, verify=True), want)
    _corrupt_one_byte(d.root / "o" / "step-000000000001", "optim.w")
    problems = reader.verify("o", 1, root=d.root)[1]
    assert len(problems) == 1 and "'optim.w'" in problems[0]


def test_a_replaced_manifest_is_read_again_not_from_the_cache(tmp_path: Path) -> None:
    from ckptd.durable import atomic_write
    from ckptd.manifest import TensorRecord

    def manifest(step_time: float) -> Manifest:
        rec = TensorRecord(dtype="float32", shape=[1], file=layout.chunk_name(0, 0), key="a", offset=4096,
                           nbytes=4, checksum="xxh3_64:0123456789abcdef")
        return Manifest(run="r", step=1, rank=0, world_size=1, time=step_time, tensors={"a": rec})

    path = tmp_path / "manifest-r00000.json"
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for t in (1.0, 2.0, 3.0):
            atomic_write(path, manifest(t).to_json())
            assert manifestcache.read(path.name, dir_fd, str(path)).time == t
            assert manifestcache.read(path.name, dir_fd, str(path)) is manifestcache.read(path.name, dir_fd, str(path))
    finally:
        os.close(dir_fd)


def test_load_to_cuda_goes_through_pinned_buffers_or_says_there_is_no_device(daemon, monkeypatch) -> None:
    """Here (no GPU) the clear error; on a machine with one, the path itself, small
    buffers so that a tensor crosses several of them (benchmarks/cuda_check.py measures it)."""
    from ckptd import devicecopy

    state = {"w": torch.randn(3000), "b": torch.tensor([True, False]), "z": torch.zeros(0), "c": torch.randn(5, dtype=torch.complex64)}
    with daemon.producer() as p:
        p.save(state, 1).wait(30)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"map_location='cuda'.*torch.cuda.is_available\(\) is False"):
            ckptd.load("t", root=daemon.root, map_location="cuda")
        assert torch.equal(ckptd.load("t", root=daemon.root, map_location="cpu")["w"], state["w"])
        return
    monkeypatch.setattr(devicecopy, "SLOT", 4096)
    out = ckptd.load("t", root=daemon.root, map_location="cuda", verify=True)
    for k, v in state.items():
        assert out[k].device.type == "cuda" and torch.equal(out[k].cpu(), v)


# -- randomized: save, emit and emit_many, layouts that repeat or change, staging made ahead ------
def _random_state(rng, names: list[str], g: torch.Generator) -> dict[str, object]:
    """Tensors of ``names``: mostly small (batched), some large (alone), a few numpy arrays
    or strided views (the general way), each of a dtype and shape drawn per name."""
    out: dict[str, object] = {}
    kinds = ["small", "small", "small", "large", "strided", "scalar"] + ["numpy"] * (rng.random() < 0.3)  # no plan with numpy
    for name in names:
        kind = rng.choice(kinds)
        if kind == "large":
            out[name] = torch.randn(2**17 + rng.randint(0, 999), generator=g)
        elif kind == "scalar":
            out[name] = torch.tensor(rng.random(), dtype=rng.choice([torch.float32, torch.float64]))
        elif kind == "numpy":
            out[name] = np.arange(rng.randint(1, 40), dtype=np.int16)
        elif kind == "strided":
            out[name] = torch.randn(7, rng.randint(1, 9), generator=g).t()
        else:
            dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64])
            out[name] = (torch.randn(rng.randint(0, 300), generator=g) * 50).to(dtype)
    return out


def _change(rng, state: dict[str, object], g: torch.Generator) -> str:
    """Keep the layout (new values, in place), or change one thing of it."""
    how = rng.choice(["same", "same", "same", "dtype", "shape", "added", "removed", "replaced"])
    name = rng.choice(list(state))
    t = state[name]
    if how == "same" or not isinstance(t, torch.Tensor) or not t.is_contiguous():
        for v in state.values():
            mutate(v)
        return "same"
    if how == "dtype":
        state[name] = t.double() if t.dtype != torch.float64 else t.float()
    elif how == "shape" and t.numel() > 1:
        state[name] = t.reshape(1, -1).clone()
    elif how == "added":
        state[f"n{rng.randint(0, 10**6)}"] = torch.randn(rng.randint(1, 99), generator=g)
    elif how == "removed" and len(state) > 2:
        del state[name]
    else:
        state[name] = torch.randn(t.shape, generator=g).to(t.dtype)  # another tensor, same signature
    return how


@pytest.mark.parametrize("seed, grows, ship, fmt", [(1, False, False, "chunk"), (2, False, False, "chunk"),
                                                     (5, False, True, "chunk"), (3, True, False, "chunk"),
                                                     (4, True, True, "chunk"), (6, False, True, "hdf5")])
def test_randomized_saves_emits_and_emit_many_with_changing_layouts(make_daemon, monkeypatch: pytest.MonkeyPatch,
                                                                   seed: int, grows: bool, ship: bool,
                                                                   fmt: str) -> None:
    """2: numpy arrays (no plan); 5: prepare(), no expected_bytes. ``grows``: staging
    scaled down 64-128x (starts at 512 KiB, 1 MiB made on the spot for a larger
    checkpoint, grown in steps of 512 KiB; the states take 1.5-4 MiB) and no hint:
    the first checkpoints stream, arenas are made on the spot and in the background
    and swapped between steps, under plans. ``ship``: plans of 128 KiB or more ship
    their messages each 64 KiB copied (``Plan.SHIP`` scaled down 512x)."""
    import random

    from ckptd.producer import plan, sizing

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    shipping = []  # saves whose plan shipped its messages as it copied
    if ship:
        monkeypatch.setattr(plan, "SHIP", 2**16)
        copy_shipping = plan.Plan._copy_shipping
        monkeypatch.setattr(plan.Plan, "_copy_shipping", lambda *a: shipping.append(1) or copy_shipping(*a))
    d = shm_daemon(make_daemon, chunk_size="1MiB")
    ahead = rng.choice([{"expected_bytes": "6MiB"}, {}])  # staging made at its size, or grown into
    if grows:
        ahead = {}
        monkeypatch.setattr(sizing, "INITIAL", 2**19)
        monkeypatch.setattr(sizing, "BRIDGE", 2**20)
        monkeypatch.setattr(sizing, "GRAIN", 2**19)
    expected: dict[int, dict[str, object]] = {}
    with d.producer("rnd", transport="shm", staging_size="auto", format=fmt, **ahead) as p:
        state = _random_state(rng, [f"t{i}" for i in range(rng.randint(20, 40))], g)
        served = 0  # emit_many calls the plan of an earlier call served
        sizes: set[int] = set()  # staging after each step
        if not ahead and not grows:
            p.prepare(state)
        planned = not any(isinstance(v, np.ndarray) for v in state.values())
        for step in range(1, 9):
            if step == 8:  # the last two: the same layout, so that a plan serves the last
                for v in state.values():
                    mutate(v)
            elif step > 1:
                _change(rng, state, g)
            want = {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in state.items()}
            api = rng.choice(["save", "emit", "emit_many", "emit_many"]) if step < 7 else "emit_many"
            if api == "save":
                handle = p.save(state, step)
            else:
                with p.checkpoint(step) as handle:
                    if api == "emit":
                        for name, t in state.items():
                            p.emit(name, t)
                    else:
                        uses = sum(pl.uses for pl in p._stager.many_plans)
                        p.emit_many(state)
                        served += sum(pl.uses for pl in p._stager.many_plans) > uses
            for v in state.values():
                mutate(v)  # right after the call: must not reach the checkpoint
            expected[step] = want
            if step >= 7 or rng.random() < 0.5:
                handle.wait(60)  # else several steps in flight: plans find staging busy
            sizes.add(p.stats()["staging_bytes"])
            if step == 7 and max(v.nbytes for v in state.values()) > p.stats()["staging_bytes"] // 4:
                planned = False  # staging (not grown yet) was too small for a plan at step 7 (Plan.build)
        p.flush(60)
        assert p.stats()["transport"] == "shm"
        assert served >= planned  # step 8 at least
        assert len(shipping) >= planned * ship
        if grows:
            assert max(sizes) > 2**19, sizes  # it grew from 512 KiB
    for step, want in expected.items():
        got = ckptd.load("rnd", step, root=d.root, verify=True)
        assert got.keys() == want.keys(), step
        for name, v in want.items():
            assert equal(got[name], v), (step, name)
