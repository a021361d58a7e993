"""What ``[remote] compression = "shuffle-zstd"`` saves on a real training state, and
what it costs: GPT-2 small (transformers, from its config) trained a few steps with
AdamW, with fp32 and with bf16 weights, saved as the daemon saves it (safetensors).

Per state: the ratio on the whole checkpoint, per dtype and per state part (weights,
exp_avg, exp_avg_sq); compression and decompression throughput on the daemon's
threads (ckptd.remote.codec.Packer, COMPRESS_THREADS of them), by the clock and per CPU
second (the figure for an unloaded core); and, against the
uncompressed floor measured in the same run, the time to upload and to restore the
checkpoint over a link of ``--link-gbit`` (pipelined: the slower of the link and the
codec).

    python benchmarks/compression.py                      # trains both states (minutes)
    python benchmarks/compression.py --layers 2 --steps 2 # a smaller GPT-2, faster
    python benchmarks/compression.py --state a.safetensors  # a state saved before
    python benchmarks/compression.py --shaped 1gbit         # and restore across a real link (root)

With ``--shaped RATE`` it also restores each state from a real bucket across a real
link: SeaweedFS (tests/seaweed.py, nice 19) in one network namespace of this run's
own, this process and its daemons in another, joined by a veth pair capped at ``RATE``
each way (``tc tbf``, benchmarks/netns.py). Each state is saved once through a daemon
with ``[remote] compression = "none"`` and once with ``"shuffle-zstd"``; then
``ckptd.load`` on an empty root restores each ``--repeats`` times, the two alternating,
every tensor compared bit-exact. The floor is the uncompressed restore of the same run.
(The codec's own figures are measured without ``--shaped``.)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from ckptd.manifest import TensorRecord
from ckptd.remote import codec
from ckptd.remote.uploader import COMPRESS_THREADS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import netns  # noqa: E402  (benchmarks/netns.py)
import seaweed  # noqa: E402  (tests/seaweed.py)

BUCKET = "bench"


def trained_state(dtype: torch.dtype, layers: int, steps: int) -> dict[str, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    text = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_bytes()
    ids = torch.tensor(list(text[:64 * steps]), dtype=torch.long).view(steps, 1, 64)
    for x in ids:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    out = {f"model.{n}": t.detach().clone() for n, t in model.state_dict().items()}
    for k, st in opt.state_dict()["state"].items():
        out.update({f"optim.state.{k}.{p}": t.clone() for p, t in st.items()})
    return out


def part(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    return last if name.startswith("optim.") else "weights"


def measure(state: dict[str, torch.Tensor], link_bps: float) -> dict:
    data = save(state)  # the bytes of one safetensors file, as the daemon writes them
    header = 8 + int.from_bytes(data[:8], "little")
    records = {}
    with_offsets = json.loads(data[8:header])
    for n, t in state.items():
        begin, end = with_offsets[n]["data_offsets"]
        records[n] = TensorRecord(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), file="f",
                                  key=n, offset=header + begin, nbytes=end - begin, checksum="")
    frames = codec.file_frames(records.values(), "f", len(data))
    t0, c0 = time.perf_counter(), time.process_time()
    packer = codec.Packer(io.BytesIO(data).read, frames, COMPRESS_THREADS)
    stored = b"".join(packer)
    pack_s, pack_cpu = time.perf_counter() - t0, time.process_time() - c0
    packed = packer.packed()
    out = bytearray()
    t0, c0 = time.perf_counter(), time.process_time()
    unpacker = codec.Unpacker(packed, out.extend, "bench")
    piece = 16 << 20  # what Store.stream hands over at the default part_bytes
    for i in range(0, len(stored), piece):
        unpacker.feed(memoryview(stored)[i:i + piece])
    unpacker.close()
    unpack_s, unpack_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert bytes(out) == data, "not bit-exact"
    by = defaultdict(lambda: [0, 0])
    starts = {r.offset: (n, r) for n, r in records.items()}
    for raw_start, raw_end, s0, s1, _ in packed.spans():
        hit = starts.get(raw_start) or next(((n, r) for n, r in records.items()
                                               if r.offset <= raw_start < r.offset + r.nbytes), None)
        if hit is not None:
            for key in (f"part {part(hit[0])}", f"dtype {hit[1].dtype}"):
                by[key][0] += raw_end - raw_start
                by[key][1] += s1 - s0
    raw, comp = len(data), len(stored)
    return {
        "bytes": raw, "stored": comp, "ratio": raw / comp,
        "by": {k: round(r / s, 3) for k, (r, s) in sorted(by.items())},
        "compress_MBps": raw / pack_s / 1e6, "decompress_MBps": raw / unpack_s / 1e6, "threads": COMPRESS_THREADS,
        # per CPU second: what a core gives where other work does not share it
        "compress_MBps_per_core": raw / pack_cpu / 1e6, "decompress_MBps_per_core": raw / unpack_cpu / 1e6,
        "link_MBps": link_bps / 1e6,
        "upload_s": {"floor": raw / link_bps, "compressed": max(comp / link_bps, pack_s)},
        "restore_s": {"floor": raw / link_bps, "compressed": max(comp / link_bps, unpack_s)},
    }


class FarSeaweed(seaweed.SeaweedS3):
    """SeaweedFS run in namespace ``ns`` and bound to ``addr`` there: the far end of the link."""

    def __init__(self, base: Path, ns: str, addr: str) -> None:
        super().__init__(base, nice=19)
        self.ns, self.addr = ns, addr
        self.endpoint = f"http://{addr}:{self.ports['s3']}"

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *(a.replace("127.0.0.1", self.addr) for a in super().command())]


def _stored(server: seaweed.SeaweedS3, prefix: str) -> int:
    client, total, token = seaweed._client(server), 0, None
    while True:
        page = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix, **({"ContinuationToken": token} if token else {}))
        total += sum(o["Size"] for o in page.get("Contents", []))
        token = page.get("NextContinuationToken")
        if not token:
            return total


def _upload(work: Path, state: dict[str, torch.Tensor], name: str, compression: str) -> str:
    """``state`` saved as step 1 of run "bench" through a daemon uploading with ``compression``."""
    from daemons import DaemonProcess

    from ckptd import Producer

    url = f"s3://{BUCKET}/{name}"
    d = DaemonProcess(work, None, name=name, tables={"remote": {"url": url, "compression": compression}})
    d.start()
    try:
        p = Producer(d.endpoint, "bench", staging_size=sum(t.nbytes for t in state.values()) + 2**26)
        p.save(state, 1).wait(900)
        os.environ["CKPTD_CONFIG"] = str(d.config)
        p.wait_complete(1, timeout=1800)
        p.close()
    finally:
        os.environ.pop("CKPTD_CONFIG", None)
        d.close()
    return url


def shaped_restore(work: Path, server: seaweed.SeaweedS3, state: dict[str, torch.Tensor], name: str,
                   repeats: int) -> dict:
    """Restore times of ``state`` from the bucket across the link, uncompressed (the
    floor) and compressed, alternating; every restore checked bit-exact."""
    import ckptd

    kinds = {"floor": "none", "compressed": codec.CODEC}
    urls = {k: _upload(work, state, f"{name}-{c}", c) for k, c in kinds.items()}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(repeats):
        for k in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
            empty = work / f"fresh-{name}-{k}-{r}"
            empty.mkdir()
            t0 = time.perf_counter()
            got = ckptd.load("bench", root=empty, remote=urls[k])
            times[k].append(time.perf_counter() - t0)
            assert got.keys() == state.keys() and all(torch.equal(got[n], t) for n, t in state.items()), k
            del got
            shutil.rmtree(empty)
    raw = sum(t.nbytes for t in state.values())
    stored = {k: _stored(server, f"{name}-{c}/") for k, c in kinds.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"bytes": raw, "stored": stored, "ratio": stored["floor"] / stored["compressed"], "restore_s": median,
            "restore_all_s": times, "compressed_over_floor": median["compressed"] / median["floor"],
            "MBps": {k: raw / v / 1e6 for k, v in median.items()}, "loadavg": os.getloadavg()}


def _across_link(rate: str, names: str) -> int:
    """Make the link (namespaces ``<names>a`` and ``<names>b``), run this benchmark again
    inside ``b``, remove the link."""
    if os.geteuid() != 0:
        raise SystemExit("compression.py --shaped makes network namespaces, which needs root")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run removes its link too
    link = netns.Link(rate)
    link.ns = {s: f"{names}{s}" for s in "ab"}
    link.dev = {s: f"{names}v{s}"[:15] for s in "ab"}
    try:
        link.up()
        return subprocess.run([*link.wrap("b"), sys.executable, *sys.argv, "--in-netns", link.ns["a"]]).returncode
    finally:
        link.down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (12: GPT-2 small, 124M parameters)")
    ap.add_argument("--steps", type=int, default=4, help="AdamW steps before the state is taken")
    ap.add_argument("--state", action="append", default=[], help="a safetensors file to measure instead")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), action="append", help="train only these (default both)")
    ap.add_argument("--save-states", help="write each trained state here, as NAME.safetensors (for --state)")
    ap.add_argument("--link-gbit", type=float, default=1.0, help="the upload/download link, Gbit/s")
    ap.add_argument("--shaped", metavar="RATE", help="also restore across a link capped at RATE (1gbit): needs root")
    ap.add_argument("--repeats", type=int, default=3, help="restores of each kind with --shaped (default 3)")
    ap.add_argument("--netns-names", default=f"ckz{os.getpid()}", help="the namespaces' names are this + a, b")
    ap.add_argument("--in-netns", help=argparse.SUPPRESS)  # namespace a's name: this is the run inside b
    args = ap.parse_args()
    if args.shaped and args.in_netns is None:
        sys.exit(_across_link(args.shaped, args.netns_names))
    torch.set_num_threads(2)
    states = ({Path(p).stem: lambda p=p: load_file(p) for p in args.state} or
              {f"gpt2-{args.layers}l-{n}": (lambda d=d: trained_state(d, args.layers, args.steps))
               for n, d in (("fp32", torch.float32), ("bf16", torch.bfloat16)) if n in (args.dtype or (n,))})
    work = Path(tempfile.mkdtemp(prefix="compression-"))
    server = None
    try:
        if args.in_netns:
            server = FarSeaweed(work / "s3", args.in_netns, netns.A).start()
            os.environ.update(server.env())
            seaweed.make_bucket(server, BUCKET)
        for name, make in states.items():
            state = make()
            if args.save_states:
                from safetensors.torch import save_file

                save_file(state, str(Path(args.save_states) / f"{name}.safetensors"))
            if server is None:
                result = measure(state, args.link_gbit * 1e9 / 8)
            else:  # the codec's figures hold three copies of the state: measured without --shaped
                result = {"shaped": {"rate": args.shaped, **shaped_restore(work, server, state, name, args.repeats)}}
            print(json.dumps({"state": name, **result}, default=lambda x: round(x, 3)), flush=True)
    finally:
        if server is not None:
            server.cleanup()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
