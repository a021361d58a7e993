"""ckptd next to the peers a user would pick instead, in one process run (benchmarks/README.md).

    .venv/bin/python benchmarks/side_by_side.py                      # 256 MiB, 3 repeats (~2 min)
    .venv/bin/python benchmarks/side_by_side.py --size 1GiB --repeat 5   # the table

The systems, each in its strongest setting on a CPU host, saving the same tensors:

- **ckptd**, the shipped config: a ``ckptd serve`` subprocess with no config keys but
  its root, and a producer with ``staging_size = "auto"`` told the state's size ahead
  (``prepare=state``). ``save`` returns once the tensors are copied into shared memory.
  It fsyncs every chunk file and the manifest, renames the step folder into place and
  fsyncs the run folder: a committed step survives a crash.
- **torch_checkpointing** (Meta, PyPI ``torch-checkpointing``, pinned in
  requirements.txt): ``CheckpointManager`` with an async saver, staging into shared
  memory on a background thread (no pinned memory: there is no GPU), written by its
  background process, buffered (its default O_DIRECT fails on ext4: EINVAL when the
  unaligned tail of a file is flushed at close). Its stall is until the staging is done (training
  may not change the tensors before: ``manager.lock()``). It fsyncs nothing: neither its
  files nor the folder it renames into place.
- **DCP** ``async_save`` with ``AsyncCheckpointerType.PROCESS`` (a writer process kept
  across saves) and one ``DefaultStager(StagingOptions(use_shared_memory=True))``
  reused across saves (pinned memory, async staging and non-blocking copies need
  CUDA). Its stall is until ``async_save`` returns (staging done). It fsyncs each file
  it writes (``FileSystemWriter(sync_files=True)``), not the folder.

Each repeat, in an order that rotates, on the same tensors (one element of every
tensor is changed first, as a training step would, so ckptd's ``reuse_unchanged``
writes them all): each system saves once; then the floors of this repeat: a memcpy of
the tensors into preallocated, pre-faulted memory (the fastest of three ways) and one
O_DIRECT write + fsync of the same bytes. Then for the peers, the cost of making their
step crash-safe as ckptd's is: an fsync of every file they wrote, of their step folder
and of its parent, timed. Then each system loads its step, warm (its files read once
first), into fresh memory and into preallocated tensors, and every load is compared
bit for bit with the tensors saved.

Reported: medians over repeats of the per-repeat ratios (blocked / memcpy, durable /
O_DIRECT + fsync), with their range, and load seconds. Two shapes: ``equal`` (64 float32
tensors of equal size) and ``gpt`` (GPT-2's state_dict: 16 blocks of layer norms,
biases and matrices, 196 tensors, width chosen so the total is ``--size``).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import torch  # noqa: E402

import baselines  # noqa: E402
from daemons import DaemonProcess  # noqa: E402

MiB = 2**20
RUN = "side-by-side"
SYSTEMS = ("ckptd", "torch_checkpointing", "dcp")

State = dict[str, torch.Tensor]


# -- the states ---------------------------------------------------------------------------------
def equal_state(size: int, n: int = 64) -> State:
    gen = torch.Generator().manual_seed(0)
    return {f"layers.{i:02d}.weight": torch.rand(size // (4 * n), generator=gen) for i in range(n)}


def gpt_shapes(size: int, layers: int = 16, vocab: int = 50257, positions: int = 1024) -> dict[str, tuple[int, ...]]:
    """GPT-2's ``state_dict()`` names and shapes (transformers' GPT2LMHeadModel, the tied
    ``lm_head`` left out as safetensors does), its width the largest multiple of 64 that
    keeps the float32 total under ``size``."""
    def shapes(d: int) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (vocab, d), "transformer.wpe.weight": (positions, d)}
        for i in range(layers):
            h = f"transformer.h.{i}."
            out |= {h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
                    h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
                    h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                    h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
                    h + "mlp.c_fc.weight": (d, 4 * d), h + "mlp.c_fc.bias": (4 * d,),
                    h + "mlp.c_proj.weight": (4 * d, d), h + "mlp.c_proj.bias": (d,)}
        return out | {"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}

    def nbytes(d: int) -> int:
        return 4 * sum(torch.Size(s).numel() for s in shapes(d).values())

    d = 64
    while nbytes(d + 64) <= size:
        d += 64
    return shapes(d)


def gpt_state(size: int) -> State:
    gen = torch.Generator().manual_seed(1)
    return {name: torch.rand(shape, generator=gen) for name, shape in gpt_shapes(size).items()}


def nbytes_of(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def bit_exact(loaded: Any, state: State, who: str) -> None:
    """Every tensor of ``state`` in ``loaded``, the same bits; else the run stops."""
    for name, t in state.items():
        got = loaded[name]
        if got.shape != t.shape or got.dtype != t.dtype or not torch.equal(got.view(torch.int32), t.view(torch.int32)):
            raise SystemExit(f"{who}: {name} loaded differs from what was saved")


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def warm(folder: Path) -> None:
    for f in files_under(folder):
        with open(f, "rb") as fh:
            while fh.read(64 * MiB):
                pass


def fsync_all(folder: Path) -> float:
    """What making a peer's step crash-safe costs: fsync of each file, the folders, the parent."""
    t0 = time.perf_counter()
    for f in files_under(folder):
        baselines.fsync_path(f)
    for d in sorted({f.parent for f in files_under(folder)} | {folder, folder.parent}, key=lambda p: -len(p.parts)):
        baselines.fsync_path(d)
    return time.perf_counter() - t0


