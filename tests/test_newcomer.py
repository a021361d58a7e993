"""What a new user trips over: each bug here has a test that failed before its fix."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptd
from ckptd import CheckpointError, Producer, config, producer
from ckptd.producer import sizing
from conftest import cli as in_process_cli  # ckptd.cli.main in this process

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, cwd: Path | None = None, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env={**os.environ, **(env or {})}, **kw)


def eventually(fn, timeout: float = 5.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


# -- 1. a refused second daemon removes nothing --------------------------------------------
def test_a_refused_second_daemon_leaves_the_first_fully_reachable(make_daemon, tmp_path) -> None:
    d = make_daemon()
    sock = d.sock_dir / "d.sock"
    shm = Path(str(sock) + ".shm")
    before = {p: p.stat().st_ino for p in (sock, shm)}
    second = cli("serve", "-c", str(d.config))
    assert second.returncode == 1 and "already serving" in second.stderr, second.stderr
    # a daemon of another root pointed at the same socket is refused too, before it binds
    other = tmp_path / "other.toml"
    other.write_text(d.config.read_text().replace(str(d.root), str(tmp_path / "other-root")))
    third = cli("serve", "-c", str(other))
    assert third.returncode == 1 and f"already serves {d.endpoint}" in third.stderr, third.stderr
    assert {p: p.stat().st_ino for p in (sock, shm)} == before  # the very same socket files
    with d.producer(transport="shm") as p:  # reachable, shared memory included
        p.save({"w": torch.ones(3)}, 1).wait(30)
        assert p.stats()["transport"] == "shm"
    assert d.proc.poll() is None


# -- 2. one config discovery rule, for every entry point -------------------------------------
def test_the_producer_reads_the_config_in_the_current_folder(make_daemon, tmp_path, monkeypatch, caplog) -> None:
    d = make_daemon()
    work = tmp_path / "job"
    work.mkdir()
    (work / "config.toml").write_text(
        f'[daemon]\nendpoint = "{d.endpoint}"\nroot = "{d.root}"\n[producer]\nstaging_size = "48MiB"\n')
    monkeypatch.chdir(work)
    monkeypatch.delenv("CKPTD_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    with caplog.at_level(logging.INFO, logger="ckptd.producer"):
        with Producer(run="disc") as p:
            assert p.endpoint == d.endpoint and p.options.staging_size == 48 * 2**20
            p.save({"w": torch.ones(2)}, 1).wait(30)
            assert p.stats()["staging_bytes"] == 48 * 2**20
    assert f"config {work / 'config.toml'} (found in the current folder)" in caplog.text
    # the readers and the CLI find the same file: its root
    assert ckptd.latest("disc").step == 1
    r = cli("latest", "disc", "--json", cwd=work, env={"CKPTD_CONFIG": ""})
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 1, r.stderr


def readme_training_script() -> str:
    """The README's training loop, as its reader saves it to train.py."""
    found = [b for b in re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
             if "producer.save" in b]
    assert len(found) == 1, "the README shows one training loop"
    return found[0]


