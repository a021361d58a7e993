"""The ``ckptd`` command line: ``serve`` runs the daemon; ``keygen``, ``cluster`` and
``install-systemd`` set a node up; the rest read the checkpoint root.

Every failure prints one line on stderr and exits non-zero; ``--json`` prints
machine-readable results on stdout.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import config as config_mod, env, index, reader, replicas, retention, tiers
from .version import __version__
from .units import duration as _duration, rate, size as _size
from .errors import CheckpointError
from .manifest import CheckpointInfo
from .names import check_run

log = logging.getLogger(__name__)


CONFIG_HELP = ("default: $CKPTD_CONFIG, else ./config.toml if all its tables are ckptd's, else "
               "~/.config/ckptd/config.toml, else /etc/ckptd/config.toml, else built-in defaults")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)  # --help and --version print here
        if args.command != "serve":  # serve sets up its own logging, from its config
            # warnings (a step left out, and why) on stderr, never a record lost in silence
            logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                                format=f"ckptd {args.command}: %(levelname)s: %(message)s")
        return args.func(args)
    except BrokenPipeError:
        return _output_closed()
    except (CheckpointError, ValueError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            return _output_closed()
        print(f"ckptd {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _output_closed() -> int:
    """Whoever read our output stopped (``ckptd list | head -1``): end quietly, as
    coreutils do, with the status of a SIGPIPE. Python would otherwise complain
    again while flushing stdout at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 128 + 13


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptd", description="Checkpoint daemon for PyTorch training.")
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _daemon_commands(sub)
    _setup_commands(sub)
    _reading_commands(sub)
    return p


def _daemon_commands(sub: Any) -> None:
    """``serve`` and ``status``: the daemon itself."""
    s = sub.add_parser("serve", help="run the writer daemon in the foreground (systemd runs this)")
    s.add_argument("-c", "--config", help=CONFIG_HELP)
    s.set_defaults(func=_serve)

    st = sub.add_parser("status", help="print a running daemon's live figures (the same as its metrics)")
    st.add_argument("-c", "--config", help="config file whose endpoint to ask; " + CONFIG_HELP)
    st.add_argument("--endpoint", help="the daemon's endpoint (default: $CKPTD_ENDPOINT, else the config's)")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon (default 5)")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=_status)


def _setup_commands(sub: Any) -> None:
    """``keygen``, ``cluster`` and ``install-systemd``: setting a node up."""
    kg = sub.add_parser("keygen", help="make a CurveZMQ key pair, for a tcp:// endpoint (docs/security.md)",
                        description="Write NAME.key (public) and NAME.key_secret (secret, mode 0600) and "
                        "print where each goes in the daemon's and the producers' config files.")
    kg.add_argument("name", metavar="NAME", help="the key's name, such as the daemon's host or a producer's user")
    kg.add_argument("folder", metavar="DIR", nargs="?", help="the folder to write them to (as --dir)")
    kg.add_argument("--dir", help="the folder to write them to (default: the current folder)")
    kg.set_defaults(func=_keygen)

    cluster = sub.add_parser("cluster", help="set up N nodes' keys and configs from one list of hosts "
                             "(docs/runbook.md)").add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help in (("init", "write every node's key pair and config.toml, and the folder of public keys"),
                         ("check", "read a set-up `cluster init` wrote back and say what is wrong, node by node")):
        c = cluster.add_parser(action, help=help, description=help)
        c.add_argument("--hosts", required=True, help="the nodes, comma-separated: HOST or HOST:PORT each")
        c.add_argument("--port", type=int, default=7701, help="the peer port of a HOST without one (default 7701)")
        c.add_argument("--out", required=True, metavar="DIR", help="the set-up's folder: DIR/NODE/, DIR/public/")
        if action == "init":
            c.add_argument("--bucket", default="", metavar="URL", help="[remote] url of every node (s3://...)")
            c.add_argument("--endpoint", default="ipc:///run/ckptd/ckptd.sock", help="[daemon] endpoint of "
                           "every node (default: the system service's socket)")
            c.add_argument("--root", default="/var/lib/ckptd", help="[daemon] root of every node "
                           "(default: the system service's)")
        c.set_defaults(func=_cluster)

    inst = sub.add_parser("install-systemd", help="install ckptd's systemd unit for this host's Python",
                          description="Write ckptd.service with ExecStart pointing at this ckptd, and a "
                          "config file if there is none; then print the systemctl commands to run.")
    inst.add_argument("--user", action="store_true", help="the user unit, for systemctl --user (no root needed)")
    inst.add_argument("--print", action="store_true", dest="print_only",
                      help="print the unit on stdout; write nothing")
    inst.set_defaults(func=_install_systemd)


