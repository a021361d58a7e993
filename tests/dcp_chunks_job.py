"""A 2-rank job (torchrun, gloo on CPU) for tests/test_dcp_chunks.py: tensors with several
pieces on a rank, through ckptd.dcp, resharded between plans.

Ported from DCP's own ``TestDistributedReshardOnLoad.test_load_with_different_shard_plan``
(test/distributed/checkpoint/test_file_system_checkpoint_cpu.py): a 10x20 ShardedTensor
under each of its four sharding specs (one chunk per rank; four chunks, two per rank;
five uneven chunks, three on rank 0; two uneven chunks) is saved with dcp.save through
ckptd.dcp.StorageWriter (run "st", steps 1-4), then loaded with dcp.load through
ckptd.dcp.StorageReader into a ShardedTensor of every other spec, and into DTensors
(Shard(0), Shard(1), Replicate(); one bfloat16: resharded and cast), also with
ckptd.load_into; every loaded value must equal the saved one exactly. Spec 2 is also
saved with dcp.async_save through ckptd.dcp.AsyncStorageWriter (run "st-async").
Rank 0 writes each saved tensor whole to OUT/spec<i>.safetensors.

    torchrun --nproc-per-node=2 dcp_chunks_job.py ENDPOINT ROOT OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptd
import ckptd.dcp

RUN = "st"
ASYNC_RUN = "st-async"
SHAPE = (10, 20)


def specs() -> list:
    def shard(offsets: list[int], sizes: list[int], rank: int) -> ShardMetadata:
        return ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{rank}")

    return [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(shards=[shard([0, 0], [2, 20], 0), shard([2, 0], [1, 20], 1),
                                       shard([3, 0], [3, 20], 0), shard([6, 0], [3, 20], 1),
                                       shard([9, 0], [1, 20], 0)]),
        EnumerableShardingSpec(shards=[shard([0, 0], [8, 20], 1), shard([8, 0], [2, 20], 0)]),
    ]


def whole(st: sharded_tensor.ShardedTensor) -> torch.Tensor:
    """The whole tensor, on every rank."""
    out = torch.zeros(SHAPE)
    for s in st.local_shards():
        o, n = s.metadata.shard_offsets, s.metadata.shard_sizes
        out[o[0]:o[0] + n[0], o[1]:o[1] + n[1]] = s.tensor
    dist.all_reduce(out)  # the pieces do not overlap: their sum is the whole
    return out


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want), f"rank {dist.get_rank()}: {what} differs"


def main(endpoint: str, root: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    options = dict(endpoint=endpoint, staging_size="16MiB", timeout=20)
    saved = []
    for i, spec in enumerate(specs()):
        torch.manual_seed(100 + 10 * i + rank)
        st = sharded_tensor.rand(spec, *SHAPE, init_rrefs=False)
        dcp.save({"st": st, "n": i}, storage_writer=ckptd.dcp.StorageWriter(run=RUN, step=i + 1, **options))
        saved.append(whole(st))
        if i == 2:
            dcp.async_save({"st": st, "n": i}, storage_writer=ckptd.dcp.AsyncStorageWriter(
                run=ASYNC_RUN, step=1, **options)).result()
        if rank == 0:
            from safetensors.torch import save_file

            save_file({"st": saved[i]}, str(out / f"spec{i}.safetensors"))
    dist.barrier()

    for i, want in enumerate(saved):
        for j, spec in enumerate(specs()):
            if i == j:
                continue
            target = sharded_tensor.zeros(spec, *SHAPE)
            state = {"st": target, "n": -1}
            dcp.load(state, storage_reader=ckptd.dcp.StorageReader(RUN, i + 1, root=root))
            assert state["n"] == i
            check(whole(target), want, f"spec {i} loaded into spec {j}")
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            dt = distribute_tensor(torch.zeros(SHAPE), mesh, placements)
            dcp.load({"st": dt}, storage_reader=ckptd.dcp.StorageReader(RUN, i + 1, root=root))
            check(dt.full_tensor(), want, f"spec {i} loaded by dcp into a DTensor {placements}")
            dt = distribute_tensor(torch.zeros(SHAPE), mesh, placements)
            ckptd.load_into({"st": dt}, RUN, i + 1, root=root, verify=i % 2 == 1)
            check(dt.full_tensor(), want, f"spec {i} loaded by ckptd.load_into into a DTensor {placements}")
        dt = distribute_tensor(torch.zeros(SHAPE, dtype=torch.bfloat16), mesh, [Shard(1)])
        dcp.load({"st": dt}, storage_reader=ckptd.dcp.StorageReader(RUN, i + 1, root=root))
        check(dt.full_tensor(), want.to(torch.bfloat16), f"spec {i} loaded by dcp into a bfloat16 DTensor")
    target = sharded_tensor.zeros(specs()[3], *SHAPE)
    dcp.load({"st": target}, storage_reader=ckptd.dcp.StorageReader(ASYNC_RUN, 1, root=root))
    check(whole(target), saved[2], "the async save of spec 2 loaded into spec 3")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