def test_the_readme_loop_finds_its_daemon_through_ckptd_config_and_resumes(daemon, tmp_path) -> None:
    """Run as the README says (CKPTD_CONFIG set, `python train.py` in the job's own folder,
    which has a config.toml of its own): it checkpoints through that daemon, and run again
    it goes on from the newest complete step."""
    config = tmp_path / "ckptd.toml"
    config.write_text(f'[daemon]\nendpoint = "{daemon.endpoint}"\nroot = "{daemon.root}"\n')
    job = tmp_path / "project"
    job.mkdir()
    (job / "config.toml").write_text("[model]\nlayers = 2\n")  # the job's own settings, not ckptd's
    (job / "train.py").write_text(readme_training_script())
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_CONFIG"] = str(config)
    for newest in (300, 600):
        r = subprocess.run([sys.executable, "train.py"], cwd=job, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert ckptd.latest("demo", root=daemon.root).step == newest


def test_serve_without_a_config_says_it_runs_on_defaults(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "PYTHONUNBUFFERED": "1"}
    env.pop("CKPTD_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve"], cwd=empty, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    if config.SYSTEM_CONFIG.is_file():  # a machine with ckptd installed: that file is the one
        assert f"config {config.SYSTEM_CONFIG} (the system config)" in first, first
    else:
        assert first.startswith("WARNING ckptd.daemon: config: no config file found"), first
        assert f"built-in defaults: endpoint ipc://{empty}/var/run/ckptd.sock, root {empty}/var/checkpoints" in first


def test_no_daemon_hint_names_a_config_that_exists(tmp_path, monkeypatch) -> None:
    cfg = tmp_path / "site.toml"
    cfg.write_text(f'[daemon]\nendpoint = "ipc://{tmp_path}/none.sock"\n')
    monkeypatch.setenv("CKPTD_CONFIG", str(cfg))
    with pytest.raises(CheckpointError, match=re.escape(f"start one with `ckptd serve -c {cfg}`")):
        Producer(run="x", timeout=0.5, on_no_daemon="raise")


# -- 3. staging sizes itself -------------------------------------------------------------
RSS_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    base = rss()
    from ckptd import Producer
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))  # ~26 KB
    with Producer(sys.argv[1], "small") as p:
        for step in (1, 2, 3):
            p.save({"model": model.state_dict(), "step": step}, step).wait(30)
        stats = p.stats()
        print(json.dumps({"added": rss() - base, **stats}))
