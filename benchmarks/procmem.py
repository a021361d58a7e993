"""Memory and CPU of a process, read from /proc (Linux only).

Peak RSS per measurement: before each one the parent writes ``5`` to
``/proc/<pid>/clear_refs``, which resets that process's high-water mark
(``VmHWM``) to its current RSS (Linux >= 4.0); after it, ``VmHWM`` is the exact
peak of that measurement alone, however short the spike. Where the kernel
refuses the reset, the peak falls back to the sampler's highest ``VmRSS`` and
the report says so.

``VmHWM`` is one number for all memory. To tell the kinds apart the parent
also samples ``RssAnon`` (the process's private memory), ``RssShmem`` (shared
memory: the payload, and a staging arena that the daemon maps too and so is
counted in both processes) and ``RssFile`` (mapped files: libraries) every few
milliseconds, from a thread of its own, which the measured processes never see.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

MiB = 2**20
_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def status(pid: int | str = "self") -> dict[str, int]:
    """The memory lines of ``/proc/<pid>/status`` in bytes; empty if the process is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _FIELDS:
                    out[key] = int(value.split()[0]) * 1024  # "123456 kB"
    except (OSError, ValueError, IndexError):
        return {}
    return out


def reset_peak(pid: int | str = "self") -> bool:
    """Reset ``VmHWM`` to the current RSS; False where the kernel does not allow it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of the whole process so far (all threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def minor_faults(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0
    return int(text[text.rindex(")") + 2:].split()[7])


def mapped_memfds(pid: int) -> set[str]:
    """Names of the memfds ``pid`` maps (``/memfd:NAME (deleted)`` in its maps)."""
    names: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                i = line.find("/memfd:")
                if i >= 0:
                    names.add(line[i + 7:].split(" (deleted)")[0].strip())
    except OSError:
        pass
    return names


@dataclass
class Peak:
    """One process's memory during one measurement, in bytes."""

    hwm: int = 0  # VmHWM after a reset: the exact peak (or the sampled VmRSS peak)
    exact: bool = True  # False: the reset was refused and hwm is the sampled maximum
    before: int = 0  # VmRSS when the measurement started
    anon: int = 0  # highest sampled RssAnon
    shmem: int = 0  # highest sampled RssShmem
    file: int = 0  # highest sampled RssFile

    def to_dict(self) -> dict[str, float]:
        return {"peak_mib": self.hwm / MiB, "peak_exact": self.exact, "before_mib": self.before / MiB,
                "added_mib": max(0, self.hwm - self.before) / MiB, "anon_mib": self.anon / MiB,
                "shmem_mib": self.shmem / MiB, "file_mib": self.file / MiB}


@dataclass
class Watch:
    """Peak memory and CPU of some processes across one measurement::

        with Watch({"producer": pid1, "daemon": pid2}) as w:
            ...
        w.peaks["daemon"].hwm, w.cpu_s["producer"]
    """

    pids: dict[str, int]
    interval_s: float = 0.01
    peaks: dict[str, Peak] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-memwatch", daemon=True)

    def __enter__(self) -> "Watch":
        for role, pid in self.pids.items():
            exact = reset_peak(pid)
            rss = status(pid).get("VmRSS", 0)
            self.peaks[role] = Peak(exact=exact, before=rss)
            self.cpu_s[role] = cpu_seconds(pid)
            self.faults[role] = minor_faults(pid)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            self._sample_all()
            if self._stop.wait(self.interval_s):
                return

    def _sample_all(self) -> None:
        for role, pid in self.pids.items():
            st, p = status(pid), self.peaks[role]
            p.anon = max(p.anon, st.get("RssAnon", 0))
            p.shmem = max(p.shmem, st.get("RssShmem", 0))
            p.file = max(p.file, st.get("RssFile", 0))
            if not p.exact:
                p.hwm = max(p.hwm, st.get("VmRSS", 0))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample_all()
        for role, pid in self.pids.items():
            self.cpu_s[role] = cpu_seconds(pid) - self.cpu_s[role]
            self.faults[role] = minor_faults(pid) - self.faults[role]
            p = self.peaks[role]
            if p.exact:
                p.hwm = max(status(pid).get("VmHWM", 0), p.hwm)
