"""One figure of ``limits.py`` measured on its own: the save stall or durable chunk,
with one daemon and nothing else in the process, to tell a change of code from a
change of the host (``--against`` compares two checkouts in one run):

    .venv/bin/python benchmarks/paired.py stall --repeat 10
    .venv/bin/python benchmarks/paired.py durable --shapes equal --against /path/to/other/checkout
    .venv/bin/python benchmarks/paired.py durable --repeat 8 --first-saves

``stall``: ``save`` and ``emit`` of 64 large tensors (1 GiB) against a memcpy of them
into warm memory, in CPU seconds of the calling thread and in wall time (which goes
first alternates). ``durable``: a ``save`` until its commit against an O_DIRECT write
+ fsync of the same bytes, with the daemon's CPU seconds per GiB (user + system, from
``/proc/PID/stat``: what a loaded machine's wall time hides); ``--shapes`` picks the states:
``equal`` (``--tensors`` equal tensors of ``--size``), ``gpt2`` (GPT-2 at transformers'
``GPT2Config`` defaults with its AdamW state, fp32: 1.39 GiB in 592 tensors, 0-d
``step`` ones among them) and ``llama`` (a Llama-like model scaled to ``--size``: a
32000-entry embedding and output 1024 wide, layers of 1024 with their norms), each
paired with a floor of its own bytes:

    .venv/bin/python benchmarks/paired.py durable --shapes equal,gpt2,llama --repeat 5

``--against CHECKOUT``: the same shapes saved by that checkout's daemon and producer too,
in the same run, the order alternating, each save with a floor of its own; their ratio is
"this / against" (each daemon runs its checkout's code: ``python -m ckptd`` would run
the current folder's otherwise).

``--first-saves``: between repeats, a job's first saves as
``limits.py`` part 6 makes them (``limits.first_save_job``: new producers with
``staging_size = "auto"``, with no hint and with ``expected_bytes``, four saves each
of a state of the same size) on the same daemon, in this process: arenas of 1+ GiB
made and dropped. Each line gives the median of the
ratios paired within each repeat, then every repeat's.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __name__ == "__main__" and sys.argv[1:2] == ["--saver"]:
    sys.path.insert(0, sys.argv[2])
    import ckptd  # noqa: F401  (saver: bound before limits.py puts this checkout first on sys.path)

import limits  # noqa: E402  (sys.path holds benchmarks/ and the checkout: limits.py sets it)
import torch  # noqa: E402

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


# -- the shapes ---------------------------------------------------------------------------
def gpt2_shapes() -> dict[str, list[int]]:
    """GPT-2's parameters at transformers' ``GPT2Config`` defaults (the output tied to the
    embedding, so stored once), made on the meta device: no memory, no weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config())
    return {name: list(p.shape) for name, p in model.named_parameters()}


