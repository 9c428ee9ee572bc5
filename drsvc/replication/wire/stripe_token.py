"""The token that ties a striped transaction's channels together (wire protocol 4).

The sender picks it (random, 128 bits) and names it in ``begin``; each stripe channel
repeats it in its ``stripe TOKEN INDEX`` request, and the receiver joins the channels that
name it (``receiver.stripe_join``). On the wire it is 32 hex digits.
"""
from __future__ import annotations

import secrets

from ...errors import ProtocolError


def new_token() -> str:
    return secrets.token_hex(16)


def check_token(token) -> bytes:
    """The token's 16 bytes; ProtocolError for anything that is not 32 hex digits."""
    try:
        raw = bytes.fromhex(token)
    except (TypeError, ValueError):
        raise ProtocolError(reason="a stripe token is 32 hex digits") from None
    if len(raw) != 16:
        raise ProtocolError(reason="a stripe token is 32 hex digits")
    return raw
