"""Agent tokens bound to one node: Kubernetes projected service-account tokens (audience
`kvstore`), verified by a TokenReview (kube_api.py), each acting as the one node id its pod
names: the node's name for DaemonSet agents, the pod's own name for sidecar agents.

Runs in the metadata service process, on the gRPC loop; reviews block, so they run on a small
pool of their own, one per distinct token at a time. A verdict is cached for CACHE_S at most
(never past the token's expiry), so lookups make no review; a review that cannot be made
refuses the call with UNAVAILABLE: it never lets a token through.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstore.errors import AuthError, ConfigError, PermissionDeniedError, UnavailableError
from kvstore.metadata.server.auth import ALL_TENANTS, TenantScope
from kvstore.metadata.server.kube_api import KubeApi

AUDIENCE = "kvstore"
NODE_NAME = "authentication.kubernetes.io/node-name"  # set in pod-bound tokens, Kubernetes 1.30+
POD_NAME = "authentication.kubernetes.io/pod-name"
CACHE_S = 60.0  # a verified token is trusted this long without another review
REFUSAL_CACHE_S = 10.0  # a refused one is refused this long without another review
MAX_CACHED = 16_384  # verdicts kept; the oldest go first
MAX_REVIEWS = 64  # distinct tokens under review at once; more are refused with UNAVAILABLE
REVIEW_THREADS = 4
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def service_account_user(account: str, setting: str) -> str:
    """'NAMESPACE/NAME' -> the user name its tokens review as; ConfigError where malformed."""
    namespace, _, name = account.partition("/")
    if not (_DNS_LABEL.fullmatch(namespace) and _DNS_SUBDOMAIN.fullmatch(name)):
        raise ConfigError(f"{setting} {account!r}: expected NAMESPACE/NAME of a service account")
    return f"system:serviceaccount:{namespace}:{name}"


def agent_bindings(agent_account: str, sidecar_account: str) -> dict[str, str]:
    """The agents' service accounts ('NAMESPACE/NAME', "" for none) as the user names their
    tokens review as -> the `extra` naming the node id those tokens act as."""
    bindings = {}
    if agent_account:
        bindings[service_account_user(agent_account, "kube_agent_service_account")] = NODE_NAME
    if sidecar_account:
        user = service_account_user(sidecar_account, "kube_sidecar_service_account")
        if user in bindings:
            raise ConfigError(
                "kube_agent_service_account and kube_sidecar_service_account must differ: a "
                "sidecar could otherwise act as its node's agent"
            )
        bindings[user] = POD_NAME
    return bindings


@dataclass(frozen=True)
class _Verdict:
    scope: TenantScope | None
    refusal: AuthError | None
    until: float  # time.monotonic()

    def scope_or_raise(self) -> TenantScope:
        if self.refusal is not None:
            raise type(self.refusal)(str(self.refusal))
        return self.scope


class KubeAgentTokens:
    """Projected tokens of the agents' service accounts, as the scope of the node they act as."""

    def __init__(self, api: KubeApi, bindings: dict[str, str]) -> None:
        """`bindings`: a service account's user name (`service_account_user`) -> the `extra`
        of its reviewed tokens that names the node id they act as (NODE_NAME or POD_NAME)."""
        self.api = api
        self.bindings = bindings
        self._verdicts: dict[bytes, _Verdict] = {}  # by the token's SHA-256
        self._pending: dict[bytes, asyncio.Future] = {}
        self._pool = ThreadPoolExecutor(REVIEW_THREADS, thread_name_prefix="token-review")

    def cached(self, token: bytes) -> TenantScope | None:
        """The scope of a token reviewed lately; None: it needs a review (`scope`). A token
        refused lately raises its refusal again."""
        return self._cached(hashlib.sha256(token).digest())

    async def scope(self, token: bytes) -> TenantScope:
        """The token's scope: cached, or reviewed now (callers of one token share a review).
        AuthError where it is refused; UnavailableError where it cannot be reviewed."""
        digest = hashlib.sha256(token).digest()
        scope = self._cached(digest)
        if scope is not None:
            return scope
        review = self._pending.get(digest)
        if review is None:
            expires_at = _expiry(token)  # refused here: not even worth a review
            if len(self._pending) >= MAX_REVIEWS:
                raise UnavailableError(
                    f"{MAX_REVIEWS} agent tokens are under review already; try again shortly"
                )
            review = asyncio.ensure_future(self._review(digest, token, expires_at))
            self._pending[digest] = review
            review.add_done_callback(lambda done: self._settled(digest, done))
        return await asyncio.shield(review)  # a caller that gives up leaves it to the others

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _cached(self, digest: bytes) -> TenantScope | None:
        verdict = self._verdicts.get(digest)
        if verdict is None or verdict.until <= time.monotonic():
            return None
        return verdict.scope_or_raise()

    def _settled(self, digest: bytes, review: asyncio.Future) -> None:
        self._pending.pop(digest, None)
        if not review.cancelled():
            review.exception()  # retrieved, even where every caller gave up

    async def _review(self, digest: bytes, token: bytes, expires_at: float) -> TenantScope:
        loop = asyncio.get_running_loop()
        status = await loop.run_in_executor(self._pool, self.api.review, token.decode(), AUDIENCE)
        try:
            scope = self._scope_of(status)
        except AuthError as exc:
            self._remember(digest, _Verdict(None, exc, time.monotonic() + REFUSAL_CACHE_S))
            raise
        trusted_s = min(CACHE_S, expires_at - time.time())
        self._remember(digest, _Verdict(scope, None, time.monotonic() + trusted_s))
        return scope

    def _scope_of(self, status: dict) -> TenantScope:
        """What a review's status lets the token do; AuthError where it may do nothing."""
        if status.get("authenticated") is not True:
            reason = status.get("error") or "the API server did not authenticate it"
            raise AuthError(f"the agent token is not valid: {reason}")
        audiences = status.get("audiences")
        if not isinstance(audiences, list) or AUDIENCE not in audiences:
            raise AuthError(f"the agent token is not valid for audience {AUDIENCE!r}")
        user = status.get("user") if isinstance(status.get("user"), dict) else {}
        username = user.get("username")
        binding = self.bindings.get(username) if isinstance(username, str) else None
        if binding is None:
            raise PermissionDeniedError(
                f"{username!r} is not a kvstore agent's service account ({sorted(self.bindings)})"
            )
        extra = user.get("extra") if isinstance(user.get("extra"), dict) else {}
        node_id = _single_name(extra.get(binding))
        if not node_id:
            raise AuthError(
                f"the token of {username} names no {binding}: agents need a projected token "
                "bound to their pod (Kubernetes 1.30 or later)"
            )
        return TenantScope(ALL_TENANTS, node=node_id)

    def _remember(self, digest: bytes, verdict: _Verdict) -> None:
        if len(self._verdicts) >= MAX_CACHED:
            now = time.monotonic()
            self._verdicts = {d: v for d, v in self._verdicts.items() if v.until > now}
        while len(self._verdicts) >= MAX_CACHED:
            del self._verdicts[next(iter(self._verdicts))]
        self._verdicts.pop(digest, None)
        self._verdicts[digest] = verdict


def _single_name(values: object) -> str:
    """The one name of an `extra` entry (a list); "" where it holds not exactly one."""
    if isinstance(values, list) and len(values) == 1 and isinstance(values[0], str):
        return values[0]
    return ""


def _expiry(token: bytes) -> float:
    """The `exp` of a JWT meant for AUDIENCE and not yet expired, read without verifying it
    (the review verifies it); AuthError, with no review, for anything else."""
    try:
        token.decode("ascii")
        payload = token.split(b".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4)))
        audiences = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        expires_at = float(claims["exp"])
    except (IndexError, KeyError, TypeError, ValueError, binascii.Error):
        raise AuthError("the bearer token is not valid") from None
    if AUDIENCE not in audiences:
        raise AuthError(f"the bearer token is not valid (not a token for audience {AUDIENCE!r})")
    if expires_at <= time.time():
        raise AuthError("the agent token has expired")
    return expires_at
