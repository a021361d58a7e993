"""From the raw records of a run to the report: summary figures, the goals, the table, the chart.

A record is one measurement of one repeat: ``blocked_s``, ``durable_s`` (None for
memcpy, which writes nothing), and the memory of the saver process
(``producer``) and of its writer process (``daemon``: ckptd's daemon, DCP's
writer process), as ``procmem.Peak.to_dict()``.
"""

from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9  # throughput in decimal GB/s, as the daemon's own log reports it
MiB = 2**20
SLACK_MIB = 200  # the goals' allowance over payload + arena (producer) and memory_budget (daemon)

# The goals (benchmarks/README.md), against which every ckptd measurement is judged
BLOCKED_OVER_MEMCPY = 1.2
GBPS_OVER_RAW = 0.9


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    group: str  # "floor", "baseline", "dcp", "ckptd": the chart's colours


def rows_for(variants: list[tuple[str, str]], apis: list[str]) -> list[Row]:
    """Every row the report can have, in the order it prints them."""
    rows = [
        Row("memcpy", "memcpy (fastest of 3 ways)", "floor"),
        Row("raw.buffered", "raw write + fsync", "floor"),
        Row("raw.direct", "raw write O_DIRECT + fsync", "floor"),
        Row("torch_save", "torch.save + fsync", "baseline"),
        Row("safetensors", "safetensors save_file + fsync", "baseline"),
        Row("h5py", "naive h5py + fsync", "baseline"),
        Row("dcp.thread", "DCP async_save, thread", "dcp"),
        Row("dcp.thread_reused", "DCP async_save, thread, kept stager", "dcp"),
        Row("dcp.process", "DCP async_save, process", "dcp"),
    ]
    for transport, fmt in variants:
        for api in apis:
            rows.append(Row(ckptd_key(transport, fmt, api), f"ckptd {transport} {fmt} {api}", "ckptd"))
    return rows


def ckptd_key(transport: str, fmt: str, api: str) -> str:
    return f"ckptd.{transport}.{fmt}.{api}"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def summarize(records: dict[str, list[dict[str, Any]]], nbytes: int) -> dict[str, dict[str, Any]]:
    """Per measurement: medians and minimums of the times, GB/s of the durable time, the
    highest peak RSS of the saver and of its writer over the repeats, and ratios to
    memcpy (blocking) and to the better raw write (throughput), from medians."""
    out: dict[str, dict[str, Any]] = {}
    for key, recs in records.items():
        blocked = [r["blocked_s"] for r in recs if r.get("blocked_s") is not None]
        durable = [r["durable_s"] for r in recs if r.get("durable_s") is not None]
        s: dict[str, Any] = {
            "n": len(recs),
            "blocked_median_s": _median(blocked), "blocked_min_s": min(blocked, default=None),
            "durable_median_s": _median(durable), "durable_min_s": min(durable, default=None),
        }
        s["gbps_median"] = nbytes / s["durable_median_s"] / GB if s["durable_median_s"] else None
        s["gbps_best"] = nbytes / s["durable_min_s"] / GB if s["durable_min_s"] else None
        for proc in ("producer", "daemon"):
            peaks = [r[proc] for r in recs if r.get(proc)]
            for field in ("peak_mib", "added_mib", "anon_mib", "shmem_mib", "file_mib"):
                s[f"{proc}_{field}"] = _max([p[field] for p in peaks])
            if peaks:
                s[f"{proc}_peak_exact"] = all(p["peak_exact"] for p in peaks)
        for field in ("staging_wait_s", "daemon_commit_s", "producer_cpu_s", "daemon_cpu_s", "daemon_faults"):
            s[field] = _median([r[field] for r in recs if r.get(field) is not None])
        out[key] = s
    memcpy = out.get("memcpy", {}).get("blocked_median_s")
    raw_key = better_raw(out)
    raw_gbps = out[raw_key]["gbps_median"] if raw_key else None
    for key, s in out.items():
        s["blocked_over_memcpy"] = s["blocked_median_s"] / memcpy if memcpy and s["blocked_median_s"] else None
        s["gbps_over_raw"] = s["gbps_median"] / raw_gbps if raw_gbps and s["gbps_median"] else None
    paired = paired_raw_ratios(records)
    for key, values in paired.items():
        out[key]["gbps_over_raw_paired"] = _median(values)
    return out


