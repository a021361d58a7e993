"""What a checkpoint costs a training run (docs/performance.md): a GPT-2 built from a
config (transformers), trained with AdamW on the CPU, saving its model and optimizer
state every k steps through each system, beside the same steps without checkpoints.

    .venv/bin/python benchmarks/training_cost.py             # k = 1, 10, 50; 3 repeats (about 35 minutes)
    .venv/bin/python benchmarks/training_cost.py --k 10 --variant nice=0

The systems are side_by_side.py's, in the same settings: ckptd as shipped (a daemon
with no config keys but its root, ``staging_size = "auto"``, the state's size said
ahead), DCP ``async_save`` in process mode with a shared-memory ``DefaultStager`` (the
next save first waits for the last, as torchtitan does), and ``torch_checkpointing``'s
async saver with shared-memory staging; ``--variant KEY=VALUE`` adds ckptd with that
``[daemon]`` key. Every system keeps its last two steps. Each repeat runs every
(system, k) in an order that rotates, as pairs: a segment of saves every k steps (at
least 10 steps, then on until its last save is durable) beside as many steps without
saves, just before or after it, alternately. Inflation: the segments' time beyond
their steps at the paired plain rate, over the plain steps' time. Blocked: the median
time a save call held the loop. Lag: the median time from a save's call to its being
durable (what each fsyncs is in the table's notes), while training went on.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import side_by_side  # noqa: E402

FSYNCS = {"ckptd": "every file, the manifest, the step folder's rename and the run folder",
          "dcp": "every file it writes (sync_files), not the folder",
          "torch_checkpointing": "nothing"}


class Training:
    """GPT-2 from a config (GPT-2's vocabulary and positions, ``layers`` blocks of width
    ``width``), AdamW, a fixed random batch; ``state`` is its parameters and optimizer
    state as one flat dict of the tensors training updates in place."""

    def __init__(self, layers: int, width: int, batch: int, seq: int) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=1024)
        self.model = GPT2LMHeadModel(cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
        self.step()  # the optimizer's state exists from here on
        self.state: dict[str, torch.Tensor] = {f"model.{n}": p.data for n, p in self.model.named_parameters()}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, st in self.opt.state.items():
            for key, t in st.items():
                self.state[f"optim.{names[id(p)]}.{key}"] = t

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model(self.ids, labels=self.ids).loss.backward()
        self.opt.step()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


class Durable:
    """Records each save's lag, call to durable, on a thread that waits for them in order
    (each system makes its saves durable in order); ``drain`` waits for them all."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._pending = 0
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def track(self, began: float, wait: Callable[[], Any], after: Callable[[], None] = lambda: None) -> None:
        self._pending += 1
        self._q.put((began, wait, after))

    def busy(self) -> bool:
        """A save is not durable yet."""
        return self._pending > 0

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            began, wait, after = item
            try:
                wait()
                self.lags.append(time.perf_counter() - began)
                after()
            finally:
                self._pending -= 1
                self._q.task_done()

    def drain(self) -> list[float]:
        self._q.join()
        lags, self.lags = self.lags, []
        return lags

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(60)


class Ckptd(side_by_side.Ckptd):
    def begin(self, state: dict, durable: Durable) -> None:
        self.step += 1
        began = time.perf_counter()
        handle = self.producer.save(state, self.step)
        durable.track(began, lambda: handle.wait(600))


class Dcp(side_by_side.Dcp):
    last: Any = None

    def begin(self, state: dict, durable: Durable) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        began = time.perf_counter()
        if self.last is not None:
            self.last.result()
        self.step += 1
        response = self.dcp.async_save(state, storage_writer=FileSystemWriter(self.folder()),
                                       async_checkpointer_type=self.kind, async_stager=self.stager)
        self.last = getattr(response, "upload_completion", response)
        durable.track(began, self.last.result, _forget(self.base, self.step))


class TorchCheckpointing(side_by_side.TorchCheckpointing):
    def begin(self, state: dict, durable: Durable) -> None:
        began = time.perf_counter()
        done = self.start(state)
        durable.track(began, done.result, _forget(self.base, self.step))


def _forget(base: Path, step: int) -> Callable[[], None]:
    """Keep the last two steps, as ckptd's retention does here."""
    return lambda: shutil.rmtree(base / f"step-{step - 2}", ignore_errors=True)


def systems(base: Path, state: dict, variants: list[str]) -> dict[str, Any]:
    """Each system, started; those started already are closed if a later one fails."""
    makers: dict[str, Callable[[], Any]] = {
        "ckptd": lambda: Ckptd(base, state), "dcp": lambda: Dcp(base, state),
        "torch_checkpointing": lambda: TorchCheckpointing(base, state)}
    for v in variants:
        key, _, value = v.partition("=")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value  # a string: "4GiB"
        folder = re.sub(r"[^A-Za-z0-9._-]", "_", f"ckptd-{key}-{value}")
        makers[f"ckptd {v}"] = lambda keys={key: parsed}, folder=folder: Ckptd(base, state, keys=keys, name=folder)
    out: dict[str, Any] = {}
    try:
        for name, make in makers.items():
            out[name] = make()
    except BaseException:
        for s in out.values():
            s.close()
        raise
    return out


