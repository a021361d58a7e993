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
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from ckptd.manifest import TensorRecord
from ckptd.remote import codec
from ckptd.remote.uploader import COMPRESS_THREADS


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (12: GPT-2 small, 124M parameters)")
    ap.add_argument("--steps", type=int, default=4, help="AdamW steps before the state is taken")
    ap.add_argument("--state", action="append", default=[], help="a safetensors file to measure instead")
    ap.add_argument("--link-gbit", type=float, default=1.0, help="the upload/download link, Gbit/s")
    args = ap.parse_args()
    torch.set_num_threads(2)
    states = ({Path(p).stem: lambda p=p: load_file(p) for p in args.state} or
              {f"gpt2-{args.layers}l-{n}": (lambda d=d: trained_state(d, args.layers, args.steps))
               for n, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))})
    for name, make in states.items():
        result = measure(make(), args.link_gbit * 1e9 / 8)
        print(json.dumps({"state": name, **result}, default=lambda x: round(x, 3)), flush=True)


if __name__ == "__main__":
    main()