def better_raw(stats: dict[str, dict[str, Any]]) -> str | None:
    """The raw write with the higher median throughput: the disk's floor."""
    have = [k for k in ("raw.buffered", "raw.direct") if stats.get(k, {}).get("gbps_median")]
    return max(have, key=lambda k: stats[k]["gbps_median"]) if have else None


def paired_raw_ratios(records: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Throughput over the better raw write of the same repeat, per repeat: this cancels a
    slow phase of the disk that hits both (the reason raw writes and ckptd interleave)."""
    raw_by_round: dict[int, float] = {}
    for key in ("raw.buffered", "raw.direct"):
        for r in records.get(key, []):
            if r.get("durable_s"):
                raw_by_round[r["round"]] = min(raw_by_round.get(r["round"], float("inf")), r["durable_s"])
    out: dict[str, list[float]] = {}
    for key, recs in records.items():
        ratios = [raw_by_round[r["round"]] / r["durable_s"] for r in recs
                  if r.get("durable_s") and r["round"] in raw_by_round]
        if ratios:
            out[key] = ratios
    return out


# -- goals ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Goal:
    name: str
    value: float | None  # the measured figure
    limit: float | None
    unit: str  # "x" (a ratio) or "MiB"
    at_most: bool  # True: value <= limit meets it; False: value >= limit
    note: str = ""  # context printed after the verdict

    @property
    def met(self) -> bool | None:
        if self.value is None or self.limit is None:
            return None
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def by(self) -> str:
        """met/MISSED and how far from the limit, in the goal's own unit."""
        if self.met is None:
            return "not measured"
        assert self.value is not None and self.limit is not None
        if self.unit == "MiB":
            amount = f"{abs(self.value - self.limit):.0f} MiB"
        else:
            pct = abs(self.value / self.limit - 1) * 100
            amount = f"{pct:.0f}%" if pct >= 10 else f"{pct:.1f}%"
        if self.met:
            return f"met, {amount} to spare"
        return f"MISSED by {amount} ({'over' if self.at_most else 'short of'} the limit)"

    def shown(self) -> str:
        if self.value is None:
            return "-"
        return f"{self.value:.0f} MiB" if self.unit == "MiB" else f"{self.value:.2f}x"

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "limit": self.limit, "unit": self.unit,
                "at_most": self.at_most, "met": self.met, "by": self.by(), "note": self.note}


GOAL_NAMES = {
    "blocked_vs_memcpy": f"blocked <= {BLOCKED_OVER_MEMCPY}x memcpy",
    "blocked_vs_dcp_thread": "blocked <= DCP thread",
    "throughput_vs_raw": f"GB/s >= {GBPS_OVER_RAW}x raw",
    "producer_rss": f"producer RSS <= payload+arena+{SLACK_MIB}",
    "daemon_rss": f"daemon RSS <= budget+{SLACK_MIB}",
}


def goals(stats: dict[str, dict[str, Any]], ckptd_keys: list[str], payload_mib: float, arena_mib: float,
          budget_mib: dict[str, float], base_mib: dict[str, float]) -> dict[str, dict[str, Goal]]:
    """Every ckptd measurement against the five goals (benchmarks/README.md). Times from medians; DCP
    thread mode is the faster of its two configurations (the stricter comparison); RSS
    from the highest peak over the repeats. ``base_mib``: per key, the producer process's
    RSS with only the interpreter and torch loaded, which the producer line shows beside
    its figure."""
    dcp = [stats[k]["blocked_median_s"] for k in ("dcp.thread", "dcp.thread_reused")
           if stats.get(k, {}).get("blocked_median_s")]
    dcp_best = min(dcp) if dcp else None
    out: dict[str, dict[str, Goal]] = {}
    for key in ckptd_keys:
        s = stats.get(key)
        if not s:
            continue
        blocked = s["blocked_median_s"]
        out[key] = {
            "blocked_vs_memcpy": Goal("blocked_vs_memcpy", s["blocked_over_memcpy"], BLOCKED_OVER_MEMCPY, "x", True),
            "blocked_vs_dcp_thread": Goal("blocked_vs_dcp_thread", blocked / dcp_best if dcp_best and blocked else None,
                                          1.0, "x", True),
            "throughput_vs_raw": Goal("throughput_vs_raw", s["gbps_over_raw"], GBPS_OVER_RAW, "x", False),
            "producer_rss": Goal("producer_rss", s.get("producer_peak_mib"), payload_mib + arena_mib + SLACK_MIB,
                                 "MiB", True,
                                 _breakdown(s.get("producer_peak_mib"), base_mib.get(key), payload_mib, arena_mib)),
            "daemon_rss": Goal("daemon_rss", s.get("daemon_peak_mib"),
                               budget_mib[key] + SLACK_MIB if key in budget_mib else None, "MiB", True),
        }
    return out


