"""The one table from domain errors to gRPC status codes."""
from __future__ import annotations

import functools
import logging

import grpc

from drsvc import errors as E

log = logging.getLogger(__name__)

# Most specific first: the first matching class wins.
CODE_TABLE: list[tuple[type, grpc.StatusCode]] = [
    (E.BadPageToken, grpc.StatusCode.ABORTED),
    (E.OperationInProgress, grpc.StatusCode.ABORTED),
    (E.InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (E.NotFound, grpc.StatusCode.NOT_FOUND),
    (E.Conflict, grpc.StatusCode.ALREADY_EXISTS),
    (E.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (E.PreconditionFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (E.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (E.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (E.Unsupported, grpc.StatusCode.UNIMPLEMENTED),
    (E.InternalError, grpc.StatusCode.INTERNAL),
    (E.DrsvcError, grpc.StatusCode.INTERNAL),
]


def code_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in CODE_TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def code_for_name(name: str) -> grpc.StatusCode:
    """The code of a domain error known by its class name (a batch's per-unit results)."""
    cls = getattr(E, name, None)
    if not (isinstance(cls, type) and issubclass(cls, E.DrsvcError)):
        return grpc.StatusCode.INTERNAL
    for known, code in CODE_TABLE:
        if issubclass(cls, known):
            return code
    return grpc.StatusCode.INTERNAL


def rpc(method):
    """Turn domain errors into a gRPC status; never let an RPC crash the server."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except E.DrsvcError as e:
            code = code_for(e)
            if code == grpc.StatusCode.INTERNAL:
                log.error("%s failed: %s", method.__name__, e)
            context.abort(code, e.message)
        except Exception as e:  # noqa: BLE001 - the server must answer, not die
            if isinstance(e, grpc.RpcError) or type(e).__name__ == "_AbortError" or context.code() is not None:
                raise
            log.exception("%s: unexpected error", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
    return wrapper