""")


def test_small_checkpoints_cost_little_memory(daemon) -> None:
    r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, daemon.endpoint], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "CKPTD_CONFIG": "none"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    print(f"a producer of a 26 KB model adds {out['added'] / 2**20:.1f} MiB over the interpreter with torch")
    assert out["staging_bytes"] == 32 * 2**20  # it never grew
    assert out["added"] <= 64 * 2**20  # was 1.36 GB with the old fixed 1 GiB default


def test_staging_grows_to_fit_in_the_background(make_daemon) -> None:
    # a disk slower than the copy: the first save must wait for the daemon to write out
    daemon = make_daemon(write_rate="64MiB")
    state = {f"t{i}": torch.full((2**20,), float(i)) for i in range(64)}  # 256 MiB in 64 tensors
    with daemon.producer(staging_size="auto") as p:
        assert p.stats()["staging_limit"] >= 320 * 2**20
        p.save(state, 1).wait(60)  # streams through 128 MiB made for it on the spot
        first = p.stats()
        assert first["staging_bytes"] == sizing.BRIDGE and first["blocked_seconds"] > 0
        assert eventually(lambda: p.stats()["staging_ready_bytes"] >= 256 * 2**20, 30)  # grown in the background
        p.save(state, 2).wait(60)
        grown = p.stats()
        assert grown["staging_bytes"] >= 256 * 2**20
        p.save(state, 3).wait(60)  # the whole checkpoint fits: no more waiting for the daemon
        assert p.stats()["blocked_seconds"] == grown["blocked_seconds"]
        assert p.stats()["transport"] == "shm"
    for step in (1, 2, 3):
        got = ckptd.load("t", step, root=daemon.root)
        assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_checkpoint_larger_than_staging_gets_more_at_once(daemon) -> None:
    # 32 MiB streams slowly (1 GiB: durable in 0.72-1.0 s, 0.5 s staged whole); a
    # checkpoint of 96 MiB fits the 128 MiB made for it before its first copy
    state = {f"t{i}": torch.full((2**20,), float(i)) for i in range(24)}
    with daemon.producer(staging_size="auto") as p:
        p.save(state, 1).wait(60)
        assert p.stats()["staging_bytes"] == 128 * 2**20
        assert p.stats()["blocked_seconds"] == 0
        # emits: the first checkpoint's size is not known before it, so it streams
        # through 32 MiB; the next is taken to be as large as the last
    with daemon.producer(run="e", staging_size="auto") as p:
        for step in (1, 2):
            with p.checkpoint(step) as handle:
                for name, t in state.items():
                    p.emit(name, t)
            handle.wait(60)
            if step == 1:
                first = p.stats()
                assert first["staging_bytes"] == 32 * 2**20 and first["blocked_seconds"] > 0
        assert p.stats()["staging_bytes"] == 128 * 2**20
        assert p.stats()["blocked_seconds"] == first["blocked_seconds"]
    for run in ("t", "e"):
        got = ckptd.load(run, root=daemon.root)
        assert all(torch.equal(got[k], v) for k, v in state.items())


def test_staging_never_exceeds_what_was_asked(daemon, monkeypatch) -> None:
    state = {f"t{i}": torch.zeros(2**20) for i in range(16)}  # 64 MiB
    with daemon.producer(staging_size="16MiB") as p:  # a size set by hand is that size
        for step in (1, 2):
            p.save(state, step).wait(60)
        assert p.stats()["staging_bytes"] == 16 * 2**20 and p.stats()["staging_limit"] == 16 * 2**20
    with daemon.producer(run="cap", staging_size="auto", staging_limit="40MiB") as p:
        p.save(state, 1).wait(60)  # made on the spot for it, at the limit: nothing grows after
        assert p.stats()["staging_bytes"] == 40 * 2**20
        p.save(state, 2).wait(60)
        assert p.stats()["staging_bytes"] == 40 * 2**20 and p.stats()["staging_ready_bytes"] == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # eight ranks on this node share the machine's memory
    from ckptd.producer import sizing

    eight = sizing.default_limit()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert abs(sizing.default_limit() / eight - 8) < 0.01


# -- 4. a missing daemon is found at start ---------------------------------------------------
def test_a_missing_daemon_is_reported_at_start(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    with pytest.warns(RuntimeWarning, match="no ckptd daemon answered .* on_no_daemon"):
        p = Producer(endpoint, "early", timeout=0.5)
        p._connection.wait_started(10)  # the warning comes from the background connect, within the timeout
    p.close()
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="no ckptd daemon answered"):
        Producer(endpoint, "early", timeout=0.5, on_no_daemon="raise")
    assert time.monotonic() - t0 < 5


def test_the_producer_connects_before_its_first_checkpoint(daemon) -> None:
    with daemon.producer() as p:
        assert eventually(lambda: p.stats()["transport"] == "shm", 10)  # no emit yet


# -- 5. the polling observer forgets a run moved away ----------------------------------------
def test_polling_forgets_a_run_folder_moved_out_of_the_root(make_daemon, tmp_path) -> None:
    d = make_daemon(tables={"index": {"observer": "polling", "poll_interval": "1s"}})
    with d.producer(run="gone") as p:
        p.save({"w": torch.ones(2)}, 1).wait(30)
        assert p.latest().step == 1
        shutil.move(str(d.root / "gone"), str(tmp_path / "elsewhere"))  # within one poll of the commit
        assert eventually(lambda: p.latest() is None, 2.0)


# -- 6. a stopped daemon is reported as stopped, at once -------------------------------------
def test_a_stopped_daemon_is_reported_at_once(daemon) -> None:
    p = daemon.producer(timeout=10)
    p.save({"w": torch.ones(2)}, 1).wait(30)
    daemon.proc.send_signal(signal.SIGINT)
    daemon.proc.wait(30)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"daemon at .* stopped \(the ckptd daemon \(pid \d+\) stopped\), "
                                              r"and no daemon listens there now"):
        p.save({"w": torch.ones(2)}, 2)
    assert time.monotonic() - t0 < 2  # not the 10 s timeout
    p.close()


# -- 7. a failed step is reported once ---------------------------------------------------------
FAIL_SCRIPT = textwrap.dedent("""
    import sys, logging, torch
    from ckptd import Producer, CheckpointError
    if sys.argv[2] == "logging":
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    with Producer(sys.argv[1], "once") as p:
        p.save({"w": torch.ones(2)}, 1).wait(30)
    with Producer(sys.argv[1], "once") as p:
        try:
            p.save({"w": torch.ones(2)}, 1).wait(30)
        except CheckpointError as exc:
            print("raised:", exc)