def _reading(sub: Any, name: str, help: str, step: bool, run: str = "") -> argparse.ArgumentParser:
    """A command that reads a checkpoint root: RUN (and STEP), --root, -c, --json."""
    r = sub.add_parser(name, help=help, description=help)
    if run != "none":
        r.add_argument("run", metavar="RUN", help="run id" + (" (none: every run, as `ckptd runs`)"
                                                               if run == "optional" else ""),
                       nargs="?" if run == "optional" else None)
    if step:
        r.add_argument("step", metavar="STEP", nargs="?", type=int, help="step (default: the newest complete)")
    r.add_argument("--root", help="checkpoint root (default: $CKPTD_ROOT, else the config's root)")
    r.add_argument("-c", "--config", help="config file whose root to read; " + CONFIG_HELP)
    r.add_argument("--json", action="store_true", help="print JSON")
    if name in ("latest", "list", "show", "verify"):
        r.add_argument("--remote", nargs="?", const="", default=None, metavar="URL",
                       help="read the remote tier (URL, or the config's [remote] url) instead of the root")
    if name in ("latest", "list"):
        r.add_argument("--endpoint", help="ask the daemon at this endpoint (its index) instead of reading the root")
        r.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon (default 5)")
    return r


def _reading_commands(sub: Any) -> None:
    latest = _reading(sub, "latest", "print the newest complete checkpoint of RUN", False)
    latest.add_argument("--verify", action="store_true",
                        help="the newest one that passes `verify` (reads every tensor), skipping damaged ones")
    latest.set_defaults(func=_latest)
    prune = _reading(sub, "prune", "apply RUN's retention policy now (or show it with --dry-run)", False)
    prune.add_argument("--dry-run", action="store_true", help="show what would be kept and removed, and why")
    prune.set_defaults(func=_prune)
    _reading(sub, "pin", "protect a checkpoint from every retention rule", True).set_defaults(func=_pin, pin=True)
    _reading(sub, "unpin", "release a pinned checkpoint", True).set_defaults(func=_pin, pin=False)
    _reading(sub, "list", "list the complete checkpoints of RUN, oldest first (* = pinned)", False,
             run="optional").set_defaults(func=_list)
    _reading(sub, "runs", "list the runs under the root with their newest step, size and age", False,
             run="none").set_defaults(func=_runs, run=None)
    _reading(sub, "show", "describe one checkpoint and its tensors", True).set_defaults(func=_show)
    _reading(sub, "verify", "check every tensor of a checkpoint against its checksum", True).set_defaults(func=_verify)
    _reading(sub, "advise", "how often RUN should checkpoint, from what its saves and failures measured "
             "(docs/advise.md)", False).set_defaults(func=_advise)
    ex = _reading(sub, "export", "write one checkpoint to one .safetensors, .h5 or .pt file (the suffix decides)", True)
    ex.add_argument("-o", "--output", required=True, metavar="PATH",
                    help="the file to write: .safetensors (flat tensors), .h5 (HDF5) or .pt (torch.save)")
    ex.add_argument("--rank", type=int, help="whose share, in a multi-rank checkpoint (default: $RANK)")
    ex.set_defaults(func=_export)


def _root(args: argparse.Namespace) -> Any:
    if args.root is None and args.config:
        return config_mod.load(args.config).root
    return config_mod.default_root(args.root)


