"""kubeclient against misbehaving servers: a hung API server costs one read timeout, and a watch
stream can be interrupted whatever state it is in."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client

from driver.kubeletplugin.claimfetch import ClaimError, ClaimFetcher
from driver.kubeletplugin.kubeclient import (
    KubeApiError,
    load_api_client,
    open_json_lines,
    plain_client,
    request_json,
)
from driver.kubeletplugin.types import ClaimRef

READ_TIMEOUT_S = 0.3


class SilentServer:
    """A listening socket that never accepts: connections complete, requests are never answered."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)  # room for every attempt a retrying client would make
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def connections(self) -> int:
        """How many connections were made so far (they wait in the accept queue)."""
        count = 0
        self._listener.setblocking(False)
        try:
            while True:
                try:
                    conn, _ = self._listener.accept()
                except BlockingIOError:
                    return count
                conn.close()
                count += 1
        finally:
            self._listener.setblocking(True)

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def kubeconfig_for(url: str, path: Path) -> str:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    return str(path)


def test_claim_read_from_a_hung_server_is_sent_once(silent: SilentServer, tmp_path: Path) -> None:
    api = load_api_client(kubeconfig_for(silent.url, tmp_path / "kubeconfig"))
    fetcher = ClaimFetcher(api, connect_timeout_s=5, read_timeout_s=READ_TIMEOUT_S)

    with pytest.raises(ClaimError, match="cannot reach the API server"):
        fetcher.fetch(ClaimRef(namespace="ns", name="claim", uid="5d4c3b2a-1f0e-4d9c-8b7a-6f5e4d3c2b1a"))
    assert silent.connections() == 1


def test_raw_request_to_a_hung_server_is_sent_once(silent: SilentServer, tmp_path: Path) -> None:
    api = load_api_client(kubeconfig_for(silent.url, tmp_path / "kubeconfig"))

    with pytest.raises(KubeApiError, match="ConnectionError"):
        request_json(api, "GET", "/version", timeout=READ_TIMEOUT_S)
    assert silent.connections() == 1


def test_loaded_client_retries_only_connection_attempts(tmp_path: Path) -> None:
    api = load_api_client(kubeconfig_for("http://127.0.0.1:1", tmp_path / "kubeconfig"))
    retries = api.configuration.retries
    assert (retries.connect, retries.read, retries.status, retries.other, retries.redirect) == (2, 0, 0, 0, 0)


# ----- interrupting a watch stream ----------------------------------------------------------


class _ChunkedLines(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked transfer needs 1.1

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for line in (b'{"type": "ADDED", "object": {}}\n', b'{"type": "DELETED", "object": {}}\n'):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def lines_api() -> Iterator[client.ApiClient]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChunkedLines)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}"))
    finally:
        server.shutdown()
        server.server_close()


def test_interrupt_after_close_is_a_no_op(lines_api: client.ApiClient) -> None:
    stream = open_json_lines(lines_api, "/watch", query=[], timeout=5)
    stream.close()
    stream.interrupt()  # urllib3 raises ValueError here


def test_interrupt_after_the_stream_ended_is_a_no_op(lines_api: client.ApiClient) -> None:
    stream = open_json_lines(lines_api, "/watch", query=[], timeout=5)
    assert [event["type"] for event in stream] == ["ADDED", "DELETED"]
    stream.interrupt()  # the connection went back to the pool: urllib3 raises RuntimeError here
    stream.close()


class OneAnswerServer:
    """Answers one request per connection (kept alive, it says) and then closes the connection, as an
    API server's idle timeout would."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    request += chunk
                body = b'{"major": "1"}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)

    def close(self) -> None:
        self._listener.close()


def test_a_kept_alive_connection_the_server_closed_is_not_used_again() -> None:
    server = OneAnswerServer()
    try:
        api = plain_client(server.url)
        for _ in range(3):
            assert request_json(api, "GET", "/version") == {"major": "1"}
        assert server.connections == 3
    finally:
        server.close()


class ClosesFirstServer(OneAnswerServer):
    """Reads the first request and closes the connection without a byte of answer (an idle close racing the
    request), then answers as OneAnswerServer does."""

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        self.connections += 1
        with conn:
            conn.recv(4096)
        super()._serve()


def test_a_get_whose_connection_closed_unanswered_is_sent_once_more() -> None:
    server = ClosesFirstServer()
    try:
        assert request_json(plain_client(server.url), "GET", "/version") == {"major": "1"}
        assert server.connections == 2
    finally:
        server.close()


def test_a_write_whose_connection_closed_unanswered_is_not_repeated() -> None:
    server = ClosesFirstServer()
    try:
        with pytest.raises(KubeApiError, match="ConnectionError"):
            request_json(plain_client(server.url), "POST", "/api/v1/namespaces/default/events", body={"a": 1})
        assert server.connections == 1
    finally:
        server.close()
