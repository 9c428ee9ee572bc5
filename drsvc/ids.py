"""Identifier and name validation: nothing a client sends may address a path.

IDs drsvc generates are short, ASCII and safe as file names. Client-chosen
names (CSI ``name``) are never used as paths; they are hashed into the
name index.
"""
from __future__ import annotations

import re

from .errors import InvalidName, InvalidParameter, MissingField

MAX_STRING = 128          # CSI: string fields are at most 128 bytes
MAX_MAP = 4096            # CSI: map fields are at most 4 KiB in total
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_id(value: str, what: str = "volume_id") -> str:
    if not value:
        raise MissingField(field=what)
    if len(value.encode()) > MAX_STRING:
        raise InvalidName(what=what, value=value[:40] + "...", reason=f"longer than {MAX_STRING} bytes")
    # fullmatch: with match, '$' would also accept a trailing newline
    if not _ID.fullmatch(value) or value in (".", "..") or ".." in value:
        raise InvalidName(what=what, value=value, reason="only letters, digits, '.', '_' and '-' are allowed")
    return value


def check_name(value: str, what: str = "name") -> str:
    if not value:
        raise MissingField(field=what)
    if len(value.encode()) > MAX_STRING:
        raise InvalidName(what=what, value=value[:40] + "...", reason=f"longer than {MAX_STRING} bytes")
    if any(ord(c) < 32 for c in value):
        raise InvalidName(what=what, value=value, reason="control characters are not allowed")
    return value


def check_map(values: dict, what: str) -> dict:
    size = sum(len(k.encode()) + len(v.encode()) for k, v in values.items())
    if size > MAX_MAP:
        raise InvalidParameter(key=what, reason=f"{size} bytes exceeds the {MAX_MAP}-byte limit")
    return values


def name_key(kind: str, name: str) -> str:
    """A file-safe key for a client-chosen name."""
    import hashlib      # here, not at the top: the receiver imports this module and never needs it
    return f"{kind}-" + hashlib.sha256(name.encode()).hexdigest()[:40]


def new_id(prefix: str) -> str:
    import secrets      # as name_key's hashlib
    return f"{prefix}-{secrets.token_hex(12)}"
