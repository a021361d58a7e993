"""What is complete under the checkpoint root: one scan, then watchdog events as hints.

A step is complete when every rank's manifest is there, all of one attempt
(``ckptd.attempt``), and every file they name is at least as long as it says. The
functions at the top answer that from the disk, for any process; ``Index`` keeps the
answer for the daemon, re-reading what an event touches and rescanning periodically
(inotify drops events on overflow and sees nothing other hosts write on NFS).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

from . import layout, manifestcache
from .config import IndexConfig
from .durable import atomic_write
from .errors import CheckpointCorrupt
from .manifest import MAX_MANIFEST_BYTES, CheckpointInfo, Manifest
from .names import RUN_ID_PATTERN

log = logging.getLogger("ckptd.index")


def read_manifests(step_path: Path) -> list[Manifest] | None:
    """All ranks' manifests of a step folder, or None if the step is not complete.
    A manifest that cannot be parsed, or a symlink in place of the step folder or a
    manifest, raises CheckpointCorrupt."""
    try:
        dir_fd = _open_step(step_path)
    except FileNotFoundError:
        return None
    try:
        return _read_manifests(dir_fd, step_path)
    finally:
        os.close(dir_fd)


def _open_step(step_path: Path, run_fd: int | None = None) -> int:
    try:
        if run_fd is not None:
            return layout.open_real_dir(step_path.name, dir_fd=run_fd)
        return layout.open_step_dir(step_path)
    except (FileNotFoundError, PermissionError):
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointCorrupt(str(exc)) from None
        raise


def _read_manifests(dir_fd: int, step_path: Path) -> list[Manifest] | None:
    names = sorted(n for n in os.listdir(dir_fd) if layout.MANIFEST.fullmatch(n))
    manifests = []
    for name in names:
        where = str(step_path / name)
        try:
            m = manifestcache.read(name, dir_fd, where)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointCorrupt(f"{step_path}: {exc.strerror}") from None
        if m.rank != layout.file_rank(name):
            raise CheckpointCorrupt(f"{where}: holds the manifest of rank {m.rank}")
        manifests.append(m)
    if not manifests:
        return None
    _agree(manifests, ("run", "step"), step_path)
    return one_attempt(manifests, step_path)


def one_attempt(manifests: list[Manifest], step_path: Path) -> list[Manifest] | None:
    """The manifests of the attempt whose every rank committed the step, or None.

    A step is complete only out of manifests of one attempt (``ckptd.attempt``): the
    shares an earlier, failed attempt left of a step never count together with the
    shares of the attempt that saved it again (which replace them rank by rank),
    whatever their world sizes."""
    by_attempt: dict[str | None, list[Manifest]] = {}
    for m in manifests:
        by_attempt.setdefault(m.attempt, []).append(m)
    for group in by_attempt.values():
        _agree(group, ("world_size",), step_path)
        world = group[0].world_size
        if len(group) == world and {m.rank for m in group} == set(range(world)):
            return group
    return None


def _agree(manifests: list[Manifest], keys: tuple[str, ...], step_path: Path) -> None:
    first = manifests[0]
    for m in manifests[1:]:
        for key in keys:
            if getattr(m, key) != getattr(first, key):
                raise CheckpointCorrupt(
                    f"{step_path}: the manifests disagree on {key}: rank {first.rank} says "
                    f"{getattr(first, key)!r}, rank {m.rank} says {getattr(m, key)!r}")


def read_share(step_path: Path, rank: int) -> Manifest | None:
    """Rank ``rank``'s manifest of a step folder if that rank's share is committed there
    with every file it names (whether or not the other ranks' are), else None."""
    try:
        dir_fd = _open_step(step_path)
    except FileNotFoundError:
        return None
    try:
        name = layout.manifest_name(rank)
        try:
            data = layout.read_small(name, MAX_MANIFEST_BYTES, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        m = Manifest.from_json(data, str(step_path / name))
        return m if m.rank == rank and _files_present(dir_fd, [m]) else None
    finally:
        os.close(dir_fd)


def step_info(step_path: Path, *, warn: bool = False, run_fd: int | None = None) -> CheckpointInfo | None:
    """The info of a complete step, or None (incomplete, unreadable, being copied in).
    ``warn``: log why a step with a damaged manifest is left out as a warning (for a
    person reading the root), not as a debug line (the daemon's rescans). ``run_fd``:
    the run folder, open already (a scan of all its steps opens it once)."""
    try:
        dir_fd = _open_step(step_path, run_fd)
    except FileNotFoundError:
        return None
    except CheckpointCorrupt as exc:
        (log.warning if warn else log.debug)("not a checkpoint: %s", exc)
        return None
    try:
        manifests = _read_manifests(dir_fd, step_path)
        if not manifests or not _files_present(dir_fd, manifests):
            return None
    except CheckpointCorrupt as exc:
        (log.warning if warn else log.debug)("not complete: %s", exc)
        return None
    finally:
        os.close(dir_fd)
    m = manifests[0]
    if m.run != step_path.parent.name or layout.step_dir_name(m.step) != step_path.name:
        log.warning("%s holds a checkpoint of run %r step %d; not listed under this name",
                    step_path, m.run, m.step)
        return None
    return CheckpointInfo.from_manifests(str(step_path), manifests)


def _files_present(dir_fd: int, manifests: list[Manifest]) -> bool:
    """Every data file is there, a regular file, and long enough: a folder copied in
    with ``cp -r`` may show its manifest before its data. The size each file had at
    commit, where the manifest records it, and the end of every tensor with an
    offset (a chunked HDF5 dataset has none) are lower bounds."""
    need: dict[str, int] = {}
    for m in manifests:
        for file, size in m.files.items():
            need[file] = max(need.get(file, 0), size)
        for t in m.tensors.values():
            end = 0 if t.offset is None else t.offset + t.nbytes
            need[t.file] = max(need.get(t.file, 0), end)
    for file, size in need.items():
        try:
            st = os.stat(file, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            return False
    return True


def step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Step folders of a run (real folders only, never symlinks), newest first; none
    if the run folder itself is a symlink (it is never followed)."""
    fd = _open_run(run_dir)
    if fd is None:
        return []
    try:
        return _steps_in(fd, run_dir)
    finally:
        os.close(fd)


def _open_run(run_dir: Path) -> int | None:
    """A descriptor of the run folder, or None where there is no real one."""
    try:
        return layout.open_real_dir(run_dir)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


def _steps_in(run_fd: int, run_dir: Path) -> list[tuple[int, Path]]:
    with os.scandir(run_fd) as it:
        steps = [
            (step, run_dir / e.name) for e in it
            if (step := layout.parse_step_dir(e.name)) is not None and e.is_dir(follow_symlinks=False)
        ]
    return sorted(steps, reverse=True)


def run_dirs(root: Path) -> list[Path]:
    try:
        with os.scandir(root) as it:
            return [Path(e.path) for e in it if RUN_ID_PATTERN.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def scan_run(run_dir: Path, *, warn: bool = False) -> dict[int, CheckpointInfo]:
    run_fd = _open_run(run_dir)
    if run_fd is None:
        return {}
    try:
        return {step: info for step, path in _steps_in(run_fd, run_dir)
                if (info := step_info(path, warn=warn, run_fd=run_fd))}
    finally:
        os.close(run_fd)


def latest_by_scan(run_dir: Path, *, warn: bool = False) -> CheckpointInfo | None:
    for _, path in step_dirs(run_dir):
        info = step_info(path, warn=warn)
        if info and not info.refused:
            return info
    return None


def latest_from_pointer(run_dir: Path) -> CheckpointInfo | None:
    """The step ``<run>/latest`` names, if it is complete; None when missing or stale."""
    step = layout.read_latest_pointer(run_dir, default=-1)
    info = step_info(run_dir / layout.step_dir_name(step)) if step >= 0 else None
    return info if info is not None and not info.refused else None


def write_pointer(run_dir: Path, step: int | None) -> None:
    """Point ``<run>/latest`` at ``step`` (or remove it when the run has none)."""
    if os.path.islink(run_dir):  # writing or unlinking through it would touch another folder
        raise OSError(errno.ELOOP, f"{run_dir} is a symlink; ckptd never writes through symlinks "
                                   "below the checkpoint root")
    path = run_dir / layout.LATEST
    if step is None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return
    if layout.read_latest_pointer(run_dir, default=-1) != step:
        atomic_write(path, f"{layout.step_dir_name(step)}\n".encode())


LatestChanged = Callable[[str, "CheckpointInfo | None"], None]


class Index:
    """Complete checkpoints per run under ``root``; thread-safe.

    ``on_latest_change(run, info)`` is called (on whichever thread noticed) when a
    run's newest complete checkpoint changes; the daemon uses it to keep the
    ``latest`` pointer files current.
    """

    def __init__(self, root: Path, config: IndexConfig = IndexConfig(), *,
                 on_latest_change: LatestChanged | None = None) -> None:
        self.root = root
        self.config = config
        self._on_latest_change = on_latest_change
        self._lock = threading.Lock()
        # two threads refreshing a step (the watcher, a commit) must not apply a stale read after a newer one
        self._refresh_lock = threading.RLock()
        self._runs: dict[str, dict[int, CheckpointInfo]] = {}
        self._latest: dict[str, int] = {}
        self._dirty: set[tuple[str, int | None]] = set()
        self._rescan_wanted = False
        self._wake = threading.Condition()
        self._stop = False
        self._observer = None
        self._thread: threading.Thread | None = None
        self.observer_kind = ""
        self.rescans = 0
        self.last_scan_s = 0.0

    def latest(self, run: str) -> CheckpointInfo | None:
        with self._lock:
            step = self._latest.get(run)
            return self._runs[run][step] if step is not None else None

    def list(self, run: str) -> list[CheckpointInfo]:
        with self._lock:
            steps = self._runs.get(run, {})
            return [steps[s] for s in sorted(steps)]

    def runs(self) -> list[str]:
        with self._lock:
            return sorted(r for r, steps in self._runs.items() if steps)

    def start(self) -> None:
        """Scan the root, then follow it. Returns once the first scan is done."""
        self.rescan()
        self._start_observer()
        self._thread = threading.Thread(target=self._loop, name="ckptd-index", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._stop_observer()

    def refresh_step(self, run: str, step: int) -> None:
        """Re-read one step folder now (the daemon calls this after its own commits)."""
        with self._refresh_lock:
            info = step_info(layout.step_dir(self.root, run, step))
            with self._lock:
                steps = self._runs.setdefault(run, {})
                if info is None:
                    steps.pop(step, None)
                else:
                    steps[step] = info
                changed = self._update_latest(run)
            self._notify(run, changed)

    def refresh_run(self, run: str) -> None:
        with self._refresh_lock:
            steps = scan_run(self.root / run)
            with self._lock:
                self._runs[run] = steps
                changed = self._update_latest(run)
            self._notify(run, changed)

    def rescan(self) -> None:
        """Re-read everything: the truth, whatever events were missed."""
        t0 = time.monotonic()
        present = {p.name for p in run_dirs(self.root)}
        for run in present:
            self.refresh_run(run)
        with self._lock:
            gone = [r for r in self._runs if r not in present]
        for run in gone:
            self.refresh_run(run)
        self.rescans += 1
        self.last_scan_s = time.monotonic() - t0

    def request_rescan(self) -> None:
        with self._wake:
            self._rescan_wanted = True
            self._wake.notify_all()

    def _update_latest(self, run: str) -> bool:
        steps = self._runs.get(run, {})
        new = max((s for s, info in steps.items() if not info.refused), default=None)
        old = self._latest.get(run)
        if new is None:
            self._latest.pop(run, None)
        else:
            self._latest[run] = new
        return new != old

    def _notify(self, run: str, changed: bool) -> None:
        if changed and self._on_latest_change is not None:
            try:
                self._on_latest_change(run, self.latest(run))
            except Exception:
                log.exception("latest-change callback failed for run %s", run)

    def _mark(self, path: str) -> None:
        """Map a path an event named to what must be re-read."""
        try:
            parts = Path(path).relative_to(self.root).parts
        except ValueError:
            return
        if not parts:
            self.request_rescan()
            return
        run = parts[0]
        if not RUN_ID_PATTERN.fullmatch(run):
            return
        if len(parts) == 1:
            key: tuple[str, int | None] = (run, None)
        else:
            step = layout.parse_step_dir(parts[1])
            if step is None:
                return
            key = (run, step)
        with self._wake:
            self._dirty.add(key)
            self._wake.notify_all()

    def _check_known(self) -> None:
        """Mark every step (and run) the index lists whose folder is gone.

        A polling observer compares snapshots, so a folder made and moved away
        between two polls (the daemon's own commit, then a person's ``mv``) shows
        no difference, and no event: only this check notices that it went. A stat
        per listed step is far less than the observer's own recursive snapshot."""
        with self._lock:
            known = [(run, step, info.path) for run, steps in self._runs.items() for step, info in steps.items()]
        gone = {(run, step) for run, step, path in known if not os.path.isdir(path)}
        if gone:
            with self._wake:
                self._dirty |= gone

    def _loop(self) -> None:
        next_rescan = time.monotonic() + self.config.rescan_interval
        next_check = time.monotonic() + self.config.poll_interval
        while True:
            with self._wake:
                while not (self._stop or self._dirty or self._rescan_wanted):
                    now = time.monotonic()
                    if now >= next_rescan:
                        self._rescan_wanted = True
                        break
                    if self.observer_kind == "polling" and now >= next_check:
                        break
                    wake_at = min(next_rescan, next_check) if self.observer_kind == "polling" else next_rescan
                    self._wake.wait(wake_at - now)
                if self._stop:
                    return
            if self.observer_kind == "polling" and time.monotonic() >= next_check:
                next_check = time.monotonic() + self.config.poll_interval
                self._check_known()
            time.sleep(0.02)
            with self._wake:
                dirty, self._dirty = self._dirty, set()
                rescan, self._rescan_wanted = self._rescan_wanted, False
            try:
                if self._observer is not None and not self._observer.is_alive():
                    log.warning("the %s observer stopped; restarting it and rescanning", self.observer_kind)
                    self._stop_observer()
                    self._start_observer()
                    rescan = True
                if rescan:
                    self.rescan()
                    next_rescan = time.monotonic() + self.config.rescan_interval
                    continue
                for run in {r for r, s in dirty if s is None}:
                    self.refresh_run(run)
                for run, step in dirty:
                    if step is not None and (run, None) not in dirty:
                        self.refresh_step(run, step)
            except Exception:
                log.exception("index update failed")

    def _start_observer(self) -> None:
        from watchdog import events as ev
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer
        from watchdog.observers.polling import PollingObserver

        # what changes a step's completeness; not every write: the daemon's own would cost it CPU
        wanted = [ev.FileCreatedEvent, ev.FileDeletedEvent, ev.FileMovedEvent, ev.FileClosedEvent,
                  ev.DirCreatedEvent, ev.DirDeletedEvent, ev.DirMovedEvent]

        index = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event) -> None:  # type: ignore[no-untyped-def]
                index._mark(os.fsdecode(event.src_path))
                dest = getattr(event, "dest_path", "")
                if dest:
                    index._mark(os.fsdecode(dest))

        kind = self.config.observer
        observer = None
        # watchdog warns when a folder is made again under a still-registered watch, and fixes it itself
        warnings.filterwarnings("ignore", message="Callback with id .* already exists for watch",
                                category=RuntimeWarning)
        if kind in ("auto", "inotify"):
            try:
                observer = Observer()
                observer.schedule(Handler(), str(self.root), recursive=True, event_filter=wanted)
                observer.start()
                kind = "inotify"
            except OSError as exc:
                if self.config.observer == "inotify":
                    raise
                log.warning("inotify unavailable (%s); polling every %.1f s instead", exc, self.config.poll_interval)
                observer = None
        if observer is None:
            observer = PollingObserver(timeout=self.config.poll_interval)
            # polling sees no "closed": a file still growing when seen shows up as modified
            observer.schedule(Handler(), str(self.root), recursive=True,
                              event_filter=[*wanted, ev.FileModifiedEvent])
            observer.start()
            kind = "polling"
        self._observer, self.observer_kind = observer, kind
        _TroubleWatch.install(self)

    def _stop_observer(self) -> None:
        _TroubleWatch.remove(self)
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()
            self._observer = None


class _TroubleWatch(logging.Handler):
    """watchdog reports trouble (an inotify queue overflow: events were lost) only
    through its log; hear it there and reconcile with a rescan."""

    _by_index: dict[int, "_TroubleWatch"] = {}

    def __init__(self, index: Index) -> None:
        super().__init__(logging.WARNING)
        self.index = index

    def emit(self, record: logging.LogRecord) -> None:
        self.index.request_rescan()

    @classmethod
    def install(cls, index: Index) -> None:
        handler = cls._by_index[id(index)] = cls(index)
        logging.getLogger("watchdog").addHandler(handler)

    @classmethod
    def remove(cls, index: Index) -> None:
        handler = cls._by_index.pop(id(index), None)
        if handler is not None:
            logging.getLogger("watchdog").removeHandler(handler)
