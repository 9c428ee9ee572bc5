"""The one object that builds paths into a pool. Nothing else joins pool paths.

Every component comes from a validated id (drsvc.ids), never from a client's
name, so no path escapes the pool::

    pool.json                                   schema, site, created
    images/<volume_id>.img                      volume images (replicas keep the same id)
    volumes/<volume_id>.json                    volume metadata
    volumes/.<volume_id>.json.deleting          the record of a volume DeleteVolume is removing
    snapshots/<snapshot_id>.img|.json           snapshot images (reflink copies) and metadata
    names/<kind>-<sha256>.json                  client name -> id index (a volume's: a pointer, i.e. a
                                                symlink whose target is the id; others: JSON documents)
    node/<volume_id>.json                       node stage/publish state
    groups/<group_id>.json                      volume groups
    group_snapshots/<id>.json                   volume group snapshots (members live in snapshots/)
    locks/<key>.lock                            flock files (per volume, per name)
    locks/<volume_id>.mount.lock                held shared by captures of its mounted filesystem
    replication/<unit_id>/state.json            UnitState (drsvc.replication.common.unit_state)
    replication/<unit_id>/control.json          this site's settings and outcomes (replication.control)
    replication/<unit_id>/snap/<gen>/           sender: reflink snapshots + block maps
    replication/<unit_id>/journal/              receiver: the open transaction
    replication/<unit_id>/verify.json           a secondary's last verify (scrub) of its replica
    replication/<unit_id>/points/index.json     receiver: the unit's recovery points (one document)
    replication/<unit_id>/points/<gen>/         a point's meta.json, per member <vol>.undo (the bytes
                                                later generations overwrote) or <vol>.img (a whole image)
    schedule-changes/<unit_id>                  an empty mark: the unit's schedule may have changed
                                                (drsvc.schedule_changes; the scheduler takes them)
    sync-soon/<unit_id>                         an empty mark: the peer asked for the unit's next sync
                                                now (a resync or a repair waits on it)
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from . import ids
from .errors import InvalidName

SUBDIRS = ("images", "volumes", "snapshots", "names", "node", "locks", "replication", "groups",
           "group_snapshots")


def check_id(value, what: str = "unit id") -> str:
    """Return *value* when it is a safe single path component, else raise InvalidName."""
    if not isinstance(value, str):
        raise InvalidName(what=what, value=value, reason="must be a string")
    return ids.check_id(value, what)


class PoolLayout:
    def __init__(self, root):
        self.root = Path(root)

    # -- the pool's own records -------------------------------------------------------
    @property
    def meta(self) -> Path:
        return self.root / "pool.json"

    def subdir(self, name: str) -> Path:
        if name not in SUBDIRS:
            raise ValueError(f"{name!r} is not a pool directory")
        return self.root / name

    @property
    def images(self) -> Path:
        return self.root / "images"

    def image(self, volume_id: str) -> Path:
        return self.images / f"{check_id(volume_id, 'volume_id')}.img"

    def volume_meta(self, volume_id: str) -> Path:
        return self.root / "volumes" / f"{check_id(volume_id, 'volume_id')}.json"

    def volume_tombstone(self, volume_id: str) -> Path:
        """Where DeleteVolume sets the record aside until the volume is gone (not listed, not found)."""
        return self.root / "volumes" / f".{check_id(volume_id, 'volume_id')}.json.deleting"

    def snapshot_image(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / f"{check_id(snapshot_id, 'snapshot_id')}.img"

    def snapshot_meta(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / f"{check_id(snapshot_id, 'snapshot_id')}.json"

    def name_index(self, key: str) -> Path:
        return self.root / "names" / f"{key}.json"

    def node_state(self, volume_id: str) -> Path:
        return self.root / "node" / f"{check_id(volume_id, 'volume_id')}.json"

    def group_meta(self, group_id: str) -> Path:
        return self.root / "groups" / f"{check_id(group_id, 'volume_group_id')}.json"

    def group_snapshot_meta(self, group_snapshot_id: str) -> Path:
        return self.root / "group_snapshots" / f"{check_id(group_snapshot_id, 'group_snapshot_id')}.json"

    def lock(self, key: str) -> Path:
        return self.root / "locks" / f"{key}.lock"

    def mount_lock(self, volume_id: str) -> Path:
        """Held shared while a capture holds the volume's staged filesystem, exclusively by its unmount."""
        return self.lock(f"{check_id(volume_id, 'volume_id')}.mount")

    @staticmethod
    def staging_image(final: Path) -> Path:
        """A temp name next to *final*, owned by the operation that creates it."""
        return final.with_name(f".{final.name}.partial")

    # -- replication units ------------------------------------------------------------
    @property
    def replication(self) -> Path:
        return self.root / "replication"

    @property
    def schedule_changes(self) -> Path:
        return self.root / "schedule-changes"

    def schedule_change_path(self, unit_id: str) -> Path:
        return self.schedule_changes / check_id(unit_id)

    @property
    def sync_soon(self) -> Path:
        return self.root / "sync-soon"

    def sync_soon_path(self, unit_id: str) -> Path:
        return self.sync_soon / check_id(unit_id)

    def unit_dir(self, unit_id: str) -> Path:
        if not isinstance(unit_id, str):
            check_id(unit_id)           # raises InvalidName, before an unhashable value meets the cache
        return _unit_dir(self.root, unit_id)

    def state_path(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / "state.json"

    def control_path(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / "control.json"

    def control_lock_path(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / ".control.lock"

    def lock_path(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / ".lock"

    def verify_path(self, unit_id: str) -> Path:
        """The last verify of a secondary's replica (``drsvc.replication.control.scrub``)."""
        return self.unit_dir(unit_id) / "verify.json"

    def verify_tmp(self, unit_id: str, run: str | None = None) -> Path:
        """The scratch directory of the unit's verifies, or of one *run* (a directory of its
        own: a scheduled verify and an operator's may run at once)."""
        d = self.unit_dir(unit_id) / "verify-tmp"
        if run is None:
            return d
        if not run or not all(c.isalnum() or c == "-" for c in run):
            raise InvalidName(what="verify run", value=run[:40], reason="letters, digits and '-' only")
        return d / run

    def role_lock_path(self, unit_id: str) -> Path:
        """Held by a promote, demote or resync for its whole run (the unit's lock is taken
        and released several times within one)."""
        return self.unit_dir(unit_id) / ".role.lock"

    def roll_lock_path(self, unit_id: str) -> Path:
        """Held while the sender's base rolls forward after a sync has returned
        (``sender.base_store.roll_behind``); a reader of the base waits for it."""
        return self.unit_dir(unit_id) / ".roll.lock"

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

    def snap_tmp(self, unit_id: str, txid: str, what: str = "") -> Path:
        """A sender's work directory for one transaction, swept when abandoned."""
        return self.snap_root(unit_id) / f"tmp-{what + '-' if what else ''}{check_id(txid, 'txid')}"

    # -- files inside a snapshot directory (snap/<gen>/ or a tmp- dir: sender) --------
    @staticmethod
    def member_image(snap: Path, volume_id: str) -> Path:
        return snap / f"{check_id(volume_id, 'volume_id')}.img"

    @staticmethod
    def member_map(snap: Path, volume_id: str, *, peer: bool = False) -> Path:
        return snap / f"{check_id(volume_id, 'volume_id')}{'.peer' if peer else ''}.map"

    @staticmethod
    def snap_meta(snap: Path) -> Path:
        return snap / "meta.json"

    @staticmethod
    def snap_plan(snap: Path) -> Path:
        return snap / "plan.bin"

    # -- files inside a unit's journal (receiver) ---------------------------------------
    def journal_tx(self, unit_id: str) -> Path:
        return self.journal_dir(unit_id) / "tx.json"

    def journal_records(self, unit_id: str) -> Path:
        return self.journal_dir(unit_id) / "records.bin"

    def journal_commit(self, unit_id: str) -> Path:
        return self.journal_dir(unit_id) / "commit.json"

    def journal_staging_dir(self, unit_id: str) -> Path:
        return self.journal_dir(unit_id) / "staging"

    def journal_staging(self, unit_id: str, volume_id: str) -> Path:
        return self.journal_staging_dir(unit_id) / f"{check_id(volume_id, 'volume_id')}.img"

    def journal_digests(self, unit_id: str) -> Path:
        """The block digests of the journal's data records (``drsvc.replication.common.replica_maps``)."""
        return self.journal_dir(unit_id) / "digests.bin"

    # -- the block maps of a secondary's replica (receiver: drsvc.replication.common.replica_maps) --
    def replica_maps_dir(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / "maps"

    def replica_map(self, unit_id: str, volume_id: str) -> Path:
        return self.replica_maps_dir(unit_id) / f"{check_id(volume_id, 'volume_id')}.map"

    def replica_maps_doc(self, unit_id: str) -> Path:
        """Which generation the maps describe, and the images they were made for."""
        return self.replica_maps_dir(unit_id) / "maps.json"

    # -- recovery points (receiver: drsvc.replication.points) ---------------------------
    def points_dir(self, unit_id: str) -> Path:
        return self.unit_dir(unit_id) / "points"

    def points_index(self, unit_id: str) -> Path:
        return self.points_dir(unit_id) / "index.json"

    def points_costs(self, unit_id: str) -> Path:
        """What the last commit spent on the unit's points (observability, not durable)."""
        return self.points_dir(unit_id) / "costs.json"

    def point_dir(self, unit_id: str, generation: int) -> Path:
        return self.points_dir(unit_id) / str(int(generation))

    def point_meta(self, unit_id: str, generation: int) -> Path:
        return self.point_dir(unit_id, generation) / "meta.json"

    def point_undo(self, unit_id: str, generation: int, volume_id: str) -> Path:
        return self.point_dir(unit_id, generation) / f"{check_id(volume_id, 'volume_id')}.undo"

    def point_image(self, unit_id: str, generation: int, volume_id: str) -> Path:
        return self.point_dir(unit_id, generation) / f"{check_id(volume_id, 'volume_id')}.img"

    def point_undo_sums(self, unit_id: str, generation: int, volume_id: str) -> Path:
        """The digests of an undo log's 4 KiB blocks, recorded as it is written."""
        return self.point_dir(unit_id, generation) / f"{check_id(volume_id, 'volume_id')}.undo.sums"

    @staticmethod
    def sums_of_undo(log: Path) -> Path:
        """``point_undo_sums`` of the undo log at *log* (a path ``point_undo`` made)."""
        return log.with_name(log.name + ".sums")

    @staticmethod
    def map_of_image(image: Path) -> Path:
        """``point_image_map`` of the point image at *image* (a path ``point_image`` made)."""
        return image.with_name(image.name + ".map")

    def point_image_map(self, unit_id: str, generation: int, volume_id: str) -> Path:
        """The block map of a point's whole image (its digests as sealed)."""
        return self.point_dir(unit_id, generation) / f"{check_id(volume_id, 'volume_id')}.img.map"

    def restore_staging(self, volume_id: str) -> Path:
        """Where a volume's image is built from a recovery point before it replaces the image."""
        return self.images / f".{check_id(volume_id, 'volume_id')}.img.restore"


@lru_cache(maxsize=65536)
def _unit_dir(root: Path, unit_id: str) -> Path:
    """A unit's directory, built once: a site failover asks for each unit's some forty
    times, and a path built with pathlib costs microseconds. An invalid id raises, and is
    not cached."""
    return root / "replication" / check_id(unit_id)
