"""Many nodes: `torchrun --nproc_per_node=4` (gloo) with two daemons standing for two
nodes (two ranks each, separate local roots, one bucket on a real S3 server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.remote import catalog
from ckptd.remote.store import Store

URL = "s3://ckptd/multinode"
STEPS, KILL_AT = 4, 3

TRAIN = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = rank // 2  # ranks 0-1 on "node" 0, 2-3 on "node" 1: each talks to its own node's daemon
    os.environ["CKPTD_CONFIG"] = os.environ["NODE_CONFIGS"].split(",")[node]
    import torch, torch.distributed as dist
    from safetensors.torch import save_file
    import ckptd
    from ckptd import producer
    run, out = os.environ["RUN"], Path(os.environ["OUT"])
    steps, kill_at = int(os.environ["STEPS"]), int(os.environ.get("KILL_AT", 0))
    def mark(name, text):  # whole when seen: the test reads a mark as soon as it exists
        (out / (name + ".tmp")).write_text(text)
        os.replace(out / (name + ".tmp"), out / name)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = 0
    if os.environ.get("RESUME"):
        state = ckptd.load(run)  # this rank's share ($RANK) of the newest complete step, any tier
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        mark(f"resumed-r{rank}", str(start))
    producer.configure(run=run, staging_size="8MiB")
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if step == kill_at and node == 1:  # mid-step: a tensor sent, the commit never
            with producer.checkpoint(step):
                producer.emit("model.weight", model.weight)
                mark(f"midstep-r{rank}", str(os.getpid()))
                time.sleep(600)
        producer.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step).wait(60)
        if step == kill_at:  # node 0: its share is durable, the step is not complete anywhere
            try:
                producer.wait_complete(step, timeout=3)
            except ckptd.CheckpointError as exc:
                mark(f"incomplete-r{rank}", str(exc))
                time.sleep(600)
            sys.exit(3)
        info = producer.wait_complete(step, timeout=120)
        assert info.step == step and "remote" in info.tiers, info
    save_file(model.state_dict(), str(out / f"final-r{rank}.safetensors"))
    producer.close()
    dist.destroy_process_group()
""")


def _torchrun(tmp_path: Path, out: Path, configs: list[Path], run: str, **env: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "train.py"  # one per job: two may start at once
    script.write_text(TRAIN)
    full_env = dict(os.environ, NODE_CONFIGS=",".join(map(str, configs)), RUN=run, OUT=str(out),
                    STEPS=str(STEPS), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **env)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)],
        env=full_env, stdout=open(out / "torchrun.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError((out / "torchrun.log").read_text()[-4000:]) from None


def _wait_for(paths: list[Path], proc: subprocess.Popen, out: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None and time.monotonic() < deadline, (out / "torchrun.log").read_text()[-4000:]
        time.sleep(0.1)


def _final(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"final-r{rank}.safetensors"))


@pytest.mark.slow
def test_two_nodes_kill_one_resume_a_fresh_node_from_the_bucket(s3, make_daemon, tmp_path) -> None:
    tables = {"remote": {"url": URL, "max_retry_s": 1}}
    node_a = make_daemon(tables=tables)
    node_b = make_daemon(tables=tables)
    store = Store(URL)

    # the uninterrupted run (the reference final weights; every step complete in the
    # bucket) and the one that node 1 will leave run side by side: the second waits at
    # step KILL_AT until the reference has finished
    ref, job = tmp_path / "ref", tmp_path / "job"
    reference = _torchrun(tmp_path, ref, [node_a.config, node_b.config], "ref")
    proc = _torchrun(tmp_path, job, [node_a.config, node_b.config], "job", KILL_AT=str(KILL_AT))
    assert _finish(reference, ref) == 0, (ref / "torchrun.log").read_text()[-4000:]
    assert [i.step for i in catalog.list_checkpoints(store, "ref")] == list(range(1, STEPS + 1))
    assert ckptd.latest("ref", root=node_a.root, remote="") is None  # no node alone holds a whole step

    # node 1 (its daemon and its two ranks) dies mid-step KILL_AT
    marks = [job / f"midstep-r{r}" for r in (2, 3)] + [job / f"incomplete-r{r}" for r in (0, 1)]
    _wait_for(marks, proc, job)
    assert "is not complete in s3://ckptd/multinode" in (job / "incomplete-r0").read_text()
    node_b.kill()
    for r in (2, 3):
        os.kill(int((job / f"midstep-r{r}").read_text()), signal.SIGKILL)
    assert _finish(proc, job) != 0  # torchrun stops the survivors
    # node 0's shares of KILL_AT reach the bucket; the step never becomes complete there, nor anywhere
    prefix = catalog.step_prefix("job", KILL_AT)
    deadline = time.monotonic() + 60
    while sorted(k for k in store.list(prefix) if "manifest" in k) != [prefix + f"manifest-r0000{r}.json" for r in (0, 1)]:
        assert time.monotonic() < deadline, store.list(prefix)
        time.sleep(0.2)
    assert catalog.latest(store, "job").step == KILL_AT - 1
    assert ckptd.latest("job", root=node_a.root, remote=URL).step == KILL_AT - 1  # both tiers considered
    for root in (node_a.root, node_b.root):
        assert all(i.step != KILL_AT for i in ckptd.list_checkpoints("job", root=root, remote=URL))

    # a new node 1 with an empty disk resumes its ranks from the bucket, to the same weights
    node_c = make_daemon(tables=tables)
    assert not (node_c.root / "job").exists()
    resumed = tmp_path / "resumed"
    proc = _torchrun(tmp_path, resumed, [node_a.config, node_c.config], "job", RESUME="1")
    assert _finish(proc, resumed) == 0, (resumed / "torchrun.log").read_text()[-4000:]
    for r in range(4):
        assert (resumed / f"resumed-r{r}").read_text() == str(KILL_AT - 1)
        want, got = _final(ref, r), _final(resumed, r)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), r
    assert catalog.latest(store, "job").step == STEPS
