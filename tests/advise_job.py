"""A training job for `torchrun --max-restarts=2` (tests/test_advise.py): two ranks that
save when ``producer.should_save`` says so (bounded to every ``EVERY`` steps), and whose rank
1 SIGKILLs itself once in attempt 0 and once in attempt 1. Each attempt after the first
resumes from the newest complete step with ``ckptd.load`` and writes how long that load
took, measured here, to ``FLAGS/load-a<attempt>-r<rank>``; every save is listed in
``FLAGS/saves-a<attempt>-r<rank>``. No collectives (as tests/elastic_job.py: gloo's
reconnection after a quick restart is not what is tested): after each save a rank waits
until the step is complete, so that neither runs ahead of the other.

    torchrun ... advise_job.py ENDPOINT ROOT FLAGS_DIR STEPS
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

RUN = "advised"
# min_steps = max_steps: every EVERY steps, whatever the advice says (two failures seconds
# apart make a short MTBF, and then an interval that a loaded machine's slow steps can pass)
EVERY = 5
KILL_AT = {0: 12, 1: 19}  # attempt -> the step at which rank 1 dies


def main(endpoint: str, root: str, flags: Path, steps: int) -> None:
    import ckptd
    from ckptd import Producer

    torch.set_num_threads(1)
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model = torch.nn.Linear(64, 64)
    start = 0
    info = ckptd.latest(RUN, root=root)
    if info is not None:
        t0 = time.monotonic()
        state = ckptd.load(RUN, info.step, root=root, rank=rank)
        (flags / f"load-a{attempt}-r{rank}").write_text(repr(time.monotonic() - t0))
        model.load_state_dict(state["model"])
        start = state["step"]
    # torchrun stops the rank that lived with SIGTERM and waits 30 s before SIGKILL; the
    # default preempt_grace (30 s) held it that long in the wait below, for a save that
    # cannot complete: a short grace ends it as torchrun meant
    p = Producer(endpoint, RUN, staging_size="8MiB", timeout=10, preempt_grace=1)
    saves = flags / f"saves-a{attempt}-r{rank}"
    for step in range(start + 1, steps + 1):
        if rank == 1 and KILL_AT.get(attempt) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        with torch.no_grad():
            model.weight.add_(0.01)
        time.sleep(0.01)
        if p.should_save(step, min_steps=EVERY, max_steps=EVERY):
            p.save({"model": model.state_dict(), "step": step}, step).wait(60)
            with open(saves, "a") as f:
                f.write(f"{step}\n")
            deadline = time.monotonic() + 120
            while (info := ckptd.latest(RUN, root=root)) is None or info.step < step:
                if time.monotonic() > deadline:  # say so, rather than hang until the test's timeout
                    raise RuntimeError(f"rank {rank}, attempt {attempt}: step {step} was not complete after "
                                       f"120 s (newest: {info.step if info else None}); did the other rank save it?")
                time.sleep(0.01)  # the other rank's share of it (a rank that died: torchrun stops us)
    p.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
