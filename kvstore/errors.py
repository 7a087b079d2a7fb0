"""The exception tree of kvstore: one base, one class per category of failure.

Shared by every process. A miss is never an exception (lookups return counts); these are for
misuse, exhaustion and broken transports. The gRPC layer maps each class to one status code.
"""


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A setting or argument is invalid; the message says what to change."""


class CapacityError(KVStoreError):
    """A tier has no free page and nothing in it may be evicted (all pinned or reserved)."""


class NotFoundError(KVStoreError, KeyError):
    """A named object (a reserved key, a node, a segment) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class ChecksumError(KVStoreError):
    """Stored or received bytes do not match their checksum or header: treat as a miss."""


class TransferError(KVStoreError):
    """Moving bytes between processes or nodes failed part-way."""


class UnavailableError(KVStoreError):
    """A service or peer cannot be reached right now; retrying later may succeed."""


class LeaseError(KVStoreError):
    """A node's lease is unknown to the caller's lease id or has expired: register again."""


class QuotaExceededError(CapacityError):
    """A tenant has reached its quota of published keys."""


class AuthError(KVStoreError):
    """The caller's credentials are missing, wrong, or not allowed to act for this tenant."""


class PermissionDeniedError(AuthError):
    """The caller is authenticated but may not act for the tenant it named."""
