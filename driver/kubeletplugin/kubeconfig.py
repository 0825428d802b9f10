"""Where the API server is and how to authenticate to it: a kubeconfig file, or the pod's service account.

Only what a node plugin uses is read: the current context's cluster (``server``, its CA,
``insecure-skip-tls-verify``) and user (a bearer ``token`` or ``tokenFile``, or a client certificate and key,
inline or as files). Credential plugins (``exec``, ``auth-provider``) are refused with a message: the driver
runs in the cluster with its service account, and a kubeconfig is for development and tests. Loading it
here, rather than through the ``kubernetes`` package, keeps that package (~0.45 s of CPU and ~35 MiB to
import) off the driver's path; docs/benchmarks.md.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The kubelet rotates projected service-account tokens well before they expire; re-reading the file
# once a minute is what client-go and the kubernetes Python client do.
TOKEN_REREAD_S = 60.0


class KubeConfigError(Exception):
    """Neither a kubeconfig file nor the in-cluster service account could be used."""


class TokenFile:
    """A bearer token read from a file and read again at most every ``reread_s`` (rotated tokens)."""

    def __init__(self, path: Path, reread_s: float = TOKEN_REREAD_S, clock: Callable[[], float] = time.monotonic):
        self._path = path
        self._reread_s = reread_s
        self._clock = clock
        self._lock = threading.Lock()
        self._token = self._read()
        self._read_at = clock()

    def _read(self) -> str:
        return self._path.read_text().strip()

    def __call__(self) -> str:
        with self._lock:
            if self._clock() - self._read_at >= self._reread_s:
                # A failed read keeps the last token; the server says so if it expired.
                with contextlib.suppress(OSError):
                    self._token = self._read()
                self._read_at = self._clock()
            return self._token


@dataclass(frozen=True)
class ClusterAccess:
    """The API server's URL and what a request needs to reach it: TLS settings and the bearer token."""

    server: str  # scheme://host[:port][/path], without a trailing slash
    token: Callable[[], str | None]
    ca_file: Path | None = None
    ca_data: str | None = None  # PEM
    client_cert_pem: bytes | None = None
    client_key_pem: bytes | None = None
    insecure: bool = False

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context for ``https`` servers: the cluster's CA (or the system's), the client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None, cadata=self.ca_data)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.client_cert_pem is not None and self.client_key_pem is not None:
            _load_cert_chain(context, self.client_cert_pem, self.client_key_pem)
        return context


def _static(token: str | None) -> Callable[[], str | None]:
    return lambda: token


def load_access(kubeconfig: str | None, environ: Mapping[str, str] | None = None,
                service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> ClusterAccess:
    """From the kubeconfig file if one is given, else from the pod's service account; KubeConfigError says why not."""
    if kubeconfig:
        try:
            return _from_kubeconfig(Path(kubeconfig))
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError, ssl.SSLError) as err:
            raise KubeConfigError(f"cannot use kubeconfig {kubeconfig}: {err}") from err
    env = os.environ if environ is None else environ
    try:
        return _in_cluster(env, service_account_dir)
    except (OSError, ValueError) as err:
        raise KubeConfigError(
            "no kubeconfig given and not running in a pod with a service account "
            f"({err}); pass --kubeconfig or run the driver in the cluster") from err


def _in_cluster(env: Mapping[str, str], directory: Path) -> ClusterAccess:
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ValueError("KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
    token = TokenFile(directory / "token")
    if ":" in host:  # an IPv6 service address
        host = f"[{host}]"
    return ClusterAccess(server=f"https://{host}:{port}", token=token, ca_file=directory / "ca.crt")


def _named(entries: Any, name: str, what: str) -> dict[str, Any]:
    for entry in entries or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(what)
            return body if isinstance(body, dict) else {}
    raise ValueError(f"no {what} named {name!r}")


def _from_kubeconfig(path: Path) -> ClusterAccess:
    config = yaml.safe_load(path.read_text())
    if not isinstance(config, dict):
        raise ValueError("not a kubeconfig (expected a mapping)")
    current = config.get("current-context")
    if not current:
        raise ValueError("no current-context")
    context = _named(config.get("contexts"), current, "context")
    cluster = _named(config.get("clusters"), str(context.get("cluster", "")), "cluster")
    user = _named(config.get("users"), str(context.get("user", "")), "user") if context.get("user") else {}
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise ValueError(f"cluster server {server!r} is not an http(s) URL")
    for unsupported in ("exec", "auth-provider"):
        if user.get(unsupported):
            raise ValueError(f"user credentials through {unsupported!r} are not supported; use a token or a "
                             "client certificate (the driver runs in the cluster with its service account)")
    if cluster.get("tls-server-name"):
        raise ValueError("tls-server-name is not supported; name the server as its certificate does")
    base = path.parent

    def file(section: dict[str, Any], key: str) -> Path | None:
        value = section.get(key)
        return (base / str(value)) if value else None  # relative paths are relative to the kubeconfig

    def inline(section: dict[str, Any], key: str) -> bytes | None:
        value = section.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(str(value), validate=True)
        except binascii.Error as err:
            raise ValueError(f"{key} is not base64: {err}") from err

    token_file = file(user, "tokenFile")
    token: Callable[[], str | None] = (TokenFile(token_file) if token_file and not user.get("token")
                                       else _static(str(user["token"]) if user.get("token") else None))
    ca_data = inline(cluster, "certificate-authority-data")
    cert = inline(user, "client-certificate-data")
    key = inline(user, "client-key-data")
    cert_file, key_file = file(user, "client-certificate"), file(user, "client-key")
    if cert is None and cert_file is not None:
        cert = cert_file.read_bytes()
    if key is None and key_file is not None:
        key = key_file.read_bytes()
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    access = ClusterAccess(
        server=server, token=token, ca_file=file(cluster, "certificate-authority"),
        ca_data=ca_data.decode() if ca_data else None, client_cert_pem=cert, client_key_pem=key,
        insecure=bool(cluster.get("insecure-skip-tls-verify")))
    if server.startswith("https://"):
        access.ssl_context()  # a bad CA or key is a configuration error now, not at the first request
    return access


def _load_cert_chain(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """``ssl`` loads certificates only from files: a private temporary file, removed once loaded."""
    with tempfile.TemporaryDirectory(prefix="kubeclient-") as directory:
        cert_path, key_path = Path(directory) / "client.crt", Path(directory) / "client.key"
        for target, data in ((cert_path, cert_pem), (key_path, key_pem)):
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
        context.load_cert_chain(str(cert_path), str(key_path))
