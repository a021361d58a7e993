"""A training loop that saves only on a preemption notice (tests/test_preempt.py).

    preempt_job.py ENDPOINT RUN OUT MODE

Each step it writes the step it reached to ``OUT/step-r<rank>`` (then asks
``should_save``), its pid to ``OUT/pid-r<rank>`` at the start and ``OUT/ready-r<rank>``
after its first ``should_save``. Under torchrun
(``WORLD_SIZE`` set) the ranks agree over gloo. MODE: ``default`` (the default
signals), ``handler`` (a SIGTERM handler of its own, installed first: it writes
``OUT/handled-r<rank>`` and exits 7), ``off`` (``preempt_signals=[]``; it writes the
dispositions it finds after a ``should_save`` to ``OUT/dispositions``), ``slow``
(a step of 2 s), ``stuck`` (a step of 60 s, and a grace of 3 s), ``peer_gone`` (two ranks, a grace of
3 s: from step 2 rank 1 sleeps for an hour and rank 0 writes ``OUT/collective-r0``, then
waits in an all-reduce, in gloo's C++); in every mode the first
step takes 0.05 s (the tests signal once it is done).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).half()},
            "step": step}


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(endpoint: str, run: str, out: Path, mode: str) -> None:
    from ckptd import Producer

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)  # the producer's notice and its save, for the test to read
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    if mode == "handler":
        def handled(signum: int, frame: object) -> None:
            (out / f"handled-r{rank}").write_text(str(signum))
            os._exit(7)
        signal.signal(signal.SIGTERM, handled)
    options = {"preempt_signals": []} if mode == "off" else {}
    p = Producer(endpoint, run, staging_size="8MiB", timeout=10,
                 preempt_grace=3 if mode in ("stuck", "peer_gone") else 20, **options)
    write(out / f"pid-r{rank}", str(os.getpid()))
    for step in range(1, 100_000):
        time.sleep({"slow": 2.0, "stuck": 60.0}.get(mode, 0.05) if step > 1 else 0.05)
        if mode == "peer_gone" and step > 1:
            if rank == 1:
                time.sleep(3600)
            write(out / f"collective-r{rank}", str(step))
            dist.all_reduce(torch.ones(1))
        write(out / f"step-r{rank}", str(step))
        if p.should_save(step, min_steps=100_000):  # never but on a notice
            p.save(state(step), step)
        if step == 1:  # the handlers are installed by now
            write(out / f"ready-r{rank}", "")
        if mode == "off" and step == 1:
            write(out / "dispositions", " ".join(str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGUSR1)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4])
