"""drsvc.admin.v1.Admin: operator status, sync-now, verify, drill clones and recovery points;
and drsvc.admin.v1.Site: the whole site at once (a site failover's promote of every unit)."""
from __future__ import annotations

import time

from drsvc.errors import MissingField
from drsvc.paging import page_by_number
from drsvc.replication.control import next_runs, next_sync
from drsvc.replication.sender import progress_of

from . import convert
from .errors import code_for_name, rpc
from .gen import admin_pb2, admin_pb2_grpc


def status_message(info, unit_id: str, kind: str, members, pool=None, live: dict | None = None
                   ) -> admin_pb2.ReplicationStatus:
    """*live*: live_status() when the caller made it (a listing), else made here from *pool*."""
    if live is None:
        live = live_status(pool, unit_id, info) if pool is not None else {}
    return admin_pb2.ReplicationStatus(**live,
        unit_id=unit_id, kind=kind, members=list(members), role=info.role, epoch=info.epoch,
        generation=info.generation, peer=info.peer, interval_seconds=info.interval,
        last_sync_time=info.last_sync_time, last_sync_duration=info.last_sync_duration,
        last_sync_bytes=info.last_sync_bytes, status=info.status, status_message=info.status_message,
        lag_seconds=info.lag_seconds, missed_intervals=info.missed_intervals,
        consecutive_failures=info.consecutive_failures, failures_total=info.failures_total,
        syncs_total=info.syncs_total, sent_bytes_total=info.sent_bytes_total,
        changed_bytes_total=info.changed_bytes_total, verify_interval_seconds=info.verify_interval,
        last_verify_time=info.last_verify_time, verify_failed=info.verify_failed,
        verify_mismatched_blocks=info.verify_mismatched_blocks, verify_generation=info.verify_generation,
        verify_message=info.verify_message, verify_damaged_points=info.verify_damaged_points)


def verify_response(out: dict) -> admin_pb2.VerifyResponse:
    """A verify's outcome (``drsvc.replication.control.scrub``) as the Admin API answers it."""
    if out.get("skipped"):
        return admin_pb2.VerifyResponse(result="skipped", skipped=out["skipped"])
    return admin_pb2.VerifyResponse(
        result=out["result"], generation=out["generation"], end_generation=out["end_generation"],
        mismatched_blocks=out["mismatched_blocks"], repair_requested=out.get("repair_requested", False),
        mismatches=[admin_pb2.Mismatch(volume_id=m["volume"], offset=m["offset"], length=m["length"],
                                       against=m["against"], generation=m["generation"],
                                       reason=m.get("reason", ""), point=m.get("point", 0),
                                       file_offset=m.get("file_offset", 0), data=m.get("data", ""))
                    for m in out["mismatches"]],
        bytes_read=out["bytes_read"], duration_seconds=out["duration_s"],
        checked_recorded=out["checked"]["recorded"], checked_primary=out["checked"]["primary"],
        rewritten_blocks=out["skipped_blocks"], notes=out["notes"],
        damaged_points=(out.get("points") or {}).get("damaged_points", []),
        unverifiable_points=sorted({u["point"] for u in (out.get("points") or {}).get("unverifiable", [])}),
        point_bad_blocks=(out.get("points") or {}).get("bad_blocks", 0))


def live_status(pool, unit_id: str, info=None, *, runs: dict | None = None, progress: str | None = None) -> dict:
    """The next scheduled sync and a running sync's progress (drsvc.replication.control.health,
    drsvc.replication.sender.progress). A listing passes the next runs it read once (*runs*)
    and the unit's progress path it keeps (*progress*)."""
    out = {"next_sync_time": next_sync(pool, unit_id, interval=info.interval if info else 0,
                                       last_sync=info.last_sync_time if info else 0.0, runs=runs)}
    if (p := progress_of(pool, unit_id, path=progress)) is not None:
        out.update(progress_bytes_sent=p["bytes_sent"], progress_bytes_planned=p["bytes_planned"],
                   progress_rate=p["rate_bps"])
    return out


