"""Plain data: volumes, snapshots, capabilities. No I/O here."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

MOUNT, BLOCK = "mount", "block"
# CSI access modes a host-local volume can honour (one node only)
SINGLE_NODE_MODES = {"SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY",
                     "SINGLE_NODE_SINGLE_WRITER", "SINGLE_NODE_MULTI_WRITER"}
READONLY_MODES = {"SINGLE_NODE_READER_ONLY", "MULTI_NODE_READER_ONLY"}


@dataclass(frozen=True)
class Capability:
    access_type: str                  # MOUNT or BLOCK
    access_mode: str                  # csi AccessMode name, e.g. SINGLE_NODE_WRITER
    fs_type: str = ""
    mount_flags: tuple = ()


@dataclass(frozen=True)
class ContentSource:
    kind: str                         # "snapshot" or "volume"
    source_id: str


@dataclass
class Volume:
    volume_id: str
    name: str
    capacity_bytes: int
    state: str = "ready"              # creating | ready | deleting
    fs_type: str = ""
    parameters: dict = field(default_factory=dict)
    source: dict | None = None        # {"kind", "source_id"}
    topology: dict = field(default_factory=dict)
    group_id: str = ""
    created_at: float = 0.0
    mutable_parameters: dict = field(default_factory=dict)   # set by ControllerModifyVolume

    def to_doc(self) -> dict:
        # asdict() deep-copies field by field (~60 us, on every CreateVolume and DeleteVolume);
        # the values here are scalars and flat str -> str dicts, so copying the dicts is the same
        return {name: dict(value) if isinstance(value, dict) else value
                for name, value in ((f, getattr(self, f)) for f in self.__dataclass_fields__)}

    @classmethod
    def from_doc(cls, doc: dict) -> Volume:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in known})


@dataclass
class Snapshot:
    snapshot_id: str
    name: str
    source_volume_id: str
    size_bytes: int
    created_at: float
    state: str = "ready"              # creating | ready
    group_snapshot_id: str = ""

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> Snapshot:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in known})


@dataclass
class NodeState:
    """What this node did for a volume: recorded so a restart loses nothing."""
    volume_id: str
    staging_path: str = ""
    access_type: str = ""
    fs_type: str = ""
    device: str = ""
    targets: dict = field(default_factory=dict)   # target_path -> {"readonly": bool}

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> NodeState:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in known})


@dataclass(frozen=True)
class Page:
    items: list
    next_token: str