def _serve(args: argparse.Namespace) -> int:
    from .daemon.server import serve

    cfg = config_mod.load(args.config)
    logging.basicConfig(
        stream=sys.stderr, level=cfg.daemon.log_level.upper(),
        format="%(levelname)s %(name)s: %(message)s",
    )
    # watchdog's debug output is one line per inotify event; its warnings still count
    logging.getLogger("watchdog").setLevel(logging.INFO)
    logging.getLogger("h5py").setLevel(logging.INFO)  # its debug output: one line per type converter
    from .daemon.notify import use_journal_priorities

    use_journal_priorities()  # before the first line: under systemd each one carries its priority
    log = logging.getLogger("ckptd.daemon")
    if cfg.path is None:  # say so loudly: the socket and the root may not be where the user thinks
        log.warning("%s: endpoint %s, root %s", config_mod.describe(cfg), cfg.endpoint, cfg.root)
    else:
        log.info("%s", config_mod.describe(cfg))
    from . import unitnet

    for line in unitnet.blocked_lines(cfg):  # installed before the config named these hosts, say
        log.error("%s", line)
    return serve(cfg)


def _status(args: argparse.Namespace) -> int:

    from .transport import wire
    from .transport.oneshot import request

    endpoint = args.endpoint or env.endpoint()
    endpoint = (config_mod.resolve_endpoint(endpoint, Path.cwd()) if endpoint
                else config_mod.load(args.config).endpoint)
    s = request(endpoint, wire.encode("status", seq=1), args.timeout, _curve_keys(args, endpoint))["status"]
    if args.json:
        print(json.dumps(s))
        return 0
    now = s["time"]
    print(f"ckptd {s['version']} (pid {s['pid']}): {s['state']} on {s['endpoint']} "
          f"for {_duration(now - s['started'])}")
    print(f"root:         {s['root']}")
    print(f"queued:       {_size(s['queued_bytes'])} of {_size(s['memory_budget'])}; "
          f"{s['commits_in_progress']} commit(s) in progress")
    lat = s["commit_seconds"]
    mean = f", {lat['sum'] / lat['count']:.2f} s on average" if lat["count"] else ""
    reused = s.get("bytes_reused") or 0
    shared = f"; {_size(reused)} unchanged, not written again" if reused else ""
    print(f"commits:      {s['commits']} ({_size(s['bytes_written'])}{shared}){mean}")
    recent = s.get("recent_commits")
    if recent and recent["commits"]:
        print(f"throughput:   {rate(recent['bytes'], recent['seconds'])} over the last {recent['commits']} "
              "commit(s), first byte to durable")
    print("errors:       " + ", ".join(f"{kind} {n}" for kind, n in s["errors"].items()))
    last = s["last_commit"]
    if last:
        print(f"last commit:  run {last['run']} step {last['step']} rank {last['rank']}, "
              f"{_size(last['bytes'])} in {last['seconds']:.2f} s, {_duration(now - last['time'])} ago")
    print(f"producers:    {len(s['producers'])}")
    for p in s["producers"]:
        steps = ", ".join(map(str, p["open_steps"])) or "none"
        print(f"  run {p['run']} rank {p['rank']}/{p['world_size']}  pid {p['pid']} on {p['host']}  "
              f"{p['transport']}  open steps: {steps}")
    if s["runs"]:
        print("runs:")
        width = max(map(len, s["runs"]))
        for run, r in sorted(s["runs"].items()):
            print(f"  {run:<{width}}  last step {r['step']}, {_duration(now - r['time'])} ago")
    advice = {run: a for run, a in (s.get("advice") or {}).items() if a["interval_seconds"] is not None}
    if advice:
        from . import advise

        print("advice:       (`ckptd advise RUN` explains)")
        for run, a in sorted(advice.items()):
            every = (f"{a['interval_steps']} steps (~{advise.seconds(a['interval_seconds'])})"
                     if a["interval_steps"] is not None else advise.seconds(a["interval_seconds"]))
            print(f"  {run}: checkpoint every {every}, expected loss {a['expected_waste']:.2%} "
                  f"({a['dominant']} dominates); {a['inputs']['failures']} failure(s) seen")
            for line in advise.tier_lines(a, "    "):
                print(line)
    for text in tiers.status_lines(s):  # each tier's, for those the daemon copies to
        print(text)
    print(f"metrics:      {s['metrics'] or 'off'}")
    return 0


