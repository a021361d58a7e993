"""Every dtype and shape through a real daemon, back bit-exactly (emit and save).

The conformance suite of the storage formats: each test that takes ``daemon`` or
``fmt`` runs once per format (chunk files and HDF5)."""

from __future__ import annotations

import glob
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckptd
from ckptd import dtypes
from conftest import module_daemon, shared

SHAPES = [(), (0,), (3, 0, 2), (7,), (5, 3), (2, 3, 4)]
ALL_DTYPES = sorted(dtypes.BY_NAME)


@pytest.fixture(scope="module", params=["chunk", "hdf5"])
def fmt(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def fmt_daemon(tmp_path_factory, fmt: str):
    with module_daemon(tmp_path_factory, format=fmt) as d:
        yield d


@pytest.fixture
def daemon(fmt_daemon, request):
    """A daemon whose checkpoints are in ``fmt``, shared by this module's tests of that
    format (each writes a run of its own name)."""
    return shared(request, fmt_daemon)


def random_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of the right width (bool: 0/1), so every bit pattern is exercised."""
    dtype = dtypes.torch_dtype(dtype_name)
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtypes.lookup(dtype_name).itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def cases() -> dict[str, torch.Tensor]:
    out = {}
    for i, d in enumerate(ALL_DTYPES):
        for j, shape in enumerate(SHAPES):
            out[f"{d}/{'x'.join(map(str, shape)) or 'scalar'}"] = random_tensor(d, shape, 100 * i + j)
    base = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    out["view/transposed"] = base.t()
    out["view/strided"] = base[::2, 1::2]
    out["view/expanded"] = torch.tensor([1.5, 2.5]).expand(3, 2)
    out["view/conj"] = torch.randn(4, dtype=torch.complex64).conj()
    out["shared/a"] = base.view(-1)[:10]  # two views of one storage: each stored as its values
    out["shared/b"] = base.view(-1)[5:15]
    return out


def test_every_dtype_and_shape_through_emit(daemon, fmt: str) -> None:
    tensors = cases()
    with daemon.producer("emit") as p:
        with p.checkpoint(1) as handle:
            for name, t in tensors.items():
                p.emit(name, t)
        info = handle.wait(30)
    assert info.format == fmt
    assert info.ntensors == len(tensors)
    assert info.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    loaded = ckptd.load("emit", root=daemon.root, verify=True)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert same_bits(loaded[name], t), name
        assert loaded[name].is_contiguous()


def test_every_dtype_and_shape_through_save(daemon) -> None:
    tensors = cases()
    state = {"tensors": tensors, "list": [tensors["float32/7"], 3], "nested": {"deep": {"x": tensors["int8/5x3"]}}}
    with daemon.producer("save") as p:
        p.save(state, 2).wait(30)
    loaded = ckptd.load("save", 2, root=daemon.root, verify=True)
    for name, t in tensors.items():
        assert same_bits(loaded["tensors"][name], t), name
    assert same_bits(loaded["list"][0], tensors["float32/7"]) and loaded["list"][1] == 3
    assert same_bits(loaded["nested"]["deep"]["x"], tensors["int8/5x3"])


def test_snapshot_survives_overwrite_right_after_emit(daemon) -> None:
    """emit copies: changing the tensor after emit returns must not change the checkpoint."""
    t = torch.arange(1 << 20, dtype=torch.float32)
    expected = t.clone()
    with daemon.producer("snapshot") as p:
        with p.checkpoint(1) as h:
            p.emit("w", t)
            t.fill_(-1)  # an optimizer step, right away
        h.wait(30)
    assert torch.equal(ckptd.load("snapshot", root=daemon.root)["w"], expected)


def test_plain_values_and_containers_keep_their_types(daemon) -> None:
    od = OrderedDict([("b", 1), ("a", 2)])
    state = {
        "none": None, "true": True, "int": -(2**70), "float": 0.1, "nan": float("nan"),
        "inf": float("inf"), "-inf": float("-inf"), "negzero": -0.0, "str": "ünïcode ✓", "bytes": b"\x00\xff",
        "tuple": (1, (2, [3])), "intkeys": {0: "a", 7: "b"}, "od": od,
        "dtype": torch.bfloat16, "device": torch.device("cuda:1"), "size": torch.Size([2, 3]),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3), "np_f64": np.linspace(0, 1, 5),
    }
    with daemon.producer("plain") as p:
        p.save(state, 3).wait(30)
    out = ckptd.load("plain", 3, root=daemon.root)
    assert out["none"] is None and out["true"] is True and out["int"] == -(2**70)
    assert out["float"] == 0.1 and math.isnan(out["nan"]) and out["inf"] == math.inf and out["-inf"] == -math.inf
    assert math.copysign(1, out["negzero"]) == -1
    assert out["str"] == "ünïcode ✓" and out["bytes"] == b"\x00\xff"
    assert out["tuple"] == (1, (2, [3])) and type(out["tuple"][1]) is tuple and type(out["tuple"][1][1]) is list
    assert out["intkeys"] == {0: "a", 7: "b"}
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["b", "a"]
    assert out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cuda:1")
    assert type(out["size"]) is torch.Size and out["size"] == torch.Size([2, 3])
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == np.int16
    assert np.array_equal(out["np"], state["np"]) and np.array_equal(out["np_f64"], state["np_f64"])


def test_numpy_arrays_through_emit_load_as_numpy(daemon) -> None:
    arrays = {
        "f32": np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32),
        "strided": np.arange(30, dtype=np.int64).reshape(5, 6)[:, ::-2],
        "bool": np.array([True, False, True]),
        "c128": np.array([1 + 2j, -3j]),
        "scalar": np.array(7, dtype=np.uint32),
    }
    with daemon.producer("numpy") as p:
        with p.checkpoint(1) as h:
            for name, a in arrays.items():
                p.emit(name, a)
        h.wait(30)
    out = ckptd.load("numpy", root=daemon.root)
    for name, a in arrays.items():
        assert isinstance(out[name], np.ndarray) and out[name].dtype == a.dtype, name
        assert np.array_equal(out[name], a), name


def test_chunk_files_are_plain_safetensors(make_daemon) -> None:
    """safetensors.safe_open reads every chunk without ckptd, and gives the same tensors
    (dtypes safetensors lacks come back as their documented stand-ins).
    HDF5's counterpart: tests/test_hdf5.py."""
    daemon = make_daemon(format="chunk")
    tensors = cases()
    with daemon.producer() as p:
        with p.checkpoint(1) as h:
            for name, t in tensors.items():
                p.emit(name, t)
        h.wait(30)
    files = glob.glob(str(daemon.root / "t" / "step-000000000001" / "*.safetensors"))
    assert len(files) >= 1
    seen = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for key in st.keys():
                seen[key] = st.get_tensor(key)
    assert set(seen) == set(tensors)
    for name, t in tensors.items():
        got = seen[name]
        if got.dtype == t.dtype:
            assert same_bits(got, t), name
        else:  # stored as a same-width stand-in (complex128 -> float64 pairs, ...)
            assert got.contiguous().view(torch.uint8).reshape(-1).tolist() == \
                t.contiguous().reshape(-1).view(torch.uint8).tolist(), name


def test_large_tensor_streams_in_pieces_smaller_than_staging(make_daemon, fmt: str) -> None:
    """A tensor larger than staging and the daemon's frame limit still round-trips."""
    d = make_daemon(max_frame="1MiB", chunk_size="2MiB", format=fmt)
    big = torch.randn(3 * 2**20 // 4 * 3)  # 9 MiB
    small = torch.randn(10)
    with d.producer(staging_size="4MiB") as p:
        with p.checkpoint(1) as h:
            p.emit("small", small)
            p.emit("big", big)
            p.emit("big.t", big.reshape(3, -1).t())  # strided and large
        h.wait(60)
    out = ckptd.load("t", root=d.root, verify=True)
    assert torch.equal(out["big"], big) and torch.equal(out["small"], small)
    assert torch.equal(out["big.t"], big.reshape(3, -1).t())


def test_selective_load_reads_only_named_tensors(daemon) -> None:
    with daemon.producer("selective") as p:
        p.save({"a": torch.ones(3), "b": {"c": torch.zeros(2)}, "n": 1}, 1).wait(30)
    out = ckptd.load("selective", root=daemon.root, names=["b.c"])
    assert list(out) == ["b.c"] and torch.equal(out["b.c"], torch.zeros(2))


def test_daemon_memory_budget_smaller_than_a_chunk_still_completes(make_daemon, fmt: str) -> None:
    """Over budget the daemon stops reading and flushes partial chunks; nothing deadlocks."""
    d = make_daemon(memory_budget="1MiB", chunk_size="4MiB", format=fmt)
    tensors = {f"w{i}": torch.randn(2**16) for i in range(32)}  # 8 MiB in 256 KiB tensors
    with d.producer(staging_size="16MiB") as p:
        with p.checkpoint(1) as h:
            for name, t in tensors.items():
                p.emit(name, t)
        h.wait(60)
    out = ckptd.load("t", root=d.root, verify=True)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


def test_a_step_aborted_and_sent_again_at_once(make_daemon, fmt: str) -> None:
    """The second attempt reuses the first's file names; removing the first's files
    must not remove the second's (it did when the syncer removed them late)."""
    d = make_daemon(chunk_size="1MiB", format=fmt)
    with d.producer() as p:
        for step in range(1, 16):
            with pytest.raises(KeyError):
                with p.checkpoint(step):
                    p.emit("a", torch.randn(2**19))  # 2 MiB: a file of its own, written at once
                    raise KeyError("the training step failed")
            w = torch.randn(2**19)
            assert p.save({"a": w}, step).wait(30).step == step
            assert torch.equal(ckptd.load("t", step, root=d.root, verify=True)["a"], w)
