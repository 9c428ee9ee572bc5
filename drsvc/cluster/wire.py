"""The wire between a site's controller and its nodes' ``drsvc.node`` tasks: JSON only.

Each pair turns a model object into a JSON document (``*_out``) and back (``*_in``); the
controller encodes what it sends and decodes what a node answers, the node
(:class:`drsvc.cluster.node_ops.NodeOps`) the reverse.
"""
from __future__ import annotations

from ..controller_api import GroupView, VolumeStatus
from ..groups import Group
from ..model import Capability, ContentSource, Snapshot, Volume
from ..snapshots import GroupSnapshot


def caps_out(caps) -> list[dict]:
    return [{"access_type": c.access_type, "access_mode": c.access_mode, "fs_type": c.fs_type,
             "mount_flags": list(c.mount_flags)} for c in caps]


def caps_in(docs) -> list[Capability]:
    return [Capability(d["access_type"], d["access_mode"], d.get("fs_type", ""),
                       tuple(d.get("mount_flags", ()))) for d in docs or ()]


def source_out(source: ContentSource | None) -> dict | None:
    return {"kind": source.kind, "source_id": source.source_id} if source is not None else None


def source_in(doc: dict | None) -> ContentSource | None:
    return ContentSource(doc["kind"], doc["source_id"]) if doc else None


def status_out(st: VolumeStatus) -> dict:
    return {"volume": st.volume.to_doc(), "published_node_ids": st.published_node_ids, "problem": st.problem}


def status_in(doc: dict) -> VolumeStatus:
    return VolumeStatus(Volume.from_doc(doc["volume"]), list(doc["published_node_ids"]), doc["problem"])


def group_out(view: GroupView) -> dict:
    return {"group": view.group.to_doc(), "volumes": [v.to_doc() for v in view.volumes]}


def group_in(doc: dict) -> GroupView:
    return GroupView(Group.from_doc(doc["group"]), [Volume.from_doc(v) for v in doc["volumes"]])


def gs_out(gs: GroupSnapshot, members) -> dict:
    return {"gs": gs.to_doc(), "members": [m.to_doc() for m in members]}


def gs_in(doc: dict) -> tuple[GroupSnapshot, list[Snapshot]]:
    return GroupSnapshot.from_doc(doc["gs"]), [Snapshot.from_doc(m) for m in doc["members"]]


def page_out(page, encode) -> dict:
    return {"items": [encode(x) for x in page.items], "next_token": page.next_token}