def _curve_keys(args: argparse.Namespace, endpoint: str) -> Any:
    """A tcp:// endpoint's CurveZMQ keys: the [producer] ones of the config file (-c, else
    $CKPTD_CONFIG), as a producer's. None for ipc://, without reading any config."""
    from .transport import curve

    return curve.client_keys(endpoint, config_mod.load(args.config)) if curve.is_tcp(endpoint) else None


def _keygen(args: argparse.Namespace) -> int:
    from .transport import curve

    if args.folder and args.dir and Path(args.folder).absolute() != Path(args.dir).absolute():
        raise ValueError(f"two folders: DIR {args.folder!r} and --dir {args.dir!r}; give one")
    for line in curve.keygen_instructions(*curve.keygen(args.name, args.folder or args.dir or ".")):
        print(line)
    return 0


def _cluster(args: argparse.Namespace) -> int:
    from . import cluster

    nodes, out = cluster.nodes(args.hosts, args.port), Path(args.out)
    if args.action == "init":
        for line in cluster.init(nodes, out, endpoint=args.endpoint, root=args.root, bucket=args.bucket):
            print(line)
        return 0
    sound, lines = cluster.report(cluster.check(nodes, out))
    print("\n".join(lines))
    return 0 if sound else 1


def _install_systemd(args: argparse.Namespace) -> int:
    from . import install

    if args.print_only:
        print(install.render_unit(user=args.user), end="")
        dropin = None if args.user else install.render_dropin()
        if dropin is not None:
            print(f"\n### drop-in {install.SYSTEM_DROPIN}\n{dropin}", end="")
        network = None if args.user else install.render_network_dropin()[0]
        if network is not None:
            print(f"\n### drop-in {install.SYSTEM_NETWORK_DROPIN}\n{network}", end="")
        return 0
    for line in install.install(user=args.user):
        print(line)
    return 0


def _remote_store(args: argparse.Namespace) -> Any:
    """With --remote: the remote tier to read (its URL, else the config's [remote] url)."""
    from .tiers import bucket

    url = args.remote or config_mod.load(args.config).remote.url
    if not url:
        raise ValueError("--remote needs a URL (--remote s3://bucket/prefix) or a [remote] url in the config")
    return bucket.open_store(url)


def _latest(args: argparse.Namespace) -> int:
    if args.remote is not None:
        from .remote import catalog

        store = _remote_store(args)
        info = catalog.latest(store, check_run(args.run))
        if info is None:
            raise CheckpointError(f"run {args.run!r} has no complete checkpoint in {store.url}")
        print(json.dumps(info.to_dict()) if args.json else _describe(info))
        return 0
    if args.endpoint and args.verify:
        raise ValueError("--verify reads the checkpoint root; leave out --endpoint")
    if args.endpoint:
        from .transport.oneshot import request
        from .transport import wire

        check_run(args.run)
        endpoint = config_mod.resolve_endpoint(args.endpoint, Path.cwd())
        reply = request(endpoint, wire.encode("latest", seq=1, run=args.run), args.timeout,
                        _curve_keys(args, endpoint))
        info = CheckpointInfo.from_dict(reply["info"]) if reply["info"] else None
        where = f"the daemon at {endpoint}"
    else:
        root = _root(args)
        info = reader.latest(args.run, root=root, verify=args.verify, config=_given_config(args))
        where = str(root) + (" that passes verification" if args.verify else "")
    if info is None:
        raise CheckpointError(f"run {args.run!r} has no complete checkpoint under {where}")
    print(json.dumps(info.to_dict()) if args.json else _describe(info))
    return 0


