"""Progress bars for long CLI work (verify, export): on a terminal only.

A bar with bytes and rate from ``tqdm`` when stderr is a terminal; nothing at all
otherwise, so logs, pipes and ``--json`` output stay clean.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def bytes_bar(total: int, what: str, *, enabled: bool = True) -> Iterator[Callable[[int], None] | None]:
    """Yield a callback that advances a bar of ``total`` bytes, or None off a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        yield bar.update
        bar.refresh()