def _breakdown(peak: float | None, base: float | None, payload_mib: float, arena_mib: float) -> str:
    """The producer's peak as python+torch + payload + arena + the rest (ckptd's own, and noise)."""
    if peak is None or base is None:
        return ""
    return (f"= python+torch {base:.0f} + payload {payload_mib:.0f} + arena {arena_mib:.0f} "
            f"+ {peak - base - payload_mib - arena_mib:.0f} MiB other")


def goal_limits(stats: dict[str, Any], payload_mib: float, arena_mib: float,
                budgets: dict[str, float]) -> dict[str, str]:
    """The goals' limits in words, with the figures they come from."""
    out: dict[str, str] = {}
    memcpy = stats.get("memcpy", {}).get("blocked_median_s")
    if memcpy:
        out["blocked_vs_memcpy"] = f"memcpy {memcpy:.4f} s, so at most {memcpy * BLOCKED_OVER_MEMCPY:.4f} s"
    dcp = {k: stats[k]["blocked_median_s"] for k in ("dcp.thread", "dcp.thread_reused") if k in stats}
    if dcp:
        best = min(dcp, key=dcp.__getitem__)
        out["blocked_vs_dcp_thread"] = (f"the faster DCP thread mode is {best} at {dcp[best]:.4f} s "
                                        f"({', '.join(f'{k} {v:.4f} s' for k, v in dcp.items())})")
    else:
        out["blocked_vs_dcp_thread"] = "DCP did not run (--no-dcp, or it failed: see the notes)"
    raw = better_raw(stats)
    if raw:
        out["throughput_vs_raw"] = (f"the better raw write is {raw} at {stats[raw]['gbps_median']:.2f} GB/s, "
                                    f"so at least {stats[raw]['gbps_median'] * GBPS_OVER_RAW:.2f} GB/s")
    out["producer_rss"] = (f"payload {payload_mib:.0f} + arena {arena_mib:.0f} + {SLACK_MIB} = "
                           f"{payload_mib + arena_mib + SLACK_MIB:.0f} MiB; the whole process's VmHWM, "
                           "interpreter and torch included")
    if budgets:
        b = sorted(set(budgets.values()))
        out["daemon_rss"] = (f"memory_budget {', '.join(f'{x:.0f}' for x in b)} + {SLACK_MIB} MiB; the "
                             "daemon's VmHWM, which counts a mapped shm arena too (see shmem in the table)")
    return out


def chart_lines(stats: dict[str, Any], payload_mib: float, arena_mib: float,
                budgets: dict[str, float]) -> dict[str, float]:
    """Where the chart draws each goal."""
    lines: dict[str, float] = {}
    if stats.get("memcpy", {}).get("blocked_median_s"):
        lines["blocked"] = stats["memcpy"]["blocked_median_s"] * BLOCKED_OVER_MEMCPY
    dcp = [stats[k]["blocked_median_s"] for k in ("dcp.thread", "dcp.thread_reused") if k in stats]
    if dcp:
        lines["dcp"] = min(dcp)
    raw = better_raw(stats)
    if raw:
        lines["gbps"] = stats[raw]["gbps_median"] * GBPS_OVER_RAW
    lines["producer_rss"] = payload_mib + arena_mib + SLACK_MIB
    if budgets:
        lines["daemon_rss"] = max(budgets.values()) + SLACK_MIB
    return lines