def _list(args: argparse.Namespace) -> int:
    if args.endpoint and args.run is None:
        raise ValueError("--endpoint lists one run: name it (`ckptd list RUN --endpoint EP`)")
    if args.endpoint and args.remote is not None:
        raise ValueError("--remote reads the remote tier; leave out --endpoint")
    if args.run is None:
        return _runs(args)
    if args.endpoint:
        root, infos, pinned = _list_from_daemon(args)
    elif args.remote is not None:
        from .remote import catalog

        store = _remote_store(args)
        root, infos = store.url, catalog.list_checkpoints(store, check_run(args.run))
        pinned: set[int] = set()  # pins are marks in a local root (`ckptd pin`)
    else:
        root = _root(args)
        listed = _list_from_local_daemon(args, root)
        if listed is not None:
            _, infos, pinned = listed
        else:
            infos = reader.list_checkpoints(args.run, root=root, config=_given_config(args))
            pinned = retention.pinned_steps(root / args.run, [i.step for i in infos])
    if args.json:
        print(json.dumps([{**i.to_dict(), "pinned": i.step in pinned} for i in infos]))
        return 0
    if not infos:
        print(f"run {args.run!r} has no complete checkpoints under {root}", file=sys.stderr)
        return 0
    print(f"{'STEP':>12}  {'TIME':<19}  {'SIZE':>10}  {'TENSORS':>7}  {'FORMAT':<6}  {'TIERS':<12}  PINNED")
    for i in infos:
        print(f"{i.step:>12}  {_time(i.time):<19}  {_size(i.nbytes):>10}  {i.ntensors:>7}  {i.format:<6}  "
              f"{','.join(i.tiers):<12}  {'pinned' if i.step in pinned else '':<6}  {_replica_mark(i)}".rstrip())
    return 0


def _replica_mark(info: CheckpointInfo) -> str:
    """``ckptd list``'s mark of a step whose replicated tensors differ across ranks (docs/training.md)."""
    if not info.diverged:
        return ""
    what = "; ".join(f"{name} on ranks {','.join(map(str, ranks))}" for name, ranks in info.diverged.items())
    return f"{'refused' if info.refused else 'diverged'}: replicas differ: {what}"


def _list_from_local_daemon(args: argparse.Namespace, root: Path) -> tuple[str, list[CheckpointInfo], set[int]] | None:
    """The listing from the daemon of this host (CKPTD_ENDPOINT, else the config's ipc://
    endpoint) when it serves ``root``: its index holds every complete step already checked,
    so nothing is parsed here (10,000 steps: ~0.45 s against ~1 s reading every manifest).
    None when there is no such daemon, or it serves another root, or does not answer within
    a second: then the caller reads the root itself, which gives the same listing."""
    import zmq

    endpoint = env.endpoint() or config_mod.load(args.config).endpoint
    if not endpoint.startswith("ipc://"):  # a daemon on another host may see another root
        return None
    endpoint = config_mod.resolve_endpoint(endpoint, Path.cwd())
    try:
        listed = _list_from_daemon(args, endpoint, timeout=min(args.timeout, 1.0))
    except (CheckpointError, OSError, zmq.ZMQError) as exc:
        log.debug("reading the root: no daemon serving it answered at %s (%s)", endpoint, exc)
        return None
    if Path(listed[0]).resolve() != Path(root).resolve():
        log.debug("reading the root: the daemon at %s serves %s, not %s", endpoint, listed[0], root)
        return None
    return listed


def _list_from_daemon(args: argparse.Namespace, endpoint: str | None = None,
                      timeout: float | None = None) -> tuple[str, list[CheckpointInfo], set[int]]:
    """What ``_list`` reads from the root, from the daemon's index instead (its ``list``
    message: no manifest is read here); the remote tier's steps merged in as
    ``reader.list_checkpoints`` merges them. ``endpoint``: default ``--endpoint``."""
    from .transport import wire
    from .transport.oneshot import request
    from . import tiers
    from .tiers.base import merge

    run = check_run(args.run)
    endpoint = endpoint or config_mod.resolve_endpoint(args.endpoint, Path.cwd())
    reply = request(endpoint, wire.encode("list", seq=1, run=run), timeout or args.timeout,
                    _curve_keys(args, endpoint))
    if reply["op"] != "listing":
        raise CheckpointError(f"the daemon at {endpoint} answered list with {reply['op']!r}, not a listing")
    listed = reply["checkpoints"]
    infos = [CheckpointInfo.from_dict(c) for c in listed]
    for tier in tiers.chain(_given_config(args), root=reply["root"])[1:]:  # the root: the daemon's index
        infos = merge(infos, tier.steps(run))
    return reply["root"], infos, {c["step"] for c in listed if c["pinned"]}


