"""A loopback stand-in for kube-apiserver's TokenReview endpoint, over HTTPS with a CA made for
the test: it issues projected service-account tokens (JWTs it alone knows) and reviews them as
kube-apiserver 1.30+ does, recording every request it is sent.

Not a real API server (none can run here): it answers in the API's wire format, with the
semantics kvstore relies on (audiences intersected, the pod's node and name in `extra`).
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.metadata.certs import write_tls_files

REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
OWN_TOKEN = "metadata-service-own-token"  # the metadata service's own service-account token
NAMESPACE = "kvstore"
AGENTS = "kv-agent"  # the agents' service account
SIDECARS = "kv-sidecar"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class Issued:
    account: str  # NAMESPACE/NAME
    audiences: list[str]
    expires_at: float
    node: str | None  # None: not bound to a pod (a legacy Secret-based token)
    pod: str | None


@dataclass
class ApiServer:
    """The stand-in's state; the handler reads and records through it."""

    issued: dict[str, Issued] = field(default_factory=dict)
    requests: list[dict] = field(default_factory=list)  # {"path", "authorization", "body"}
    refuse_with: int = 0  # answer every review with this HTTP status (401/403/500)
    audience_agnostic: bool = False  # answer with no `audiences` (an authenticator that has none)
    delay_s: float = 0.0  # before each answer
    lock: threading.Lock = field(default_factory=threading.Lock)

    def issue(
        self,
        node: str | None = "node-a",
        pod: str | None = "kv-node-x1",
        account: str = f"{NAMESPACE}/{AGENTS}",
        audiences=("kvstore",),
        ttl_s: float = 3600,
    ) -> str:
        """A projected token as the kubelet would get it for a pod on `node`."""
        namespace, name = account.split("/")
        expires_at = time.time() + ttl_s
        claims = {
            "aud": list(audiences),
            "exp": int(expires_at),
            "iat": int(time.time()),
            "iss": "https://kubernetes.default.svc.cluster.local",
            "sub": f"system:serviceaccount:{namespace}:{name}",
            "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": name}},
        }
        if node is not None:
            claims["kubernetes.io"]["node"] = {"name": node, "uid": secrets.token_hex(8)}
            claims["kubernetes.io"]["pod"] = {"name": pod, "uid": secrets.token_hex(8)}
        header = {"alg": "RS256", "kid": "test"}
        token = ".".join(
            [
                _b64(json.dumps(header).encode()),
                _b64(json.dumps(claims).encode()),
                _b64(secrets.token_bytes(64)),
            ]
        )
        self.issued[token] = Issued(account, list(audiences), expires_at, node, pod)
        return token

    def reviews(self) -> list[dict]:
        with self.lock:
            return [r for r in self.requests if r["path"] == REVIEW_PATH]

    def status_of(self, token: str, audiences: list[str]) -> dict:
        """A review's status, as kube-apiserver computes it for a service-account token."""
        issued = self.issued.get(token)
        if issued is None or issued.expires_at <= time.time():
            return {
                "user": {},
                "error": "[invalid bearer token, square/go-jose: error in cryptographic primitive]",
            }
        shared = [a for a in audiences if a in issued.audiences]
        if not shared:
            return {
                "user": {},
                "error": "[invalid bearer token, token audiences "
                f"{issued.audiences} is invalid for the target audiences {audiences}]",
            }
        namespace, name = issued.account.split("/")
        user = {
            "username": f"system:serviceaccount:{namespace}:{name}",
            "uid": "d4c8a2e6",
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace}",
                "system:authenticated",
            ],
        }
        if issued.node is not None:
            user["extra"] = {
                "authentication.kubernetes.io/credential-id": ["JTI=" + token[-12:]],
                "authentication.kubernetes.io/node-name": [issued.node],
                "authentication.kubernetes.io/node-uid": ["0f1e2d3c"],
                "authentication.kubernetes.io/pod-name": [issued.pod],
                "authentication.kubernetes.io/pod-uid": ["4b5a6978"],
            }
        status = {"authenticated": True, "user": user, "audiences": shared}
        if self.audience_agnostic:
            del status["audiences"]
        return status


class _Handler(BaseHTTPRequestHandler):
    server_version = "kube-apiserver-stand-in"

    def do_POST(self) -> None:
        api: ApiServer = self.server.api
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with api.lock:
            api.requests.append(
                {
                    "path": self.path,
                    "authorization": self.headers.get("Authorization"),
                    "body": json.loads(body),
                }
            )
        time.sleep(api.delay_s)
        if self.headers.get("Authorization") != f"Bearer {OWN_TOKEN}":
            return self._answer(401, {"kind": "Status", "reason": "Unauthorized", "code": 401})
        if api.refuse_with:
            return self._answer(api.refuse_with, {"kind": "Status", "code": api.refuse_with})
        if self.path != REVIEW_PATH:
            return self._answer(404, {"kind": "Status", "code": 404})
        review = json.loads(body)
        spec = review["spec"]
        status = api.status_of(spec["token"], spec.get("audiences") or ["https://kubernetes"])
        answer = {
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }
        self._answer(201, answer)

    def _answer(self, code: int, document: dict) -> None:
        data = json.dumps(document).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # quiet
        pass


@dataclass
class StandIn:
    """A running stand-in: where it listens, the service's own credentials as a pod mounts
    them (`token`, `ca.crt`), its state."""

    url: str
    credentials_dir: Path
    api: ApiServer
    http: ThreadingHTTPServer

    def stop(self) -> None:
        """Stop answering and close the port (an API server that is down)."""
        self.http.shutdown()
        self.http.server_close()


@contextmanager
def running_apiserver(tmp_path: Path) -> Iterator[StandIn]:
    tls = write_tls_files(tmp_path)
    credentials_dir = tmp_path / "serviceaccount"
    credentials_dir.mkdir()
    (credentials_dir / "token").write_text(OWN_TOKEN)
    (credentials_dir / "ca.crt").write_bytes(tls["ca"].read_bytes())
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls["cert"], tls["key"])
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    http.socket = context.wrap_socket(http.socket, server_side=True)
    http.api = ApiServer()
    threading.Thread(target=http.serve_forever, daemon=True).start()
    stand_in = StandIn(
        f"https://127.0.0.1:{http.server_address[1]}", credentials_dir, http.api, http
    )
    try:
        yield stand_in
    finally:
        if http.socket.fileno() != -1:
            stand_in.stop()