# -- the table --------------------------------------------------------------------------------------
def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], stats: dict[str, dict[str, Any]], nbytes: int, ntensors: int,
                repeats: int) -> None:
    raw = better_raw(stats)
    print(f"\n{nbytes / 2**30:.3f} GiB ({nbytes} bytes) in {ntensors} float32 tensors, {repeats} repeat(s); "
          f"medians; GB/s = 1e9 bytes/s of the durable time; x raw: over the better raw write ({raw or '-'})")
    head = (f"{'measurement':<38} {'blocked s':>9} {'durable s':>9} {'GB/s':>6} {'x memcpy':>8} {'x raw':>6} "
            f"{'x raw/rep':>9}  {'producer MiB':>12} {'+MiB':>6}  {'writer MiB':>10} {'anon':>6} {'shmem':>6}")
    print(head)
    print("-" * len(head))
    for row in rows:
        s = stats.get(row.key)
        if not s:
            continue
        print(f"{row.label:<38} {_f(s['blocked_median_s'], '.4f'):>9} {_f(s['durable_median_s'], '.3f'):>9} "
              f"{_f(s['gbps_median'], '.2f'):>6} {_f(s['blocked_over_memcpy'], '.2f'):>8} "
              f"{_f(s['gbps_over_raw'], '.2f'):>6} {_f(s.get('gbps_over_raw_paired'), '.2f'):>9}  "
              f"{_f(s.get('producer_peak_mib'), '.0f'):>12} {_f(s.get('producer_added_mib'), '.0f'):>6}  "
              f"{_f(s.get('daemon_peak_mib'), '.0f'):>10} {_f(s.get('daemon_anon_mib'), '.0f'):>6} "
              f"{_f(s.get('daemon_shmem_mib'), '.0f'):>6}")
    print(textwrap.fill(
        "blocked: the caller could not go on; durable: until fsync done / commit acknowledged. x memcpy: blocked "
        "over memcpy's; x raw: GB/s over the better raw write's, x raw/rep: the same ratio taken within each "
        "repeat, then the median. producer MiB: the saver process's peak RSS (VmHWM), +MiB: above its RSS "
        "before the call; writer MiB: the peak RSS of ckptd's daemon or DCP's writer process, anon/shmem: its "
        "highest RssAnon/RssShmem (a shared arena is counted in both processes).", width=len(head)))


def print_detail(rows: list[Row], stats: dict[str, dict[str, Any]], nbytes: int) -> None:
    """Where ckptd's time and CPU go: medians per checkpoint."""
    shown = [r for r in rows if r.group == "ckptd" and r.key in stats]
    if not shown:
        return
    head = (f"{'ckptd, per checkpoint (medians)':<38} {'staging wait s':>14} {'daemon s':>9} "
            f"{'producer CPU s':>14} {'daemon CPU s':>12} {'daemon faults':>13}")
    print("\n" + head)
    for r in shown:
        s = stats[r.key]
        faults = s.get("daemon_faults")
        print(f"{r.label:<38} {_f(s.get('staging_wait_s'), '.4f'):>14} {_f(s.get('daemon_commit_s'), '.3f'):>9} "
              f"{_f(s.get('producer_cpu_s'), '.2f'):>14} {_f(s.get('daemon_cpu_s'), '.2f'):>12} "
              f"{_f(None if faults is None else faults * 4096 / nbytes, '.2f'):>13}")
    print(textwrap.fill(
        "staging wait: part of blocked spent waiting for free staging memory; daemon s: the daemon's own time "
        "from the first byte received to the manifest durable (its log); CPU s: utime+stime of the whole "
        "process; daemon faults: minor page faults x 4 KiB over the payload (1.0: every byte landed in "
        "freshly mapped memory).", width=len(head) + 10))


def print_goals(goal_table: dict[str, dict[str, Goal]], labels: dict[str, str], limits: dict[str, str]) -> None:
    """Goal by goal: its limit, then every ckptd measurement, met or missed and by how much."""
    if not goal_table:
        return
    print("\nGoals (benchmarks/README.md), each ckptd measurement against each:")
    for i, name in enumerate(GOAL_NAMES, 1):
        print(f"{i}. {GOAL_NAMES[name]}: {limits.get(name, '')}")
        for key, gs in goal_table.items():
            g = gs[name]
            print(f"   {labels.get(key, key):<30} {g.shown():>10}   {g.by()}" + (f"; {g.note}" if g.note else ""))
    met = sum(1 for gs in goal_table.values() for g in gs.values() if g.met)
    missed = sum(1 for gs in goal_table.values() for g in gs.values() if g.met is False)
    total = sum(len(gs) for gs in goal_table.values())
    print(f"   in all: {met} met, {missed} missed, {total - met - missed} not measured")


