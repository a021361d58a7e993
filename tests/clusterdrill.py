"""The cluster drill (issue 38): ckptd installed from its wheel on N nodes of
tests/netcluster.py, each set up only by docs/runbook.md's ``cluster`` blocks, a torchrun
FSDP2 + Adam job across them with ``keep_last = 3``, every node's disk and peer memory
sampled and bounded throughout, a node lost and replaced, the job resumed and compared
bit-exact with an uninterrupted run. Start at ``drill``; tests/test_cluster.py runs it
small, benchmarks/cluster_drill.py in full. ``SUBSTITUTIONS`` lists where the runbook
cannot run as written here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from netcluster import HUB_ADDRESS, NetCluster

REPO = Path(__file__).resolve().parent.parent
SETUPS = ("peers", "bucket", "both")
RANKS = 2  # the job's ranks on each node (the runbook's --nproc-per-node)
# what the job's agent and workers import beyond torch: their fork server imports it once
PRELOAD = "torch.distributed.run,torch.distributed.fsdp,torch.distributed.checkpoint.state_dict"
BUCKET_PORT = 8333  # the runbook's bucket: http://10.0.0.100:8333
SUBSTITUTIONS = [
    "`sudo ` dropped: the drill runs as root",
    "/etc/ckptd, /run/ckptd, /var/lib/ckptd: the same paths under each node's own folder",
    ".venv/bin/: the fresh venv that holds ckptd's wheel",
    "step 2 (copy every .key into every peers folder) is prose: the drill copies them",
    "step 3: the `# this node's` lines and `metrics` get the node's address; `peers` lists the N nodes;"
    " [peer] or [remote] dropped for the bucket-only and peers-only set-ups",
    "step 4: `ckptd serve -c CONFIG` in the node's namespace with the bucket's AWS_* variables in its"
    " environment, instead of install-systemd, the drop-in, sysusers, chgrp and systemctl;"
    " run/ckptd made by hand (the unit's RuntimeDirectory); its `ckptd status` line runs as written",
    "step 5: `--rdzv-id RUN-LAUNCH` (each launch of a job needs its own: without it a relaunch after"
    " a node loss is refused by the surviving daemons, 'already committed by this attempt');"
    " `--nnodes` is the drill's N; tests/cluster_job.py runs examples/fsdp2_torchrun.py paced (a step"
    " first waits, up to DRILL_PACE s, until the step before is complete in the set-up's tiers, as a real"
    " one takes minutes, in which the copies are made); with a fork server (tests/forkserver.py, the"
    " venv's Python) torchrun's agent and workers fork from it, each in its node's namespace; the script gets `--steps S --every 1`; node 1 adds"
    " `--rdzv-conf is_host=1` (its hostname does not resolve to 10.0.0.1, so torchrun does not know"
    " it hosts the rendezvous) and every node `--local-addr 10.0.0.<i>` (the namespaces share the"
    " host's name, which torchrun would hand the workers as the store's address); trainers get GLOO_SOCKET_IFNAME and the bucket's AWS_* variables",
]


# torch's console script, as installing torch in the venv writes it; under the drill's fork
# server ($TESTS_FORKSERVER) the agent is forked from it instead, in this node's namespace
TORCHRUN = """#!{python}
import sys
from os import environ
if environ.get("TESTS_FORKSERVER"):
    sys.path.insert(0, "{tests}")
    import forkserver
    agent = ("import sys; sys.path.insert(0, '{tests}'); import netcluster; netcluster.join_requester(); "
             "from torch.distributed.run import main; sys.exit(main())")
    sys.exit(forkserver.ForkedPopen([sys.executable, "-c", agent, *sys.argv[1:]]).wait() % 256)
