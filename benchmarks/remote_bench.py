"""The remote tier's report, in one run against a local SeaweedFS S3 server:

1. clients: put of the same files with each plain client (boto3's transfer manager,
   obstore, s3fs) - the measurement that chose ckptd's client;
2. upload: a checkpoint (default 1 GiB) through the daemon (commit durable -> every
   byte in the bucket, manifest last) against the best plain client's put of the
   same files;
3. resume: ``ckptd.load`` on a node with an empty disk against downloading the same
   files with that client (into memory);
4. stall: how long ``producer.save`` blocks the caller while uploads run, against a
   daemon with no remote tier (the same saves).

    .venv/bin/python benchmarks/remote_bench.py [--gib 1] [--json out.json]

Every figure is a median of ``--repeats``; ratios are against peers measured in the
same run. SeaweedFS runs as ``weed mini`` bound to 127.0.0.1 (tests/seaweed.py), at nice 19:
on a real node the object store is elsewhere and takes none of the node's CPU, so it
must not take the trainer's here either. The daemon that uploads runs at nice 0, the
plain clients' priority (the stall measurement uses the default, nice 19), and its
uploads alternate with the plain clients' puts, so that drift in the shared machine
falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import seaweed  # noqa: E402
from daemons import DaemonProcess  # noqa: E402

MB = 1e6
BUCKET = "bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size (default 1 GiB)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30)
    work = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    server = seaweed.SeaweedS3(work / "s3", nice=19).start()
    os.environ.update(server.env())
    seaweed.make_bucket(server, BUCKET)
    results: dict[str, Any] = {"bytes": nbytes, "tensors": args.tensors, "repeats": args.repeats}
    try:
        state = {f"layer{i}.weight": torch.randn(nbytes // args.tensors // 4) for i in range(args.tensors)}
        up, puts = measure_uploads(work, state, args.repeats)
        results["daemon_upload"] = up
        files = up["files"]
        size = sum(p.stat().st_size for p in files)
        results["clients_put"] = {name: _median(t) for name, t in puts.items()}
        best = min(results["clients_put"], key=results["clients_put"].get)
        results["best_client"] = best
        results["resume"] = measure_resume(work, up["url"], args.repeats)
        results["client_download"] = _median([_timed(lambda: GETS[best](f"plain-{best}-{args.repeats}", files))
                                              for _ in range(args.repeats)])
        results["stall"] = measure_stall(work, state, args.repeats)
        report(results, size)
    finally:
        server.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in results.items() if k != "daemon_upload"}
                                              | {"daemon_upload": {k: v for k, v in results["daemon_upload"].items()
                                                                   if k != "files"}}, indent=1))
    return 0


# -- through the daemon ---------------------------------------------------------------
def _daemon(work: Path, name: str, remote: bool, nice: int | None = None) -> DaemonProcess:
    tables = {"remote": {"url": f"s3://{BUCKET}/{name}"}} if remote else {}
    keys = {} if nice is None else {"nice": nice}
    d = DaemonProcess(work, None, name=name, tables=tables, keys=keys)  # AWS_* come from os.environ
    d.start()
    return d


def _producer_env(d: DaemonProcess) -> None:
    os.environ["CKPTD_CONFIG"] = str(d.config)


def measure_uploads(work: Path, state: dict, repeats: int) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Per repeat: one step saved and uploaded through the daemon (the uploader's own
    seconds for the share, and durable -> complete in the bucket), then each plain
    client's put of that step's very files."""
    from ckptd import Producer

    d = _daemon(work, "ckptd", remote=True, nice=0)
    _producer_env(d)
    upload, end_to_end = [], []
    puts: dict[str, list[float]] = {name: [] for name in PUTS}
    try:
        p = Producer(d.endpoint, "bench", staging_size=sum(t.nbytes for t in state.values()) + 2**26)
        for step in range(1, repeats + 1):
            p.save(state, step).wait(600)
            t0 = time.perf_counter()
            p.wait_complete(step, timeout=900)
            end_to_end.append(time.perf_counter() - t0)
            upload.append(_status(d)["remote"]["last_upload"]["seconds"])
            files = sorted((d.root / "bench" / f"step-{step:012d}").glob("r*.safetensors"))
            for name, put in PUTS.items():
                _uncache(files)  # the daemon read them from the disk (written with O_DIRECT): so do these
                puts[name].append(_timed(lambda: put(files, f"plain-{name}-{step}")))
        p.close()
        return ({"url": f"s3://{BUCKET}/ckptd", "upload_s": _median(upload), "end_to_end_s": _median(end_to_end),
                 "files": files, "nfiles": len(files)}, puts)
    finally:
        os.environ.pop("CKPTD_CONFIG", None)
        _keep_files(d)


def _uncache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _keep_files(d: DaemonProcess) -> None:
    """Stop the daemon but keep its root: the plain clients put the very same files."""
    d.proc.terminate()
    d.proc.wait(120)
    if d.sock_dir is not None:
        subprocess.run(["rm", "-rf", str(d.sock_dir)], check=False)