class Admin(admin_pb2_grpc.AdminServicer):
    def __init__(self, site, requests, status):
        self.site = site
        self.requests = requests      # drsvc.replication.control.requests
        self.status = status          # drsvc.replication.control.read_model

    def _unit(self, unit):
        if unit.volume_group_id:
            return self.status.resolve("group", unit.volume_group_id)
        if unit.volume_id:
            return self.status.resolve("volume", unit.volume_id)
        raise MissingField(field="unit.volume_id or unit.volume_group_id")

    @rpc
    def ListReplications(self, req, context):
        out = []
        units, next_token = self.status.units_page(req.max_entries, req.starting_token)
        pool, runs = self.status.pool, next_runs(self.status.pool)
        for unit_id in units:
            try:
                info, kind, members = self.status.row(unit_id)
            except Exception:  # noqa: BLE001 - a unit half torn down is skipped, not fatal
                continue
            live = live_status(pool, unit_id, info, runs=runs, progress=self.status.records.progress_path(unit_id))
            out.append(status_message(info, unit_id, kind, members, live=live))
        return admin_pb2.ListReplicationsResponse(replications=out, next_token=next_token)

    @rpc
    def GetReplicationStatus(self, req, context):
        unit = self._unit(req.unit)
        return status_message(self.status.describe(unit.unit_id), unit.unit_id, unit.kind, unit.members,
                              self.status.pool)

    @rpc
    def SyncNow(self, req, context):
        out = self.requests.sync_now(self._unit(req.unit), wait=req.wait_seconds or None)
        return admin_pb2.SyncNowResponse(
            base_generation=out.get("base_generation", 0), target_generation=out.get("target_generation", 0),
            bytes_on_wire=out.get("bytes_on_wire", 0), bytes_changed=out.get("bytes_changed", 0),
            duration_seconds=out.get("duration_s", 0.0), skipped=out.get("skipped", ""))

    @rpc
    def Verify(self, req, context):
        return verify_response(self.requests.verify(self._unit(req.unit), repair=req.repair,
                                                    wait=req.wait_seconds or None))

    @rpc
    def CloneReplica(self, req, context):
        gen, vols = self.requests.clone_replica(self._unit(req.unit), req.name_prefix,
                                                     req.recovery_point, force=req.force)
        return admin_pb2.CloneReplicaResponse(generation=gen, volumes=[convert.volume(v) for v in vols])

    @rpc
    def ListRecoveryPoints(self, req, context):
        pts, space, grid = self.status.points(self._unit(req.unit))
        page = page_by_number(pts, lambda p: p.generation, req.max_entries, req.starting_token)
        now = time.time()
        return admin_pb2.ListRecoveryPointsResponse(
            next_token=page.next_token,
            points=[admin_pb2.RecoveryPoint(
                generation=p.generation, time=p.time, time_rfc3339=p.rfc3339, kind=p.kind,
                pinned=p.is_pinned(now), pin_until=p.pin_until or 0.0, unique_bytes=p.unique_bytes,
                total_bytes=p.total_bytes, members=list(p.members)) for p in page.items],
            replica_bytes=space.replica_bytes, points_bytes=space.points_bytes, retention=grid)


def promoted_unit(row: dict) -> admin_pb2.PromotedUnit:
    failed = row.get("result") == "failed"
    return admin_pb2.PromotedUnit(
        unit_id=row["unit_id"], kind=row.get("kind", ""), peer=row.get("peer", ""),
        generation=int(row.get("generation") or 0), data_age_seconds=float(row.get("data_age_seconds") or 0.0),
        result=row.get("result", "would promote"), code=code_for_name(row.get("error", "")).name if failed else "",
        message=row.get("message", ""), epoch=int(row.get("epoch") or 0), seconds=float(row.get("seconds") or 0.0))


def demoted_unit(row: dict) -> admin_pb2.DemotedUnit:
    failed = row.get("result") == "failed" or row.get("resync") == "failed"
    return admin_pb2.DemotedUnit(
        unit_id=row["unit_id"], kind=row.get("kind", ""), peer=row.get("peer", ""),
        generation=int(row.get("generation") or 0), result=row.get("result", "would demote"),
        code=code_for_name(row.get("error", "")).name if failed else "", message=row.get("message", ""),
        final_sync=bool(row.get("final_sync")), resync=row.get("resync", ""), seconds=float(row.get("seconds") or 0.0))


class Site(admin_pb2_grpc.SiteServicer):
    """*replication*: ``ReplicationAPI`` of a one-node site, ``ClusterReplication`` of a
    multi-node site's controller; both answer ``promote_all`` and ``demote_all`` with a row
    per unit."""

    def __init__(self, replication, check_secrets):
        self.replication = replication
        self.check_secrets = check_secrets

    @rpc
    def PromoteAll(self, req, context):
        self.check_secrets(dict(req.secrets))
        t0 = time.monotonic()
        if req.dry_run:
            rows = [{**r, "result": "would promote"}
                    for r in self.replication.promote_all(req.force, dry_run=True)]
        else:
            rows = self.replication.promote_all(req.force, wait=req.wait_seconds)
        return admin_pb2.PromoteAllResponse(units=[promoted_unit(r) for r in rows],
                                            seconds=round(time.monotonic() - t0, 4))

    @rpc
    def DemoteAll(self, req, context):
        self.check_secrets(dict(req.secrets))
        t0 = time.monotonic()
        if req.dry_run:
            rows = [{**r, "result": "would demote"} for r in self.replication.demote_all(dry_run=True)]
        else:
            rows = self.replication.demote_all(resync=req.resync, wait=req.wait_seconds)
        return admin_pb2.DemoteAllResponse(units=[demoted_unit(r) for r in rows],
                                           seconds=round(time.monotonic() - t0, 4))
