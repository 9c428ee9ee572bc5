"""Paging shared by every List RPC.

``paginate``: offset tokens over a list the caller built whole (small listings).
``page_by_number``: a unit's recovery points, by generation (the token: the last one listed).
``page_by_id``: the listings that grow with the site (volumes, snapshots): the token is the
last id of the previous page, and a page reads the records of its own ids only, from the
sorted names of their directory. A record created during a walk is listed when its id sorts
after the token, and not when it sorts before (ids are random: the spec allows a walk to miss
it, never to list one twice).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

from .errors import BadPageToken, DrsvcError, InvalidInput
from .ids import check_id
from .model import Page


def paginate(items: list, max_entries: int, token: str) -> Page:
    if max_entries < 0:
        raise InvalidInput("max_entries must not be negative")
    start = 0
    if token:
        if not (token.isascii() and token.isdigit()) or int(token) > len(items):
            raise BadPageToken(token=token[:64])
        start = int(token)
    end = len(items) if max_entries == 0 else min(len(items), start + max_entries)
    return Page(items[start:end], str(end) if end < len(items) else "")


def check_id_token(token: str, marker: str) -> None:
    """A page token must be an id of the listing's kind (it holds *marker*, e.g. "vol-"):
    anything else is a token this plugin never gave (CSI: ABORTED)."""
    try:
        check_id(token)
    except DrsvcError:
        raise BadPageToken(token=token[:64]) from None
    if marker not in token:
        raise BadPageToken(token=token[:64])


def page_by_id(ids: list[str], max_entries: int, token: str, load: Callable[[str], object | None], *,
               marker: str) -> Page:
    """At most *max_entries* (0: all) items of the sorted *ids* after *token*; *load* makes an
    item of an id (None: not listed, e.g. not ready). The next token is the page's last id."""
    if max_entries < 0:
        raise InvalidInput("max_entries must not be negative")
    start = 0
    if token:
        check_id_token(token, marker)
        start = bisect.bisect_right(ids, token)
    items: list = []
    last = ""
    for ident in ids[start:]:
        if max_entries and len(items) == max_entries:
            return Page(items, last)
        item = load(ident)
        if item is not None:
            items.append(item)
            last = ident
    return Page(items, "")


def page_by_number(items: list, number: Callable[[object], int], max_entries: int, token: str) -> Page:
    """At most *max_entries* (0: all) of *items* (ascending by *number*, e.g. a point's
    generation) after the one numbered *token*; the next token is the page's last number."""
    if max_entries < 0:
        raise InvalidInput("max_entries must not be negative")
    keys = [number(i) for i in items]
    start = 0
    if token:
        if not (token.isascii() and token.isdigit()) or len(token) > 19:
            raise BadPageToken(token=token[:64])
        start = bisect.bisect_right(keys, int(token))
    end = len(items) if not max_entries else min(len(items), start + max_entries)
    return Page(items[start:end], str(keys[end - 1]) if end < len(items) else "")