def llama_shapes(size: int, width: int = 1024, vocab: int = 32000) -> dict[str, list[int]]:
    """A Llama-like model (embedding and output of ``vocab`` x ``width``, attention, a
    gated MLP 2.6875x as wide, two norms a layer) with as many layers as make ``size``
    bytes of float32."""
    hidden = 2752 * width // 1024
    per_layer = 4 * width * width + 3 * width * hidden + 2 * width
    layers = max(1, round((size // 4 - 2 * vocab * width - width) / per_layer))
    shapes = {"model.embed_tokens.weight": [vocab, width]}
    for i in range(layers):
        at = f"model.layers.{i}."
        shapes |= {at + f"self_attn.{p}_proj.weight": [width, width] for p in "qkvo"}
        shapes |= {at + "mlp.gate_proj.weight": [hidden, width], at + "mlp.up_proj.weight": [hidden, width],
                   at + "mlp.down_proj.weight": [width, hidden], at + "input_layernorm.weight": [width],
                   at + "post_attention_layernorm.weight": [width]}
    return shapes | {"model.norm.weight": [width], "lm_head.weight": [vocab, width]}


def make_shape(shape: str, size: int, tensors: int) -> dict[str, Any]:
    """The state ``save`` gets for ``shape`` (random float32: nothing can shortcut zeros)."""
    if shape == "equal":
        return limits.make_states(size, tensors, 1, 1)["large"]
    gen = torch.Generator().manual_seed(0)
    rand = lambda dims: torch.rand(dims, generator=gen)  # noqa: E731
    if shape == "llama":
        return {"model": {name: rand(dims) for name, dims in llama_shapes(size).items()}}
    params = gpt2_shapes()
    state = {i: {"step": torch.tensor(10.0), "exp_avg": rand(dims), "exp_avg_sq": rand(dims)}
             for i, dims in enumerate(params.values())}
    group = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
             "fused": None, "params": list(range(len(params)))}
    return {"model": {name: rand(dims) for name, dims in params.items()},
            "optim": {"state": state, "param_groups": [group]}}


def flat(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list) else []
    return [t for v in values for t in flat(v)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_for(base: Path, checkout: Path, args: argparse.Namespace) -> DaemonProcess:
    """A daemon that runs ``checkout``'s code, whatever the current folder."""
    return DaemonProcess(base / "disk", None, name="chunk", extra_env={"PYTHONPATH": str(checkout), "PYTHONSAFEPATH": "1"},
                         keys={"nice": 19, "reuse_unchanged": False, "format": "chunk"} | dict(args.daemon_set),
                         tables={"retention": {"keep_last": 1}})


class Saver:
    """A producer of ``checkout``'s code in a process of its own (``--saver``), saving
    ``shape`` to ``daemon`` on each request: its blocked and durable seconds."""

    def __init__(self, checkout: Path, daemon: DaemonProcess, shape: str, args: argparse.Namespace) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--saver", str(checkout), daemon.endpoint, shape,
             args.size, str(args.tensors)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(checkout)))
        self.nbytes = int(self._answer())

    def _answer(self) -> str:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"the saver of {self.proc.args[2]} exited ({self.proc.wait()})")
        return line

    def save(self, step: int, timeout: float) -> tuple[float, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{step} {timeout}\n")
        self.proc.stdin.flush()
        blocked, durable = map(float, self._answer().split())
        return blocked, durable

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def saver(checkout: str, endpoint: str, shape: str, size: str, tensors: str) -> None:
    """``--saver``: the other end of ``Saver``, ckptd imported from ``checkout``."""
    import ckptd

    if not Path(ckptd.__file__).resolve().is_relative_to(Path(checkout).resolve()):
        raise SystemExit(f"ckptd came from {ckptd.__file__}, not {checkout}")
    state = make_shape(shape, limits.parse_size(size), int(tensors))
    ts = flat(state)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    p = ckptd.Producer(endpoint, limits.RUN, rank=0, world_size=1, transport="shm",
                       staging_size=-(-nbytes // 4096) * 4096 + 4096 * (len(ts) + 2), timeout=60)
    print(nbytes, flush=True)
    for line in sys.stdin:
        step, timeout = line.split()
        print(*limits.time_save(p, state, int(step), float(timeout)), flush=True)
    p.close()


def against(args: argparse.Namespace, base: Path, ratios: dict[str, list[float]]) -> None:
    """Each shape saved by this checkout's daemon and producer and by ``--against``'s."""
    trees = {"this": Path(__file__).resolve().parent.parent, "against": args.against.resolve()}
    daemons = {tag: daemon_for(base / tag, tree, args) for tag, tree in trees.items()}
    step = 0
    try:
        for d in daemons.values():
            d.start()
        for shape in args.shapes:
            savers = {tag: Saver(trees[tag], d, shape, args) for tag, d in daemons.items()}
            nbytes = savers["this"].nbytes
            data = memoryview(mmap.mmap(-1, -(-nbytes // 4096) * 4096))
            block = os.urandom(64 * limits.MiB)
            for at in range(0, len(data), len(block)):
                data[at:at + len(block)] = block[:len(data) - at]
            for r in range(args.repeat + 1):
                got = {}
                for tag in list(trees) if r % 2 else list(trees)[::-1]:
                    os.sync()
                    direct = limits.direct_floor(data[:nbytes], base / "raw.bin", 64 * limits.MiB)
                    (base / "raw.bin").unlink()
                    os.sync()
                    step += 1
                    got[tag] = savers[tag].save(step, args.timeout)[1]
                    if r:
                        ratios.setdefault(f"{shape}: {tag} durable / floor", []).append(got[tag] / direct)
                if r:
                    ratios.setdefault(f"{shape}: durable, this / against", []).append(got["this"] / got["against"])
            for s in savers.values():
                s.close()
    finally:
        for d in daemons.values():
            d.close()


def durable_shapes(args: argparse.Namespace, d: DaemonProcess, base: Path, ratios: dict[str, list[float]]) -> None:
    """Each shape's saves, each paired with an O_DIRECT write + fsync of its bytes."""
    sizes = {}
    data: memoryview | None = None
    for shape in args.shapes:
        state = make_shape(shape, limits.parse_size(args.size), args.tensors)
        tensors = flat(state)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        sizes[shape] = (nbytes, len(tensors))
        if data is None or len(data) < nbytes:
            data = memoryview(mmap.mmap(-1, -(-nbytes // 4096) * 4096))
            block = os.urandom(64 * limits.MiB)
            for at in range(0, len(data), len(block)):
                data[at:at + len(block)] = block[:len(data) - at]
        p = limits.producer_for(d, -(-nbytes // 4096) * 4096 + 4096 * (len(tensors) + 2))
        for r in range(args.repeat + 1):  # the first warms up (and makes the save plan)
            os.sync()
            raw = base / "raw.bin"
            direct = limits.direct_floor(data[:nbytes], raw, 64 * limits.MiB)
            raw.unlink()
            os.sync()
            cpu = cpu_seconds(d.pid)
            blocked, durable = limits.time_save(p, state, 1000 * (args.shapes.index(shape) + 1) + r, args.timeout)
            cpu = cpu_seconds(d.pid) - cpu
            if r:
                for key, value in ((f"{shape}: durable / floor", durable / direct),
                                   (f"{shape}: durable - blocked / floor", (durable - blocked) / direct),
                                   (f"{shape}: daemon CPU s / GiB", cpu * 2**30 / nbytes),
                                   (f"{shape}: floor GB/s", nbytes / direct / 1e9)):
                    ratios.setdefault(key, []).append(value)
        p.close()
        del state, tensors
    for shape, (nbytes, n) in sizes.items():
        print(f"{shape}: {nbytes / 2**30:.2f} GiB in {n} tensors")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--saver"]:
        saver(*argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=("stall", "durable"))
    ap.add_argument("--size", default="1GiB", help="bytes of the state (default 1GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="its tensors (default 64)")
    ap.add_argument("--shapes", default=None, type=lambda t: t.split(","),
                    help="durable: the states, of equal,gpt2,llama (default: the first figure alone)")
    ap.add_argument("--repeat", type=int, default=8, help="measured repeats after one warm-up (default 8)")
    ap.add_argument("--first-saves", action="store_true", help="a job's first saves between repeats (limits.py part 6)")
    ap.add_argument("--dir", type=Path, default=None, help="where the daemon writes (default: temp dir)")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                    help="another [daemon] key for the daemon, e.g. writer_threads=4")
    ap.add_argument("--against", type=Path, default=None, metavar="CHECKOUT",
                    help="durable --shapes: also save with that checkout's daemon and producer, interleaved")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    import ckptd

    if args.shapes and (args.figure != "durable" or set(args.shapes) - {"equal", "gpt2", "llama"}):
        ap.error("--shapes goes with durable, and names some of equal,gpt2,llama")
    if args.against is not None and not args.shapes:
        ap.error("--against goes with durable --shapes")
    base = Path(tempfile.mkdtemp(prefix="ckptd-paired-", dir=args.dir)).resolve()
    d = daemon_for(base, Path(__file__).resolve().parent.parent, args)
    ratios: dict[str, list[float]] = {}
    if args.shapes:
        try:
            if args.against is not None:
                against(args, base, ratios)
            else:
                d.start()
                durable_shapes(args, d, base, ratios)
        finally:
            d.close()
            shutil.rmtree(base, ignore_errors=True)
        print(f"ckptd {Path(ckptd.__file__).parent}; {args.repeat} repeats; load average {os.getloadavg()}")
        for key, xs in ratios.items():
            print(f"{key:40s} {statistics.median(xs):6.3f}  [{' '.join(f'{x:.2f}' for x in xs)}]")
        return 0
    state = limits.make_states(limits.parse_size(args.size), args.tensors, 1, 1)["large"]
    nbytes = limits.nbytes_of(state)
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
                direct = limits.direct_floor(data, raw, 64 * limits.MiB)
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




def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


if __name__ == "__main__":
    sys.exit(main())