def _status(d: DaemonProcess) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "-c", str(d.config), "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def measure_resume(work: Path, url: str, repeats: int) -> float:
    """``ckptd.load`` of the newest step on a node whose disk is empty."""
    import ckptd

    times = []
    for r in range(repeats):
        empty = work / f"fresh-node-{r}"
        empty.mkdir()
        t0 = time.perf_counter()
        state = ckptd.load("bench", root=empty, remote=url)
        times.append(time.perf_counter() - t0)
        del state
    return _median(times)


def measure_stall(work: Path, state: dict, repeats: int) -> dict[str, float]:
    """The caller's blocked time in ``producer.save`` (median), with uploads running
    (each save right after the previous commit, its upload still going) and without."""
    from ckptd import Producer

    out = {}
    for name, remote in (("without_remote", False), ("with_uploads", True)):
        d = _daemon(work, f"stall-{name}", remote)
        try:
            p = Producer(d.endpoint, "stall", staging_size=sum(t.nbytes for t in state.values()) + 2**26)
            p.save(state, 0).wait(600)  # warm the arena
            blocked = []
            for step in range(1, repeats + 1):
                t0 = time.perf_counter()
                h = p.save(state, step)
                blocked.append(time.perf_counter() - t0)
                h.wait(600)
            p.close()
            out[name] = _median(blocked)
        finally:
            d.close()
    return out


# -- plain clients, the same files ----------------------------------------------------------
def _boto_client() -> Any:
    import boto3

    return boto3.client("s3")


def put_boto3(files: list[Path], prefix: str) -> None:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=16 * 2**20, multipart_chunksize=16 * 2**20, max_concurrency=8)
    c = _boto_client()
    for f in files:
        c.upload_file(str(f), BUCKET, f"{prefix}/{f.name}", Config=cfg)


def put_obstore(files: list[Path], prefix: str) -> None:
    import obstore
    from obstore.store import from_url

    store = from_url(f"s3://{BUCKET}/{prefix}", client_options={"allow_http": True})
    for f in files:
        with open(f, "rb") as fh:
            obstore.put(store, f.name, fh, chunk_size=16 * 2**20, max_concurrency=8)


def put_s3fs(files: list[Path], prefix: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True)
    fs.put([str(f) for f in files], f"{BUCKET}/{prefix}/")


def get_boto3(prefix: str, files: list[Path]) -> None:
    import io

    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_chunksize=16 * 2**20, max_concurrency=8)
    c = _boto_client()
    for f in files:
        c.download_fileobj(BUCKET, f"{prefix}/{f.name}", io.BytesIO(), Config=cfg)


def get_obstore(prefix: str, files: list[Path]) -> None:
    import obstore
    from obstore.store import from_url

    store = from_url(f"s3://{BUCKET}/{prefix}", client_options={"allow_http": True})
    for f in files:
        size = f.stat().st_size
        starts = list(range(0, size, 16 * 2**20))
        obstore.get_ranges(store, f.name, starts=starts, ends=[min(s + 16 * 2**20, size) for s in starts])


def get_s3fs(prefix: str, files: list[Path]) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True)
    fs.cat([f"{BUCKET}/{prefix}/{f.name}" for f in files])


PUTS: dict[str, Callable[[list[Path], str], None]] = {"boto3": put_boto3, "obstore": put_obstore, "s3fs": put_s3fs}
GETS: dict[str, Callable[[str, list[Path]], None]] = {"boto3": get_boto3, "obstore": get_obstore, "s3fs": get_s3fs}


# -- report ---------------------------------------------------------------------------------
def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def report(r: dict[str, Any], size: int) -> None:
    up = r["daemon_upload"]
    best = r["best_client"]
    best_put = r["clients_put"][best]
    print(f"checkpoint: {size / 2**30:.2f} GiB in {up['nfiles']} chunk files; medians of {r['repeats']}")
    print("plain clients, put of the same files:")
    for name, secs in sorted(r["clients_put"].items(), key=lambda kv: kv[1]):
        print(f"  {name:<8} {secs:7.2f} s  {size / secs / MB:7.1f} MB/s")
    ratio_up = best_put / up["upload_s"]
    print(f"ckptd upload (uploader's time)   {up['upload_s']:7.2f} s  {size / up['upload_s'] / MB:7.1f} MB/s  "
          f"= {ratio_up:.2f}x {best} (goal >= 0.90)")
    print(f"ckptd durable -> complete in bucket {up['end_to_end_s']:5.2f} s  "
          f"= {best_put / up['end_to_end_s']:.2f}x {best}")
    ratio_down = r["client_download"] / r["resume"]
    print(f"fresh-node resume, ckptd.load    {r['resume']:7.2f} s  {size / r['resume'] / MB:7.1f} MB/s  "
          f"vs {best} download {r['client_download']:.2f} s: {ratio_down:.2f}x")
    st = r["stall"]
    print(f"producer.save blocked: {st['without_remote'] * 1e3:.0f} ms without a remote tier, "
          f"{st['with_uploads'] * 1e3:.0f} ms with uploads running: "
          f"{st['with_uploads'] / st['without_remote']:.2f}x")
    r["ratios"] = {"upload_vs_best_client": ratio_up, "resume_vs_best_client": ratio_down,
                   "stall_with_vs_without": st["with_uploads"] / st["without_remote"]}


if __name__ == "__main__":
    sys.exit(main())
