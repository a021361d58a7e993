"""Sizes, rates and durations as people read them (the CLI and the daemon's log)."""

from __future__ import annotations


def size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; bytes below 1 KiB as a whole number."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def rate(nbytes: float, seconds: float) -> str:
    """Bytes over seconds, in the unit that shows it: ``"12.3 MiB/s"``, not ``"0.01 GB/s"``."""
    return f"{size(nbytes / max(seconds, 1e-9))}/s"


def duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"
