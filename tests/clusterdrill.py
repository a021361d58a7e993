"""The cluster drill (issue 38): ckptd installed from its wheel on N nodes of
tests/netcluster.py, each set up only by docs/runbook.md's ``cluster`` blocks, a torchrun
FSDP2 + Adam job across them with ``keep_last = 3``, every node's disk and peer memory
sampled and bounded throughout, a node lost and replaced, the job resumed and compared
bit-exact with an uninterrupted run. Start at ``drill``; benchmarks/cluster_drill.py runs it
small, benchmarks/cluster_drill.py in full. ``SUBSTITUTIONS`` lists where the runbook
cannot run as written here.
"""

from __future__ import annotations

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
from typing import Any

from netcluster import HUB_ADDRESS, NetCluster

REPO = Path(__file__).resolve().parent.parent
SETUPS = ("peers", "bucket", "both")
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
    " takes DRILL_PACE seconds at least, as a real one takes minutes, in which the peers get copies); the script gets `--steps S --every 1`; node 1 adds"
    " `--rdzv-conf is_host=1` (its hostname does not resolve to 10.0.0.1, so torchrun does not know"
    " it hosts the rendezvous) and every node `--local-addr 10.0.0.<i>` (the namespaces share the"
    " host's name, which torchrun would hand the workers as the store's address); trainers get GLOO_SOCKET_IFNAME and the bucket's AWS_* variables",
]


