#!/usr/bin/env python3
"""What a LoRA-style run writes: a frozen base and small adapters, saved a few times.

    .venv/bin/python benchmarks/reuse_lora.py                     # 20 layers of 4 MiB, 3 steps
    .venv/bin/python benchmarks/reuse_lora.py --layers 40 --steps 5 --json out.json

The state is a ``state_dict()``-ordered model: each layer's frozen weight followed by
its two adapter matrices, which change at every save. It is saved ``--steps`` times
by a real ``ckptd serve`` in four ways: ``frozen=`` (reuse on), recognised (reuse on,
no declaration), ``frozen=`` with ``reuse_unchanged = false``, and whole (reuse off,
no declaration). For each, the daemon's own figures (``ckptd status``:
``bytes_written``, ``bytes_reused``), the bytes the daemon process sent to storage
(``/proc/PID/io`` ``write_bytes``, after ``sync``), the disk the run's folders take
(each inode counted once) and whether every chunk file of every step folder holds
only that step's tensors (docs/training.md, "A checkpoint costs what changed").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemons import DaemonProcess  # noqa: E402

MB = 1e6


def lora_state(step: int, base: dict[str, torch.Tensor], rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    model: dict[str, torch.Tensor] = {}
    for name, w in base.items():
        model[name] = w
        layer = name.rsplit(".", 1)[0]
        model[f"{layer}.lora_a"] = torch.randn(rank, w.shape[1], generator=g)
        model[f"{layer}.lora_b"] = torch.randn(w.shape[0], rank, generator=g)
    return {"model": model, "step": step}


def status(d: DaemonProcess) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "--endpoint", d.endpoint],
                         capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def io_written(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/PID/io")


def disk_bytes(root: Path) -> int:
    seen, total = set(), 0
    for path in root.rglob("*"):
        st = path.lstat()
        if path.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def foreign_tensors(root: Path, run: str) -> int:
    """Tensors found in a step folder's chunk files that are not that step's (or another value)."""
    from safetensors import safe_open

    bad = 0
    for folder in sorted((root / run).glob("step-*")):
        records = {}
        for m in folder.glob("manifest-r*.json"):
            for name, rec in json.loads(m.read_text())["tensors"].items():
                records[rec["key"]] = (rec["file"], rec["checksum"])
        for path in folder.glob("*.safetensors"):
            with safe_open(str(path), "np") as f:
                bad += sum(1 for key in f.keys() if key not in records or records[key][0] != path.name)
    return bad


def run_case(tmp: Path, kind: str, args: argparse.Namespace, base: dict[str, torch.Tensor]) -> dict[str, Any]:
    reuse = kind in ("frozen", "recognised")
    d = DaemonProcess(tmp, None, name=kind, keys={"reuse_unchanged": reuse})
    d.start()
    try:
        from ckptd import Producer

        frozen = ["model.*.weight"] if kind.startswith("frozen") else None
        p = Producer(d.endpoint, "lora", staging_size=args.staging, timeout=30)
        try:
            for step in range(1, args.steps + 1):
                p.save(lora_state(step, base, args.rank), step, frozen=frozen).wait(300)
        finally:
            p.close()
        os.sync()
        figures = status(d)
        return {"bytes_written_mb": figures["bytes_written"] / MB,
                "bytes_reused_mb": (figures.get("bytes_reused") or 0) / MB,
                "io_write_mb": io_written(d.pid) / MB,
                "disk_mb": disk_bytes(d.root) / MB,
                "foreign_tensors": foreign_tensors(d.root, "lora")}
    finally:
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--dim", type=int, default=1024, help="a layer's weight is dim x dim float32 (4 MiB)")
    ap.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--staging", default="256MiB")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    base = {f"model.layers.{i}.weight": torch.randn(args.dim, args.dim, generator=g) for i in range(args.layers)}
    state_mb = sum(t.nbytes for t in lora_state(1, base, args.rank)["model"].values()) / MB
    results: dict[str, Any] = {"state_mb": state_mb, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="reuse-lora") as tmp:
        for kind in ("frozen", "recognised", "frozen, reuse off", "whole"):
            results[kind] = run_case(Path(tmp), kind, args, base)
    print(f"state {state_mb:.1f} MB, {args.steps} steps")
    print(f"{'':18}{'written MB':>12}{'reused MB':>12}{'io MB':>10}{'disk MB':>10}{'foreign':>9}")
    for kind in ("frozen", "recognised", "frozen, reuse off", "whole"):
        r = results[kind]
        print(f"{kind:18}{r['bytes_written_mb']:12.1f}{r['bytes_reused_mb']:12.1f}{r['io_write_mb']:10.1f}"
              f"{r['disk_mb']:10.1f}{r['foreign_tensors']:9d}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
