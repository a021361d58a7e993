"""What replica comparison costs (docs/performance.md): the digest functions per GB against a
memcpy of the same bytes measured in the same run, and the stall of a DDP save
(``save(replicated=True)``, every rank holding the whole state) with
``compare_replicas = "off"`` against ``"warn"``, alternating, against one real daemon.

    .venv/bin/python benchmarks/replica_digest.py                      # 256 MiB, 3 ranks, 3 repeats
    .venv/bin/python benchmarks/replica_digest.py --size 1GiB --json out.json

The ranks are producers in this process, saving one after the other (each rank's stall
is its own ``save`` call, as in a job where each rank is a process; the digests a rank
takes after its save returned are waited for, untimed, before the next rank saves, as
each rank's own training steps would run beside them). On a machine with
CUDA, the words64 kernel is also timed on the device (launch, and to completion).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemons import DaemonProcess  # noqa: E402

import ckptd  # noqa: E402
from ckptd import replicas  # noqa: E402
from ckptd.config import parse_size  # noqa: E402
from ckptd.sharding import assign_writers  # noqa: E402


def state(nbytes: int, tensors: int) -> dict:
    g = torch.Generator().manual_seed(0)
    per = nbytes // tensors // 4
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}}


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def digests_per_gb(s: dict, repeat: int) -> dict:
    tensors = list(s["model"].items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    targets = [torch.empty_like(t) for _, t in tensors]

    def memcpy() -> None:
        for dst, (_, src) in zip(targets, tensors):
            dst.copy_(src)

    out = {"bytes": nbytes, "memcpy_s": best(memcpy, repeat)}
    for fn in replicas.FUNCTIONS:
        out[f"{fn}_s"] = best(lambda: replicas.digest_pieces(((n, t, None) for n, t in tensors), fn), repeat)
    for key in [k for k in out if k.endswith("_s")]:
        out[key.replace("_s", "_gb_per_s")] = nbytes / out[key] / 1e9
    out["xxh3_64_vs_memcpy"] = out["xxh3_64_s"] / out["memcpy_s"]
    if torch.cuda.is_available():
        dev = [(n, t.cuda()) for n, t in tensors]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sums = [replicas.words64_sum(replicas._torch_bytes(t)) for _, t in dev]
        out["cuda_words64_launch_s"] = time.perf_counter() - t0
        torch.stack(sums).cpu()
        out["cuda_words64_s"] = best(lambda: replicas.digest_pieces(((n, t, None) for n, t in dev), "words64"),
                                     repeat)
        out["cuda_words64_gb_per_s"] = nbytes / out["cuda_words64_s"] / 1e9
    return out


def ddp_stall(s: dict, ranks: int, repeat: int, base: Path) -> dict:
    # which rank writes what (the others hold a copy and digest it): sharding.assign_writers
    writer = assign_writers((f"model.{n}", t.numel() * t.element_size(), tuple(range(ranks)))
                            for n, t in s["model"].items())
    daemon = DaemonProcess(base, "64MiB", name="d").start()
    try:
        stalls: dict[str, list[float]] = {"off": [], "warn": []}
        # per rank, and the job's per save (the slowest rank's: in a job the ranks save at once)
        by_rank: dict[str, list[list[float]]] = {k: [[] for _ in range(ranks)] for k in stalls}
        job: dict[str, list[float]] = {"off": [], "warn": []}
        after: dict[str, list[float]] = {"off": [], "warn": []}  # digests still being taken once save returned
        producers = {policy: [ckptd.Producer(daemon.endpoint, f"ddp-{policy}", rank=r, world_size=ranks,
                                             compare_replicas=policy, staging_size="auto") for r in range(ranks)]
                     for policy in stalls}
        for ps in producers.values():
            ps[0].prepare(s, replicated=True)
        try:
            for step in range(repeat + 1):  # the first: staging warms up, not counted
                for policy in (("off", "warn") if step % 2 else ("warn", "off")):
                    handles = []
                    for rank, p in enumerate(producers[policy]):
                        t0 = time.perf_counter()
                        handles.append(p.save(s, step, replicated=True))
                        t1 = time.perf_counter()
                        replicas.settle()  # a rank's digests run beside its next steps, not the next rank's save
                        if step:
                            stalls[policy].append(t1 - t0)
                            by_rank[policy][rank].append(stalls[policy][-1])
                            after[policy].append(time.perf_counter() - t1)
                    if step:
                        job[policy].append(max(stalls[policy][-ranks:]))
                    for h in handles:
                        h.wait(300)
        finally:
            for ps in producers.values():
                for p in ps:
                    p.close()
        problems = daemon.problems()
        if problems:
            raise SystemExit(f"the daemon logged problems: {problems[:3]}")
    finally:
        daemon.close()
    off, warn = statistics.median(stalls["off"]), statistics.median(stalls["warn"])
    job_off, job_warn = statistics.median(job["off"]), statistics.median(job["warn"])
    writes = {r: sum(t.numel() * t.element_size() for name, t in s["model"].items() if writer[f"model.{name}"] == r)
              for r in range(ranks)}
    return {"ranks": ranks, "stall_off_s": off, "stall_warn_s": warn, "overhead": warn / off - 1,
            "job_off_s": job_off, "job_warn_s": job_warn, "job_overhead": job_warn / job_off - 1,
            "after_save_warn_s": statistics.median(after["warn"]),
            "per_rank": [{"rank": r, "writes_bytes": writes[r],
                          "off_s": statistics.median(by_rank["off"][r]),
                          "warn_s": statistics.median(by_rank["warn"][r])} for r in range(ranks)],
            "samples": {k: v for k, v in stalls.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    s = state(parse_size(args.size), args.tensors)
    report = {"digest": digests_per_gb(s, args.repeat)}
    with tempfile.TemporaryDirectory(prefix="replicas") as base:
        report["ddp"] = ddp_stall(s, args.ranks, args.repeat, Path(base))
    d, r = report["digest"], report["ddp"]
    print(f"{d['bytes'] / 2**20:.0f} MiB: memcpy {d['memcpy_gb_per_s']:.2f} GB/s, xxh3_64 {d['xxh3_64_gb_per_s']:.2f} "
          f"GB/s ({d['xxh3_64_vs_memcpy']:.2f}x memcpy's time), words64 on CPU {d['words64_gb_per_s']:.2f} GB/s"
          + (f", words64 on CUDA {d['cuda_words64_gb_per_s']:.1f} GB/s (launch {d['cuda_words64_launch_s'] * 1e3:.2f} ms)"
             if "cuda_words64_s" in d else ""))
    print(f"DDP save on {r['ranks']} ranks, stall per rank (median): off {r['stall_off_s'] * 1e3:.1f} ms, "
          f"warn {r['stall_warn_s'] * 1e3:.1f} ms: {r['overhead'] * 100:+.0f}%")
    for pr in r["per_rank"]:
        print(f"  rank {pr['rank']} (writes {pr['writes_bytes'] / 2**20:.0f} MiB, digests the rest): "
              f"off {pr['off_s'] * 1e3:.1f} ms, warn {pr['warn_s'] * 1e3:.1f} ms: "
              f"{(pr['warn_s'] / pr['off_s'] - 1) * 100:+.0f}%")
    print(f"  job stall (slowest rank per save, median): off {r['job_off_s'] * 1e3:.1f} ms, "
          f"warn {r['job_warn_s'] * 1e3:.1f} ms: {r['job_overhead'] * 100:+.0f}% "
          f"(x{r['job_warn_s'] / r['job_off_s']:.3f}); the digests then ran on for "
          f"{r['after_save_warn_s'] * 1e3:.1f} ms beside the training steps (median per rank)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
