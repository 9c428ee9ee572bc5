"""The protocol between the sender and the receiver (docs/design/wire-protocol.md).

- ``frames``: framing, pure encode/decode: control messages, record headers and payload
  codecs, hash frames, the manifest chain, the versions this release speaks;
- ``stripe_token``: the token that ties a striped transaction's channels together.

May import ``common`` only. Nothing here does I/O.
"""
from __future__ import annotations

from ..common.exports import lazy_exports

_EXPORTS = {"VERSION": "frames", "SUPPORTED_VERSIONS": "frames"}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
