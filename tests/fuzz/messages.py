"""Hypothesis strategies for any protobuf request, built from its descriptor.

Random, oversized and invalid values for every field; ids are drawn partly from real
objects of the lab so that deep code paths run; every path field points into a
sandbox or is plainly invalid (relative, empty), so a fuzzed NodePublish can never
mount over something that matters. Recursion is cut at a fixed depth."""
from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

HOSTILE = ["", ".", "..", "../../etc", "/etc/passwd", "a/b", "vol-1\n", "x" * 129, "\x00", "vol-\u00e9",
           "vol-" + "0" * 24, "snap-" + "0" * 24, "grp-" + "0" * 24, "-rf", "$(id)", "`id`", "*"]
HUGE = ["x" * (64 << 10), "y" * (1 << 20)]
PARAM_KEYS = ["schedulingInterval", "schedulingStartTime", "bandwidthLimit", "peer", "volumeGroup",
              "preallocate", "fsType", "csi.storage.k8s.io/pvc/name",
              "replication.storage.openshift.io/replication-secret-name"]
PARAM_VALUES = ["1s", "0s", "-1s", "2h", "1h30m", "99999999999d", "10:00", "2030-01-01T00:00:00",
                "junk", "0", "-1", str(1 << 70), "true", "b", "a", "nope"]
INT_EDGES = [0, 1, -1, 4096, 1 << 20, 1 << 30, 1 << 40, 1 << 50, 1 << 62]
FS_TYPES = ["ext4", "xfs", "btrfs", "ntfs", "", "EXT4", "ext4 -o", "../ext4"]
MOUNT_FLAGS = ["ro", "rw", "noexec", "nosuid", "sync", "remount", "bind", "x=y", "ro,bind", ""]
_RANGES = {F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1),
           F.TYPE_SFIXED32: (-2**31, 2**31 - 1), F.TYPE_INT64: (-2**63, 2**63 - 1),
           F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
           F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
           F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1)}


def message_class(desc):
    return message_factory.GetMessageClass(desc)


class Requests:
    def __init__(self, ids: dict, sandbox, depth: int = 3):
        self.ids, self.sandbox, self.depth = ids, sandbox, depth
        plain, hostile = st.text(max_size=40), st.sampled_from(HOSTILE)
        # oversized values now and then: each costs a megabyte on the wire
        self.text = st.one_of(plain, plain, hostile, hostile, plain, st.sampled_from(HUGE))
        self.paths = st.one_of(
            st.sampled_from(["", "relative", "relative/x", ".", "./s1"]),
            st.sampled_from(["s1", "s2", "p1", "p2", "s1/inner", "deep/a/b", "p1/../p2", "s 3", "p\n4"])
            .map(lambda n: str(sandbox / n)))

    def _ids(self, kind):
        real = self.ids.get(kind, [])
        return st.one_of(st.sampled_from(real), self.text) if real else self.text

    def string(self, name: str):
        if name.endswith("path"):
            return self.paths
        if name in ("volume_id", "source_volume_id", "volume_ids", "source_volume_ids"):
            return self._ids("volume")
        if name in ("snapshot_id", "snapshot_ids", "base_snapshot_id", "target_snapshot_id"):
            return self._ids("snapshot")
        if name == "volume_group_id":
            return self._ids("group")
        if name == "node_id":
            return self._ids("node")
        if name == "fs_type":
            return st.one_of(st.sampled_from(FS_TYPES), self.text)
        if name == "mount_flags":
            return st.one_of(st.sampled_from(MOUNT_FLAGS), self.text)
        return self.text

    def scalar(self, f):
        t = f.type
        if t == F.TYPE_STRING:
            return self.string(f.name)
        if t == F.TYPE_BYTES:
            return st.binary(max_size=64)
        if t == F.TYPE_BOOL:
            return st.booleans()
        if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
            return st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64 if t == F.TYPE_DOUBLE else 32),
                             st.sampled_from([0.0, -1.0, 1e300, 0.001]))
        if t == F.TYPE_ENUM:
            return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-3, 99))
        lo, hi = _RANGES[t]
        return st.one_of(st.integers(lo, hi), st.sampled_from([v for v in INT_EDGES if lo <= v <= hi]))

    def _map(self, f):
        kf, vf = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        if vf.type == F.TYPE_MESSAGE:
            values = self.message(vf.message_type, self.depth - 1)
        elif f.name == "secrets":
            values = self.text
        else:
            values = st.one_of(st.sampled_from(PARAM_VALUES), self.scalar(vf))
        keys = st.one_of(st.sampled_from(PARAM_KEYS), self.scalar(kf)) if kf.type == F.TYPE_STRING \
            else self.scalar(kf)
        return st.dictionaries(keys, values, max_size=4)

    def field(self, f, depth):
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            return self._map(f)
        if f.type == F.TYPE_MESSAGE:
            one = self.message(f.message_type, depth - 1)
        else:
            one = self.scalar(f)
        if f.is_repeated:
            return st.lists(one, max_size=3)
        return one

    def message(self, desc, depth=None):
        depth = self.depth if depth is None else depth
        cls = message_class(desc)
        if depth <= 0:
            return st.just(cls())
        optional = {f.name: self.field(f, depth) for f in desc.fields}

        def build(kw):
            msg = cls()
            for name, value in kw.items():
                f = desc.fields_by_name[name]
                target = getattr(msg, name)
                if f.message_type is not None and f.message_type.GetOptions().map_entry:
                    for k, v in value.items():
                        if f.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
                            target[k].CopyFrom(v)
                        else:
                            target[k] = v
                elif f.is_repeated:
                    if f.type == F.TYPE_MESSAGE:
                        for v in value:
                            target.add().CopyFrom(v)
                    else:
                        target.extend(value)
                elif f.type == F.TYPE_MESSAGE:
                    target.CopyFrom(value)
                else:
                    setattr(msg, name, value)
            return msg
        return st.fixed_dictionaries({}, optional=optional).map(build)
