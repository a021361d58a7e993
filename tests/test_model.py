"""A randomized, model-based test of the whole save path: a real daemon, a real producer,
random sequences of states, saves and emit blocks, every step checked against a model.

The fast paths (batches of small tensors, the cached save plan, self-sizing staging,
reuse of unchanged tensors, shards) each have tests of their own; bugs lived where
they meet. Here hypothesis's stateful testing drives them together:

- states mix tensor sizes from 0 bytes to larger than staging, small and large
  interleaved as a ``state_dict()`` has them, every dtype (values are random bytes,
  so NaN payloads, negative zeros and subnormals come along), numpy arrays, tied
  storage (one tensor under two names, a strided view of another), DTensor pieces
  (a one-rank gloo group in this process);
- steps are whole ``save``\\s (with ``frozen=``, ``replicated=``) and ``emit`` blocks;
  and replicated saves of the state by two ranks of a run of its own, the second's
  copy with one bit flipped or not: the step's ``diverged`` names exactly the tensors
  whose bytes differ (docs/training.md);
  the same layout again (the cached plan's hits, with in-place updates between
  saves, and right after ``save`` returns: the snapshot must not see them) or a new
  one (a miss);
- each example runs under one configuration: the smallest ``"auto"`` staging or a
  hand-set size, the daemon's ``chunk_size``, the format, ``reuse_unchanged``.

After every step: it finished within a bound (else the failure shows every
thread's stack and the daemon's log), ``ckptd.load`` gives back every byte,
``verify`` finds nothing, and the step folder's data files, opened with
``safetensors`` or ``h5py`` themselves, hold exactly the step's tensors and values.

CI runs a fixed number of examples from a fixed seed (about a minute);
``CKPTD_MODEL_EXAMPLES`` and ``CKPTD_MODEL_STEPS`` raise them, and
``benchmarks/stress.py --only model`` soaks the same model for as long as asked.
"""

from __future__ import annotations

import copy
import faulthandler
import itertools
import os
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import ckptd
from ckptd import layout
from ckptd.completion import wait_complete
from ckptd.reader import verify
from ckptd.state import flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import Daemon  # noqa: E402

EXAMPLES = int(os.environ.get("CKPTD_MODEL_EXAMPLES", "30"))
STEPS = int(os.environ.get("CKPTD_MODEL_STEPS", "8"))
EMIT_TIMEOUT_S = float(os.environ.get("CKPTD_MODEL_EMIT_TIMEOUT", "5"))  # a wait for staging longer than this fails
COMMIT_TIMEOUT_S = 60.0  # a commit not acknowledged within this is a hang
HANG_S = 600.0  # past this, a step that never returns at all dumps every stack and exits


MIB = 2**20
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.bool,
          torch.int64, torch.int32, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]
NUMPY_DTYPES = {torch.float32, torch.float16, torch.float64, torch.int8, torch.uint8, torch.bool, torch.int64,
                torch.int32, torch.complex64}
# bytes of one tensor, by class: empty; batched (<= 64 KiB); alone but gathered into a
# chunk; a quarter of small staging and more (pieces, a file of its own); beyond staging
SIZES = {"empty": (0, 0), "tiny": (1, 256), "small": (257, 64 * 1024), "medium": (64 * 1024 + 1, 256 * 1024),
         "mid": (256 * 1024 + 1, 900 * 1024), "large": (MIB, 3 * MIB), "huge": None}


@st.composite
def tensor_specs(draw: Any, sizes: tuple[str, ...] = ("empty", "tiny", "tiny", "small", "small", "medium", "medium",
                                                       "mid", "large", "huge")) -> dict[str, Any]:
    size = draw(st.sampled_from(sizes))
    dtype = draw(st.sampled_from(DTYPES))
    form = draw(st.sampled_from(["tensor", "tensor", "tensor", "numpy", "tied", "view", "dtensor", "frozen"]))
    if form == "numpy" and dtype not in NUMPY_DTYPES:
        form = "tensor"
    if size == "huge" and draw(st.booleans()):
        size = "large"  # a state larger than staging is rare: it costs a full write
    lo, hi = SIZES[size] or (0, 0)
    nbytes = draw(st.integers(lo, hi)) if SIZES[size] else -1  # -1: staging's size and a bit
    two_dims = draw(st.booleans())
    return {"size": size, "dtype": dtype, "form": form, "nbytes": nbytes, "two_dims": two_dims}