from torch.distributed.run import main
sys.exit(main())
"""


def wheel_venv(base: Path) -> Path:
    """A fresh venv under ``base`` with ckptd installed from a wheel of this checkout.

    Its other requirements (torch, pyzmq, boto3...) come from the running interpreter's
    site-packages through a ``.pth`` line, after the venv's own, so nothing is
    downloaded: in CI that is the ``.venv`` scripts/test.sh makes, on a developer's
    machine whichever venv runs the test. Only path lines of a ``.pth`` are read from
    there, so an editable install in that venv does not shadow the wheel's copy."""
    wheels = base / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(REPO)], check=True, capture_output=True, timeout=600, env=clean_env())
    venv = base / "venv"
    subprocess.run([os.path.realpath(sys.executable), "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    wheel = next(wheels.glob("ckptd-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=600,
                   env=clean_env())  # PYTHONPATH at a checkout would show pip ckptd as installed already
    own = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True, env=clean_env()).stdout.strip()
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(own) / "zz_ckptd_drill_requirements.pth").write_text("".join(p + "\n" for p in sorted(shared)))
    torchrun = venv / "bin" / "torchrun"
    torchrun.write_text(TORCHRUN.format(python=venv / "bin/python", tests=REPO / "tests"))
    torchrun.chmod(0o755)
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u, ckptd; "
                            "print(ckptd.__file__ if u.find_spec('torch') else 'no torch')"],
                           check=True, capture_output=True, text=True, env=clean_env(), cwd=base).stdout.strip()
    if not where.startswith(str(venv)):
        raise RuntimeError(f"the fresh venv imports ckptd from {where}, not from its wheel (or has no torch)")
    return venv


def cached_wheel_venv(cache: Path) -> Path:
    """``wheel_venv`` under ``cache``, made once for this source tree, this interpreter
    and its site-packages (their hash names its folder): later test sessions of the
    same tree use it as it is. Folders of other trees unused for a day are removed."""
    import fcntl
    import hashlib

    h = hashlib.sha256(f"{os.path.realpath(sys.executable)}\0{sorted(sysconfig.get_paths().items())}".encode())
    for path in sorted([REPO / "pyproject.toml", REPO / "README.md", *(REPO / "ckptd").rglob("*")]):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(f"\0{path.relative_to(REPO)}\0".encode() + path.read_bytes())
    base = cache / f"ckptd-drill-venv-{h.hexdigest()[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(f"{base}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building the same tree: wait for it
        if not (base / "complete").exists():
            shutil.rmtree(base, ignore_errors=True)  # a build cut short
            wheel_venv(base)
            (base / "complete").touch()
    os.utime(base / "complete")
    for old in cache.glob("ckptd-drill-venv-*"):
        done = old / "complete"
        if old != base and done.exists() and time.time() - done.stat().st_mtime > 86400:
            shutil.rmtree(old, ignore_errors=True)
            Path(f"{old}.lock").unlink(missing_ok=True)
    return base / "venv"


