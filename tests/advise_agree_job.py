"""`torchrun --nproc-per-node=2` (tests/test_advise.py): both ranks call
``producer.should_save`` at every step over a gloo group, rank 1 with other bounds than
rank 0's: every rank answers as rank 0 does (its plan is broadcast). Each rank writes
the steps it was told to save to ``OUT/saves-r<rank>``.

    torchrun ... advise_agree_job.py ENDPOINT OUT
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(endpoint: str, out: Path) -> None:
    from ckptd import Producer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    p = Producer(endpoint, "agreed", staging_size="8MiB", timeout=10)
    told = []
    for step in range(1, 31):
        time.sleep(0.005 * (1 + rank))  # another step time on each rank
        if p.should_save(step, max_steps=4 if rank == 0 else 9):
            told.append(step)
            p.save({"w": torch.full((8,), float(step))}, step).wait(60)
    (out / f"saves-r{rank}").write_text(" ".join(map(str, told)))
    p.close()
    dist.destroy_process_group()
    assert os.environ["WORLD_SIZE"] == "2"


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
