"""A 2-rank FSDP2 job (torchrun, gloo on CPU) for tests/test_staging.py: a 20-layer model
with its Adam state saved through 4 MiB of staging, where every DTensor piece sent the
open batch of small tensors and the saves hung (docs/design.md, "The producer").

  run "dcp"   step 1  dcp.save through ckptd.dcp.StorageWriter
  run "adcp"  step 1  dcp.async_save through ckptd.dcp.AsyncStorageWriter
  run "ps"    step 1  Producer.save of the same state (ckptd's own sharded format)

Rank 0 writes the whole state (every DTensor's full tensor, by ckptd.state.flatten's
names) to OUT/reference.safetensors, for the test to compare "ps" with.

    torchrun --nproc-per-node=2 fsdp_staging_job.py ENDPOINT OUT
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

import ckptd.dcp
from ckptd import Producer
from ckptd.state import flatten

LAYERS = 20
OPTIONS = dict(staging_size="4MiB", emit_timeout=30, timeout=20)  # a hang fails in 30 s, not 300 (5 s was short for a loaded 2-core machine)


def main(endpoint: str, out: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
                                  for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    t0 = time.monotonic()
    dcp.save(state, storage_writer=ckptd.dcp.StorageWriter(run="dcp", step=1, endpoint=endpoint, **OPTIONS))
    dcp.async_save(state, storage_writer=ckptd.dcp.AsyncStorageWriter(run="adcp", step=1, endpoint=endpoint,
                                                                     **OPTIONS)).result()
    with Producer(endpoint, "ps", **OPTIONS) as p:
        p.save(state, 1).wait(60)
    print(f"rank {dist.get_rank()}: three saves in {time.monotonic() - t0:.1f} s", flush=True)
    whole = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in flatten(state)[1].items()}
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in whole.items()}, str(out / "reference.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