def plain(training: Training, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        training.step()
    return time.perf_counter() - t0


def saving(training: Training, system: Any, k: int, saves: int, durable: Durable) -> tuple[float, int, list[float]]:
    """``saves`` saves, one after every k steps, then steps until the last is durable: the
    time, the steps taken and each save's blocked time."""
    blocked: list[float] = []
    n = 0
    t0 = time.perf_counter()
    while n < saves * k or durable.busy():
        training.step()
        n += 1
        if n % k == 0 and n <= saves * k:
            s0 = time.perf_counter()
            system.begin(training.state, durable)
            blocked.append(time.perf_counter() - s0)
    return time.perf_counter() - t0, n, blocked


def pairs(training: Training, system: Any, k: int, steps: int, durable: Durable) -> dict[str, Any]:
    """Segments of saves every k steps, each beside as many steps without a save just
    before or after it (the order alternating): a machine whose speed drifts over minutes
    drifts alike for both. Inflation: the segments' time beyond their steps at the plain
    rate, over the plain steps' time."""
    saves = -(-10 // k)  # segments of at least 10 steps: a save every step runs as it would
    extra = base = 0.0
    blocked: list[float] = []
    count = max(2, steps // (2 * saves * k))
    for i in range(count):
        durable.drain()
        if i % 2:
            took, n, b = saving(training, system, k, saves, durable)
            plain_s = plain(training, saves * k)
        else:
            plain_s = plain(training, saves * k)
            took, n, b = saving(training, system, k, saves, durable)
        extra += took - n * plain_s / (saves * k)
        base += plain_s
        blocked += b
    return {"inflation": extra / base, "step_s": base / (count * saves * k),
            "blocked": blocked, "lags": durable.drain()}


def measure(args: argparse.Namespace, base: Path) -> dict[str, list[dict[str, Any]]]:
    training = Training(args.layers, args.width, args.batch, args.seq)
    print(f"GPT-2 {args.layers}x{args.width}: {sum(p.numel() for p in training.model.parameters()) / 1e6:.1f} M "
          f"parameters, checkpoint {training.nbytes / 2**20:.0f} MiB", flush=True)
    made = systems(base, training.state, args.variant)
    durable = Durable()
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        for s in made.values():
            s.begin(training.state, durable)  # a warm-up save each
        durable.drain()
        names = list(made)
        for r in range(args.repeat):
            for j, k in enumerate(args.k):
                turn = (r + j) % len(names)
                for name in names[turn:] + names[:turn]:
                    got = pairs(training, made[name], k, args.steps, durable)
                    rows.setdefault(f"{name} k={k}", []).append({
                        "k": k, "step_s": got["step_s"], "inflation": got["inflation"],
                        "blocked_s": statistics.median(got["blocked"]), "lag_s": statistics.median(got["lags"])})
                print(f"  repeat {r + 1} k={k}: " + ", ".join(
                    f"{n} {rows[f'{n} k={k}'][-1]['inflation'] * 100:+.1f}%" for n in names), flush=True)
    finally:
        durable.close()
        for s in made.values():
            s.close()
    return rows


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    def cell(key: str, got: list[dict[str, Any]], scale: float, fmt: str) -> str:
        v = [g[key] * scale for g in got]
        return f"{statistics.median(v):{fmt}} [{min(v):{fmt}} - {max(v):{fmt}}]"

    out = ["| system | k | s/step, no save | inflation % | blocked ms / save | save to durable s |",
           "|---|---|---|---|---|---|"]
    for key, got in sorted(rows.items(), key=lambda kv: (kv[1][0]["k"], kv[0])):
        name = key.rpartition(" k=")[0]
        out.append(f"| {name} | {got[0]['k']} | {cell('step_s', got, 1, '.3f')} | {cell('inflation', got, 100, '+.1f')} "
                   f"| {cell('blocked_s', got, 1e3, '.0f')} | {cell('lag_s', got, 1, '.2f')} |")
    out.append("Durable means, for ckptd: " + FSYNCS["ckptd"] + " fsynced; DCP: " + FSYNCS["dcp"]
               + "; torch_checkpointing: " + FSYNCS["torch_checkpointing"] + " fsynced (its write done).")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 10, 50])
    ap.add_argument("--steps", type=int, default=100,
                    help="steps of each system at each k in a repeat, half of them without saves (at least 2k)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch's intra-op threads for training")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="training-cost") as base:
        rows = measure(args, Path(base))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
