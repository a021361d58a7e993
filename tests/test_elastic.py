"""Elastic restarts (ckptd.attempt): `torchrun --max-restarts=1`, a rank killed mid-step
after the other rank committed that step. The restarted job saves the step again and
finishes; its weights equal an uninterrupted run's; no step is ever listed complete
with shares of two attempts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptd
import elastic_job as job

STEPS = 15


def attempts_of(step_dir: Path) -> set[str | None]:
    """The attempts recorded by every manifest in a step folder."""
    return {json.loads(m.read_text()).get("attempt") for m in step_dir.glob("manifest-r*.json")}


class MixWatch(threading.Thread):
    """Lists the run's complete steps over and over while the job runs; records any whose
    manifests come from more than one attempt."""

    def __init__(self, root: Path) -> None:
        super().__init__(name="mix-watch", daemon=True)
        self.root, self.stop, self.mixed, self.seen = root, threading.Event(), [], set()

    def run(self) -> None:
        while not self.stop.is_set():
            for info in ckptd.list_checkpoints(job.RUN, root=self.root):
                self.seen.add(info.step)
                if len(attempts_of(Path(info.path))) != 1:
                    self.mixed.append(info.step)
            time.sleep(0.02)


@pytest.mark.slow
def test_torchrun_restart_resaves_the_step_and_matches_an_uninterrupted_run(daemon, tmp_path) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    watch = MixWatch(daemon.root)
    watch.start()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "--max-restarts=1", "--monitor-interval=0.1", str(Path(job.__file__)), daemon.endpoint,
             str(daemon.root), str(flags), str(STEPS)],
            capture_output=True, text=True, timeout=240)
    finally:
        watch.stop.set()
        watch.join(10)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert watch.mixed == [] and {5, 10} <= watch.seen
    # attempt 0 died at step 10 after rank 0 committed it; attempt 1 resumed from step 5
    assert (flags / "resumed-a0-r0").read_text() == "0" and (flags / "resumed-a1-r1").read_text() == "5"
    assert (flags / "resumed-a1-r0").read_text() == "5"
    assert [i.step for i in ckptd.list_checkpoints(job.RUN, root=daemon.root)] == [5, 10, 15]
    steps = daemon.root / job.RUN
    (a0,), (a1,) = attempts_of(steps / "step-000000000005"), attempts_of(steps / "step-000000000010")
    assert a0.startswith("torchelastic:") and ":0:" in a0 and ":1:" in a1 and a0 != a1
    assert attempts_of(steps / "step-000000000015") == {a1}
    assert "is replaced by attempt" in daemon.log_text()  # rank 0's share of step 10
    for rank in (0, 1):  # the uninterrupted run, here
        model, opt = job.make(rank)
        for step in range(1, STEPS + 1):
            job.train_step(model, opt, step, rank)
        final = load_file(str(flags / f"final-r{rank}.safetensors"))
        assert final.keys() == model.state_dict().keys()
        assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())
        saved = ckptd.load(job.RUN, 15, root=daemon.root, rank=rank, verify=True)
        assert all(torch.equal(saved["model"][k], v) for k, v in model.state_dict().items())