# -- the systems ----------------------------------------------------------------------------------
class Ckptd:
    """The shipped config: a daemon with defaults (its root and socket only), a producer with
    ``staging_size = "auto"`` and the state's size said ahead."""

    def __init__(self, base: Path, state: State, keys: dict[str, Any] | None = None, name: str = "ckptd") -> None:
        import ckptd

        self.daemon = DaemonProcess(base, None, name=name, keys=keys, tables={"retention": {"keep_last": 2}}).start()
        self.producer = ckptd.Producer(self.daemon.endpoint, RUN, rank=0, world_size=1, timeout=120, prepare=state)
        self.step = 0

    def save(self, state: State) -> tuple[float, float, float | None]:
        self.step += 1
        t0 = time.perf_counter()
        handle = self.producer.save(state, self.step)
        t1 = time.perf_counter()
        handle.wait(300)
        return t1 - t0, time.perf_counter() - t0, None  # durable already: nothing to add

    def folder(self) -> Path:
        return self.daemon.root / RUN / f"step-{self.step:012d}"

    def load(self, out: State | None) -> Any:
        import ckptd

        return ckptd.load(RUN, self.step, root=self.daemon.root, out=out)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.producer.close()
        self.daemon.close()


class TorchCheckpointing:
    """``CheckpointManager`` with its async saver, shared-memory staging on a background
    thread, and its background writer process (O_DIRECT where the filesystem takes it)."""

    def __init__(self, base: Path, state: State) -> None:
        import torch_checkpointing as tc
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        staging = CheckpointStagerConfig(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                         use_non_blocking_copy=False)
        self.manager = tc.CheckpointManager(tc.CheckpointManager.Config(
            # its writer process is spawned (a fresh interpreter importing torch): on a loaded
            # host that takes longer than its 30 s default allows
            save=AsyncCheckpointSaverConfig(staging_config=staging,
                                            process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=300)),
            # its default, O_DIRECT through a buffered Python file, fails on ext4 (EINVAL when
            # the file's unaligned tail is flushed at close): its buffered writes are what works
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        self.manager.prewarm_staging({"model": state})  # its way of making staging ahead
        self.base = base / "torch_checkpointing"
        self.base.mkdir(parents=True)
        self.step = 0

    def start(self, state: State) -> Any:
        """Save the next step; return once its staging is done (training may not change
        the tensors before), with the future of its write."""
        self.step += 1
        done = self.manager.save(str(self.folder()), {"model": state})
        staged = self.manager._staging_future
        if staged is not None:
            staged.result()
        return done

    def save(self, state: State) -> tuple[float, float, float | None]:
        t0 = time.perf_counter()
        done = self.start(state)
        t1 = time.perf_counter()
        done.result()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, fsync_all(self.folder())

    def folder(self) -> Path:
        return self.base / f"step-{self.step}"

    def load(self, out: State | None) -> Any:
        into = out if out is not None else {k: torch.empty_like(t) for k, t in self.template.items()}
        return self.manager.load(str(self.folder()), {"model": into})["model"]

    def close(self) -> None:
        self.manager.close()


class Dcp:
    """``dcp.async_save`` in process mode with one shared-memory ``DefaultStager``."""

    def __init__(self, base: Path, state: State) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
        baselines.init_single_rank_gloo()
        self.dcp = dcp
        self.kind = AsyncCheckpointerType.PROCESS
        self.stager = DefaultStager(baselines.dcp_staging_options(StagingOptions))
        self.base = base / "dcp"
        self.base.mkdir(parents=True)
        self.step = 0

    def save(self, state: State) -> tuple[float, float, float | None]:
        from torch.distributed.checkpoint import FileSystemWriter

        self.step += 1
        t0 = time.perf_counter()
        response = self.dcp.async_save(state, storage_writer=FileSystemWriter(self.folder()),
                                       async_checkpointer_type=self.kind, async_stager=self.stager)
        t1 = time.perf_counter()
        getattr(response, "upload_completion", response).result()
        t2 = time.perf_counter()
        t3 = time.perf_counter()  # it fsynced its files: the folder and its parent are left
        baselines.fsync_path(self.folder())
        baselines.fsync_path(self.base)
        return t1 - t0, t2 - t0, time.perf_counter() - t3

    def folder(self) -> Path:
        return self.base / f"step-{self.step}"

    def load(self, out: State | None) -> Any:
        into = out if out is not None else {k: torch.empty_like(t) for k, t in self.template.items()}
        self.dcp.load(into, checkpoint_id=str(self.folder()))
        return into

    def close(self) -> None:
        self.stager.close()
        baselines.stop_dcp_writer_process()


MAKERS: dict[str, Callable[[Path, State], Any]] = {"ckptd": Ckptd, "torch_checkpointing": TorchCheckpointing,
                                                   "dcp": Dcp}


# -- one shape --------------------------------------------------------------------------------------
def run_shape(shape: str, state: State, base: Path, repeat: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}

    def rec(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    targets = baselines.CopyTargets({k: t.view(-1) for k, t in state.items()})  # views: the same memory
    out = {k: torch.empty_like(t) for k, t in state.items()}
    systems = {name: MAKERS[name](base / shape, state) for name in SYSTEMS}
    try:
        for s in systems.values():
            s.template = state
            s.save(state)  # a warm-up save each (first saves: benchmarks/limits.py --first-save)
        for r in range(repeat):
            for t in state.values():  # a training step changed every tensor
                t.view(-1)[r % t.numel()] += 1.0
            order = SYSTEMS[r % 3:] + SYSTEMS[:r % 3]
            timings: dict[str, tuple[float, float, float | None]] = {}
            for name in order:
                timings[name] = systems[name].save(state)
            memcpy = min(baselines.memcpy_three_ways(targets).values())
            floor = baselines.raw_write_direct(targets.bytes_view(), base / "floor.bin", 8 * MiB)
            (base / "floor.bin").unlink()
            for name, (blocked, durable, extra) in timings.items():
                rec(f"{name}.blocked", blocked / memcpy)
                rec(f"{name}.durable", durable / floor)
                if extra is not None:
                    rec(f"{name}.crash_safe", (durable + extra) / floor)
                    rec(f"{name}.fsync_s", extra)
            rec("floor.memcpy_s", memcpy)
            rec("floor.direct_s", floor)
            for name in order:
                s = systems[name]
                for kind, into in (("fresh", None), ("prealloc", out)):
                    for t in out.values():
                        t.zero_()
                    warm(s.folder())
                    t0 = time.perf_counter()
                    loaded = s.load(into)
                    rec(f"{name}.load_{kind}_s", time.perf_counter() - t0)
                    bit_exact(loaded, state, f"{name} load into {kind} memory")
                    del loaded
            print(f"  {shape} repeat {r + 1}/{repeat}: " + ", ".join(
                f"{n} {timings[n][0] / memcpy:.2f}x/{timings[n][1] / floor:.2f}x" for n in SYSTEMS), flush=True)
    finally:
        for s in systems.values():
            s.close()
    return samples


# -- the table ------------------------------------------------------------------------------------
def cell(values: list[float] | None, unit: str = "x") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if unit == "s":
        return f"{med:.3f}"
    return f"{med:.2f} ({min(values):.2f}-{max(values):.2f})"


def table(results: dict[str, dict[str, list[float]]], sizes: dict[str, int], repeat: int) -> str:
    lines = ["| | " + " | ".join(SYSTEMS) + " |", "|---|" + "---|" * len(SYSTEMS)]
    for shape, s in results.items():
        label = {"equal": "64 equal tensors", "gpt": "GPT-2 state_dict (196 tensors)"}[shape]
        rows = [
            (f"{label}: blocked / memcpy", "blocked", "x"),
            ("durable as shipped / O_DIRECT + fsync", "durable", "x"),
            ("crash-safe (+ fsync of files, folders) / O_DIRECT + fsync", "crash_safe", "x"),
            ("load into fresh memory, s (warm)", "load_fresh_s", "s"),
            ("load into preallocated tensors, s (warm)", "load_prealloc_s", "s"),
        ]
        for title, key, unit in rows:
            vals = []
            for name in SYSTEMS:
                v = s.get(f"{name}.{key}") or (s.get(f"{name}.durable") if key == "crash_safe" and name == "ckptd"
                                                else None)
                vals.append(cell(v, unit))
            lines.append(f"| {title} | " + " | ".join(vals) + " |")
        lines.append(f"| {shape}: floors, s: memcpy / O_DIRECT + fsync | {cell(s['floor.memcpy_s'], 's')} / "
                     f"{cell(s['floor.direct_s'], 's')} | | |")
    note = (f"{', '.join(f'{k} {v / MiB:.0f} MiB' for k, v in sizes.items())}; {repeat} repeats; medians of "
            "per-repeat ratios (range). Durable as shipped: ckptd's commit (files, manifest, folder fsynced); "
            "torch_checkpointing's write done (nothing fsynced); DCP's (files fsynced, not the folder).")
    return "\n".join(lines) + "\n\n" + note + "\n"


def main(argv: list[str] | None = None) -> int:
    from ckptd.config import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB", help="bytes of each state (default 256MiB; the table: 1GiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", default="equal,gpt", help="comma-separated: equal, gpt")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder under /tmp)")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    base = Path(tempfile.mkdtemp(prefix="ckptd-side-", dir=args.dir))
    results: dict[str, dict[str, list[float]]] = {}
    sizes: dict[str, int] = {}
    try:
        for shape in args.shapes.split(","):
            if shape not in ("equal", "gpt"):
                raise SystemExit(f"--shapes: {shape!r} is not a shape; the shapes are equal and gpt")
            state = equal_state(size) if shape == "equal" else gpt_state(size)
            sizes[shape] = nbytes_of(state)
            print(f"{shape}: {len(state)} tensors, {sizes[shape] / MiB:.0f} MiB", flush=True)
            results[shape] = run_shape(shape, state, base, args.repeat)
            del state
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(table(results, sizes, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