def _runs(args: argparse.Namespace) -> int:
    root = _root(args)
    now = time.time()
    rows = []
    for run_dir in sorted(index.run_dirs(root)):
        infos = reader.list_checkpoints(run_dir.name, root=root)
        if infos:
            newest = infos[-1]
            rows.append({"run": run_dir.name, "step": newest.step, "checkpoints": len(infos),
                         "bytes": sum(i.nbytes for i in infos), "time": newest.time})
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print(f"no run under {root} has a complete checkpoint", file=sys.stderr)
        return 0
    width = max(3, *(len(r["run"]) for r in rows))
    print(f"{'RUN':<{width}}  {'NEWEST STEP':>12}  {'CHECKPOINTS':>11}  {'SIZE':>10}  AGE")
    for r in rows:
        print(f"{r['run']:<{width}}  {r['step']:>12}  {r['checkpoints']:>11}  {_size(r['bytes']):>10}  "
              f"{_duration(now - r['time'])}")
    return 0


def _given_config(args: argparse.Namespace) -> config_mod.Config | None:
    """-c's config, whose tiers (its [peer] and [remote]) reading commands also consider;
    None: the discovered config's."""
    return config_mod.load(args.config) if args.config else None


def _show(args: argparse.Namespace) -> int:
    if args.remote is not None:
        from .tiers import bucket

        info, manifests = bucket.find(_remote_store(args), check_run(args.run), args.step)
        pinned = False  # pins are marks in a local root (`ckptd pin`)
    else:
        path, manifests = reader.find(args.run, args.step, _root(args))
        info = CheckpointInfo.from_manifests(str(path), manifests)
        pinned = bool(retention.pinned_steps(path.parent, [info.step]))
    if args.json:
        out = info.to_dict()
        out["pinned"] = pinned
        out["ranks"] = [
            {"rank": m.rank, "tensors": {n: t.to_dict() for n, t in m.tensors.items()}} for m in manifests
        ]
        print(json.dumps(out))
        return 0
    print(_describe(info) + ("  (pinned)" if pinned else ""))
    for m in manifests:
        if len(manifests) > 1:
            print(f"rank {m.rank}:")
        rows = [(name, f"{t.dtype}[{'x'.join(map(str, t.shape)) or 'scalar'}]", _size(t.nbytes), t.file)
                for name, t in m.tensors.items()]
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
        for name, kind, size, file in rows:
            print(f"  {name:<{widths[0]}}  {kind:<{widths[1]}}  {size:>{widths[2]}}  {file}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .reader.export import export

    root = _root(args)
    _, manifests = reader.find(args.run, args.step, root)  # the step and share it names, for the report
    world = manifests[0].world_size
    if args.rank is None and world > 1 and env.rank() is None:
        raise ValueError(f"step {manifests[0].step} of run {args.run!r} has {world} ranks; export one "
                         f"rank's share with --rank R (0 to {world - 1}), or set RANK")
    manifest = reader.pick_rank(manifests, args.rank)
    out = export(args.run, manifest.step, args.output, root=root, rank=manifest.rank, progress=not args.json)
    if args.json:
        print(json.dumps({"path": str(out), "bytes": out.stat().st_size, "step": manifest.step,
                          "rank": manifest.rank}))
    else:
        share = f" (rank {manifest.rank}'s share)" if manifest.world_size > 1 else ""
        print(f"exported run {args.run} step {manifest.step}{share} to {out} ({_size(out.stat().st_size)})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    if args.remote is not None:
        from .remote import fetch
        from .tiers import bucket

        store = _remote_store(args)
        info, manifests = bucket.find(store, check_run(args.run), args.step)
        path, problems = info.path, fetch.check(store, manifests)
    else:
        from .progress import bytes_bar

        path, manifests = reader.find(args.run, args.step, _root(args))
        total = sum(m.nbytes for m in manifests)
        with bytes_bar(total, f"verify step {manifests[0].step}", enabled=not args.json) as progress:
            problems = reader.check(path, manifests, progress)
    differ = replicas.describe(manifests)  # copies of replicated tensors that disagree across ranks
    if args.json:
        print(json.dumps({"path": str(path), "ok": not problems and not differ, "problems": problems,
                          "diverged": replicas.diverged(manifests)}))
    else:
        for p in problems:
            print(f"damaged: {p}", file=sys.stderr)
        for line in differ:
            print(f"diverged: {line}", file=sys.stderr)
        if not problems and not differ:
            print(f"ok: {path}: every tensor matches its checksum")
    return 1 if problems or differ else 0


def _prune(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config)  # its [retention], and its root unless --root says
    root = _root(args)
    run_dir = root / check_run(args.run)
    policy = retention.run_policy(cfg.retention, run_dir)
    if cfg.peer.enabled or cfg.remote.enabled:  # each node may have its own root: the cluster's rule
        from .tiers import bucket, completeness

        peers = completeness.open_peers(cfg) if cfg.peer.enabled else None
        s = completeness.survey(args.run, run_dir, peers, bucket.open_store(None, cfg))
        decisions, trash = completeness.apply(s, run_dir, policy, now=time.time(), dry_run=args.dry_run)
        whole = completeness.whole_here(s)  # the steps the pointer may name: complete in this root
    else:
        decisions, trash = retention.apply(run_dir, reader.list_checkpoints(args.run, root=root), policy,
                                           now=time.time(), dry_run=args.dry_run)
        whole = {d.step for d in decisions}
    for t in trash:
        retention.remove_trash(t)
    if trash:
        newest = max((d.step for d in decisions if d.keep and d.step in whole), default=None)
        index.write_pointer(run_dir, newest)
    if args.json:
        print(json.dumps([{"step": d.step, "keep": d.keep, "reasons": d.reasons, "nbytes": d.nbytes}
                          for d in decisions]))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for d in decisions:
        print(f"{d.step:>12}  {'keep' if d.keep else verb:<12}  {_size(d.nbytes):>10}  {'; '.join(d.reasons)}")
    if not decisions:
        print(f"run {args.run!r} has no complete checkpoints under {root}", file=sys.stderr)
    return 0


def _pin(args: argparse.Namespace) -> int:
    if args.step is None:
        raise ValueError(f"{'pin' if args.pin else 'unpin'} needs a STEP")
    path, _ = reader.find(args.run, args.step, _root(args))
    if retention.set_pin(path, args.pin):
        print(f"{'pinned' if args.pin else 'unpinned'} {path}")
    else:
        print(f"{path} was {'already pinned' if args.pin else 'not pinned'}; nothing changed")
    return 0


def _advise(args: argparse.Namespace) -> int:
    from . import advise, measures

    run = check_run(args.run)
    root = _root(args)
    if not (root / run).is_dir():
        raise CheckpointError(f"no run {run!r} under {root}: `ckptd runs --root {root}` lists the runs there")
    m = measures.merge(measures.read(root / run), run)
    if not m["saves"]:  # no daemon recorded this run's saves: the step time from its manifests at least
        m["saves"] = [{"step": i.step, "rank": 0, "attempt": None, "time": i.time}
                      for i in reader.list_checkpoints(run, root=root)]
    seen = {measures.upload_tier(u) for u in m["uploads"]}
    names = (tiers.local.NAME, *(t for t in tiers.target_names() if t in seen))
    advice = measures.advice(m, config_mod.load(args.config).advise.mtbf, names)
    if args.json:
        print(json.dumps({"run": run, **advice}))
        return 0
    for line in advise.render(run, advice):
        print(line)
    return 0


def _describe(info: CheckpointInfo) -> str:
    meta = f"  metadata {json.dumps(info.metadata)}" if info.metadata else ""
    return (f"run {info.run} step {info.step}  {_time(info.time)}  {_size(info.nbytes)} in "
            f"{info.ntensors} tensors  {info.format}  {info.path}{meta}")


def _time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