def fork_server(venv: Path, folder: Path) -> tuple[subprocess.Popen, str]:
    """tests/forkserver.py run by the venv's Python, and its socket: the drill's jobs
    (torchrun's agent and workers) fork from it, importing torch once for them all. The
    server for their modules (``PRELOAD``) starts now, in the background, while the
    nodes are set up."""
    folder.mkdir(parents=True, exist_ok=True)
    sock = str(folder / "fork.sock")
    with open(folder / "forkserver.log", "ab") as log:
        server = subprocess.Popen([str(venv / "bin/python"), str(REPO / "tests/forkserver.py"), sock],
                                  env=clean_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not os.path.exists(sock):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the drill's fork server did not start: {(folder / 'forkserver.log').read_text()}")
        time.sleep(0.05)
    warm = (f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import forkserver as f, os; "
            "e = dict(os.environ); f._server_for(f.preload_for([sys.executable, '-c', ''], e), e)")
    threading.Thread(target=subprocess.run, args=([str(venv / "bin/python"), "-c", warm],), daemon=True,
                     kwargs={"env": clean_env(TESTS_FORKSERVER=sock, TESTS_FORKSERVER_PRELOAD=PRELOAD),
                             "capture_output": True, "timeout": 600}).start()
    return server, sock


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that points at a checkout, a daemon
    or the tests' own fork server."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(("CKPTD_", "AWS_", "TESTS_FORKSERVER"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def bucket_env() -> dict[str, str]:
    from seaweed import ACCESS_KEY, SECRET_KEY

    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": f"http://{HUB_ADDRESS}:{BUCKET_PORT}", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true"}


@dataclass
class Runbook:
    """docs/runbook.md's ``cluster`` blocks, by what each does."""

    keys: str
    config: str
    service: str
    job: str

    @classmethod
    def read(cls) -> "Runbook":
        from test_docs import cluster_blocks

        found: dict[str, list[str]] = {"keys": [], "config": [], "service": [], "job": []}
        for b in cluster_blocks():
            kind = ("config" if b.lang == "toml" else "keys" if "keygen" in b.code
                    else "service" if "install-systemd" in b.code else "job" if "torchrun" in b.code else None)
            if kind is None:
                raise RuntimeError(f"{b.where()}: a cluster block the drill does not know how to run; teach "
                                   "tests/clusterdrill.py what it does")
            found[kind].append(b.code)
        missing = [k for k, v in found.items() if len(v) != 1]
        if missing:
            raise RuntimeError(f"docs/runbook.md: expected one cluster block each for {missing}")
        return cls(**{k: v[0] for k, v in found.items()})


def local_paths(code: str, node_dir: Path, venv: Path) -> str:
    code = code.replace("sudo ", "")
    for path in ("/etc/ckptd", "/run/ckptd", "/var/lib/ckptd"):
        code = code.replace(path, f"{node_dir}{path}")
    return code.replace(".venv/bin/", f"{venv}/bin/")


def node_config(block: str, node: int, members: list[int], setup: str) -> str:
    """Step 3's file for ``node``: its address on its own lines, ``peers`` the members,
    the tables the set-up does not use left out."""
    keep = {"daemon", "retention"} | ({"peer"} if setup != "bucket" else set()) \
        | ({"remote", "remote.retention"} if setup != "peers" else set())
    out, table = [], ""
    for line in block.splitlines():
        m = re.match(r"^\[([\w.]+)\]", line)
        if m:
            table = m[1]
        if "# this node's" in line or line.startswith("metrics"):
            line = line.replace("10.0.0.1", NetCluster.address(node))
        if line.startswith("peers ="):
            line = "peers = [" + ", ".join(f'"tcp://{NetCluster.address(i)}:7701"' for i in members) + "]"
        if table in keep or not table:
            out.append(line)
    return "\n".join(out) + "\n"


@dataclass
class Sample:
    t: float
    node: int
    disk: int  # bytes under the node's root
    steps: dict[str, int]  # run -> step folders in the root
    held: int | None  # peer memory: bytes of other nodes' shares held
    held_steps: int | None  # peer memory: the (run, step)s of which it holds a share
    held_ranks: int | None  # peer memory: the (run, rank)s of which it holds a share (where status says)
    folders: dict[str, list[str]] = field(default_factory=dict)  # run -> its step folders' numbers
    when: str = ""  # what the drill was doing


@dataclass
class Drill:
    """One set-up on one NetCluster: ``nodes`` nodes, the job's ``steps``."""

    net: NetCluster
    venv: Path
    base: Path
    setup: str
    nodes: int = 2
    steps: int = 8
    keep_last: int = 3
    replicas: int = 1
    pace: float = 3.0  # the most seconds a step of the job waits for the step before to be copied
    forks: str | None = None  # the fork server's socket (``fork_server``): the jobs fork from it
    bucket: Any = None  # tests/seaweed.py's SeaweedS3, its server run in the hub namespace
    lost: int = 0  # nodes lost so far
    doing: str = ""  # the phase under way (``timed``), for the samples
    runbook: Runbook = field(default_factory=Runbook.read)
    members: list[int] = field(default_factory=list)
    daemons: dict[int, subprocess.Popen] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    step_bytes: dict[tuple[int, str], int] = field(default_factory=dict)  # (node, run) -> largest step folder
    data_bytes: int = 0  # the most tensor bytes one node's step folder holds: a node's share of a step
    runs: list[str] = field(default_factory=list)
    launched: list[str] = field(default_factory=list)  # a run's name for each launch of its job
    log: list[str] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)  # phase -> seconds, summed over its runs
    launch_times: list[float] = field(default_factory=list)  # the epoch of each of ``launched``
    ended: dict[int, float] = field(default_factory=dict)  # index in ``launched`` -> the epoch it ended

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        if phase != "sampling":
            self.doing = f"{self.setup}: {phase}"
        started = time.monotonic()
        try:
            yield
        finally:
            self.times[phase] = round(self.times.get(phase, 0.0) + time.monotonic() - started, 1)

    def say(self, text: str) -> None:
        self.log.append(text)
        print(f"[{self.setup}] {text}", flush=True)

    def node_dir(self, i: int) -> Path:
        return self.base / f"n{i}"

    def root(self, i: int) -> Path:
        return self.node_dir(i) / "var/lib/ckptd"

    def config(self, i: int) -> Path:
        return self.node_dir(i) / "etc/ckptd/config.toml"

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(**(bucket_env() if self.setup != "peers" else {}), **extra)

    def sh(self, i: int, code: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return self.net.run(i, ["bash", "-euo", "pipefail", "-c", code], env=self.env(i=str(i), **extra),
                            cwd=REPO, timeout=300)

    # -- steps 1 to 4 of the runbook ----------------------------------------------------------
    def set_up(self, i: int) -> None:
        """Node ``i`` from nothing: its namespace, key pair, config and daemon."""
        with self.timed("namespaces"):
            self.net.add(i)
        if i not in self.members:  # a new address: the others keep the old one (the runbook's case)
            self.members.append(i)
        nd = self.node_dir(i)
        with self.timed("keygen"):
            done = self.sh(i, local_paths(self.runbook.keys, nd, self.venv))
        if done.returncode != 0:
            raise RuntimeError(f"node {i}: runbook step 1 failed: {done.stderr[-2000:]}")
        self.config(i).write_text(node_config(local_paths(self.runbook.config, nd, self.venv), i,
                                              self.members, self.setup))
        self.share_keys()
        (nd / "run/ckptd").mkdir(parents=True, exist_ok=True)
        with self.timed("serve"):
            self.serve(i)
        self.say(f"node {i} ({NetCluster.address(i)}) up")

    def serve(self, i: int) -> None:
        nd = self.node_dir(i)
        log = open(nd / "daemon.log", "ab")
        self.daemons[i] = self.net.popen(i, [str(self.venv / "bin/ckptd"), "serve", "-c", str(self.config(i))],
                                         env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        status = next(line for line in self.runbook.service.splitlines() if "ckptd status" in line)
        status = local_paths(status.split("#")[0], nd, self.venv)
        deadline = time.monotonic() + 120
        while self.status(i) is None:
            if self.daemons[i].poll() is not None or time.monotonic() > deadline:
                break  # the runbook's own line below says what is wrong
            time.sleep(0.2)
        if (done := self.sh(i, status)).returncode != 0:
            raise RuntimeError(f"node {i}: the daemon does not answer `{status}`: {done.stderr[-1500:]}\n"
                               + (nd / "daemon.log").read_text(errors="replace")[-3000:])

    def share_keys(self) -> None:
        """Step 2: every node's public key into every node's peers folder (never a secret)."""
        keys = [k for i in self.members if i in self.net.nodes
                for k in (self.node_dir(i) / "etc/ckptd/curve").glob("*.key")]
        for i in self.members:
            if i in self.net.nodes:
                for k in keys:
                    shutil.copy(k, self.node_dir(i) / "etc/ckptd/peers" / k.name)

    def start_bucket(self) -> None:
        from seaweed import SeaweedS3

        sw = self.bucket = SeaweedS3(self.base / "bucket")
        sw.ports["s3"] = BUCKET_PORT
        argv = [a.replace("127.0.0.1", HUB_ADDRESS) if a.startswith("-ip") else a for a in sw.command()]
        self.bucket_log = open(sw.log, "ab")
        self.net.popen("hub", argv, stdout=self.bucket_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       start_new_session=True)
        make = ("import boto3, time\n"
                "c = boto3.client('s3')\n"
                "for _ in range(300):\n"
                "    try: c.create_bucket(Bucket='ckpt'); break\n"
                "    except Exception as e: err = e; time.sleep(0.5)\n"
                "else: raise SystemExit(f'no bucket: {err}')\n")
        done = self.net.run("hub", [str(self.venv / "bin/python"), "-c", make], env=self.env(), timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"SeaweedFS at {HUB_ADDRESS}:{BUCKET_PORT}: {done.stderr[-1500:]}\n{sw.log_tail()}")
        self.say(f"bucket up at http://{HUB_ADDRESS}:{BUCKET_PORT}")

    # -- sampling ---------------------------------------------------------------------------------
    def sample(self, i: int) -> None:
        with self.timed("sampling"):
            self._sample(i)

    def _sample(self, i: int) -> None:
        root, steps, numbers = self.root(i), {}, {}
        disk = _bytes_in(root, "**/*")
        for run in self.runs:
            folders = _folders(root / run, "step-*")
            steps[run] = len(folders)
            numbers[run] = [f.name.removeprefix("step-").lstrip("0") for f in folders]
            for f in folders:
                size, data = _bytes_in(f, "**/*"), _bytes_in(f, "*.safetensors")
                self.step_bytes[(i, run)] = max(self.step_bytes.get((i, run), 0), size)
                self.data_bytes = max(self.data_bytes, data)
        held = held_steps = held_ranks = None
        if self.setup != "bucket" and (answer := self.status(i)) is not None:
            peer = answer.get("peer") or {}
            held, held_steps, held_ranks = peer.get("held_bytes"), peer.get("held_steps"), peer.get("held_ranks")
        s = Sample(time.monotonic(), i, disk, steps, held, held_steps, held_ranks, numbers, self.doing)
        self.samples.append(s)
        self.check(s)

    def status(self, i: int) -> dict[str, Any] | None:
        """What ``ckptd status --json`` on node ``i`` prints, asked over its daemon's socket
        file from here (a process per sample would take the nodes' CPU); None: no answer."""
        from ckptd.config import load
        from ckptd.errors import CheckpointError
        from ckptd.transport import wire
        from ckptd.transport.oneshot import request

        endpoint = load(self.config(i)).endpoint
        try:
            return request(endpoint, wire.encode("status", seq=1), 30)["status"]
        except CheckpointError:
            return None

    def check(self, s: Sample) -> None:
        """The bounds at this sample, as docs/runbook.md ("Size it") promises them: the
        root holds at most ``keep_last`` steps of each run, the newest complete across
        the cluster and the one in flight. Peer memory (docs/tiers.md, "Holding"): of
        each rank held, ``max(keep_last, 2)`` steps and the newest step complete here,
        of the shares of ``replicas`` nodes (a ring's partners) and, for each node lost,
        one node's more (the lost node's newest copies stay; its partner's shares come
        to their next peer)."""
        most = self.keep_last + 2
        for run, n in s.steps.items():
            if n > most:
                self.violations.append(f"node {s.node}: {n} step folders of {run} in its root (at most {most}): "
                                       f"steps {s.folders[run]}, during {s.when!r}")
        allowed = sum(most * b for (node, _), b in self.step_bytes.items() if node == s.node)
        spare = 1 << 20  # the index, pointers and logs beside the step folders
        if s.disk > allowed + spare:
            self.violations.append(f"node {s.node}: {s.disk} bytes in its root (at most {allowed + spare})")
        held = max(self.keep_last, 2) + 1
        senders = self.replicas + self.lost
        if s.held_ranks is not None and s.held_ranks > RANKS * senders * len(self.runs):
            self.violations.append(f"node {s.node}: copies of {s.held_ranks} ranks held (at most {RANKS} of each "
                                   f"of {senders} node(s), of {len(self.runs)} run(s))")
        if s.held_steps is not None and s.held_steps > held * senders * len(self.runs):
            self.violations.append(f"node {s.node}: peers' shares of {s.held_steps} steps held (at most {held} "
                                   f"of each of {senders} node(s)' shares, of {len(self.runs)} run(s))")
        if s.held is not None and self.data_bytes:  # no bound in bytes before a step is on a disk
            bound = held * senders * self.data_bytes * len(self.runs)
            if s.held > bound:
                self.violations.append(f"node {s.node}: {s.held} bytes of peers' shares held (at most {bound}: "
                                       f"{held} steps of {senders} node(s)' shares, of {len(self.runs)} run(s))")

    def sampling(self, stop: threading.Event, every: float) -> threading.Thread:
        def loop() -> None:
            while not stop.is_set():
                for i in list(self.net.nodes):
                    try:
                        self.sample(i)
                    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
                        pass  # a node going away under the sampler
                stop.wait(every)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        return t

    # -- step 5: the job ---------------------------------------------------------------------------
    def launch(self, run: str, steps: int) -> dict[int, subprocess.Popen]:
        """The runbook's job command on every node up, its output in ``<node>/<run>.log``."""
        if run not in self.runs:
            self.runs.append(run)
        first = min(self.net.nodes)
        launch = sum(r == run for r in self.launched)
        self.launched.append(run)
        self.launch_times.append(time.time())
        procs = {}
        for i in sorted(self.net.nodes):
            code = local_paths(self.runbook.job, self.node_dir(i), self.venv)
            code = re.sub(r"--nnodes \d+", f"--nnodes {len(self.net.nodes)}", code)
            code = re.sub(r"--rdzv-id \S+ ", "", code)  # the runbook's own id: each launch here gets its own
            code = code.replace("--rdzv-backend", f"--rdzv-id {run}-{launch} --rdzv-conf is_host={int(i == first)} "
                                f"--local-addr {NetCluster.address(i)} --rdzv-backend")
            code = re.sub(r"--run-name \S+", f"--run-name {run} --steps {steps} --every 1", code)
            code = code.replace("examples/fsdp2_torchrun.py", "tests/cluster_job.py")
            forks = {"TESTS_FORKSERVER": self.forks, "TESTS_FORKSERVER_PRELOAD": PRELOAD} if self.forks else {}
            with open(self.node_dir(i) / f"{run}.log", "ab") as out:
                procs[i] = self.net.popen(i, ["bash", "-euo", "pipefail", "-c", code], cwd=REPO, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                          env=self.env(GLOO_SOCKET_IFNAME="eth0", TORCH_CPP_LOG_LEVEL="ERROR",
                                                       DRILL_PACE=str(self.pace), DRILL_WAIT=self.tiers, **forks))
        return procs

    @property
    def tiers(self) -> str:
        """The tiers a step of the job waits on for the step before: those the set-up copies to."""
        return {"peers": "peer", "bucket": "remote", "both": "peer,remote"}[self.setup]

    def job_log(self, i: int, run: str) -> str:
        path = self.node_dir(i) / f"{run}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def job_times(self) -> list[dict[str, Any]]:
        """Each launch's phases on the first node, from its ``drill-time`` lines (tests/cluster_job.py):
        torchrun to its workers' start (the agent's imports and the rendezvous), the
        workers' imports, their set-up to the first step (process group, FSDP2, the
        resume), and the first step to the end of the job (None: it was killed)."""
        out, seen = [], {}
        for k, (run, at) in enumerate(zip(self.launched, self.launch_times)):
            n = seen[run] = seen.get(run, -1) + 1
            logs = self.job_log(min(self.net.nodes), run)
            # one line per launch, found wherever another process's output ran into it
            phases = re.findall(r"drill-time (\d+\.\d+) (\d+\.\d+) (\d+\.\d+)", logs)
            if len(phases) <= n:
                continue
            start, imported, first = (float(v) for v in phases[n])
            end = self.ended.get(k)
            out.append({"run": run, "agent_s": round(start - at, 1), "import_s": round(imported - start, 1),
                        "setup_s": round(first - imported, 1), "steps_s": None if end is None else round(end - first, 1)})
        return out

    def finish(self, procs: dict[int, subprocess.Popen], run: str, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        failed: dict[int, int | None] = {}
        for i, p in procs.items():
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                failed[i] = rc
                deadline = min(deadline, time.monotonic() + 30)  # the others follow a failed node soon
        if failed:
            self.stop_job(procs)
            # every failed node's log: the first to fail is the cause, the others say "closed by peer"
            raise AssertionError("\n".join(f"node {i}: the job {run} ended with {rc}:\n{self.job_log(i, run)[-4000:]}"
                                           for i, rc in failed.items()))
        self.ended[len(self.launched) - 1 - self.launched[::-1].index(run)] = time.time()

    def stop_job(self, procs: dict[int, subprocess.Popen]) -> None:
        """The job killed on every node still up: its launchers, and every process there
        but the daemon (the agents and workers forked from the fork server among them)."""
        for i, p in procs.items():
            if i in self.net.nodes:
                self.net.stop_all_but(i, {self.daemons[i].pid})
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
            p.wait()

    def latest(self, i: int, run: str) -> int:
        """The newest step of ``run`` complete in any tier, as node ``i`` sees it (0: none)."""
        done = self.net.run(i, [str(self.venv / "bin/ckptd"), "latest", run, "--json", "-c", str(self.config(i))],
                            env=self.env(), timeout=60)
        if done.returncode != 0 or not done.stdout.strip():
            self.say(f"node {i}: `ckptd latest {run}`: {done.stderr.strip()[-300:]}")
            return 0
        return int(json.loads(done.stdout)["step"])

    def digests(self, run: str) -> dict[str, str]:
        """The digest of every tensor and value of ``run``'s last step, by rank and name, as
        each rank loaded its share back at the end of the job (tests/cluster_job.py)."""
        out: dict[str, str] = {}
        for i in self.net.nodes:
            for line in re.findall(r"^drill-digests (.*)$", self.job_log(i, run), re.M):
                out.update(json.loads(line))
        return out

    def compare(self, ref: dict[str, str], run: str) -> list[str]:
        """The tensors and values of ``run``'s last step that differ from the uninterrupted
        run's (``ref``: its ``digests``), or a line saying a rank printed none."""
        got = self.digests(run)
        ranks = {k.split(":")[0] for k in got}
        missing = [f"rank {r} printed no digests" for r in range(RANKS * len(self.net.nodes)) if f"rank {r}" not in ranks]
        return missing or sorted(k for k in set(ref) | set(got) if ref.get(k) != got.get(k))

    # -- a node lost and replaced ------------------------------------------------------------------
    def lose(self, victim: int) -> None:
        """The machine is gone: daemon and trainers killed at once, its disk and keys with it."""
        self.lost += 1  # first: its partners' shares go to their next peers within a timeout of the kill
        self.net.kill(victim)
        daemon = self.daemons.pop(victim)
        daemon.wait(30)
        shutil.rmtree(self.node_dir(victim))
        self.members.remove(victim)

    def resumed_from(self, run: str) -> dict[int, list[int]]:
        return {i: [int(m) for m in re.findall(r"resumed from step (\d+)", self.job_log(i, run))]
                for i in self.net.nodes}

    def case(self, ref: dict[str, str], run: str, kill_at: int, address: str) -> dict[str, object]:
        """``run`` is killed once its step after ``kill_at`` is handed to ckptd, the last node lost
        and set up again (at its ``address``: "same" or "new"), the job launched again and
        its last step compared with the uninterrupted run's (``ref``: its ``digests``)."""
        first = min(self.net.nodes)
        with self.timed("job to the loss"):
            procs = self.launch(run, self.steps)
            while f"step {kill_at + 1}: checkpoint handed" not in self.job_log(first, run):
                if any(p.poll() is not None for p in procs.values()):
                    self.stop_job(procs)
                    raise AssertionError(f"the job {run} ended before step {kill_at}:\n{self.job_log(first, run)[-3000:]}")
                time.sleep(0.05)
        victim = max(self.net.nodes)
        with self.timed("loss"):
            self.lose(victim)
            lost = time.monotonic()
            self.stop_job(procs)  # the others' workers fail on the lost peer; the scheduler ends the job
        with self.timed("latest"):
            seen = self.latest(first, run)  # what the survivors hold: the step the job must resume from
        self.say(f"node {victim} lost after step {kill_at + 1} was handed over; newest complete on node {first}: {seen}")
        self.set_up(victim if address == "same" else max(self.members + [victim]) + 1)
        replaced = time.monotonic()
        with self.timed("relaunch to resumed"):
            procs = self.launch(run, self.steps)
            while not all(len(v) == RANKS for v in self.resumed_from(run).values()):
                if any(p.poll() not in (None, 0) for p in procs.values()) or all(p.poll() == 0 for p in procs.values()):
                    break  # failed, or done without resuming: finish and the comparison say so
                time.sleep(0.5)
        resumed = time.monotonic()
        with self.timed("resumed to the end"):
            self.finish(procs, run)
        for i in list(self.net.nodes):  # the sampler may have missed a replacement that was quick
            self.sample(i)
        steps = sorted({s for v in self.resumed_from(run).values() for s in v})
        differ = self.compare(ref, run)
        result = {"address": address, "newest_when_lost": seen, "handed_over_when_lost": kill_at + 1, "resumed_from": steps,
                  "replace_s": round(replaced - lost, 1), "resume_s": round(resumed - replaced, 1),
                  "differ": differ}
        self.say(f"case {address} address: {result}")
        return result

    def figures(self) -> dict[str, object]:
        """Per node: the most disk and peer memory sampled, and the number of samples."""
        out: dict[str, object] = {}
        for i in sorted({s.node for s in self.samples}):
            mine = [s for s in self.samples if s.node == i]
            out[f"n{i}"] = {"samples": len(mine), "disk_max": max(s.disk for s in mine),
                            "held_max": max((s.held or 0) for s in mine),
                            "steps_max": max((max(s.steps.values(), default=0) for s in mine), default=0)}
        return out


def _folders(folder: Path, pattern: str) -> list[Path]:
    """The sorted entries of ``folder`` matching ``pattern``; none if it is gone."""
    try:
        return sorted(folder.glob(pattern))
    except OSError:
        return []


def _bytes_in(folder: Path, pattern: str) -> int:
    """Bytes of the files under ``folder`` matching ``pattern``; what retention removes
    while they are counted counts 0."""
    total = 0
    try:
        for path in folder.glob(pattern):
            try:
                if path.is_file():
                    total += path.stat().st_size
            except OSError:
                continue
    except OSError:
        pass
    return total


def drill(base: Path, venv: Path, setup: str, *, nodes: int = 2, steps: int = 8, kill_at: int = 4,
          addresses: tuple[str, ...] = ("same",), rate: str = "1gbit", every: float = 2.0,
          ref: dict[str, str] | None = None, forks: str | None = None) -> dict[str, Any]:
    """One set-up ("peers", "bucket" or "both") from nothing to the last comparison.
    ``ref``: the uninterrupted run's ``digests`` (a job of as many nodes and steps in
    another set-up: the job does not depend on the tiers); None runs it here first.
    ``forks``: the socket of a ``fork_server`` the jobs fork from (None: each process
    imports torch itself). Returns what was measured, ``ref`` among it; ``violations``
    lists every sample past a bound."""
    if setup not in SETUPS:
        raise ValueError(f"set-up {setup!r}: one of {', '.join(SETUPS)}")
    with NetCluster(rate) as net:
        d = Drill(net, venv, base / setup, setup, nodes, steps, members=list(range(1, nodes + 1)), forks=forks)
        started = time.monotonic()
        stop = threading.Event()
        sampler = None
        try:
            if setup != "peers":
                with d.timed("bucket"):
                    d.start_bucket()
            for i in range(1, nodes + 1):
                d.set_up(i)
            sampler = d.sampling(stop, every)
            if ref is None:
                with d.timed("uninterrupted job"):
                    d.finish(d.launch("ref", steps), "ref")
                ref = d.digests("ref")
                if missing := d.compare(ref, "ref"):
                    raise AssertionError(f"the uninterrupted run: {missing}")
                d.say(f"uninterrupted run done, {d.figures()}")
            cases = [d.case(ref, f"drill-{a}", kill_at, a) for a in addresses]
        finally:
            stop.set()
            if sampler is not None:
                sampler.join(120)
            if d.bucket is not None:
                d.bucket.cleanup()
        return {"setup": setup, "nodes": nodes, "steps": steps, "cases": cases, "violations": d.violations,
                "figures": d.figures(), "seconds": round(time.monotonic() - started, 1), "samples": d.samples,
                "ref": ref, "times": d.times, "jobs": d.job_times()}
