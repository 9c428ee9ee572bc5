"""What the multi-node controller needs from the edge: calls on the nodes, name claims, a
barrier. workers.client implements them over Celery and the site's Redis
(NodeDispatcher, RedisBarrier)."""
from __future__ import annotations

from typing import Any, Protocol


class NodeCalls(Protocol):
    def call(self, node: str, op: str, kwargs: dict, *, wait: float) -> Any:
        """Run *op* on *node*'s pool and return its JSON result; a domain error raised there
        is raised here with its class; NodeUnreachable when the node does not answer."""

    def call_each(self, calls: dict[str, dict], op: str, *, wait: float) -> dict:
        """*op* on several nodes at once, each with its kwargs ({node: kwargs}): node ->
        result, or the DrsvcError it ended with."""

    def holder(self, key: str) -> str | None:
        """The node *key* (a client-chosen name) is claimed for, if any."""

    def claim(self, key: str, node: str) -> str:
        """Claim *key* for *node* unless it is claimed already: the holder."""

    def release(self, key: str, node: str) -> None:
        """Drop *key*'s claim if *node* holds it."""

    def bind(self, object_id: str, key: str) -> None:
        """Remember which name's claim *object_id* holds (so a delete can drop it even when
        the node no longer knows the object: a retried delete whose first answer was lost)."""

    def unbind(self, object_id: str) -> str | None:
        """Forget *object_id*'s name; the name key it held, if any."""


class Barrier(Protocol):
    def wait(self) -> None:
        """Arrive, and return once every party has arrived; raise when one is not in time."""
