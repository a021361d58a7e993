"""One figure of ``limits.py`` measured on its own: the save stall or durable chunk,
with one daemon and nothing else in the process, to tell a change of code from a
change of the host. Run it under each tree to compare, alternately:

    .venv/bin/python benchmarks/paired.py stall --repeat 10
    PYTHONPATH=/path/to/other/checkout .venv/bin/python /path/to/other/checkout/benchmarks/paired.py stall
    .venv/bin/python benchmarks/paired.py durable --repeat 8 --first-saves

``stall``: ``save`` and ``emit`` of 64 large tensors (1 GiB) against a memcpy of them
into warm memory, in CPU seconds of the calling thread and in wall time (which goes
first alternates). ``durable``: a ``save`` until its commit against an O_DIRECT write
+ fsync of the same bytes. ``--first-saves``: between repeats, a job's first saves as
``limits.py`` part 6 makes them (``limits.first_save_job``: new producers with
``staging_size = "auto"``, with no hint and with ``expected_bytes``, four saves each
of a state of the same size) on the same daemon, in this process: arenas of 1+ GiB
made and dropped. Each line gives the median of the
ratios paired within each repeat, then every repeat's.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import limits  # noqa: E402  (sys.path holds benchmarks/ and the checkout: limits.py sets it)
import torch  # noqa: E402

import baselines  # noqa: E402
from daemons import DaemonProcess  # noqa: E402


def aligned_copy(state: dict[str, torch.Tensor]) -> memoryview:
    """The state's bytes in page-aligned memory (what O_DIRECT writes from)."""
    nbytes = limits.nbytes_of(state)
    view = memoryview(mmap.mmap(-1, -(-nbytes // 4096) * 4096))
    off = 0
    for t in state.values():
        n = t.numel() * t.element_size()
        view[off:off + n] = t.numpy().tobytes()
        off += n
    return view[:nbytes]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=("stall", "durable"))
    ap.add_argument("--size", default="1GiB", help="bytes of the state (default 1GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="its tensors (default 64)")
    ap.add_argument("--repeat", type=int, default=8, help="measured repeats after one warm-up (default 8)")
    ap.add_argument("--first-saves", action="store_true", help="a job's first saves between repeats (limits.py part 6)")
    ap.add_argument("--dir", type=Path, default=None, help="where the daemon writes (default: temp dir)")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    import ckptd

    state = limits.make_states(limits.parse_size(args.size), args.tensors, 1, 1)["large"]
    nbytes = limits.nbytes_of(state)
    base = Path(tempfile.mkdtemp(prefix="ckptd-paired-", dir=args.dir)).resolve()
    d = DaemonProcess(base / "disk", None, name="chunk",
                      keys={"nice": 19, "reuse_unchanged": False, "format": "chunk"},
                      tables={"retention": {"keep_last": 1}})
    ratios: dict[str, list[float]] = {}
    try:
        d.start()
        p = limits.producer_for(d, nbytes + 4096 * (args.tensors + 2))
        targets = limits.Targets(state) if args.figure == "stall" else None
        data = aligned_copy(state) if args.figure == "durable" else None
        step = 0
        for r in range(args.repeat + 1):  # the first warms up and is not counted
            got: dict[str, float] = {}
            if targets is not None:
                floor_cpu, floor = targets.fastest_cpu(), targets.fastest()
                calls: list[tuple[str, Any]] = [("save", limits.time_save), ("emit", limits.time_emit)]
                for api, fn in calls if r % 2 else calls[::-1]:
                    os.sync()
                    step += 1
                    blocked, _ = fn(p, state, step, args.timeout)
                    got[f"{api} stall, CPU s / memcpy's"] = limits.CPU["blocked"] / floor_cpu
                    got[f"{api} stall, wall / memcpy"] = blocked / floor
            else:
                assert data is not None
                os.sync()
                raw = base / "raw.bin"
                direct = baselines.raw_write_direct(data, raw, 64 * limits.MiB)
                raw.unlink()
                os.sync()
                step += 1
                _, durable = limits.time_save(p, state, step, args.timeout)
                got["durable chunk / O_DIRECT write + fsync"] = direct / durable
            if r:
                for key, value in got.items():
                    ratios.setdefault(key, []).append(value)
            if args.first_saves:  # limits.py part 6's job, in this process: its arenas made and dropped here
                limits.first_save_job({"endpoint": d.endpoint, "size": nbytes, "tensors": args.tensors,
                                       "timeout": args.timeout, "step": 1000 * (r + 1)})
        p.close()
    finally:
        d.close()
        shutil.rmtree(base, ignore_errors=True)
    print(f"ckptd {Path(ckptd.__file__).parent}; {nbytes >> 20} MiB in {args.tensors} tensors, {args.repeat} repeats"
          f"{', first saves between them' if args.first_saves else ''}")
    for key, xs in ratios.items():
        print(f"{key:40s} {statistics.median(xs):6.3f}  [{' '.join(f'{x:.2f}' for x in xs)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
