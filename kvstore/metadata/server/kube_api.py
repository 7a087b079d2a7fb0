"""The TokenReview call to the Kubernetes API server: is a bearer token valid, for which
audiences, and whose is it. Made with the metadata service's own in-cluster credentials: its
service account's token (read again for every call: the kubelet rotates it) and the cluster CA.

Runs in the metadata service process, on the threads of the review pool (kube_tokens.py): a
call blocks for up to `timeout_s`.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvstore.config import read_secret_file
from kvstore.errors import ConfigError, UnavailableError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
MAX_ANSWER_BYTES = 1 << 20
REFUSED_HINT = (
    "bind the metadata service's service account to the ClusterRole system:auth-delegator "
    "(deploy/README.md)"
)


def in_cluster_url(env: Mapping[str, str]) -> str:
    """The API server as a pod sees it (the kubelet sets both variables in every pod)."""
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    port = env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ConfigError(
            "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are unset (not in a pod?): "
            "set kube_api_url to the API server's https://HOST:PORT"
        )
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def _is_https_origin(url: str) -> bool:
    """https://HOST[:PORT], nothing more."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        return False
    origin = parts.scheme == "https" and bool(parts.hostname) and parts.path in ("", "/")
    return origin and port != 0


@dataclass(frozen=True)
class KubeApi:
    """Where the API server is and how the service proves itself to it."""

    url: str  # https://HOST[:PORT]
    credentials_dir: Path = SERVICE_ACCOUNT_DIR  # holds `token` and `ca.crt`
    timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if not _is_https_origin(self.url):
            raise ConfigError(f"kube_api_url {self.url!r}: expected https://HOST[:PORT]")

    def check(self) -> None:
        """ConfigError unless the service's own token and the cluster CA can be read."""
        read_secret_file(self.credentials_dir / "token", "service account token")
        self._tls()

    def review(self, token: str, audience: str) -> dict:
        """The `status` of a TokenReview of `token` for `audience` (authenticated, user,
        audiences, error). UnavailableError where the API server cannot be reached, does not
        answer in time, or refuses the service itself: the caller must then refuse the token."""
        try:
            own_token = read_secret_file(self.credentials_dir / "token", "service account token")
            tls = self._tls()
        except ConfigError as exc:  # they were there at the start: gone while running
            raise UnavailableError(f"cannot make a TokenReview: {exc}") from None
        body = json.dumps(
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token, "audiences": [audience]},
            }
        ).encode()
        headers = {
            "Authorization": f"Bearer {own_token}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        code, answer = self._post(body, headers, tls)
        return self._status(code, answer)

    def _tls(self) -> ssl.SSLContext:
        try:
            return ssl.create_default_context(cafile=str(self.credentials_dir / "ca.crt"))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot read the cluster CA {self.credentials_dir / 'ca.crt'}: {exc}"
            ) from None

    def _post(self, body: bytes, headers: dict[str, str], tls: ssl.SSLContext) -> tuple[int, bytes]:
        """(HTTP status, body) of the POST; no proxy is used, whatever the environment says."""
        parts = urlsplit(self.url)
        connection = http.client.HTTPSConnection(
            parts.hostname, parts.port or 443, timeout=self.timeout_s, context=tls
        )
        try:
            connection.request("POST", REVIEW_PATH, body, headers)
            response = connection.getresponse()
            return response.status, response.read(MAX_ANSWER_BYTES + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise UnavailableError(
                f"the Kubernetes API server at {self.url} did not answer a TokenReview: {exc}"
            ) from None
        finally:
            connection.close()

    def _status(self, code: int, answer: bytes) -> dict:
        if code in (401, 403):
            raise UnavailableError(
                f"the Kubernetes API server refused this service's TokenReview (HTTP {code}): "
                f"{REFUSED_HINT}"
            )
        if code not in (200, 201):
            raise UnavailableError(f"a TokenReview failed with HTTP {code}: {answer[:200]!r}")
        try:
            status = json.loads(answer[:MAX_ANSWER_BYTES])["status"]
        except (ValueError, KeyError, TypeError):
            status = None
        if not isinstance(status, dict):
            raise UnavailableError("the API server's TokenReview answer has no status object")
        return status
