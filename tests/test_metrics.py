"""Metrics over real HTTP, and `ckptd status` over the real socket: the same figures."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptd import CheckpointError
from ckptd.config import ConfigError, build, DaemonConfig
from conftest import cli as ckptd_cli  # ckptd.cli.main in this process


def status(d) -> dict:
    r = ckptd_cli("status", "--json", "--endpoint", d.endpoint)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_scrape_shows_the_figures_change(make_daemon) -> None:
    d = make_daemon(metrics="127.0.0.1:0")  # any free port; status says which
    url = status(d)["metrics"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    before = scrape(url)
    assert before[("ckptd_commits_total", ())] == 0
    assert before[("ckptd_bytes_written_total", ())] == 0
    assert before[("ckptd_commit_duration_seconds_count", ())] == 0
    assert before[("ckptd_producers", ())] == 0
    assert before[("ckptd_errors_total", (("kind", "step"),))] == 0
    assert not [k for k in before if k[0] == "ckptd_last_commit_age_seconds"]

    state = {"a": torch.randn(2**18), "b": torch.randn(1000)}
    with d.producer("m") as p:
        info = p.save(state, 7).wait(30)
        with pytest.raises(CheckpointError, match="already committed"):
            p.save(state, 7).wait(30)  # an error, counted
        during = scrape(url)
    deadline = time.monotonic() + 10
    while (after := scrape(url))[("ckptd_producers", ())] != 0:  # its bye arrives a moment later
        assert time.monotonic() < deadline, after
        time.sleep(0.05)

    assert during[("ckptd_producers", ())] == 1
    assert after[("ckptd_commits_total", ())] == 1
    assert after[("ckptd_bytes_written_total", ())] == info.nbytes == 4 * (2**18 + 1000)
    assert after[("ckptd_commit_duration_seconds_count", ())] == 1
    assert after[("ckptd_commit_duration_seconds_bucket", (("le", "+Inf"),))] == 1
    assert 0 < after[("ckptd_commit_duration_seconds_sum", ())] < 30
    assert after[("ckptd_errors_total", (("kind", "step"),))] == 1
    assert after[("ckptd_queued_bytes", ())] == 0
    assert after[("ckptd_last_commit_step", (("run", "m"),))] == 7
    assert abs(after[("ckptd_last_commit_timestamp_seconds", (("run", "m"),))] - info.time) < 5
    assert 0 <= after[("ckptd_last_commit_age_seconds", (("run", "m"),))] < 30

    # `ckptd status` prints the same figures
    s = status(d)
    assert (s["commits"], s["bytes_written"], s["errors"]["step"]) == (1, info.nbytes, 1)
    assert s["last_commit"]["run"] == "m" and s["last_commit"]["step"] == 7
    assert s["runs"]["m"]["step"] == 7 and s["producers"] == [] and s["state"] == "serving"
    text = ckptd_cli("status", "--endpoint", d.endpoint)
    assert text.returncode == 0, text.stderr
    assert "commits:      1 (1.0 MiB)" in text.stdout
    assert "errors:       protocol 0, step 1, commit 0" in text.stdout
    assert f"metrics:      {url}" in text.stdout


def test_status_shows_producers_and_their_open_steps(daemon) -> None:
    with daemon.producer("live", rank=1, world_size=2) as p:
        p.emit("x", torch.ones(10), step=3)
        p.latest()
        s = status(daemon)
        assert [(q["run"], q["rank"], q["world_size"], q["transport"], q["open_steps"])
                for q in s["producers"]] == [("live", 1, 2, "shm", [3])]
        text = ckptd_cli("status", "--endpoint", daemon.endpoint).stdout
        assert "run live rank 1/2" in text and "shm  open steps: 3" in text
        p.abort(3)


def test_status_without_a_daemon_fails_in_one_line(tmp_path) -> None:
    # --timeout 3600: a missing socket file is reported at once, not after the timeout
    # (the subprocess's own 60 s limit would fail this test if it waited)
    r = ckptd_cli("status", "--endpoint", f"ipc://{tmp_path}/none.sock", "--timeout", "3600")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"ckptd status: error: no ckptd daemon at ipc://{tmp_path}/none.sock: the socket file "
        f"{tmp_path}/none.sock does not exist; start one with `ckptd serve -c CONFIG`, or name a running "
        "one's endpoint (--endpoint, -c CONFIG, CKPTD_ENDPOINT)"]
    # a socket file nobody listens on (a daemon killed with SIGKILL leaves one): at once too
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "stale.sock"))
    r = ckptd_cli("status", "--endpoint", f"ipc://{tmp_path}/stale.sock", "--timeout", "3600")
    assert r.returncode == 1
    assert "nothing listens on the socket file" in r.stderr and "stale.sock" in r.stderr, r.stderr
    # a daemon that does not answer in time is still reported after --timeout: a socket that
    # accepts connections but never replies
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "mute.sock"))
        s.listen()
        r = ckptd_cli("status", "--endpoint", f"ipc://{tmp_path}/mute.sock", "--timeout", "0.5")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"ckptd status: error: no ckptd daemon answered at ipc://{tmp_path}/mute.sock within 0.5 s"]


def test_a_metrics_port_in_use_stops_the_start(make_daemon) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = make_daemon(start=False, metrics=f"127.0.0.1:{port}")
        d.start(wait=False)
        assert d.proc.wait(30) == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in d.log_text()
    assert not (d.sock_dir / "d.sock").exists()  # the socket it bound is gone with it


@pytest.mark.parametrize("value", ["9464", "localhost", ":9464", "127.0.0.1:http", "[::1]:70000", 9464])
def test_bad_metrics_addresses_are_refused(value) -> None:
    with pytest.raises(ConfigError, match="'metrics'"):
        build(DaemonConfig, {"metrics": value}, "[daemon]")


@pytest.mark.parametrize("value", ["", "127.0.0.1:9464", "[::1]:0", "localhost:9100"])
def test_good_metrics_addresses(value) -> None:
    assert build(DaemonConfig, {"metrics": value}, "[daemon]").metrics == value
