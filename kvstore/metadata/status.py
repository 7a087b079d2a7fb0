"""The one mapping between kvstore's errors and gRPC status codes, for services and clients.

Imported by the metadata service, its client and the node agent's control socket (in whichever
process runs them).
"""

from __future__ import annotations

import grpc

from kvstore import errors

# the trailing metadata of a call refused for want of a stream slot (server/slots.py sends it;
# RESOURCE_EXHAUSTED has other causes)
REFUSED_A_SLOT = ("kvstore-refused", "stream-slots")

# Most specific first: the first matching class wins.
STATUS_FOR: list[tuple[type[Exception], grpc.StatusCode]] = [
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.LeaseError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.ChecksumError, grpc.StatusCode.DATA_LOSS),
    (errors.KVStoreError, grpc.StatusCode.INTERNAL),
]


def status_for(exc: Exception) -> grpc.StatusCode:
    """The status of an error; socket errors (a peer too slow, or gone) map too."""
    for cls, code in STATUS_FOR:
        if isinstance(exc, cls):
            return code
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, OSError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


_ERROR_FOR = {code: cls for cls, code in reversed(STATUS_FOR)}
_ERROR_FOR[grpc.StatusCode.UNAVAILABLE] = errors.UnavailableError
_ERROR_FOR[grpc.StatusCode.DEADLINE_EXCEEDED] = errors.UnavailableError


def error_for(code: grpc.StatusCode, details: str) -> errors.KVStoreError:
    """The kvstore error a client raises for a call that ended with `code`."""
    return _ERROR_FOR.get(code, errors.KVStoreError)(f"{code.name}: {details}")


_CODES = {code.value[0]: code for code in grpc.StatusCode}  # a status's number -> the code


def lookup_answer(answer) -> object:
    """A LookupStreamResponse's LookupResponse; its error where it carries a status."""
    if answer.status_code:
        code = _CODES.get(answer.status_code, grpc.StatusCode.UNKNOWN)
        raise error_for(code, answer.status_message)
    return answer.response
