"""Where the API server is and how to authenticate: the kubeconfig fields the driver reads, the pod's
service account, a rotating token, and the refusals that name what to fix."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from driver.kubeletplugin.kubeconfig import ClusterAccess, KubeConfigError, TokenFile, load_access


def kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> str:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    return str(path)


def test_server_and_token_from_the_current_context(tmp_path: Path) -> None:
    access = load_access(kubeconfig(tmp_path / "kc", {"server": "http://127.0.0.1:8001/"}, {"token": "t0"}))
    assert (access.server, access.token()) == ("http://127.0.0.1:8001", "t0")


def test_a_token_file_is_relative_to_the_kubeconfig_and_read_again_when_it_rotates(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("first\n")
    access = load_access(kubeconfig(tmp_path / "kc", {"server": "https://api:6443", "insecure-skip-tls-verify": True},
                                    {"tokenFile": "token"}))
    assert access.token() == "first"
    now = [0.0]
    rotating = TokenFile(tmp_path / "token", reread_s=60, clock=lambda: now[0])
    (tmp_path / "token").write_text("second\n")  # the kubelet rotated the projected token
    now[0] = 59.0
    assert rotating() == "first", "read again only once a minute"
    now[0] = 60.0
    assert rotating() == "second"
    (tmp_path / "token").unlink()
    now[0] = 120.0
    assert rotating() == "second", "a token file that cannot be read keeps the last token"


def test_in_cluster_access_uses_the_service_account(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token")
    access = load_access(None, {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"},
                         service_account_dir=tmp_path)
    assert (access.server, access.token(), access.ca_file) == ("https://[fd00::1]:443", "sa-token",
                                                               tmp_path / "ca.crt")


@pytest.mark.parametrize(("cluster", "user", "message"), [
    ({"server": "https://api"}, {"exec": {"command": "aws"}}, "'exec' are not supported"),
    ({"server": "https://api"}, {"auth-provider": {"name": "gcp"}}, "'auth-provider' are not supported"),
    ({"server": "ftp://api"}, {}, "is not an http(s) URL"),
    ({"server": "https://api", "tls-server-name": "x"}, {}, "tls-server-name is not supported"),
    ({"server": "https://api", "insecure-skip-tls-verify": True}, {"client-certificate-data": "eA=="},
     "needs its key"),
    ({"server": "https://api"}, {"client-key-data": "not base64!"}, "client-key-data is not base64"),
])
def test_what_cannot_be_used_is_refused_naming_it(tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any],
                                                  message: str) -> None:
    with pytest.raises(KubeConfigError, match=r"cannot use kubeconfig .*" + message.replace("(", r"\(").replace(
            ")", r"\)")):
        load_access(kubeconfig(tmp_path / "kc", cluster, user))


def test_a_missing_context_or_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kc"
    path.write_text(json.dumps({"current-context": "nope", "contexts": []}))
    with pytest.raises(KubeConfigError, match="no context named 'nope'"):
        load_access(str(path))
    with pytest.raises(KubeConfigError, match=r"cannot use kubeconfig .*missing"):
        load_access(str(tmp_path / "missing"))
    with pytest.raises(KubeConfigError, match="no kubeconfig given and not running in a pod"):
        load_access(None, {})


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_a_client_certificate_given_inline_is_loaded(tmp_path: Path) -> None:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    cert, key = (tmp_path / "cert.pem").read_bytes(), (tmp_path / "key.pem").read_bytes()
    access = load_access(kubeconfig(tmp_path / "kc", {
        "server": "https://api:6443", "certificate-authority-data": base64.b64encode(cert).decode()}, {
        "client-certificate-data": base64.b64encode(cert).decode(),
        "client-key-data": base64.b64encode(key).decode()}))
    assert isinstance(access.ssl_context(), ssl.SSLContext)
    with pytest.raises(KubeConfigError, match="cannot use kubeconfig"):
        load_access(kubeconfig(tmp_path / "kc2", {"server": "https://api:6443"}, {
            "client-certificate-data": base64.b64encode(key).decode(),  # a key where the certificate goes
            "client-key-data": base64.b64encode(key).decode()}))


def test_plain_access_needs_no_tls(tmp_path: Path) -> None:
    assert ClusterAccess(server="http://127.0.0.1:1", token=lambda: None).token() is None
