"""A TCP relay in front of the API server double that holds back chosen requests until the test lets them go.

It plays a slow API server at the driver's start, as production meets one: the driver reads its Node
(for the sharing plan) while it initialises, after it has registered with the kubelet, and that read
waits here until :meth:`HeldApi.release`. Bytes are relayed as they are, so kept-alive connections and
watch streams work unchanged; only a connection whose first request matches ``hold_prefix`` waits.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class HeldApi:
    """Relays 127.0.0.1:<port> to ``upstream`` (``http://host:port``); see the module docstring."""

    def __init__(self, upstream: str, hold_prefix: bytes):
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._hold_prefix = hold_prefix
        self._released = threading.Event()
        self._held = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="held-api", daemon=True).start()

    def wait_held(self, timeout: float) -> bool:
        """True once a request matching the prefix arrived and is being held."""
        return self._held.wait(timeout)

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._released.set()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client:
            first = client.recv(65536)
            if first.startswith(self._hold_prefix) and not self._released.is_set():
                self._held.set()
                self._released.wait()
            try:
                server = socket.create_connection(self._upstream)
            except OSError:
                return  # no API server behind: the client sees its connection closed
            with server, contextlib.suppress(OSError):
                server.sendall(first)
                back = threading.Thread(target=_pump, args=(server, client), daemon=True)
                back.start()
                _pump(client, server)
                back.join()


def _pump(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)