# A state: layers repeating a pattern as a model's state_dict() does (a weight, then its
# bias, a norm's weight and bias, ...: large and small interleaved), or tensors in any order.
LAYER = st.tuples(tensor_specs(sizes=("medium", "medium", "mid", "large")), tensor_specs(sizes=("tiny", "small")),
                  st.lists(tensor_specs(), max_size=2)).map(lambda t: [t[0], t[1], *t[2]])
STATES = st.one_of(
    st.builds(lambda layer, n: layer * n, LAYER, st.integers(2, 24)),
    st.lists(tensor_specs(), min_size=1, max_size=16),
)

CONFIGS = st.fixed_dictionaries({
    "format": st.sampled_from(["chunk", "hdf5"]),
    "reuse_unchanged": st.booleans(),
    "chunk_size": st.sampled_from(["256KiB", "64MiB"]),
    "staging_size": st.sampled_from([None, "2MiB", "4MiB", "8MiB"]),  # None: "auto", starting at its smallest
})


class Daemons:
    """One daemon per daemon configuration, reused by every example that wants it."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.made: dict[tuple, Daemon] = {}

    def get(self, fmt: str, reuse: bool, chunk_size: str) -> Daemon:
        key = (fmt, reuse, chunk_size)
        d = self.made.get(key)
        if d is None or d.proc is None or d.proc.poll() is not None:
            d = Daemon(self.base / f"d{len(self.made)}", format=fmt, reuse_unchanged=reuse, chunk_size=chunk_size,
                       fsync=False, log_level="info").start()
            self.made[key] = d
        return d

    def cleanup(self) -> None:
        for d in self.made.values():
            d.cleanup()


def _bytes(value: Any) -> bytes:
    """Every byte of a tensor or array, in C order (a DTensor's whole tensor)."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).tobytes()
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    if value.numel() == 0:  # (an empty strided view is not viewable as bytes)
        return b""
    return bytes(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _kind(value: Any) -> tuple:
    if isinstance(value, np.ndarray):
        return ("numpy", str(value.dtype), tuple(value.shape))
    return ("torch", value.dtype, tuple(value.shape))


def every_stack() -> str:
    """Every thread's stack in this process, for a report of a hang."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


class SaveModel(RuleBasedStateMachine):
    """The model: what each committed step must hold, byte for byte."""

    daemons: Daemons
    runs = itertools.count()
    mesh: Any = None
    checked = 0  # steps checked, over all examples (benchmarks/stress.py reports it)

    def __init__(self) -> None:
        super().__init__()
        self.producer: ckptd.Producer | None = None
        self.pair: list[ckptd.Producer] = []  # ranks 0 and 1 of the run "<run>-rep" (save_replicas)
        self.state: dict[str, Any] = {}
        self.step = 0
        self.rng = np.random.default_rng(0)

    # -- set-up ---------------------------------------------------------------------------
    @initialize(cfg=CONFIGS, specs=STATES, seed=st.integers(0, 2**32 - 1))
    def start(self, cfg: dict[str, Any], specs: list[dict[str, Any]], seed: int) -> None:
        self.cfg = cfg
        self.daemon = self.daemons.get(cfg["format"], cfg["reuse_unchanged"], cfg["chunk_size"])
        self.run = f"m{next(self.runs)}"
        self.producer = ckptd.Producer(self.daemon.endpoint, self.run, staging_size=cfg["staging_size"],
                                       emit_timeout=EMIT_TIMEOUT_S, timeout=10, on_no_daemon="raise",
                                       transport="shm")  # never inline by accident: batches need shm
        self.rng = np.random.default_rng(seed)
        self._build(specs)

    def teardown(self) -> None:
        if self.producer is not None or self.pair:
            closer = threading.Thread(target=self._close, daemon=True)
            closer.start()
            closer.join(COMMIT_TIMEOUT_S)
            assert not closer.is_alive(), "Producer.close() hung:\n" + every_stack()

    def _close(self) -> None:
        for p in [self.producer, *self.pair]:
            try:
                if p is not None:
                    p.close()
            except ckptd.CheckpointError:
                pass  # a failed step was reported by the rule that made it

    # -- states ---------------------------------------------------------------------------
    def _values(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``numel`` random values of ``dtype``: random bytes (NaN payloads and all)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        raw = torch.from_numpy(self.rng.integers(0, 256, numel * itemsize, dtype=np.uint8))
        if dtype == torch.bool:
            return (raw & 1).view(torch.bool)
        return raw.view(dtype)

    def _build(self, specs: list[dict[str, Any]]) -> None:
        """A new state (a new layout: the cached plan misses) in ``specs``' order."""
        staging = self.producer.stats()["staging_bytes"] if self.producer is not None else 32 * MIB
        model: dict[str, Any] = {}
        last_tensor: torch.Tensor | None = None
        for i, spec in enumerate(specs):
            dtype = spec["dtype"]
            itemsize = torch.empty(0, dtype=dtype).element_size()
            nbytes = spec["nbytes"] if spec["nbytes"] >= 0 else staging + MIB + 4096
            numel = nbytes // itemsize
            form = spec["form"]
            if form in ("tied", "view") and last_tensor is None:
                form = "tensor"
            if form == "tied":
                model[f"tied{i}"] = last_tensor  # the same tensor under a second name
                continue
            if form == "view":
                assert last_tensor is not None
                flat = last_tensor.reshape(-1) if last_tensor.is_contiguous() else last_tensor.contiguous().reshape(-1)
                model[f"view{i}"] = flat[::2]  # a strided view sharing its storage
                continue
            values = self._values(dtype, numel)
            if spec["two_dims"] and numel % 2 == 0 and numel:
                values = values.reshape(2, numel // 2)
            if form == "numpy":
                model[f"np{i}"] = values.numpy().copy()
            elif form == "dtensor" and self._mesh() is not None and values.dim() > 0:
                from torch.distributed.tensor import DTensor, Shard

                # from_local: no collective (gloo's scatter knows no float8)
                model[f"dt{i}"] = DTensor.from_local(values.clone(), self._mesh(), [Shard(0)], run_check=False)
            else:
                t = values.clone()
                model[f"fz{i}" if form == "frozen" else f"p{i}"] = t
                last_tensor = t
        self.state = {"model": model, "epoch": self.step}

    def _mesh(self) -> Any:
        return SaveModel.mesh

    def _flat(self) -> dict[str, Any]:
        return flatten(self.state)[1]

    def _expected(self) -> dict[str, tuple[tuple, bytes]]:
        return {name: (_kind(v), _bytes(v)) for name, v in self._flat().items()}

    def _update_in_place(self, fraction: float) -> None:
        """New values in some of the state's tensors, in place: same layout, same storage."""
        for name, v in self._flat().items():
            if self.rng.random() >= fraction:
                continue
            if isinstance(v, np.ndarray):
                v[...] = self._values(torch.from_numpy(v).dtype, v.size).numpy().reshape(v.shape)
            elif hasattr(v, "to_local"):
                local = v.to_local()
                local.copy_(self._values(local.dtype, local.numel()).reshape(local.shape))
            elif v.numel():
                v.copy_(self._values(v.dtype, v.numel()).reshape(v.shape))

    # -- steps ----------------------------------------------------------------------------
    @rule(specs=STATES)
    def new_layout(self, specs: list[dict[str, Any]]) -> None:
        self._build(specs)

    @rule(fraction=st.sampled_from([0.3, 1.0]))
    def update(self, fraction: float) -> None:
        self._update_in_place(fraction)

    @rule(frozen=st.booleans(), replicated=st.booleans(), touch_after=st.booleans())
    def save(self, frozen: bool, replicated: bool, touch_after: bool) -> None:
        self.step += 1
        self.state["epoch"] = self.step
        expected = self._expected()
        step = self.step

        def go() -> Any:
            assert self.producer is not None
            return self.producer.save(self.state, step, frozen=["*fz*"] if frozen else None,
                                      replicated=True if replicated else None)

        handle = self._bounded(f"save of step {step}", go)
        if touch_after:  # the snapshot was taken when save returned
            self._update_in_place(1.0)
        self._bounded(f"commit of step {step}", lambda: handle.wait(COMMIT_TIMEOUT_S))
        self._check(step, expected, nested=True)

    @rule(flip=st.booleans(), pick=st.integers(0, 2**16))
    def save_replicas(self, flip: bool, pick: int) -> None:
        """The state saved replicated=True by two ranks; rank 1's copy has one bit of one
        tensor flipped or not. Two copies that differ: both ranks are named."""
        self.step += 1
        step = self.step
        if not self.pair:
            self.pair = [ckptd.Producer(self.daemon.endpoint, f"{self.run}-rep", rank=r, world_size=2,
                                        staging_size=self.cfg["staging_size"], timeout=10, on_no_daemon="raise")
                         for r in (0, 1)]
        # DTensors of this process's one-rank mesh have no second holder: left out
        mine = {"model": {k: v for k, v in self.state["model"].items() if not hasattr(v, "to_local")},
                "epoch": step}
        theirs = copy.deepcopy(mine)  # ties and views as in the original
        flat = flatten(theirs)[1]
        candidates = [n for n, v in flat.items() if _bytes(v)]
        if flip and candidates:
            v = flat[candidates[pick % len(candidates)]]
            raw = torch.from_numpy(v).view(-1).view(torch.uint8) if isinstance(v, np.ndarray) \
                else v.view(-1).view(torch.uint8) if v.is_contiguous() else v.contiguous().view(-1).view(torch.uint8)
            raw[pick % raw.numel()] ^= 1 << (pick % 8)
            if not isinstance(v, np.ndarray) and not v.is_contiguous():
                v.copy_(raw.view(v.dtype).reshape(v.shape))
        ours = flatten(mine)[1]
        differ = sorted(n for n in ours if _bytes(ours[n]) != _bytes(flat[n]))

        def go() -> Any:
            return [p.save(s, step, replicated=True) for p, s in zip(self.pair, (mine, theirs))]

        handles = self._bounded(f"replicated save of step {step}", go)
        for h in handles:
            self._bounded(f"commit of step {step}", lambda: h.wait(COMMIT_TIMEOUT_S))
        info = wait_complete(f"{self.run}-rep", step, timeout=COMMIT_TIMEOUT_S, root=self.daemon.root,
                                   remote="")
        # no tensor in common (a layout of DTensors alone): nothing compared, None
        expected = {n: [0, 1] for n in differ} if ours else None
        assert info.diverged == expected, f"step {step}: {info.diverged} != {expected}"
        loaded = flatten(ckptd.load(f"{self.run}-rep", step, root=self.daemon.root, rank=0))[1]
        for name in set(ours) - set(differ):
            assert _bytes(loaded[name]) == _bytes(ours[name]), f"step {step} {name!r}: loaded bytes differ"

    @rule(touch_after=st.booleans())
    def emit_block(self, touch_after: bool) -> None:
        self.step += 1
        expected = self._expected()
        expected.pop("epoch", None)
        step = self.step

        def go() -> Any:
            assert self.producer is not None
            with self.producer.checkpoint(step) as handle:
                for name, value in self._flat().items():
                    self.producer.emit(name, value)
            return handle

        handle = self._bounded(f"emit block of step {step}", go)
        if touch_after:
            self._update_in_place(1.0)
        self._bounded(f"commit of step {step}", lambda: handle.wait(COMMIT_TIMEOUT_S))
        self._check(step, expected, nested=False)

    @invariant()
    def producer_is_usable(self) -> None:
        if self.producer is not None:
            assert not self.producer.closed

    # -- checks ---------------------------------------------------------------------------
    def _bounded(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; a failure or a hang reports every thread's stack and the daemon's log."""
        faulthandler.dump_traceback_later(HANG_S, exit=True)  # the last resort: a call that never returns
        try:
            return fn()
        except Exception as exc:
            raise AssertionError(
                f"{what} failed ({self.cfg}): {type(exc).__name__}: {exc}\n\n"
                f"every thread of the producer's process:\n{every_stack()}\n"
                f"the daemon's log (last lines):\n{self._log_tail()}") from exc
        finally:
            faulthandler.cancel_dump_traceback_later()

    def _log_tail(self, n: int = 40) -> str:
        return "\n".join(self.daemon.log_text().splitlines()[-n:])

    def _check(self, step: int, expected: dict[str, tuple[tuple, bytes]], nested: bool) -> None:
        root = self.daemon.root
        loaded = ckptd.load(self.run, step, root=root)
        got = flatten(loaded)[1] if nested else loaded
        want = {n: e for n, e in expected.items()}
        assert set(got) == set(want), f"step {step}: loaded {sorted(got)} != saved {sorted(want)}"
        for name, (kind, data) in want.items():
            value = got[name]
            assert _kind(value) == kind, f"step {step} {name!r}: loaded {_kind(value)}, saved {kind}"
            assert _bytes(value) == data, f"step {step} {name!r}: loaded bytes differ from the saved ones"
        path, problems = verify(self.run, step, root=root)
        assert problems == [], f"step {step}: verify found {problems}"
        self._check_files(path, step, {n: d for n, (_, d) in want.items()})
        SaveModel.checked += 1

    def _check_files(self, path: Path, step: int, want: dict[str, bytes]) -> None:
        """The step folder's files, read with safetensors / h5py themselves."""
        if self.cfg["format"] == "hdf5":
            import h5py

            seen: dict[str, list[bytes]] = {}
            with h5py.File(path / layout.h5_name(0), "r") as f:  # the rank's entry file (external links)
                for key in f:
                    ds = f[key]
                    seen.setdefault(ds.attrs["name"], []).append(np.asarray(ds[()]).tobytes())
        else:
            from safetensors import safe_open

            seen = {}
            for file in sorted(path.glob("r00000-*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        t = f.get_tensor(key)
                        seen.setdefault(key, []).append(bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        for name, data in want.items():
            assert data in seen.get(name, []), f"step {step}: no data file in {path} holds {name!r} as saved"
        # exactly the step, whatever was linked or copied from an earlier one (reuse)
        extra = sorted(set(seen) - set(want))
        assert not extra, f"step {step}: the data files in {path} hold tensors not of the step: {extra[:5]}"
        twice = sorted(n for n, v in seen.items() if len(v) > 1)
        assert not twice, f"step {step}: the data files in {path} hold {twice[:5]} more than once"


@pytest.fixture
def one_rank_mesh() -> Any:
    """A one-rank gloo process group and device mesh in this process, for DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        yield init_device_mesh("cpu", (1,)) if dist.get_world_size() == 1 else None
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def run_model(base: Path, mesh: Any, examples: int, steps: int, seed: int | None = 0) -> None:
    """Run the model for ``examples`` examples of up to ``steps`` steps (also benchmarks/stress.py)."""
    daemons = Daemons(base)
    SaveModel.daemons, SaveModel.mesh = daemons, mesh
    try:
        run_state_machine_as_test(SaveModel, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
            derandomize=seed is not None, print_blob=True,
            suppress_health_check=list(HealthCheck)))
    finally:
        daemons.cleanup()


def test_every_step_saves_and_loads_back_exactly(one_rank_mesh: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="model", dir=os.environ.get("TMPDIR")) as base:
        run_model(Path(base), one_rank_mesh, EXAMPLES, STEPS)
