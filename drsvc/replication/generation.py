"""A generation prepared for sending: its directory and its ``meta.json``.

The one type the sender's rooms hand each other (the driver's ``Attempt``, the
steps, prepare, the snapshot store, stream). A leaf: it imports nothing of the
engine.

    snap/tmp-<txid>/   being captured and planned (ours alone; swept at the next sync)
    snap/<G+1>/        the intent: this generation may be on the wire
    snap/<G>/          the acked base
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Prepared:
    dir: Path
    meta: dict

    def member_file(self, member: dict) -> Path:
        """The file a member's records are read from: its overlay, or its whole image."""
        vol = member["volume_id"]
        if member.get("overlay") and not (self.dir / f"{vol}.img").exists():
            return self.dir / f"{vol}.delta"
        return self.dir / f"{vol}.img"
