"""Sync and verify reports: plain data, kept apart from live state."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SyncReport:
    unit_id: str
    mode: str = "delta"
    started_at: float = 0.0          # unix time
    duration_s: float = 0.0
    base_generation: int = 0
    target_generation: int = 0
    epoch: int = 0
    members: list = field(default_factory=list)
    bytes_scanned: int = 0           # bytes read and hashed to find changes
    bytes_changed: int = 0           # data bytes that differ from the base
    bytes_zeroed: int = 0            # bytes sent as zero ranges (punched at the peer)
    bytes_on_wire: int = 0           # everything written to the channel
    records: int = 0                 # records in the generation
    records_sent: int = 0            # records sent by this run (fewer when resumed)
    resumed: bool = False
    reflink: bool = False            # changes found from FIEMAP extent maps
    ranges_cloned: int = 0           # FICLONERANGE calls of the overlay capture (work follows the change)
    steps: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)   # seconds per phase (connect_s, freeze_s, ...)
    attempts: list = field(default_factory=list)  # [{"steps": [...], "error": str | None}] per plan
    txid: str | None = None
    stripes: int = 1                 # channels the generation's records went over
    pipelined: bool = False          # records left while the plan still read the images
    early: bool = False              # ... and while the capture still cloned (capture_feed)
    round_trips: int = 0             # replies waited for (each a round trip), every attempt
    channels_opened: int = 0         # fresh receivers started (a few round trips each over SSH)
    repair: bool = False             # re-sent the blocks a verify at the peer found differing

    @property
    def throughput(self) -> float:
        """Changed bytes per second of sync."""
        return (self.bytes_changed + self.bytes_zeroed) / self.duration_s if self.duration_s else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["throughput"] = self.throughput
        return d


@dataclass
class VerifyReport:
    unit_id: str
    generation: int
    peer_generation: int
    members: dict = field(default_factory=dict)   # volume_id -> {"size", "peer_size", "differs": [[off, len]]}

    @property
    def ok(self) -> bool:
        return all(not m["differs"] and m["size"] == m["peer_size"] for m in self.members.values())

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d
