"""One HTTP/1.1 client connection to the API server: send a request, read its answer whole or as it comes.

Enough HTTP for the Kubernetes API: a request with an optional body in one write, an answer framed by
``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the connection, kept alive unless
either side says ``close``. Not ``http.client``: it parses every answer's headers through the
``email`` package, which was two thirds of its CPU per claim read (docs/benchmarks.md).
"""

from __future__ import annotations

import io
import socket
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

_MAX_LINE = 65536  # a status, header or chunk-size line longer than this is not an API server's
_MAX_HEADERS = 200
_READ_SIZE = 65536


class HttpProtocolError(OSError):
    """The server closed the connection early or sent something that is not HTTP/1.x."""


class ServerClosed(HttpProtocolError):
    """The server closed the connection before any answer: a kept-alive connection it timed out."""


@dataclass(frozen=True)
class Head:
    """The status line and headers of an answer (header names in lower case)."""

    status: int
    reason: str
    headers: Mapping[str, str]
    keep_alive: bool

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()


class Connection:
    """A connected socket (TLS when ``tls`` is given) and its buffered reader; one request at a time."""

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None, timeout: float):
        """Connects within ``timeout`` seconds (OSError otherwise), then reads and writes with it."""
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            # A request is one write and its answer follows: Nagle's algorithm would only delay it.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        self.sock: socket.socket = sock
        # What sock.makefile("rb") builds, spelled out so the reader's type is known.
        self._reader = io.BufferedReader(socket.SocketIO(sock, "rb"), _READ_SIZE)
        self._host = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.closed = False

    def settimeout(self, seconds: float) -> None:
        self.sock.settimeout(seconds)

    def send(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None) -> None:
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append(f"Content-Length: {len(body)}" if body is not None else "Content-Length: 0")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))

    def read_head(self) -> Head:
        raw = self._reader.readline(_MAX_LINE + 1)
        if not raw:
            raise ServerClosed("the server closed the connection before answering")
        status_line = _text(raw)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        while line := self._line():
            name, colon, value = line.partition(":")
            if not colon or len(headers) >= _MAX_HEADERS:
                raise HttpProtocolError(f"bad header line: {line[:80]!r}")
            key = name.strip().lower()
            # Repeated headers (e.g. Warning) are joined, as HTTP allows.
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        closing = "close" in headers.get("connection", "").lower() or parts[0] == "HTTP/1.0"
        framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
        return Head(int(parts[1]), parts[2].strip() if len(parts) > 2 else "", headers,
                    keep_alive=not closing and framed)

    def read_body(self, head: Head) -> bytes:
        """The whole body of ``head``'s answer."""
        if head.status in (204, 304) or 100 <= head.status < 200:
            return b""
        if head.chunked:
            return b"".join(self.chunks())
        length = head.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise HttpProtocolError(f"bad Content-Length {length[:40]!r}")
            return self._exactly(int(length))
        return self._reader.read()  # framed by the end of the connection

    def chunks(self) -> Iterator[bytes]:
        """The data of a chunked body as it arrives, up to its last chunk (trailers are skipped)."""
        while True:
            size_line = self._line().split(";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise HttpProtocolError(f"bad chunk size {size_line[:40]!r}") from None
            if size == 0:
                while self._line():  # trailers, then the empty line
                    pass
                return
            data = self._exactly(size)
            if self._reader.read(2) != b"\r\n":
                raise HttpProtocolError("a chunk does not end with CRLF")
            yield data

    def read_available(self) -> Iterator[bytes]:
        """A body framed by the end of the connection, as it arrives."""
        while data := self._reader.read1(_READ_SIZE):
            yield data

    def close(self) -> None:
        self.closed = True
        self._reader.close()
        self.sock.close()

    def _line(self) -> str:
        return _text(self._reader.readline(_MAX_LINE + 1))

    def _exactly(self, size: int) -> bytes:
        data = self._reader.read(size)
        if len(data) != size:
            raise HttpProtocolError(f"the server closed the connection after {len(data)} of {size} bytes")
        return data


def _text(line: bytes) -> str:
    """A line of the answer without its CRLF; HttpProtocolError if it is cut short or too long."""
    if len(line) > _MAX_LINE:
        raise HttpProtocolError("a line of the answer is too long")
    if not line.endswith(b"\n"):
        raise HttpProtocolError("the server closed the connection in the middle of the answer")
    return line.rstrip(b"\r\n").decode("latin-1")
