"""A gRPC client for one site's plugin socket: the API a CO uses, plus drsvc's Admin service.

Results are plain dicts so the CLI, the Ansible module and the demo share them.
"""
from __future__ import annotations

import time

import grpc

from csi_plugin.gen import (admin_pb2, admin_pb2_grpc, csi_pb2, csi_pb2_grpc, replication_pb2,
                            replication_pb2_grpc, volumegroup_pb2, volumegroup_pb2_grpc)

RETRYABLE = {grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class RpcFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        self.code, self.message = code, message
        super().__init__(f"{code.name}: {message}")

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


def _volume(v) -> dict:
    return {"volume_id": v.volume_id, "capacity_bytes": v.capacity_bytes,
            "group_id": v.volume_context.get("drsvc.io/volumeGroup", "")}


def _status(s) -> dict:
    return {"unit_id": s.unit_id, "kind": s.kind, "members": list(s.members), "role": s.role,
            "epoch": s.epoch, "generation": s.generation, "peer": s.peer, "interval_seconds": s.interval_seconds,
            "last_sync_time": s.last_sync_time or None, "last_sync_duration": s.last_sync_duration,
            "last_sync_bytes": s.last_sync_bytes, "status": s.status, "status_message": s.status_message,
            "lag_seconds": round(s.lag_seconds, 3), "missed_intervals": s.missed_intervals,
            "consecutive_failures": s.consecutive_failures, "failures_total": s.failures_total,
            "next_sync_time": s.next_sync_time or None,
            "syncs_total": s.syncs_total, "sent_bytes_total": s.sent_bytes_total,
            "changed_bytes_total": s.changed_bytes_total,
            "verify": ({"interval_seconds": s.verify_interval_seconds, "last_time": s.last_verify_time or None,
                        "failed": s.verify_failed, "mismatched_blocks": s.verify_mismatched_blocks,
                        "generation": s.verify_generation, "message": s.verify_message,
                        "damaged_points": s.verify_damaged_points}
                       if s.role == "secondary" else None),
            "progress": ({"bytes_sent": s.progress_bytes_sent, "bytes_planned": s.progress_bytes_planned,
                          "rate_bps": round(s.progress_rate, 1)} if s.progress_bytes_planned or
                         s.progress_bytes_sent else None)}


STATUS_PAGE = 500        # units per ListReplications call when the caller lists them all
POINTS_PAGE = 500        # points per ListRecoveryPoints call when the caller lists them all


class DrClient:
    def __init__(self, endpoint: str, *, timeout: float = 60.0, secrets: dict | None = None):
        target = endpoint if endpoint.startswith("unix:") else f"unix://{endpoint}"
        self.channel = grpc.insecure_channel(target)
        self.endpoint = endpoint
        self.timeout = timeout
        self.secrets = dict(secrets or {})
        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
        self.groups = volumegroup_pb2_grpc.ControllerStub(self.channel)
        self.repl = replication_pb2_grpc.ControllerStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.site_service = admin_pb2_grpc.SiteStub(self.channel)
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, fn, req, *, timeout: float | None = None):
        try:
            return fn(req, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED and fn in self._admin_calls():
                raise RpcFailed(e.code(), f"{self.endpoint} does not serve drsvc's Admin service (status, "
                                          "points, verify, sync-now, clone): a multi-node site's controller "
                                          "does not; each storage node's plugin does, for its own units: give "
                                          "its endpoint (--endpoint), node by node") from None
            raise RpcFailed(e.code(), e.details() or e.code().name) from None

    def _admin_calls(self) -> set:
        return {getattr(self.admin, m) for m in admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name}

    def until_done(self, fn, *, wait: float, progress=None):
        """Repeat a call while it answers ABORTED (in progress), as a CO does, up to *wait* s."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return fn()
            except RpcFailed as e:
                if not e.retryable or time.monotonic() > deadline:
                    raise
                if progress:
                    progress(e.message)
                time.sleep(0.5)

    def site(self) -> str:
        """The name of the site this socket serves (CSI GetPluginInfo's manifest)."""
        return self._call(self.identity.GetPluginInfo, csi_pb2.GetPluginInfoRequest()).manifest.get("site", "")

    # -- volumes and groups ---------------------------------------------------------
    def create_volume(self, name: str, size: int, *, fs_type: str = "ext4", group_id: str = "") -> dict:
        cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs_type),
                                       access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
        params = {"volumeGroup": group_id} if group_id else {}
        v = self._call(self.controller.CreateVolume, csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
            volume_capabilities=[cap], parameters=params, secrets=self.secrets)).volume
        return _volume(v)

    def list_volumes(self) -> list[dict]:
        out, token = [], ""
        while True:
            r = self._call(self.controller.ListVolumes, csi_pb2.ListVolumesRequest(max_entries=100,
                                                                                   starting_token=token))
            out += [_volume(e.volume) for e in r.entries]
            if not (token := r.next_token):
                return out

    def delete_volume(self, volume_id: str) -> None:
        self._call(self.controller.DeleteVolume, csi_pb2.DeleteVolumeRequest(volume_id=volume_id,
                                                                            secrets=self.secrets))

    def create_group(self, name: str) -> dict:
        g = self._call(self.groups.CreateVolumeGroup, volumegroup_pb2.CreateVolumeGroupRequest(
            name=name, secrets=self.secrets)).volume_group
        return {"group_id": g.volume_group_id, "name": g.volume_group_context.get("name", name),
                "volumes": [v.volume_id for v in g.volumes]}

    def list_groups(self) -> list[dict]:
        out, token = [], ""
        while True:
            r = self._call(self.groups.ListVolumeGroups, volumegroup_pb2.ListVolumeGroupsRequest(
                max_entries=100, starting_token=token, secrets=self.secrets))
            out += [{"group_id": e.volume_group.volume_group_id,
                     "name": e.volume_group.volume_group_context.get("name", ""),
                     "volumes": [v.volume_id for v in e.volume_group.volumes]} for e in r.entries]
            if not (token := r.next_token):
                return out

    def delete_group(self, group_id: str) -> None:
        self._call(self.groups.DeleteVolumeGroup, volumegroup_pb2.DeleteVolumeGroupRequest(
            volume_group_id=group_id, secrets=self.secrets))

    # -- replication -------------------------------------------------------------------
    def _repl_req(self, method: str, volume_id: str, group_id: str, **fields):
        req = getattr(replication_pb2, f"{method}Request")(secrets=self.secrets, **fields)
        if group_id:
            req.replication_source.volumegroup.volume_group_id = group_id
        else:
            req.replication_source.volume.volume_id = volume_id
        return req

    def replication(self, method: str, *, volume_id: str = "", group_id: str = "", **fields):
        return self._call(getattr(self.repl, method), self._repl_req(method, volume_id, group_id, **fields))

    def promote_all(self, *, force: bool, dry_run: bool = False, wait: float = 0.0) -> tuple[list[dict], float]:
        """The Site service's PromoteAll: a row per unit held here as secondary, and the
        server's seconds. UNIMPLEMENTED (RpcFailed) from a plugin without the Site service."""
        out = self._call(self.site_service.PromoteAll, admin_pb2.PromoteAllRequest(
            force=force, dry_run=dry_run, wait_seconds=wait, secrets=self.secrets),
            timeout=max(self.timeout, wait + 30.0) if wait else 24 * 3600.0)
        fields = ("unit_id", "kind", "peer", "generation", "data_age_seconds", "result", "code", "message",
                  "epoch", "seconds")
        return [{f: getattr(u, f) for f in fields} for u in out.units], out.seconds

    def demote_all(self, *, resync: bool, dry_run: bool = False, wait: float = 0.0) -> tuple[list[dict], float]:
        """The Site service's DemoteAll: a row per unit held here as primary, and the
        server's seconds. UNIMPLEMENTED (RpcFailed) from a plugin without it."""
        out = self._call(self.site_service.DemoteAll, admin_pb2.DemoteAllRequest(
            resync=resync, dry_run=dry_run, wait_seconds=wait, secrets=self.secrets),
            timeout=max(self.timeout, wait + 30.0) if wait else 24 * 3600.0)
        fields = ("unit_id", "kind", "peer", "generation", "result", "code", "message", "final_sync", "resync",
                  "seconds")
        return [{f: getattr(u, f) for f in fields} for u in out.units], out.seconds

    @staticmethod
    def unit(volume_id: str = "", group_id: str = "") -> admin_pb2.Unit:
        return admin_pb2.Unit(volume_id=volume_id, volume_group_id=group_id)

    def status(self, *, volume_id: str = "", group_id: str = "") -> dict:
        return _status(self._call(self.admin.GetReplicationStatus, admin_pb2.GetReplicationStatusRequest(
            unit=self.unit(volume_id, group_id))))

    def statuses(self) -> list[dict]:
        return [row for page, _ in self.status_pages() for row in page]

    def status_page(self, limit: int = 0, token: str = "") -> tuple[list[dict], str]:
        """One page of every unit's status, in id order: (rows, the next page's token or "")."""
        r = self._call(self.admin.ListReplications, admin_pb2.ListReplicationsRequest(
            max_entries=limit, starting_token=token))
        return [_status(s) for s in r.replications], r.next_token

    def status_pages(self, page: int = STATUS_PAGE, token: str = ""):
        """Every unit's status, page by page (each answer holds one page's units only)."""
        while True:
            rows, token = self.status_page(page, token)
            yield rows, token
            if not token:
                return

    def sync_now(self, *, volume_id: str = "", group_id: str = "", wait: float = 0) -> dict:
        r = self._call(self.admin.SyncNow, admin_pb2.SyncNowRequest(unit=self.unit(volume_id, group_id),
                                                                    wait_seconds=wait))
        return {"base_generation": r.base_generation, "target_generation": r.target_generation,
                "bytes_on_wire": r.bytes_on_wire, "bytes_changed": r.bytes_changed,
                "duration_seconds": r.duration_seconds, "skipped": r.skipped}

    def verify(self, *, volume_id: str = "", group_id: str = "", repair: bool = False, wait: float = 0) -> dict:
        r = self._call(self.admin.Verify, admin_pb2.VerifyRequest(unit=self.unit(volume_id, group_id),
                                                                  repair=repair, wait_seconds=wait))
        return {"result": r.result, "generation": r.generation, "end_generation": r.end_generation,
                "mismatched_blocks": r.mismatched_blocks, "repair_requested": r.repair_requested,
                "mismatches": [{"volume_id": m.volume_id, "offset": m.offset, "length": m.length,
                                "against": m.against, "generation": m.generation, "reason": m.reason,
                                **({"point": m.point, "file_offset": m.file_offset, "data": m.data}
                                   if m.against == "point" else {})}
                               for m in r.mismatches],
                "damaged_points": list(r.damaged_points), "unverifiable_points": list(r.unverifiable_points),
                "point_bad_blocks": r.point_bad_blocks,
                "bytes_read": r.bytes_read, "duration_seconds": round(r.duration_seconds, 3),
                "checked": {"recorded": r.checked_recorded, "primary": r.checked_primary},
                "rewritten_blocks": r.rewritten_blocks, "notes": list(r.notes), "skipped": r.skipped}

    def clone_replica(self, prefix: str, *, volume_id: str = "", group_id: str = "", point: str = "",
                      force: bool = False) -> dict:
        r = self._call(self.admin.CloneReplica, admin_pb2.CloneReplicaRequest(
            unit=self.unit(volume_id, group_id), name_prefix=prefix, recovery_point=point, force=force))
        return {"generation": r.generation, "volumes": [_volume(v) for v in r.volumes]}

    def recovery_points(self, *, volume_id: str = "", group_id: str = "", limit: int = 0, token: str = "") -> dict:
        """The unit's recovery points at this site (oldest first) and the space they take.
        With *limit*: one page of that many from after *token*, and the next page's token;
        without: every page, POINTS_PAGE points an answer."""
        if limit:
            return self._points_page(volume_id, group_id, limit, token)
        out = self._points_page(volume_id, group_id, POINTS_PAGE, token)
        while out["next_token"]:
            more = self._points_page(volume_id, group_id, POINTS_PAGE, out["next_token"])
            out = {**more, "points": out["points"] + more["points"]}
        return out

    def _points_page(self, volume_id: str, group_id: str, limit: int, token: str) -> dict:
        r = self._call(self.admin.ListRecoveryPoints, admin_pb2.ListRecoveryPointsRequest(
            unit=self.unit(volume_id, group_id), max_entries=limit, starting_token=token))
        return {"points": [{"generation": p.generation, "time": p.time_rfc3339, "kind": p.kind, "pinned": p.pinned,
                            "unique_bytes": p.unique_bytes, "total_bytes": p.total_bytes} for p in r.points],
                "replica_bytes": r.replica_bytes, "points_bytes": r.points_bytes, "retention": r.retention,
                "next_token": r.next_token}

    # -- node: stage and publish a volume on this host (drills, demos) -------------------
    def _mount_cap(self, fs_type: str, readonly: bool):
        mode = 2 if readonly else 1     # SINGLE_NODE_READER_ONLY / SINGLE_NODE_WRITER
        return csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs_type),
                                        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode))

    def mount(self, volume_id: str, staging: str, target: str, *, fs_type: str = "ext4",
              readonly: bool = False) -> str:
        """Stage then publish a filesystem volume; returns the target path."""
        node = csi_pb2_grpc.NodeStub(self.channel)
        cap = self._mount_cap(fs_type, readonly)
        self._call(node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=staging, volume_capability=cap, secrets=self.secrets))
        self._call(node.NodePublishVolume, csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=staging, target_path=target, volume_capability=cap,
            readonly=readonly, secrets=self.secrets))
        return target

    def unmount(self, volume_id: str, staging: str, target: str) -> None:
        node = csi_pb2_grpc.NodeStub(self.channel)
        self._call(node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=target))
        self._call(node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
            volume_id=volume_id, staging_target_path=staging))
