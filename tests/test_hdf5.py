"""format = "hdf5": the files as other HDF5 tools see them, names, options, selective
reads, crashes, and a run that mixes formats. The dtype/shape round trip of both
formats is tests/test_roundtrip.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ckptd
from ckptd import CheckpointError, index, layout
from ckptd.format import hdf5 as hdf5_format
from ckptd.config import ConfigError, load as load_config
from test_crash import referenced_files_only
from test_roundtrip import cases, same_bits

STEP1 = "step-000000000001"
H5 = layout.h5_name(0)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def emit_all(d, tensors: dict[str, torch.Tensor], step: int = 1, **producer: object) -> ckptd.CheckpointInfo:
    with d.producer(**producer) as p:
        with p.checkpoint(step) as h:
            for name, t in tensors.items():
                p.emit(name, t)
        return h.wait(60)


def manifest(d, step_dir: str = STEP1) -> dict:
    return json.loads((d.root / "t" / step_dir / layout.manifest_name(0)).read_bytes())


@pytest.mark.needs("h5dump")
def test_files_open_with_plain_h5py_and_h5dump(make_daemon) -> None:
    """Every dataset holds the bytes emitted, under its name, with its torch dtype; dtypes
    HDF5 lacks are same-width unsigned integers; h5dump -H lists every dataset."""
    d = make_daemon(format="hdf5")
    tensors = cases()
    info = emit_all(d, tensors)
    assert info.format == "hdf5"
    step = d.root / "t" / STEP1
    assert sorted(os.listdir(step)) == sorted([H5, layout.manifest_name(0)])
    records = manifest(d)["tensors"]
    with h5py.File(step / H5, "r") as f:
        assert len(f) == len(tensors)
        for name, t in tensors.items():
            ds = f[records[name]["key"]]
            assert ds.attrs["name"] == name and ds.attrs["torch_dtype"] == dtypes_name(t)
            assert ds.shape == tuple(t.shape), name
            assert ds[()].tobytes() == raw_bytes(t), name
            if dtypes_name(t) in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "complex32"):
                assert ds.dtype.kind == "u" and ds.dtype.itemsize == t.element_size(), name
            elif t.dtype == torch.bool:
                assert ds.dtype == np.bool_
            elif t.dtype == torch.complex64:
                assert ds.dtype == np.complex64
        assert f.attrs["run"] == "t" and f.attrs["step"] == 1
    dump = subprocess.run(["h5dump", "-H", str(step / H5)], capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    listed = re.findall(r'^\s*DATASET "(.*)" \{', dump.stdout, re.M)
    assert sorted(listed) == sorted(r["key"] for r in records.values())


def dtypes_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


NAMES = ["a/b", "a.b", "a%2Fb", "a%b", "a%25b", "/", "//", "/a", "a/", ".", "..", "%2E", "%",
         "ü/ß", "ü.ß", "日本/語", "a b", " a", "a/b/c", "a.b.c", "a.b/c", "a/b.c", "😀"]


def test_hostile_names_survive_and_stay_distinct(make_daemon) -> None:
    d = make_daemon(format="hdf5")
    tensors = {n: torch.full((2,), float(i)) for i, n in enumerate(NAMES)}
    emit_all(d, tensors)
    out = ckptd.load("t", root=d.root, verify=True)
    assert set(out) == set(NAMES)
    assert all(torch.equal(out[n], t) for n, t in tensors.items())
    keys = {r["key"] for r in manifest(d)["tensors"].values()}
    assert len(keys) == len(NAMES)  # no two names share a dataset
    with h5py.File(d.root / "t" / STEP1 / H5, "r") as f:
        assert sorted(f[k].attrs["name"] for k in f) == sorted(NAMES)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12, alphabet=st.sampled_from("ab/.%25FE ü")), min_size=2, max_size=6))
def test_name_mapping_is_injective(names: list[str]) -> None:
    keys = [hdf5_format.dataset_key(n) for n in names]
    for n, k in zip(names, keys):
        assert "/" not in k and k != "." and hdf5_format.tensor_name(k) == n
    assert len(set(keys)) == len(set(names))


@pytest.mark.parametrize("options", [
    {"compression": "gzip", "level": 1, "chunk_shape": "auto"},
    {"compression": "lzf", "chunk_shape": "auto", "fletcher32": True},
    {"chunk_shape": "auto"},
])
def test_chunked_and_compressed_datasets(make_daemon, options: dict) -> None:
    """Filters apply; pieces that split rows (max_frame smaller than a row, and not a
    multiple of one) are reassembled; offsets are recorded only where real."""
    d = make_daemon(format="hdf5", max_frame="1MiB", chunk_size="2MiB", tables={"hdf5": options})
    tensors = {k: v for k, v in cases().items() if not k.startswith("view/")}
    tensors["rows"] = torch.arange(1000 * 333, dtype=torch.float32).reshape(1000, 333)  # 1332-byte rows
    tensors["wide"] = torch.arange(2 * 700_001, dtype=torch.int32).reshape(2, 700_001)  # rows > a piece
    tensors["zeros"] = torch.zeros(2**20)  # compresses
    emit_all(d, tensors, staging_size="4MiB")
    out = ckptd.load("t", root=d.root, verify=True)
    for name, t in tensors.items():
        assert same_bits(out[name], t), name
    records = manifest(d)["tensors"]
    with h5py.File(d.root / "t" / STEP1 / H5, "r") as f:
        for name, t in tensors.items():
            ds, rec = f[records[name]["key"]], records[name]
            if t.dim() and t.numel():
                assert ds.chunks is not None and rec["offset"] is None, name
                assert ds.compression == (None if options.get("compression", "none") == "none"
                                          else options["compression"]), name
                assert ds.fletcher32 == options.get("fletcher32", False)
            else:  # scalars and empty tensors cannot be chunked
                assert ds.chunks is None
    if "compression" in options:
        assert os.path.getsize(d.root / "t" / STEP1 / H5) < sum(raw_bytes(t).__len__() for t in tensors.values())


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(re.search(r"^rchar: (\d+)", f.read(), re.M).group(1))


@pytest.mark.parametrize("options", [{}, {"compression": "gzip", "level": 1, "chunk_shape": "auto"}])
def test_selective_load_reads_only_the_named_datasets(make_daemon, options: dict) -> None:
    """Count the bytes this process reads (/proc/self/io rchar): one tensor of 8 costs
    about its own size, whether read by offset (contiguous) or through h5py (gzip)."""
    d = make_daemon(format="hdf5", chunk_size="1MiB", tables={"hdf5": options})
    g = torch.Generator().manual_seed(0)
    # random bits in the low bytes, so gzip cannot shrink the payload much
    tensors = {f"t{i}": torch.randint(0, 2**16, (2**21,), generator=g, dtype=torch.int32) for i in range(8)}
    emit_all(d, tensors, staging_size="80MiB")
    size = 4 * 2**21
    ckptd.load("t", root=d.root, names=["t0"])  # imports and the first opening are not measured
    before = bytes_read()
    one = ckptd.load("t", root=d.root, names=["t5"])
    one_read = bytes_read() - before
    before = bytes_read()
    everything = ckptd.load("t", root=d.root)
    all_read = bytes_read() - before
    assert list(one) == ["t5"] and torch.equal(one["t5"], tensors["t5"])
    assert all(torch.equal(everything[k], v) for k, v in tensors.items())
    file_size = os.path.getsize(d.root / "t" / STEP1 / H5)
    assert one_read < file_size / 4, (one_read, file_size)
    assert all_read > file_size * 0.9, (all_read, file_size)
    if not options:  # contiguous: exactly the tensor's bytes, plus the manifest
        assert size <= one_read < size + 64 * 2**10


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_kill_daemon_during_an_hdf5_write(make_daemon, compression: str) -> None:
    """kill -9 while r00000.h5 is being written: the partial file is never part of a
    complete checkpoint, and the restarted daemon removes it."""
    options = {"compression": "gzip", "level": 9, "chunk_shape": "auto"} if compression == "gzip" else {}
    d = make_daemon(format="hdf5", chunk_size="1MiB", tables={"hdf5": options})
    p = d.producer(staging_size="80MiB", timeout=60, heartbeat=0.2)
    g = torch.Generator().manual_seed(2)
    p.save({"w": torch.randn(1000, generator=g)}, 1).wait(30)
    state2 = {f"w{i}": torch.randn(2**18, generator=g) for i in range(48)}  # 48 MiB, 1 MiB each
    handle = p.save(state2, 2)
    partial = d.root / "t" / "step-000000000002" / H5
    deadline = time.monotonic() + 20
    while not (partial.exists() and partial.stat().st_size >= 2**20) and time.monotonic() < deadline:
        time.sleep(0.0005)
    d.kill()
    try:
        handle.wait(30)
        committed = True
    except CheckpointError as exc:
        committed = False
        assert "daemon" in str(exc)
    if compression == "gzip":  # random floats at level 9: seconds of work, far from done
        assert not committed
    if not committed:
        assert partial.exists()  # the crash left it...
        assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [1]  # ...never listed
        assert index.step_info(partial.parent) is None
    d.start()
    assert not partial.exists() or committed  # ...and start-up removed it
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == ([1, 2] if committed else [1])
    referenced_files_only(d.root)
    latest = ckptd.load("t", root=d.root, verify=True)
    assert set(latest) == (set(state2) if committed else {"w"})
    assert p.save({"w": torch.ones(3)}, 3).wait(30).format == "hdf5"  # the producer goes on
    try:
        p.close()
    except CheckpointError:
        pass  # close re-raises the failed step 2


def test_a_slow_hdf5_write_stalls_neither_the_loop_nor_chunk_files(make_daemon) -> None:
    """While the ckptd-hdf5 thread gzips a large step, the daemon keeps receiving,
    answering and committing: another run's chunk checkpoint completes first. The
    write rate holds the large step for 8 s or more, however fast the CPU gzips."""
    d = make_daemon(tables={"daemon": {"write_rate": "6MiB"},
                            "hdf5": {"compression": "gzip", "level": 9, "chunk_shape": "auto"}})
    g = torch.Generator().manual_seed(3)
    slow = d.producer("slow", format="hdf5", staging_size="64MiB")
    state = {f"w{i}": torch.randn(2**18, generator=g) for i in range(48)}  # 48 MiB: seconds of gzip
    handle = slow.save(state, 1)
    h5 = d.root / "slow" / STEP1 / H5
    deadline = time.monotonic() + 20
    while not h5.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    with d.producer("fast") as fast:  # a new session, a commit, a query: all through the busy daemon
        assert fast.save({"w": torch.ones(1000)}, 1).wait(30).format == "chunk"
        assert fast.latest("fast").step == 1
    assert not handle.done()  # the HDF5 file is still being written
    assert handle.wait(120).format == "hdf5"
    slow.close()
    out = ckptd.load("slow", root=d.root, verify=True)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_run_mixes_formats_and_loads_the_same(make_daemon) -> None:
    """The daemon's default is chunk; one producer asks for HDF5 in its hello. The same
    state loads identically, with the same types, from either format."""
    d = make_daemon()
    state = {"model": {"w": torch.randn(4, 5), "b": torch.zeros(5, dtype=torch.bfloat16)},
             "np": np.arange(6, dtype=np.int16), "epoch": 3, "lr": (0.1, None)}
    with d.producer() as p:
        p.save(state, 1).wait(30)
    with d.producer(format="hdf5") as p:
        p.save(state, 2).wait(30)
    with d.producer(format="chunk") as p:
        p.save(state, 3).wait(30)
    infos = ckptd.list_checkpoints("t", root=d.root)
    assert [(i.step, i.format) for i in infos] == [(1, "chunk"), (2, "hdf5"), (3, "chunk")]
    assert os.listdir(d.root / "t" / "step-000000000002").count(H5) == 1
    chunk, hdf5 = ckptd.load("t", 1, root=d.root), ckptd.load("t", 2, root=d.root, verify=True)
    assert chunk.keys() == hdf5.keys() and hdf5["epoch"] == 3 and hdf5["lr"] == (0.1, None)
    assert isinstance(hdf5["np"], np.ndarray) and hdf5["np"].dtype == np.int16
    assert np.array_equal(hdf5["np"], state["np"])
    for k in ("w", "b"):
        assert same_bits(hdf5["model"][k], chunk["model"][k]) and same_bits(hdf5["model"][k], state["model"][k])
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", "t", "2", "--root", str(d.root)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_damage_to_an_hdf5_file_is_found(make_daemon) -> None:
    """verify names a flipped bit (read by offset); a truncated file, as a copy in
    progress would leave it, is not a complete checkpoint (the manifest records its size)."""
    d = make_daemon(format="hdf5", tables={"hdf5": {"compression": "gzip", "chunk_shape": "auto"}})
    with d.producer() as p:
        p.save({"s": torch.tensor(1.5), "v": torch.arange(1000.0)}, 1).wait(30)
    step = d.root / "t" / STEP1
    rec = manifest(d)["tensors"]["s"]
    assert rec["offset"] is not None and manifest(d)["tensors"]["v"]["offset"] is None
    data = bytearray((step / H5).read_bytes())
    data[rec["offset"]] ^= 0x40
    (step / H5).write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", "t", "--root", str(d.root)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "'s'" in r.stderr and H5 in r.stderr, r.stderr
    copy = d.root / "t" / "step-000000000002"
    shutil.copytree(step, copy)
    assert index.step_info(step) is not None
    with open(copy / H5, "r+b") as f:
        f.truncate(os.path.getsize(step / H5) - 100)
    assert index.step_info(copy) is None


def test_hdf5_settings_are_checked(tmp_path: Path, make_daemon) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[hdf5]\ncompression = "gzip"\n')
    with pytest.raises(ConfigError, match=r'\[hdf5\] of .*needs chunk_shape = "auto"'):
        load_config(cfg)
    cfg.write_text('[hdf5]\ncompression = "zstd"\n')
    with pytest.raises(ConfigError, match="compression"):
        load_config(cfg)
    cfg.write_text('[daemon]\nformat = "hdf5"\n[hdf5]\ncompression = "gzip"\nlevel = 9\nchunk_shape = "auto"\n')
    c = load_config(cfg)
    assert c.daemon.format == "hdf5" and c.hdf5.level == 9 and c.hdf5.filtered
    with pytest.raises(ValueError, match="format"):
        ckptd.Producer("ipc:///tmp/none", "t", format="zarr")
