"""One local rank restoring from the bucket, for tests/test_read_once.py and
benchmarks/restore_bench.py: ``RANK``/``WORLD_SIZE`` and ``CKPTD_CONFIG`` come from the
environment, as torchrun and the node's config give them.

    python tests/read_once_job.py load RUN OUT          # ckptd.load: this rank's share, DDP-style
    python tests/read_once_job.py into RUN OUT SHAPE    # ckptd.load_into a whole tensor "w" of SHAPE (JSON)

Writes OUT (JSON): the SHA-256 of each tensor read, by name, the seconds the restore
took and when it began and ended (Unix seconds). With ``READ_ONCE_GO`` set, touches OUT.ready and waits for that file to
exist first (the benchmark starts every rank at once, their imports done)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

import ckptd


def main() -> None:
    mode, run, out = sys.argv[1:4]
    torch.set_num_threads(1)
    go = os.environ.get("READ_ONCE_GO")
    if go:
        warm()
        Path(f"{out}.ready").touch()
    while go and not Path(go).exists():
        time.sleep(0.01)
    start, began = time.monotonic(), time.time()
    if mode == "load":
        flat = flatten(ckptd.load(run))
    else:
        flat = {"w": torch.zeros(json.loads(sys.argv[4]))}
        ckptd.load_into(flat, run)
    seconds = time.monotonic() - start
    Path(out).write_text(json.dumps({"seconds": seconds, "began": began, "ended": began + seconds,
                                     "tensors": digests(flat)}))


def warm() -> None:
    """What a load imports, imported (and compiled: PYTHONDONTWRITEBYTECODE leaves no
    .pyc behind) before the clock starts: 8 ranks doing it at once on a 2-core host took
    about 6 of the benchmark's seconds that a node with cores of its own does not spend."""
    import ckptd.reader  # noqa: F401
    import ckptd.transport.oneshot  # noqa: F401
    from ckptd import tiers

    tiers.chain()


def flatten(state: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: state} if isinstance(state, torch.Tensor) else {}


def digests(flat: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            + f":{t.dtype}:{list(t.shape)}" for n, t in flat.items()}


if __name__ == "__main__":
    main()
