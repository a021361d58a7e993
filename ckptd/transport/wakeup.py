"""A self-pipe: lets other threads (and signal handlers) wake a loop blocked in poll."""

from __future__ import annotations

import os


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def write_fd(self) -> int:
        return self._write_fd

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"w")
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._write_fd)
