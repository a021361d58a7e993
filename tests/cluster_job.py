"""examples/fsdp2_torchrun.py as the cluster drill runs it (tests/clusterdrill.py): the
same job (its arguments, its output), where each step first waits, up to ``DRILL_PACE``
seconds, until the step before is complete in the tiers ``DRILL_WAIT`` names (``peer``,
``remote``), as the copies are made while a real step runs. At the end, once every rank
has closed its producer (its commits durable), each rank loads its share of the last
step back and prints a digest of every tensor and value (``drill-digests``); each
node's local rank 0 prints ``drill-time STARTED IMPORTED FIRST-STEP`` (epoch seconds).
Forked from the drill's fork server, a process first joins its requester's network
namespace (tests/netcluster.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

STARTED = time.time()
# A node's ranks write one log. Under PYTHONUNBUFFERED a print is two writes, its text and
# then its newline, and another rank's line could come between them: one write a line.
sys.stdout.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import netcluster  # noqa: E402  (tests/, this script's folder, is on sys.path)

netcluster.join_requester()

import fsdp2_torchrun as example  # noqa: E402  (examples/ is on sys.path above)
import torch  # noqa: E402

import ckptd  # noqa: E402
from ckptd import producer  # noqa: E402
from ckptd.errors import CheckpointError, CheckpointNotFound  # noqa: E402

IMPORTED = time.time()
PACE = float(os.environ.get("DRILL_PACE", "0"))
TIERS = [t for t in os.environ.get("DRILL_WAIT", "").split(",") if t]
unpaced = example.batch
started = False


def paced(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    global started
    if not started and os.environ.get("LOCAL_RANK") == "0":
        print(f"drill-time {STARTED:.3f} {IMPORTED:.3f} {time.time():.3f}", flush=True)
    elif started and os.environ.get("RANK") == "0":  # the others wait for it in the step's collectives
        deadline = time.monotonic() + PACE
        for tier in TIERS:
            try:
                producer.wait_complete(step - 1, max(0.0, deadline - time.monotonic()),
                                       tier="peer" if tier == "peer" else None)
            except CheckpointError:
                pass  # not copied in time (a partner lost, say): the step goes on, as a real one would
    started = True
    return unpaced(step)


def digests(run: str, step: int) -> dict[str, str]:
    rank = int(os.environ["RANK"])
    flat: dict[str, object] = {}

    def walk(d: dict, prefix: str = "") -> None:
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.update({f"{prefix}{k}": v})

    deadline = time.monotonic() + 300
    while True:  # until the other nodes' shares of the step are seen (committed, or copied here)
        try:
            walk(ckptd.load(run, step, rank=rank))
            break
        except CheckpointNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    out = {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            data = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[f"rank {rank}: {k}"] = hashlib.sha256(f"{v.dtype}{tuple(v.shape)}".encode() + data).hexdigest()
        else:
            out[f"rank {rank}: {k}"] = hashlib.sha256(repr(v).encode()).hexdigest()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--run-name", dest="run")
    p.add_argument("--steps", type=int)
    args, _ = p.parse_known_args()
    example.batch = paced
    destroy = example.dist.destroy_process_group
    example.dist.destroy_process_group = lambda: (example.dist.barrier(), destroy())  # after every rank's close
    example.main()
    print(f"drill-digests {json.dumps(digests(args.run, args.steps))}", flush=True)
