"""Pool paths for replication, built only from validated IDs.

    POOL/images/<volume_id>.img                 the volume (or replica) image
    POOL/replication/<unit_id>/state.json       UnitState (drsvc.replication.state)
    POOL/replication/<unit_id>/snap/<gen>/      sender: reflink snapshots + block maps
    POOL/replication/<unit_id>/journal/         receiver: the open transaction
"""
from __future__ import annotations

from pathlib import Path

from .. import ids
from ..errors import InvalidName


def check_id(value, what: str = "unit id") -> str:
    """Return *value* when it is a safe single path component, else raise InvalidName."""
    if not isinstance(value, str) or not value:
        raise InvalidName(what=what, value=value, reason="must be a non-empty string")
    return ids.check_id(value, what)


class PoolLayout:
    def __init__(self, root):
        self.root = Path(root)

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def replication(self) -> Path:
        return self.root / "replication"

    def image(self, volume_id: str) -> Path:
        return self.images / f"{check_id(volume_id, 'volume id')}.img"

    def unit_dir(self, unit_id: str) -> Path:
        return self.replication / check_id(unit_id)

    def state_path(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / "state.json"

    def control_path(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / "control.json"

    def control_lock_path(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / ".control.lock"

    def lock_path(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / ".lock"

    def snap_root(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / "snap"

    def snap_dir(self, unit_id: str, generation: int) -> Path:
        return self.snap_root(unit_id) / str(int(generation))

    def journal_dir(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / "journal"

    def ensure_unit_dir(self, unit_id: str) -> Path:
        d = self.unit_dir(unit_id)
        d.mkdir(parents=True, exist_ok=True)
        return d
