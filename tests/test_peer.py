"""The peer tier (docs/tiers.md): three daemons on 127.0.0.1, each with its own root
and [peer] listen port, stand for three nodes; a node is lost (daemon killed, root
deleted) and a fresh one resumes from its peers' memory, bit-exact."""

from __future__ import annotations

import json
import os
import shutil
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
from ckptd.config import load as load_config
from ckptd.peer.tier import PeerTier
from conftest import Daemon, free_port

TRAIN = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["CKPTD_CONFIG"] = os.environ["NODE_CONFIGS"].split(",")[rank]  # rank r on node r
    import torch, torch.distributed as dist
    from safetensors.torch import save_file
    import ckptd
    from ckptd import producer
    run, out, steps = os.environ["RUN"], Path(os.environ["OUT"]), int(os.environ["STEPS"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def flat(state):
        out = {f"model.{k}": v for k, v in state["model"].items()}
        for i, s in state["optim"]["state"].items():
            out[f"optim.{i}"] = s["momentum_buffer"]
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    start = 0
    if os.environ.get("RESUME"):
        state = ckptd.load(run)  # this rank's share ($RANK) of the newest complete step, any tier
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        save_file(flat(state), str(out / f"loaded-r{rank}.safetensors"))
        (out / f"resumed-r{rank}").write_text(str(start))
    producer.configure(run=run, staging_size="8MiB")
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 32, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        producer.save(state, step).wait(60)
        save_file(flat(state), str(out / f"saved-{step}-r{rank}.safetensors"))
    info = producer.wait_complete(steps, timeout=60, tier="peer")  # every rank's share in a peer's memory
    assert info.step == steps and info.world_size == world, info
    producer.close()
    dist.destroy_process_group()
""")


def _nodes(tmp_path: Path, tables: dict | None = None, memory: str = "64MiB") -> list[Daemon]:
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    nodes = []
    for i, listen in enumerate(listens):
        peer = {"listen": listen, "peers": [e for e in listens if e != listen], "memory": memory, "stall": "3s"}
        nodes.append(Daemon(tmp_path / f"node{i}", tables={**(tables or {}), "peer": peer}))
    return nodes


def _torchrun(tmp_path: Path, out: Path, configs: list[Path], **env: str) -> int:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, NODE_CONFIGS=",".join(map(str, configs)), RUN="job", OUT=str(out),
                    GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        env=full_env, stdout=open(out / "torchrun.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError((out / "torchrun.log").read_text()[-4000:]) from None
    assert rc == 0, (out / "torchrun.log").read_text()[-4000:]
    return rc


def _status(node: Daemon) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "-c", str(node.config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bucket", ["none", "stopped"])
def test_a_lost_node_resumes_from_peer_memory(tmp_path, request, bucket) -> None:
    tables = {}
    if bucket == "stopped":
        s3 = request.getfixturevalue("s3")
        tables = {"remote": {"url": "s3://ckptd/peer", "max_retry_s": 1}}
    nodes = _nodes(tmp_path, tables)
    try:
        for n in nodes:
            n.start()
        job = tmp_path / "job"
        _torchrun(tmp_path, job, [nodes[0].config, nodes[1].config], STEPS="3")
        for n in nodes[:2]:
            peer = _status(n)["peer"]
            assert peer["under_replicated"] == 0, peer
        assert sum(_status(n)["peer"]["held_shares"] for n in nodes) >= 2 * 3

        # node 0 is lost with its disk; a fresh one takes its place, address and config
        nodes[0].kill()
        shutil.rmtree(nodes[0].root)
        if bucket == "stopped":
            s3.stop()
        nodes[0].start()
        assert not (nodes[0].root / "job").exists()
        resumed = tmp_path / "resumed"
        _torchrun(tmp_path, resumed, [nodes[0].config, nodes[1].config], STEPS="5", RESUME="1")
        for r in range(2):
            assert (resumed / f"resumed-r{r}").read_text() == "3"
            assert _equal(load_file(str(resumed / f"loaded-r{r}.safetensors")),
                          load_file(str(job / f"saved-3-r{r}.safetensors"))), r
        # the share came back through the durable path: committed in the new root
        assert (nodes[0].root / "job" / "step-000000000003" / "manifest-r00000.json").is_file()
    finally:
        for n in nodes:
            n.cleanup()
