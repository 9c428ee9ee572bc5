"""Offset-token paging shared by every List RPC."""
from __future__ import annotations

from .errors import BadPageToken, InvalidInput
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
