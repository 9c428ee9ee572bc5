"""Case `failover`: a planned failover with unsynced data, timed over gRPC as a CO calls it.

A two-site lab of its own (drsvc_lab) with every component up at both sites (plugin,
data and control workers, scheduler), as `drsvc site up` starts them. --repeat block
volumes of --failover-volume-mib MiB are made at a over gRPC, filled with random data
and enabled (schedulingInterval 1h: no scheduled sync interferes); the initial syncs
are awaited. Each run then writes --failover-mib MiB (1 MiB at random places) to one
of them, and times DemoteVolume at a (with its final sync) and PromoteVolume at b,
each retried on ABORTED after 0.2 s as the csi-addons controller requeues. With
--link, a's peer b and b's peer a are both reached through one emulator (a --back
route for b's), so both directions of the link are the WAN's.

drsvc_s is demote + promote; the phases are the final sync's, plus demote_s and
promote_s; the wire bytes are the final sync's.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import grpc

from .harness import MiB, CaseResult, Run, measure, same_content, write_random

ABORTED_RETRY_S = 0.2


class Calls:
    """gRPC stubs on one site's plugin socket; ABORTED answers are retried."""

    def __init__(self, endpoint: str):
        from csi_plugin.gen import csi_pb2_grpc, replication_pb2_grpc
        self.channel = grpc.insecure_channel(endpoint)
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.ctl = csi_pb2_grpc.ControllerStub(self.channel)
        self.repl = replication_pb2_grpc.ControllerStub(self.channel)

    def create_block(self, name: str, size: int) -> str:
        from csi_plugin.gen import csi_pb2
        cap = csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                       access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
        req = csi_pb2.CreateVolumeRequest(name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                                          volume_capabilities=[cap])
        return self.ctl.CreateVolume(req, timeout=60).volume.volume_id

    def timed(self, method: str, **fields) -> float:
        """Wall time of a replication RPC as the caller sees it, ABORTED retried."""
        from csi_plugin.gen import replication_pb2
        req = getattr(replication_pb2, f"{method}Request")(**fields)
        t = time.monotonic()
        while True:
            try:
                getattr(self.repl, method)(req, timeout=600)
                return time.monotonic() - t
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ABORTED or time.monotonic() - t > 600:
                    raise
                time.sleep(ABORTED_RETRY_S)

    def close(self) -> None:
        self.channel.close()


@contextlib.contextmanager
def routed(spec, lab):
    """With --link: a's peer b through a route of one emulator, b's peer a through its --back route."""
    if spec is None:
        yield None
        return
    from .wan import LinkProcess, route_lab_peer
    sa, sb = lab.sites["a"], lab.sites["b"]
    with LinkProcess(spec, [sb.sshd_port], back=[sa.sshd_port]) as link:
        route_lab_peer(sa, "b", sb.sshd_port, link.ports[0], link_rate=spec.rate)
        route_lab_peer(sb, "a", sa.sshd_port, link.ports[1], link_rate=spec.rate)
        yield link


def _wait_synced(pool: Path, vids, timeout: float) -> None:
    from drsvc.replication.common import find_state
    deadline = time.monotonic() + timeout
    while not all((st := find_state(pool, v)) is not None and st.generation >= 1 for v in vids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the initial syncs did not land in {timeout:.0f} s")
        time.sleep(0.2)


def _failovers(args, rnd, lab, A: Calls, B: Calls, res: CaseResult) -> None:
    from drsvc.replication.common import find_state
    sa, sb = lab.sites["a"], lab.sites["b"]
    size = args.failover_volume_mib * MiB
    vids = [A.create_block(f"failover-{i}", size) for i in range(args.repeat)]
    for vid in vids:
        write_random(sa.pool / "images" / f"{vid}.img", size, rnd)
        A.timed("EnableVolumeReplication", volume_id=vid, parameters={"schedulingInterval": "1h"})
    _wait_synced(sa.pool, vids, 120 + len(vids) * size / MiB)
    os.sync()       # the seed copies' writeback is done before any run is timed, not during the first

    def change(i):
        path = sa.pool / "images" / f"{vids[i]}.img"
        with open(path, "r+b") as f:
            for slot in rnd.sample(range(size // MiB), args.failover_mib):
                f.seek(slot * MiB)
                f.write(rnd.randbytes(MiB))
            f.flush()
            os.fsync(f.fileno())
        return Run(args.failover_mib * MiB)

    def failover(i):
        demote = A.timed("DemoteVolume", volume_id=vids[i])
        promote = B.timed("PromoteVolume", volume_id=vids[i])
        rep = find_state(sa.pool, vids[i]).reports[-1]
        return {"wall_s": demote + promote, "report": {"bytes_on_wire": rep["bytes_on_wire"],
                                                       "round_trips": rep.get("round_trips"), "phases": {
            **rep.get("phases", {}), "demote_s": round(demote, 4), "promote_s": round(promote, 4)}}}
    measure(res, args.repeat, make_cold=lambda: None, change=change, drsvc=failover, rsync=None)
    res.verified = all(same_content(sa.pool / "images" / f"{v}.img", sb.pool / "images" / f"{v}.img") for v in vids)
    res.extra.update({"volume_bytes": size, "unsynced_bytes": args.failover_mib * MiB,
                      "note": "drsvc_s: DemoteVolume at a (final sync) + PromoteVolume at b, over gRPC"})


def failover_case(args, rnd) -> CaseResult:
    from drsvc_lab import Lab
    res = CaseResult("failover", False)     # the data was just written: no cold floor
    lab = Lab(Path(tempfile.mkdtemp(prefix="drsvc-bench-failover-")), visibility_timeout=600)
    calls: list[Calls] = []
    try:
        lab.build()
        with routed(args.link, lab):
            lab.up()
            calls += [Calls(lab.sites[n].endpoint) for n in ("a", "b")]
            _failovers(args, rnd, lab, *calls, res)
    finally:
        for c in calls:
            c.close()
        lab.teardown()
    return res
