"""Prometheus /metrics for one site, computed from the pool's durable state at scrape time."""
from __future__ import annotations

import argparse
import logging
import os
import socket

from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from drsvc.config import SiteConfig, load
from drsvc.signals import wait_for_stop
from drsvc.site import Site

from .titles import set_title

log = logging.getLogger("workers.metrics")
PREFIX = "drsvc_replication"


LABELS = ["site", "unit", "kind", "peer"]
# name -> (help, value of a unit's Info; None: not exported for that unit). Gauges.
GAUGES = {
    "last_sync_timestamp_seconds": ("Primary: start of the last successful sync. Secondary: commit time of the "
                                    "last generation received (unix time)", lambda i: i.last_sync_time),
    "last_sync_duration_seconds": ("Duration of that sync (secondary: begin to commit)", lambda i: i.last_sync_duration),
    "last_sync_bytes": ("Bytes on the wire of that sync", lambda i: i.last_sync_bytes),
    "lag_seconds": ("Primary only: RPO lag, seconds since the newest data the peer holds",
                    lambda i: i.lag_seconds if i.role == "primary" else None),
    "data_age_seconds": ("Secondary only: data age, now minus the origin's capture time of the newest "
                         "generation held", lambda i: i.lag_seconds if i.role == "secondary" else None),
    "missed_intervals": ("Primary: whole intervals missed since the last successful sync. Secondary: whole "
                         "intervals the primary has been silent", lambda i: i.missed_intervals),
    "interval_seconds": ("Configured sync interval", lambda i: i.interval),
    "epoch": ("Fencing epoch of the unit at this site", lambda i: i.epoch),
    "generation": ("Replicated generation at this site", lambda i: i.generation),
    "consecutive_failures": ("Sync failures since the last success", lambda i: i.consecutive_failures),
    "schedule_delay_seconds": ("Primary: how late the last scheduled sync started after its slot "
                               "(scheduler drift plus queueing)", lambda i: i.schedule_delay),
    "verify_failed": ("Secondary only: 1 while a verify of the replica found blocks that differ and they are "
                      "not repaired, or found a recovery point damaged", lambda i: (1.0 if i.verify_failed else 0.0) if i.role == "secondary" else None),
    "verify_mismatched_blocks": ("Secondary only: blocks the last failed verify found different (0: none "
                                 "known)", lambda i: i.verify_mismatched_blocks if i.role == "secondary" else None),
    "verify_damaged_points": ("Secondary only: recovery points the last verify found differing from their "
                              "recorded digests (they cannot be repaired from the primary)",
                              lambda i: i.verify_damaged_points if i.role == "secondary" else None),
    "last_verify_timestamp_seconds": ("Secondary only: end of the last complete verify of the replica (never "
                                      "verified: its first receive; unix time)",
                                      lambda i: i.last_verify_time if i.role == "secondary" else None),
    "verify_interval_seconds": ("Secondary only: the verify interval (drsvc.io/verifyInterval or the site's "
                                "verify_interval; 0: none)", lambda i: i.verify_interval if i.role == "secondary" else None),
}


class ReplicationCollector:
    """Every value comes from the pool's durable records at scrape time; the counters are
    counted in the sync outcome record (control.json), so they survive a restart of this
    process and never go backwards."""

    def __init__(self, cfg: SiteConfig):
        self.cfg = cfg
        self.service = Site.from_config(cfg).status      # the read model: no dispatcher

    def _units(self):
        for unit_id in self.service.units():
            try:
                info, kind, members = self.service.row(unit_id)
            except Exception as e:  # noqa: BLE001 - one bad unit must not blank the page
                log.warning("unit %s: %s", unit_id, e)
                continue
            yield [self.cfg.site, unit_id, kind, info.peer], info, members

    def collect(self):
        g = {name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=LABELS) for name, (doc, _) in GAUGES.items()}
        role = GaugeMetricFamily(f"{PREFIX}_role", "1 for the role this site holds", labels=LABELS + ["role"])
        health = GaugeMetricFamily(f"{PREFIX}_health", "1 for the current health status", labels=LABELS + ["status"])
        failures = CounterMetricFamily(f"{PREFIX}_sync_failures", "Failed syncs", labels=LABELS)
        syncs = CounterMetricFamily(f"{PREFIX}_syncs", "Syncs this site ran as the sender, by result",
                                    labels=LABELS + ["result"])
        sent = CounterMetricFamily(f"{PREFIX}_sent_bytes", "Bytes on the wire of this site's successful syncs",
                                   labels=LABELS)
        changed = CounterMetricFamily(f"{PREFIX}_changed_bytes",
                                      "Data bytes this site's successful syncs changed at the peer", labels=LABELS)
        points = _points_families(LABELS)
        for lv, info, members in self._units():
            for name, (_, value) in GAUGES.items():
                if (v := value(info)) is not None:
                    g[name].add_metric(lv, v)
            for r in ("primary", "secondary"):
                role.add_metric(lv + [r], 1.0 if info.role == r else 0.0)
            for st in ("HEALTHY", "DEGRADED", "ERROR", "UNKNOWN", "VERIFY_FAILED"):
                health.add_metric(lv + [st], 1.0 if info.status == st else 0.0)
            failures.add_metric(lv, info.failures_total)
            syncs.add_metric(lv + ["success"], info.syncs_total)
            syncs.add_metric(lv + ["failure"], info.failures_total)
            sent.add_metric(lv, info.sent_bytes_total)
            changed.add_metric(lv, info.changed_bytes_total)
            _add_points(points, self.service, lv, members)
        yield from g.values()
        yield from (role, health, failures, syncs, sent, changed)
        yield from points.values()
        yield from site_families(self.cfg)


