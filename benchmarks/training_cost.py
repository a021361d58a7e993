"""What a checkpoint costs a training run (docs/performance.md): a GPT-2 built from a
config (transformers), trained with AdamW on the CPU, saving its model and optimizer
state every k steps through each system, beside the same steps without checkpoints.

    .venv/bin/python benchmarks/training_cost.py             # k = 1, 10, 50; 3 repeats (k = 50 runs 100 steps)
    .venv/bin/python benchmarks/training_cost.py --variant nice=0 --variant writer_threads=2

The systems are side_by_side.py's, in the same settings: ckptd as shipped (a daemon
with no config keys but its root, ``staging_size = "auto"``, the state's size said
ahead), DCP ``async_save`` in process mode with a shared-memory ``DefaultStager`` (the
next save first waits for the last, as torchtitan does), and ``torch_checkpointing``'s
async saver with shared-memory staging; ``--variant KEY=VALUE`` adds ckptd with that
``[daemon]`` key. Every system keeps its last two steps. Each repeat runs every
(system, k) for ``--steps`` steps in an order that rotates, each run paired with one
without checkpoints in the same repeat: inflation = its training time / the paired
run's - 1. Blocked: the median time a save call held the loop. Lag: the median time
from a save's call to its being durable (what each fsyncs is in the table's notes),
while training went on; a run's saves are drained, untimed, before the next run.
"""

from __future__ import annotations

import argparse
import json
import queue
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
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def track(self, began: float, wait: Callable[[], Any], after: Callable[[], None] = lambda: None) -> None:
        self._q.put((began, wait, after))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            began, wait, after = item
            try:
                wait()
                self.lags.append(time.perf_counter() - began)
                after()
            finally:
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
    out: dict[str, Any] = {"ckptd": Ckptd(base, state), "dcp": Dcp(base, state),
                           "torch_checkpointing": TorchCheckpointing(base, state)}
    for v in variants:
        key, _, value = v.partition("=")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value  # a string: "4GiB"
        out[f"ckptd {v}"] = Ckptd(base, state, keys={key: parsed}, name=f"ckptd-{key}")
    return out


def run(training: Training, system: Any, k: int, steps: int, durable: Durable) -> dict[str, Any]:
    blocked = []
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        training.step()
        if system is not None and i % k == 0:
            s0 = time.perf_counter()
            system.begin(training.state, durable)
            blocked.append(time.perf_counter() - s0)
    loop = time.perf_counter() - t0
    return {"loop_s": loop, "blocked": blocked, "lags": durable.drain()}


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
        names = [None, *made]
        for r in range(args.repeat):
            for j, k in enumerate(args.k):
                steps = max(args.steps, 2 * k)
                turn = (r + j) % len(names)
                results = {name: run(training, made.get(name) if name else None, k, steps, durable)
                           for name in names[turn:] + names[:turn]}
                none = results.pop(None)
                for name, got in results.items():
                    rows.setdefault(f"{name} k={k}", []).append({
                        "k": k, "steps": steps, "step_s": got["loop_s"] / steps,
                        "none_step_s": none["loop_s"] / steps, "inflation": got["loop_s"] / none["loop_s"] - 1,
                        "blocked_s": statistics.median(got["blocked"]), "lag_s": statistics.median(got["lags"])})
                print(f"  repeat {r + 1} k={k}: " + ", ".join(
                    f"{n} {rows[f'{n} k={k}'][-1]['inflation'] * 100:+.1f}%" for n in results), flush=True)
    finally:
        durable.close()
        for s in made.values():
            s.close()
    return rows


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    def cell(key: str, got: list[dict[str, Any]], scale: float, fmt: str) -> str:
        v = [g[key] * scale for g in got]
        return f"{statistics.median(v):{fmt}} [{min(v):{fmt}} - {max(v):{fmt}}]"

    out = ["| system | k | s/step (none) | inflation % | blocked ms / save | save to durable s |",
           "|---|---|---|---|---|---|"]
    for key, got in sorted(rows.items(), key=lambda kv: (kv[1][0]["k"], kv[0])):
        name = key.rpartition(" k=")[0]
        out.append(f"| {name} | {got[0]['k']} | {cell('step_s', got, 1, '.3f')} "
                   f"({statistics.median(g['none_step_s'] for g in got):.3f}) | {cell('inflation', got, 100, '+.1f')} "
                   f"| {cell('blocked_s', got, 1e3, '.0f')} | {cell('lag_s', got, 1, '.2f')} |")
    out.append("Durable means, for ckptd: " + FSYNCS["ckptd"] + " fsynced; DCP: " + FSYNCS["dcp"]
               + "; torch_checkpointing: " + FSYNCS["torch_checkpointing"] + " fsynced (its write done).")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 10, 50])
    ap.add_argument("--steps", type=int, default=40, help="steps per run (at least 2k)")
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