""")


def test_a_failed_step_is_reported_once(daemon) -> None:
    plain = subprocess.run([sys.executable, "-c", FAIL_SCRIPT, daemon.endpoint, "plain"], capture_output=True,
                           text=True, timeout=120)
    assert "raised: step 1 of run 'once' is already committed" in plain.stdout, plain.stderr
    assert "checkpoint step 1 failed" not in plain.stderr, plain.stderr  # no bare duplicate line
    logged = subprocess.run([sys.executable, "-c", FAIL_SCRIPT, daemon.endpoint, "logging"], capture_output=True,
                            text=True, timeout=120)
    assert logged.stderr.count("ERROR ckptd.producer: checkpoint step 1 failed") == 1, logged.stderr


# -- 8. output closed early ---------------------------------------------------------------
def test_commands_end_quietly_when_their_output_is_closed(daemon) -> None:
    with daemon.producer() as p:
        p.save({"w": torch.ones(2)}, 1).wait(30)
    for args in (["status", "--endpoint", daemon.endpoint], ["list", "t", "--root", str(daemon.root)]):
        read, write = os.pipe()
        os.close(read)  # `| head -0`: nobody reads
        r = subprocess.run([sys.executable, "-m", "ckptd", *args], stdout=write, stderr=subprocess.PIPE,
                           text=True, timeout=60)
        os.close(write)
        assert r.returncode == 141 and r.stderr == "", (args, r.stderr)


# -- expected and missing ------------------------------------------------------------------
def test_version_runs_and_pins(daemon) -> None:
    root = str(daemon.root)
    with daemon.producer(run="a") as p:
        p.save({"w": torch.ones(256)}, 1).wait(30)
        p.save({"w": torch.ones(256)}, 2).wait(30)
    with daemon.producer(run="bb") as p:
        p.save({"w": torch.ones(4)}, 7).wait(30)
    r = in_process_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ckptd {ckptd.__version__}"
    r = in_process_cli("runs", "--root", root, "--json")
    assert [(x["run"], x["step"], x["checkpoints"], x["bytes"]) for x in json.loads(r.stdout)] == [
        ("a", 2, 2, 2048), ("bb", 7, 1, 16)]
    table = in_process_cli("list", "--root", root).stdout.splitlines()  # no RUN: the runs
    assert table[0].split() == ["RUN", "NEWEST", "STEP", "CHECKPOINTS", "SIZE", "AGE"]
    assert table[1].split()[:5] == ["a", "2", "2", "2.0", "KiB"]
    assert in_process_cli("pin", "a", "1", "--root", root).stdout.startswith("pinned ")
    assert "already pinned; nothing changed" in in_process_cli("pin", "a", "1", "--root", root).stdout
    listed = in_process_cli("list", "a", "--root", root).stdout.splitlines()
    assert listed[1].endswith("pinned") and not listed[2].endswith("pinned")
    assert [x["pinned"] for x in json.loads(in_process_cli("list", "a", "--root", root, "--json").stdout)] == [True, False]
    assert in_process_cli("show", "a", "1", "--root", root).stdout.splitlines()[0].endswith("(pinned)")
    assert in_process_cli("unpin", "a", "1", "--root", root).stdout.startswith("unpinned ")
    assert "was not pinned; nothing changed" in in_process_cli("unpin", "a", "1", "--root", root).stdout


def test_show_aligns_its_columns(daemon) -> None:
    with daemon.producer() as p:
        p.save({"a": torch.ones(1), "a_much_longer_name": torch.ones(100, 100, dtype=torch.float64)}, 1).wait(30)
    lines = in_process_cli("show", "t", "--root", str(daemon.root)).stdout.splitlines()[1:]
    assert len({line.index("float") for line in lines}) == 1
    assert len({line.index("r00000") for line in lines}) == 1


def test_export_names_its_step_and_gives_every_format_one_mode(daemon, tmp_path) -> None:
    with daemon.producer() as p:
        p.save({"w": torch.ones(4)}, 5).wait(30)
    modes = {}
    for suffix in (".safetensors", ".h5", ".pt"):
        out = tmp_path / f"x{suffix}"
        r = subprocess.run([sys.executable, "-c", "import os, sys; os.umask(0o022); from ckptd.cli import main; "
                            f"sys.exit(main(['export', 't', '-o', '{out}', '--root', '{daemon.root}']))"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"exported run t step 5 to {out}"), r.stdout
        modes[suffix] = out.stat().st_mode & 0o777
    assert set(modes.values()) == {0o644}, modes


def test_verify_and_export_show_progress_on_a_terminal_only(daemon, tmp_path) -> None:
    with daemon.producer() as p:
        p.save({f"w{i}": torch.ones(2**18) for i in range(8)}, 1).wait(30)
    root = str(daemon.root)
    piped = cli("verify", "t", "--root", root)
    assert piped.returncode == 0 and "B/s" not in piped.stderr and piped.stderr == ""
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 wide
    try:
        r = subprocess.run([sys.executable, "-m", "ckptd", "verify", "t", "--root", root], stdout=subprocess.PIPE,
                           stderr=sub, timeout=60)
        os.close(sub)
        shown = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(main)
    assert r.returncode == 0
    assert b"verify step 1" in shown and re.search(rb"\d(\.\d+)?[kMG]?B/s", shown), shown


def test_status_shows_recent_throughput_and_the_log_a_readable_rate(daemon) -> None:
    with daemon.producer() as p:
        p.save({"w": torch.ones(16)}, 1).wait(30)
    s = cli("status", "--endpoint", daemon.endpoint).stdout
    assert re.search(r"^throughput: +[\d.]+ (B|KiB|MiB|GiB)/s over the last 1 commit\(s\)", s, re.M), s
    log = daemon.log_text()
    assert re.search(r"committed run=t step=1 .* rate=[\d.]+ (B|KiB|MiB)/s", log), log
    assert "GB/s=0.00" not in log
    assert "INFO ckptd.index: index: " in log  # under the index's own logger


def test_module_level_stats_and_a_rank_share_says_so(daemon, monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_ENDPOINT", daemon.endpoint)
    producer.configure(run="ranks", rank=1, world_size=2)
    try:
        info = producer.save({"w": torch.ones(3)}, 1).wait(30)
        assert producer.stats()["transport"] == "shm"
    finally:
        producer.close()
    # rank 0 has not committed: this is rank 1's share alone, and says so
    assert (info.rank, info.world_size, info.ntensors) == (1, 2, 1)
    with Producer(daemon.endpoint, "ranks", rank=0, world_size=2) as p:
        whole = p.save({"w": torch.ones(3), "v": torch.ones(1)}, 1).wait(30)
    assert (whole.rank, whole.world_size, whole.ntensors) == (None, 2, 3)  # the whole step


def test_numpy_scalars_come_back_as_what_they_were(daemon) -> None:
    metrics = {"loss": np.float32(0.5), "acc": np.float64(0.1), "seen": np.int64(-3), "ok": np.bool_(True)}
    with daemon.producer() as p:
        p.save({"metrics": metrics, "w": torch.ones(1)}, 1).wait(30)
    back = ckptd.load("t", root=daemon.root)["metrics"]
    for key, value in metrics.items():
        assert type(back[key]) is type(value) and back[key] == value, key
