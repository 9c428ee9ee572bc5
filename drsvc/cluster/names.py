"""Client-chosen names on a site of several nodes: claimed for one node in the site's Redis
before the node creates anything, so a retried create lands on the node that holds the
first attempt's object, whatever placement says by then."""
from __future__ import annotations

from collections.abc import Callable

from ..errors import Conflict, DrsvcError, NodeUnreachable
from .routing import Router


def dig(doc: dict, path: str):
    """doc['a']['b'] for path 'a.b'."""
    for part in path.split("."):
        doc = doc[part]
    return doc


class NameClaims:
    """A named object: its name claimed for a node, made there, remembered by id."""

    def __init__(self, router: Router):
        self.router = router
        self.calls = router.calls

    def claim(self, key: str, choose: Callable[[], str]) -> tuple[str, bool]:
        """(the node *key* is claimed for, whether this call claimed it). A retry goes where
        the first attempt went; *choose* picks the node only for a name not yet claimed."""
        holder = self.calls.holder(key)
        if holder is not None:
            return holder, False
        chosen = choose()
        holder = self.calls.claim(key, chosen)
        return holder, holder == chosen

    def make(self, key: str, holder: str, made: bool, op: str, kwargs: dict, id_field: str) -> dict:
        """Run the create *op* on *holder*; *made*: this call claimed the name. A failure that
        created nothing lets the name go (a retry may place it afresh); a conflict or a node
        that did not answer keeps it with its node (a retry must find its object there).
        The new object's id remembers its name's key, for the delete."""
        try:
            doc = self.router.call(holder, op, kwargs)
        except (Conflict, NodeUnreachable):
            raise
        except DrsvcError:
            if made:
                self.calls.release(key, holder)
            raise
        self.calls.bind(dig(doc, id_field), key)
        return doc

    def unmake(self, node: str, op: str, id_field: str, object_id: str) -> None:
        """Run the delete *op*, then drop the name's claim: by the key the node names, or,
        when the node no longer knows the object (a retry whose first answer was lost), by
        the key its id remembers."""
        key = self.router.call(node, op, {id_field: object_id})
        key = self.calls.unbind(object_id) or key
        if key:
            self.calls.release(key, node)
