"""A job torchrun starts for tests/test_sharded_training.py (gloo, CPU): an FSDP2 model,
then what a ``torch.load`` user writes first, ``model.load_state_dict(ckptd.load(run)["model"])``,
on the sharded step that ``fsdp-train`` (tests/sharded_job.py) saved.

    torchrun --nproc_per_node=N tests/plain_load_job.py OUT_DIR

Each rank writes OUT/plain-load-r<rank>.json: the error ckptd.load raised (or null), the
shape of its piece with rank= given; the code the error shows is then run as pasted. Rank 0 also writes OUT/plain-load-weights.safetensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptd  # noqa: E402
from sharded_job import ROOT, RUN, SAVE_AT, fsdp, full_weights  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        model, opt = fsdp()
        result: dict = {"error": None}
        try:
            model.load_state_dict(ckptd.load(RUN, SAVE_AT, root=ROOT)["model"])
        except ValueError as exc:
            result["error"] = str(exc)
        except RuntimeError as exc:  # PyTorch's own size mismatch: what this test rules out
            result["error"] = "PyTorch: " + str(exc)
        # rank= asks for the pieces knowingly
        result["piece_shape"] = list(ckptd.load(RUN, SAVE_AT, root=ROOT, rank=rank)["model"]["2.weight"].shape)
        # what the error says to do, run as pasted
        code = "\n".join(line[4:] for line in result["error"].splitlines() if line.startswith("    "))
        exec(code, {"ckptd": ckptd, "model": model, "opt": opt})
        weights = full_weights(model)
        if rank == 0:
            save_file(weights, str(out / "plain-load-weights.safetensors"))
        (out / f"plain-load-r{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
