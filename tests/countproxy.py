"""A TCP relay in front of a server that counts the bytes the server sends: what the
bucket served, as the bucket's own network link sees it (HTTP headers included).
Point clients at ``endpoint`` instead of the server's."""

from __future__ import annotations

import socket
import threading

from ports import free_port


class CountingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.served = 0  # bytes from the server to its clients
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", free_port()))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="countproxy")
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._spawn(self._pump, client, server, False)
            self._spawn(self._pump, server, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while chunk := src.recv(1 << 20):
                dst.sendall(chunk)
                if counted:
                    with self._lock:
                        self.served += len(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def reset(self) -> None:
        with self._lock:
            self.served = 0

    def close(self) -> None:
        self._closed = True
        self._listener.close()