PEER_PROBE_S = 0.5      # a peer's sshd that does not accept a TCP connection in this long is unreachable


def site_families(cfg: SiteConfig) -> list:
    """The site's own gauges: its pool's size and free space (a DR pool that fills up fails
    every sync into it), and whether each peer's sshd accepts a TCP connection from here."""
    size = GaugeMetricFamily("drsvc_pool_size_bytes", "Size of the filesystem that holds this site's pool",
                             labels=["site", "node"])
    free = GaugeMetricFamily("drsvc_pool_free_bytes", "Bytes free for this site's pool on its filesystem",
                             labels=["site", "node"])
    try:
        st = os.statvfs(cfg.pool)
        size.add_metric([cfg.site, cfg.node_id], st.f_blocks * st.f_frsize)
        free.add_metric([cfg.site, cfg.node_id], st.f_bavail * st.f_frsize)
    except OSError as e:
        log.warning("pool %s: %s", cfg.pool, e.strerror or e)
    up = GaugeMetricFamily("drsvc_peer_reachable", "1 when the peer's sshd accepted a TCP connection from this "
                           f"site at the scrape (within {PEER_PROBE_S}s); 0 when not", labels=["site", "peer", "address"])
    for name, peer in sorted(cfg.peers.items()):
        for address, ok in _probe(peer):
            up.add_metric([cfg.site, name, address], 1.0 if ok else 0.0)
    return [size, free, up]


def _probe(peer) -> list[tuple[str, bool]]:
    if peer.transport == "local":
        return [(str(peer.pool), bool(peer.pool) and os.path.isdir(peer.pool))]
    out = []
    for host, port in (list(peer.nodes.values()) or [(peer.host, peer.port)]):
        try:
            socket.create_connection((host, port), timeout=PEER_PROBE_S).close()
            out.append((f"{host}:{port}", True))
        except OSError:
            out.append((f"{host}:{port}", False))
    return out


# -- recovery points --------------------------------------------------------------------------
def _points_families(labels) -> dict:
    return {name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels) for name, doc in (
        ("points", "Recovery points kept at this site"),
        ("points_bytes", "Bytes kept for the recovery points alone (the sum of their unique bytes)"),
        ("dr_bytes", "Bytes the unit takes at this site: the replica plus its recovery points"),
    )}


def _add_points(fam: dict, status, lv: list, members: list) -> None:
    from drsvc.replication.control import Unit
    unit_id, kind = lv[1], lv[2]
    try:
        pts, space, _ = status.points(Unit(kind, unit_id, tuple(members)))
    except Exception as e:  # noqa: BLE001 - one bad unit must not blank the page
        log.warning("unit %s points: %s", unit_id, e)
        return
    fam["points"].add_metric(lv, len(pts))
    fam["points_bytes"].add_metric(lv, space.points_bytes)
    fam["dr_bytes"].add_metric(lv, space.total)


def serve(cfg: SiteConfig, port: int | None = None, address: str = "127.0.0.1"):
    REGISTRY.register(ReplicationCollector(cfg))
    return start_http_server(port or cfg.metrics_port, addr=address)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="drsvc metrics")
    ap.add_argument("--config", default=os.environ.get("DRSVC_CONFIG"))
    ap.add_argument("--address", default="127.0.0.1")
    ap.add_argument("--node", default=os.environ.get("DRSVC_NODE", ""),
                    help="a multi-node site: this storage node's units (their ids name the node)")
    args = ap.parse_args(argv)
    if not args.config:
        ap.error("--config or DRSVC_CONFIG is required")
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load(args.config, node=args.node)
    if cfg.pool is None:
        ap.error(f"{args.config} lists [nodes]: give --node (or DRSVC_NODE), the node whose units to export")
    if not cfg.metrics_port:
        ap.error(f"{args.config} sets no metrics_port")
    set_title("metrics", cfg)
    serve(cfg, address=args.address)
    log.info("serving /metrics for site %s on %s:%d", cfg.site, args.address, cfg.metrics_port)
    wait_for_stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
