"""How fast `latest` is found among many checkpoints: the daemon's index, the pointer
file, and a cold scan; and how long the index takes to build at start-up.

    .venv/bin/python benchmarks/index_bench.py [--steps 10000] [--json out.json]

It makes one real checkpoint through a real daemon, clones its folder into
``--steps`` complete steps (tiny ones), then measures, in one run:
  * the start-up scan: ``Index.start()`` over the whole root;
  * ``latest`` from the daemon's index over its socket (a producer's ``latest()``)
    and from the index in process (no socket);
  * ``ckptd.latest`` from the ``<run>/latest`` pointer (what a process without a
    daemon does), and from a cold scan (pointer removed), and a full ``list``;
  * the commands a person types: ``ckptd status`` (with a daemon, and without: it says
    so at once), ``ckptd latest RUN``, ``ckptd list RUN`` (reading the root; from the
    daemon's index when the config names a daemon that serves the root; with
    ``--endpoint``), ``ckptd list``, each a process.
Goals: latest under 1 ms from the index and the pointer; a 10,000-step scan under 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import Daemon  # noqa: E402  (the same real-daemon harness the tests use)

import ckptd  # noqa: E402
from ckptd import index as index_mod  # noqa: E402
from ckptd.config import IndexConfig  # noqa: E402


def clone_steps(run_dir: Path, n: int) -> None:
    """Copy step 1 into steps 2..n, fixing each manifest's step (much faster than n commits)."""
    src = run_dir / "step-000000000001"
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    manifest_name = next(name for name in files if name.startswith("manifest-"))
    manifest = json.loads(files[manifest_name])
    for step in range(2, n + 1):
        dst = run_dir / f"step-{step:012d}"
        dst.mkdir()
        manifest["step"] = step
        for name, data in files.items():
            (dst / name).write_bytes(json.dumps(manifest).encode() if name == manifest_name else data)


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="ckptd-index-bench-"))
    d = Daemon(base / "d", log_level="info")
    try:
        d.start()
        with d.producer("bench", staging_size="1MiB") as p:
            p.save({"w": torch.ones(4)}, 1).wait(30)
        d.stop()
        t0 = time.perf_counter()
        clone_steps(d.root / "bench", args.steps)
        print(f"made {args.steps} complete checkpoints in {time.perf_counter() - t0:.1f} s under {d.root}")
        subprocess.run(["sync"], check=False)

        results: dict[str, list[float]] = {}
        idx = index_mod.Index(d.root, IndexConfig())
        t0 = time.perf_counter()
        idx.start()
        results["index start-up scan"] = [time.perf_counter() - t0]
        assert idx.latest("bench").step == args.steps
        results["latest from the index, in process"] = timed(lambda: idx.latest("bench"), args.repeat)
        idx.close()

        d.start()  # its start-up scan rewrites the pointer to the newest step
        with d.producer("bench", staging_size="1MiB") as p:
            assert p.latest().step == args.steps
            results["latest from the daemon's index, over its socket"] = timed(p.latest, args.repeat)
        # what a person types, each a whole process (Python's start-up included)
        # (`list RUN -c CONFIG`: the config names this daemon, which serves that root, so the
        # listing comes from its index; `list RUN --root`: no daemon named, every manifest read)
        for what, words in (("status", ["status", "-c", str(d.config)]),
                            ("latest RUN", ["latest", "bench", "--root", str(d.root)]),
                            ("list RUN --root", ["list", "bench", "--root", str(d.root)]),
                            ("list RUN -c CONFIG", ["list", "bench", "-c", str(d.config)]),
                            ("list RUN --endpoint", ["list", "bench", "--endpoint", d.endpoint]),
                            ("list", ["list", "--root", str(d.root)])):
            results[f"`ckptd {what}` (a process)"] = timed(
                lambda w=words: subprocess.run([sys.executable, "-m", "ckptd", *w], check=True,
                                               stdout=subprocess.DEVNULL), 3)
        d.stop()
        results["`ckptd status` with no daemon (a process)"] = timed(
            lambda: subprocess.run([sys.executable, "-m", "ckptd", "status", "-c", str(d.config)],
                                   stderr=subprocess.DEVNULL), 3)
        results["ckptd.latest via the pointer"] = timed(lambda: ckptd.latest("bench", root=d.root), args.repeat)
        os.unlink(d.root / "bench" / "latest")
        results["ckptd.latest by cold scan (no pointer)"] = timed(lambda: ckptd.latest("bench", root=d.root), 20)
        results["ckptd.list_checkpoints (full scan)"] = timed(lambda: ckptd.list_checkpoints("bench", root=d.root), 3)
    finally:
        d.cleanup()
        shutil.rmtree(base, ignore_errors=True)

    print(f"\n{args.steps} checkpoints of one run\n")
    print(f"{'measurement':<52} {'median':>12} {'min':>12}")
    for name, xs in results.items():
        print(f"{name:<52} {_fmt(statistics.median(xs)):>12} {_fmt(min(xs)):>12}")
    goals = {
        "latest from the daemon's index, over its socket": 1e-3,
        "latest from the index, in process": 1e-3,
        "ckptd.latest via the pointer": 1e-3,
        "index start-up scan": 2.0 * args.steps / 10_000,
    }
    print()
    for name, goal in goals.items():
        med = statistics.median(results[name])
        print(f"goal {name}: {_fmt(med)} <= {_fmt(goal)}  {'ok' if med <= goal else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "results": results}, indent=1))
    return 0


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


if __name__ == "__main__":
    sys.exit(main())