def wheel_venv(base: Path) -> Path:
    """A fresh venv under ``base`` with ckptd installed from a wheel of this checkout.

    Its other requirements (torch, pyzmq, boto3...) come from the running interpreter's
    site-packages through a ``.pth`` line, after the venv's own, so nothing is
    downloaded: in CI that is the ``.venv`` scripts/test.sh makes, on a developer's
    machine whichever venv runs the test. Only path lines of a ``.pth`` are read from
    there, so an editable install in that venv does not shadow the wheel's copy."""
    wheels = base / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(REPO)], check=True, capture_output=True, timeout=600)
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
    torchrun = venv / "bin" / "torchrun"  # torch's console script, as installing torch there writes it
    torchrun.write_text(f"#!{venv}/bin/python\nimport sys\nfrom torch.distributed.run import main\n"
                        "sys.exit(main())\n")
    torchrun.chmod(0o755)
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import ckptd, torch; print(ckptd.__file__)"],
                           check=True, capture_output=True, text=True, env=clean_env(), cwd=base).stdout.strip()
    if not where.startswith(str(venv)):
        raise RuntimeError(f"the fresh venv imports ckptd from {where}, not from its wheel")
    return venv


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that points at a checkout or a daemon."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(("CKPTD_", "AWS_"))}
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
    pace: float = 1.0  # seconds a step of the job takes, at least
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
        self.net.add(i)
        if i not in self.members:  # a new address: the others keep the old one (the runbook's case)
            self.members.append(i)
        nd = self.node_dir(i)
        done = self.sh(i, local_paths(self.runbook.keys, nd, self.venv))
        if done.returncode != 0:
            raise RuntimeError(f"node {i}: runbook step 1 failed: {done.stderr[-2000:]}")
        self.config(i).write_text(node_config(local_paths(self.runbook.config, nd, self.venv), i,
                                              self.members, self.setup))
        self.share_keys()
        (nd / "run/ckptd").mkdir(parents=True, exist_ok=True)
        log = open(nd / "daemon.log", "ab")
        self.daemons[i] = self.net.popen(i, [str(self.venv / "bin/ckptd"), "serve", "-c", str(self.config(i))],
                                         env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        status = next(line for line in self.runbook.service.splitlines() if "ckptd status" in line)
        status = local_paths(status.split("#")[0], nd, self.venv)
        deadline = time.monotonic() + 120
        while (done := self.sh(i, status)).returncode != 0:
            if self.daemons[i].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {i}: the daemon does not answer `{status}`: {done.stderr[-1500:]}\n"
                                   + (nd / "daemon.log").read_text(errors="replace")[-3000:])
            time.sleep(1)
        self.say(f"node {i} ({NetCluster.address(i)}) up")

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

        sw = SeaweedS3(self.base / "bucket")
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
        root, steps, disk = self.root(i), {}, 0
        for path in root.rglob("*") if root.exists() else ():
            try:
                if path.is_file():
                    disk += path.stat().st_size
            except OSError:
                continue  # removed while we walked: retention at work
        for run in self.runs:
            folders = sorted((root / run).glob("step-*")) if (root / run).exists() else []
            steps[run] = len(folders)
            for f in folders:
                size = sum(p.stat().st_size for p in f.rglob("*") if p.is_file()) if f.exists() else 0
                data = sum(p.stat().st_size for p in f.glob("*.safetensors")) if f.exists() else 0
                self.step_bytes[(i, run)] = max(self.step_bytes.get((i, run), 0), size)
                self.data_bytes = max(self.data_bytes, data)
        held = held_steps = None
        if self.setup != "bucket":
            done = self.net.run(i, [str(self.venv / "bin/ckptd"), "status", "--json", "-c", str(self.config(i))],
                                env=self.env(), timeout=60)
            if done.returncode == 0:
                peer = json.loads(done.stdout).get("peer") or {}
                held, held_steps = peer.get("held_bytes"), peer.get("held_steps")
        s = Sample(time.monotonic(), i, disk, steps, held, held_steps)
        self.samples.append(s)
        self.check(s)

    def check(self, s: Sample) -> None:
        """The bounds at this sample: the root holds at most ``keep_last`` steps of each run
        plus the one in flight; peer memory at most what ``keep_last`` steps (and the one
        being copied) need for ``replicas`` copies of every other node's share."""
        most = self.keep_last + 1
        for run, n in s.steps.items():
            if n > most:
                self.violations.append(f"node {s.node}: {n} step folders of {run} in its root (at most {most})")
        allowed = sum(most * b for (node, _), b in self.step_bytes.items() if node == s.node)
        spare = 1 << 20  # the index, pointers and logs beside the step folders
        if s.disk > allowed + spare:
            self.violations.append(f"node {s.node}: {s.disk} bytes in its root (at most {allowed + spare})")
        if s.held_steps is not None and s.held_steps > most * len(self.runs):
            self.violations.append(f"node {s.node}: peers' shares of {s.held_steps} steps held "
                                   f"(at most {most} of each of {len(self.runs)} run(s))")
        if s.held is not None and self.data_bytes:  # no bound in bytes before a step is on a disk
            bound = most * self.replicas * self.data_bytes * len(self.runs)
            if s.held > bound:
                self.violations.append(f"node {s.node}: {s.held} bytes of peers' shares held (at most {bound})")

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
        procs = {}
        for i in sorted(self.net.nodes):
            code = local_paths(self.runbook.job, self.node_dir(i), self.venv)
            code = re.sub(r"--nnodes \d+", f"--nnodes {len(self.net.nodes)}", code)
            code = re.sub(r"--rdzv-id \S+ ", "", code)  # the runbook's own id: each launch here gets its own
            code = code.replace("--rdzv-backend", f"--rdzv-id {run}-{launch} --rdzv-conf is_host={int(i == first)} "
                                f"--local-addr {NetCluster.address(i)} --rdzv-backend")
            code = re.sub(r"--run-name \S+", f"--run-name {run} --steps {steps} --every 1", code)
            code = code.replace("examples/fsdp2_torchrun.py", "tests/cluster_job.py")
            out = open(self.node_dir(i) / f"{run}.log", "ab")
            procs[i] = self.net.popen(i, ["bash", "-euo", "pipefail", "-c", code], cwd=REPO, stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                      env=self.env(GLOO_SOCKET_IFNAME="eth0", TORCH_CPP_LOG_LEVEL="ERROR",
                                                   DRILL_PACE=str(self.pace)))
        return procs

    def job_log(self, i: int, run: str) -> str:
        path = self.node_dir(i) / f"{run}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def finish(self, procs: dict[int, subprocess.Popen], run: str, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        for i, p in procs.items():
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                self.stop_job(procs)
                raise AssertionError(f"node {i}: the job {run} ended with {rc}:\n{self.job_log(i, run)[-4000:]}")

    @staticmethod
    def stop_job(procs: dict[int, subprocess.Popen]) -> None:
        for p in procs.values():
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

    def digests(self, i: int, run: str) -> dict[str, str]:
        """Node ``i`` loads every rank's share of the newest step of ``run`` (from any tier,
        as a rank that resumes does): a digest of each tensor and value, by rank and name."""
        code = ("import hashlib, json, sys, ckptd, torch\n"
                "def flat(d, p=''):\n"
                "    out = {}\n"
                "    for k, v in d.items():\n"
                "        out.update(flat(v, f'{p}{k}.') if isinstance(v, dict) else {f'{p}{k}': v})\n"
                "    return out\n"
                "def digest(v):\n"
                "    if not isinstance(v, torch.Tensor):\n"
                "        return hashlib.sha256(repr(v).encode()).hexdigest()\n"
                "    data = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()\n"
                "    return hashlib.sha256(f'{v.dtype}{tuple(v.shape)}'.encode() + data).hexdigest()\n"
                "out = {}\n"
                "for r in range(int(sys.argv[2])):\n"
                "    out.update({f'rank {r}: {k}': digest(v) for k, v in flat(ckptd.load(sys.argv[1], rank=r)).items()})\n"
                "print(json.dumps(out))\n")
        done = self.net.run(i, [str(self.venv / "bin/python"), "-c", code, run, str(2 * len(self.net.nodes))],
                            timeout=300, cwd=self.base, env=self.env(CKPTD_CONFIG=str(self.config(i))))
        if done.returncode != 0:
            raise AssertionError(f"node {i} cannot load run {run}: {done.stderr[-1500:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def compare(self, i: int, ref: dict[str, str], run: str) -> list[str]:
        """The tensors and values of ``run``'s newest step, loaded on node ``i``, that differ
        from the uninterrupted run's (``ref``: its ``digests``)."""
        try:
            got = self.digests(i, run)
        except AssertionError as exc:
            return [str(exc)]
        return sorted(k for k in set(ref) | set(got) if ref.get(k) != got.get(k))

    # -- a node lost and replaced ------------------------------------------------------------------
    def lose(self, victim: int) -> None:
        """The machine is gone: daemon and trainers killed at once, its disk and keys with it."""
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
        procs = self.launch(run, self.steps)
        while f"step {kill_at + 1}: checkpoint handed" not in self.job_log(first, run):
            if any(p.poll() is not None for p in procs.values()):
                self.stop_job(procs)
                raise AssertionError(f"the job {run} ended before step {kill_at}:\n{self.job_log(first, run)[-3000:]}")
            time.sleep(0.05)
        victim = max(self.net.nodes)
        self.lose(victim)
        lost = time.monotonic()
        self.stop_job(procs)  # the others' workers fail on the lost peer; the scheduler ends the job
        seen = self.latest(first, run)  # what the survivors hold: the step the job must resume from
        self.say(f"node {victim} lost after step {kill_at + 1} was handed over; newest complete on node {first}: {seen}")
        self.set_up(victim if address == "same" else max(self.members + [victim]) + 1)
        replaced = time.monotonic()
        procs = self.launch(run, self.steps)
        while not all(len(v) == 2 for v in self.resumed_from(run).values()):  # two ranks a node
            if any(p.poll() not in (None, 0) for p in procs.values()) or all(p.poll() == 0 for p in procs.values()):
                break  # failed, or done without resuming: finish and the comparison say so
            time.sleep(0.5)
        resumed = time.monotonic()
        self.finish(procs, run)
        steps = sorted({s for v in self.resumed_from(run).values() for s in v})
        result = {"address": address, "newest_when_lost": seen, "handed_over_when_lost": kill_at + 1, "resumed_from": steps,
                  "replace_s": round(replaced - lost, 1), "resume_s": round(resumed - replaced, 1),
                  "differ": self.compare(first, ref, run)}
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


def drill(base: Path, venv: Path, setup: str, *, nodes: int = 2, steps: int = 8, kill_at: int = 4,
          addresses: tuple[str, ...] = ("same",), rate: str = "1gbit", every: float = 2.0,
          ref: dict[str, str] | None = None) -> dict[str, Any]:
    """One set-up ("peers", "bucket" or "both") from nothing to the last comparison.
    ``ref``: the uninterrupted run's ``digests`` (a job of as many nodes and steps in
    another set-up: the job does not depend on the tiers); None runs it here first.
    Returns what was measured, ``ref`` among it; ``violations`` lists every sample past a bound."""
    if setup not in SETUPS:
        raise ValueError(f"set-up {setup!r}: one of {', '.join(SETUPS)}")
    with NetCluster(rate) as net:
        d = Drill(net, venv, base / setup, setup, nodes, steps, members=list(range(1, nodes + 1)))
        started = time.monotonic()
        if setup != "peers":
            d.start_bucket()
        for i in range(1, nodes + 1):
            d.set_up(i)
        stop = threading.Event()
        sampler = d.sampling(stop, every)
        try:
            if ref is None:
                d.finish(d.launch("ref", steps), "ref")
                ref = d.digests(min(net.nodes), "ref")
                d.say(f"uninterrupted run done, {d.figures()}")
            cases = [d.case(ref, f"drill-{a}", kill_at, a) for a in addresses]
        finally:
            stop.set()
            sampler.join(120)
        return {"setup": setup, "nodes": nodes, "steps": steps, "cases": cases, "violations": d.violations,
                "figures": d.figures(), "seconds": round(time.monotonic() - started, 1), "samples": d.samples,
                "ref": ref}
