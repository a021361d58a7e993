"""The reader's side of the peer tier (docs/tiers.md, "Recovery"): the keys a training
process presents to its peers, with real daemons on 127.0.0.1 standing for nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import ckptd
from conftest import Daemon, free_port
from test_peer import _held, _save, _wait
from test_peer_fuzz import node_keys


def _keyed_pair(tmp_path, **producer: object) -> tuple[Daemon, Daemon, dict[str, Path]]:
    """Two nodes, each its own key pair ([peer] curve_peers); ``producer``: a [producer]
    table in both configs besides. Also the secret key file of each node's listen."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    secrets = node_keys(tmp_path / "nodekeys", listens)
    nodes = []
    for i, listen in enumerate(listens):
        peer = {"listen": listen, "peers": [listens[1 - i]], "curve_peers": str(tmp_path / "nodekeys" / "peers")}
        tables = {"peer": peer, **({"producer": producer} if producer else {})}
        nodes.append(Daemon(tmp_path / f"node{i}", tables=tables, curve_secret_key=str(secrets[listen])))
    return nodes[0], nodes[1], {str(n.config): secrets[listen] for n, listen in zip(nodes, listens)}


def test_a_lost_node_recovers_from_its_peer_under_per_node_keys(tmp_path, keys, monkeypatch) -> None:
    """With [peer] curve_peers the peer port admits only the nodes' keys: the reader
    presents its node's daemon key pair, even where the config also names a
    producer's keys (which that port refuses)."""
    a, b, _ = _keyed_pair(tmp_path, curve_server_key=str(keys["server"]), curve_secret_key=str(keys["alice"]))
    try:
        a.start()
        b.start()
        saved = _save(a, range(1, 3))
        _wait(lambda: _held(b).get((2, 0)) == "memory", "A's newest share held by B")
        a.kill()
        shutil.rmtree(a.root)
        a.start()
        monkeypatch.setenv("CKPTD_CONFIG", str(a.config))
        info = ckptd.latest("job")
        assert info is not None and info.step == 2, info
        state = ckptd.load("job")
        assert state["step"] == 2 and torch.equal(state["w"], saved[2])
    finally:
        for n in (a, b):
            n.cleanup()


READER = textwrap.dedent("""
    import json, logging, sys
    import ckptd
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    first, again = ckptd.latest("job"), ckptd.latest("job")
    w = ckptd.load("job", first.step)["w"]
    print(json.dumps({"steps": [first.step, again.step], "tiers": list(first.tiers), "w0": float(w[0])}))
""")


def test_an_unreadable_daemon_key_leaves_the_peers_out_with_one_warning(tmp_path) -> None:
    """A training process that cannot read its node's daemon key: ``latest`` answers
    from the local root, and one WARNING names the file and what to do."""
    a, b, secrets = _keyed_pair(tmp_path)
    try:
        a.start()
        b.start()
        saved = _save(a, range(1, 3))
        _wait(lambda: _held(b).get((2, 0)) == "memory", "A's newest share held by B")
        secret = secrets[str(a.config)]
        os.chmod(secret, 0)  # the daemon read it at start; a reader of another user cannot
        # root reads any file: drop the capability that lets it, as an ordinary user lacks it
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
        out = subprocess.run(prefix + [sys.executable, "-c", READER], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, CKPTD_CONFIG=str(a.config)))
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer == {"steps": [2, 2], "tiers": ["local"], "w0": float(saved[2][0])}, answer
        warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
        assert len(warnings) == 1, out.stderr
        assert str(secret) in warnings[0] and "run it as the daemon's user" in warnings[0], warnings
        assert "chmod 640" in warnings[0] and "docs/security.md" in warnings[0], warnings
    finally:
        for n in (a, b):
            n.cleanup()