# -- the chart ----------------------------------------------------------------------------------------
_COLOURS = {"floor": "#7f7f7f", "baseline": "#bcbd22", "dcp": "#ff7f0e", "ckptd": "#1f77b4"}
_CKPTD_COLOURS = {"shm": "#08519c", "inline": "#3182bd", "tcp": "#9ecae1"}  # by transport


def _colour(row: Row) -> str:
    if row.group == "ckptd":
        return _CKPTD_COLOURS.get(row.key.split(".")[1], _COLOURS["ckptd"])
    return _COLOURS[row.group]


def write_png(path: Path, rows: list[Row], stats: dict[str, dict[str, Any]], title: str,
              lines: dict[str, float]) -> None:
    """Three panels over the same rows: how long the caller was blocked (log scale), durable
    throughput, and peak RSS of the saver and of its writer; the goals as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.key in stats]
    labels = [r.label for r in shown]
    colours = [_colour(r) for r in shown]
    y = list(range(len(shown)))
    fig, axes = plt.subplots(1, 3, figsize=(18, 0.38 * len(shown) + 2.2), sharey=True)

    def bars(ax: Any, values: list[float | None], spec: str, **kw: Any) -> None:
        ax.barh(y, [v or 0 for v in values], **kw)
        for yi, v in zip(y, values):
            if v is None:  # at the left edge, in axes units: a log axis has no 0
                ax.text(0.01, yi, "n/a", va="center", fontsize=7, color="grey", transform=ax.get_yaxis_transform())
            else:
                ax.text(v, yi, f" {v:{spec}}", va="center", fontsize=7)

    blocked = [stats[r.key]["blocked_median_s"] for r in shown]
    bars(axes[0], blocked, ".4f", color=colours)
    axes[0].set_xscale("log")
    axes[0].set_title("caller blocked, s (median, log scale)")
    if "blocked" in lines:
        axes[0].axvline(lines["blocked"], ls="--", color="k", lw=1, label=f"goal: {BLOCKED_OVER_MEMCPY}x memcpy")
    if "dcp" in lines:
        axes[0].axvline(lines["dcp"], ls=":", color="#ff7f0e", lw=1.5, label="goal: DCP thread")

    gbps = [stats[r.key]["gbps_median"] for r in shown]
    bars(axes[1], gbps, ".2f", color=colours)
    axes[1].set_title("durable throughput, GB/s (median)")
    if "gbps" in lines:
        axes[1].axvline(lines["gbps"], ls="--", color="k", lw=1, label=f"goal: {GBPS_OVER_RAW}x better raw write")

    h = 0.4
    prod = [stats[r.key].get("producer_peak_mib") for r in shown]
    daemon = [stats[r.key].get("daemon_peak_mib") for r in shown]
    axes[2].barh([v - h / 2 for v in y], [v or 0 for v in prod], height=h, color=colours, label="saver process")
    axes[2].barh([v + h / 2 for v in y], [v or 0 for v in daemon], height=h, color=colours, alpha=0.45,
                 hatch="//", label="writer process (daemon)")
    axes[2].set_title("peak RSS, MiB (highest repeat)")
    if "producer_rss" in lines:
        axes[2].axvline(lines["producer_rss"], ls="--", color="k", lw=1, label="goal: payload+arena+200 MiB")
    if "daemon_rss" in lines:
        axes[2].axvline(lines["daemon_rss"], ls=":", color="k", lw=1.5, label="goal: memory_budget+200 MiB")
    from matplotlib.patches import Patch
    from matplotlib.ticker import NullFormatter

    groups = [Patch(color=_COLOURS[g], label=t) for g, t in
              (("floor", "floors"), ("baseline", "synchronous savers"), ("dcp", "DCP async_save"))]
    groups += [Patch(color=c, label=f"ckptd {t}") for t, c in _CKPTD_COLOURS.items()]
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    axes[0].xaxis.set_minor_formatter(NullFormatter())  # 2x10^-2, 3x10^-2... would overlap
    fig.legend(handles=groups, loc="lower center", ncol=len(groups), fontsize=8, frameon=False)
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))  # room for the legend of colours
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
