"""Compressed shares in the bucket (``[remote] compression``) against a real S3 server
(SeaweedFS on 127.0.0.1): uploads compressed, the root keeps plain safetensors, an empty
disk restores bit-exact; readers refuse what they cannot decode, by name."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors import safe_open

import ckptd
from ckptd import config, manifest as manifests
from ckptd.errors import CheckpointCorrupt, ConfigError
from ckptd.remote import catalog, codec, fetch
from ckptd.remote.store import Store
from ckptd.tiers.bucket import fetch_share

URL = "s3://ckptd/packed"


def _state(step: int, seed: int) -> dict:
    """Every kind of tensor the codec meets: several dtypes (bf16, ints, bool), empty and
    0-d tensors, and one larger than a frame (FRAME_BYTES), so spanning frames."""
    g = torch.Generator().manual_seed(seed)
    big = (torch.randn(codec.FRAME_BYTES // 4 + 12345, generator=g) * 0.02).to(torch.float32)
    return {"base": {"big": big, "bf": torch.randn(3000, 7, generator=g).to(torch.bfloat16)},
            "ints": torch.randint(-2**40, 2**40, (5001,), generator=g), "bytes": torch.arange(255, dtype=torch.uint8),
            "i16": torch.randint(-300, 300, (999,), generator=g, dtype=torch.int16),
            "mask": torch.rand(77, generator=g) > 0.5, "f64": torch.randn(33, generator=g, dtype=torch.float64),
            "c64": torch.randn(9, generator=g, dtype=torch.complex64), "empty": torch.empty(0, 3),
            "scalar": torch.tensor(float(step)), "half": torch.randn(4, 5, generator=g).half(), "step": step}


def _equal(a: dict, b: dict) -> None:
    for k, v in b.items():
        if isinstance(v, dict):
            _equal(a[k], v)
        elif isinstance(v, torch.Tensor):
            assert a[k].dtype == v.dtype and a[k].shape == v.shape and torch.equal(a[k], v), k
        else:
            assert a[k] == v


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_compressed_shares_restore_bit_exact_from_the_bucket(s3, make_daemon, monkeypatch, tmp_path, fmt) -> None:
    url = f"{URL}-{fmt}"
    d = make_daemon(tables={"remote": {"url": url, "part_bytes": "5MiB", "compression": "shuffle-zstd"}},
                    chunk_size="1MiB", format=fmt)
    monkeypatch.setenv("CKPTD_CONFIG", str(d.config))
    states = {}
    with d.producer("z") as p:
        for step in (1, 2):  # step 2 reuses step 1's frozen base: copied in the bucket with its frames
            states[step] = _state(step, seed=step if fmt == "hdf5" else 1)
            p.save(states[step], step, frozen=["base.*"] if fmt == "chunk" else None).wait(30)
            p.wait_complete(step, timeout=60)
    store = Store(url)
    local = manifests.Manifest.from_json((d.root / "z/step-000000000002/manifest-r00000.json").read_bytes(), "x")
    remote = catalog.read_manifest(store, "z", 2, 0)
    assert not local.compression and local.format_version < manifests.COMPRESSED_FORMAT_VERSION
    assert remote.format_version == manifests.COMPRESSED_FORMAT_VERSION and set(remote.compression) == set(local.files)
    sizes = catalog.run_objects(store, "z")[2]
    assert sum(sizes[f] for f in local.files) < sum(local.files.values())  # the bucket holds fewer bytes
    assert all(sizes[f] == remote.compression[f].size for f in local.files)
    if fmt == "chunk":  # the root keeps plain safetensors
        first = sorted(local.files)[0]
        with safe_open(str(d.root / "z/step-000000000002" / first), "pt") as fh:
            assert list(fh.keys())
    empty = tmp_path / "fresh-node"
    empty.mkdir()
    for step in (1, 2):  # tensors read straight into memory, frames decoded
        _equal(ckptd.load("z", step, root=empty, remote=url, verify=True), states[step])
    part = ckptd.load("z", 2, root=empty, remote=url, names=["base.big", "scalar"])
    assert torch.equal(part["base.big"], states[2]["base"]["big"]) and float(part["scalar"]) == 2.0
    assert fetch.check(store, [remote]) == []
    landed = fetch_share(store, "z", 2, 0, empty)  # files decoded as they stream in
    assert not landed.compression
    text = (empty / "z/step-000000000002/manifest-r00000.json").read_text()
    assert '"compression"' not in text and json.loads(text)["format_version"] < manifests.COMPRESSED_FORMAT_VERSION
    _equal(ckptd.load("z", 2, root=empty, remote="", verify=True), states[2])


def test_a_reader_refuses_what_it_cannot_decode_by_name(s3, make_daemon, monkeypatch) -> None:
    d = make_daemon(tables={"remote": {"url": URL, "compression": "shuffle-zstd"}})
    monkeypatch.setenv("CKPTD_CONFIG", str(d.config))
    with d.producer("old") as p:
        p.save({"w": torch.randn(1000)}, 1).wait(30)
        p.wait_complete(1, timeout=60)
    data = Store(URL).get(catalog.key("old", 1, "manifest-r00000.json"), manifests.MAX_MANIFEST_BYTES)
    # a ckptd from before compression: its version check is what refuses
    monkeypatch.setattr(manifests, "READABLE_VERSIONS", manifests.READABLE_VERSIONS[:-1])
    with pytest.raises(CheckpointCorrupt, match=r"format_version 4 is not supported .*upgrade ckptd"):
        manifests.Manifest.from_json(data, "bucket")
    monkeypatch.undo()
    d2 = json.loads(data)
    for entry in d2["compression"].values():
        entry["codec"] = "zstd-of-the-future"
    with pytest.raises(CheckpointCorrupt, match=r"codec 'zstd-of-the-future' is not one this ckptd decodes "
                                                r"\(shuffle-zstd\); upgrade ckptd"):
        manifests.Manifest.from_json(json.dumps(d2).encode(), "bucket")
    frames = json.loads(data)
    next(iter(frames["compression"].values()))["size"] += 1
    with pytest.raises(CheckpointCorrupt, match="its frames hold"):
        manifests.Manifest.from_json(json.dumps(frames).encode(), "bucket")


def test_compression_choices(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[remote]\ncompression = "bogus"\n')
    with pytest.raises(ConfigError, match=r"'compression' in \[remote\].*'bogus' is not one of 'none', 'off', "
                                          r"'shuffle-zstd'"):
        config.load(f)
    for value, want in (("off", "none"), ("none", "none"), ("shuffle-zstd", "shuffle-zstd")):
        f.write_text(f'[remote]\ncompression = "{value}"\n')
        assert config.load(f).remote.compression == want


def test_frames_decode_bit_exact_and_damage_is_named() -> None:
    g = torch.Generator().manual_seed(0)
    raw = torch.cat([torch.randn(40000, generator=g).view(torch.uint8), torch.arange(10, dtype=torch.uint8)])
    data = raw.numpy().tobytes()
    frames = codec.segments(len(data), [(0, 160000, 4)])
    packer = codec.Packer(io.BytesIO(data).read, frames, 2)
    stored = b"".join(packer)
    packed = packer.packed()
    out = bytearray()
    unpacker = codec.Unpacker(packed, out.extend, "obj")
    for i in range(0, len(stored), 1000):
        unpacker.feed(stored[i:i + 1000])
    unpacker.close()
    assert bytes(out) == data
    piece = bytearray(3010)
    codec.unpack_range(lambda s, e: stored[s:e], packed, 157000, memoryview(piece), "obj")
    assert bytes(piece) == data[157000:]
    bad = bytearray(stored)
    bad[1] ^= 0xFF  # a plane length; damage inside a plane is what the checksums catch
    with pytest.raises(CheckpointCorrupt, match="obj: a compressed frame does not decode"):
        codec.unpack_range(lambda s, e: bytes(bad[s:e]), packed, 0, memoryview(bytearray(len(data))), "obj")
    short = codec.Unpacker(packed, out.extend, "obj")
    short.feed(stored[:-1])
    with pytest.raises(CheckpointCorrupt, match="obj: the compressed object is shorter"):
        short.close()
