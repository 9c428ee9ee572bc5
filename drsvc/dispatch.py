"""How the core hands long operations to workers, without importing Celery.

The edge (workers.client) implements :class:`Dispatcher`; tests and the CLI
use the same interface. Results travel as plain dicts so that a domain error
raised in a worker is re-raised, with its class, at the caller.
"""
from __future__ import annotations

from typing import Protocol

from . import errors as E


class Dispatcher(Protocol):
    def run(self, op: str, unit_id: str, kwargs: dict, *, wait: float) -> dict:
        """Start *op* on *unit_id* (or join the identical one in flight) and wait
        up to *wait* seconds. Raises OperationInProgress when it is still running
        or when a different operation holds the unit."""

    def submit(self, op: str, unit_id: str, kwargs: dict) -> str:
        """Queue *op* without waiting; returns a task id."""


def error_to_dict(exc: E.DrsvcError) -> dict:
    return {"ok": False, "error": type(exc).__name__, "message": exc.message}


def raise_from_dict(result: dict) -> dict:
    """Return *result* when it succeeded; else raise the domain error it carries."""
    if result.get("ok", True):
        return result
    cls = getattr(E, result.get("error", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, E.DrsvcError)):
        cls = E.InternalError
    exc = cls.__new__(cls)
    E.DrsvcError.__init__(exc, result.get("message") or "operation failed")
    raise exc
