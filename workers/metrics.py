"""Prometheus /metrics for one site, computed from the pool's durable state at scrape time."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from drsvc.config import SiteConfig, load
from drsvc.site import Site

from .titles import set_title

log = logging.getLogger("workers.metrics")
PREFIX = "drsvc_replication"


class ReplicationCollector:
    def __init__(self, cfg: SiteConfig):
        self.cfg = cfg
        self.service = Site.from_config(cfg).status      # the read model: no dispatcher

    def collect(self):
        labels = ["site", "unit", "kind", "peer"]
        g = {name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels) for name, doc in (
            ("last_sync_timestamp_seconds", "Start of the last successful sync (unix time)"),
            ("last_sync_duration_seconds", "Duration of the last successful sync"),
            ("last_sync_bytes", "Bytes on the wire of the last successful sync"),
            ("lag_seconds", "Primary: seconds since the newest data the peer holds (RPO lag). "
                            "Secondary: data age, now minus the origin's capture time of the newest "
                            "generation held"),
            ("missed_intervals", "Primary: whole intervals missed since the last successful sync. "
                                 "Secondary: whole intervals the primary has been silent"),
            ("interval_seconds", "Configured sync interval"),
            ("epoch", "Fencing epoch of the unit at this site"),
            ("generation", "Replicated generation at this site"),
            ("consecutive_failures", "Sync failures since the last success"),
            ("schedule_delay_seconds", "Primary: how late the last scheduled sync started after its slot "
                                       "(scheduler drift plus queueing)"),
        )}
        role = GaugeMetricFamily(f"{PREFIX}_role", "1 for the role this site holds", labels=labels + ["role"])
        health = GaugeMetricFamily(f"{PREFIX}_health", "1 for the current health status",
                                   labels=labels + ["status"])
        failures = CounterMetricFamily(f"{PREFIX}_sync_failures", "Failed syncs", labels=labels)
        for unit_id in self.service.units():
            try:
                info = self.service.describe(unit_id)
            except Exception as e:  # noqa: BLE001 - one bad unit must not blank the page
                log.warning("unit %s: %s", unit_id, e)
                continue
            kind, _ = self.service.kind_of(unit_id)
            lv = [self.cfg.site, unit_id, kind, info.peer]
            g["last_sync_timestamp_seconds"].add_metric(lv, info.last_sync_time)
            g["last_sync_duration_seconds"].add_metric(lv, info.last_sync_duration)
            g["last_sync_bytes"].add_metric(lv, info.last_sync_bytes)
            g["lag_seconds"].add_metric(lv, info.lag_seconds)
            g["missed_intervals"].add_metric(lv, info.missed_intervals)
            g["interval_seconds"].add_metric(lv, info.interval)
            g["epoch"].add_metric(lv, info.epoch)
            g["generation"].add_metric(lv, info.generation)
            g["consecutive_failures"].add_metric(lv, info.consecutive_failures)
            g["schedule_delay_seconds"].add_metric(lv, info.schedule_delay)
            for r in ("primary", "secondary"):
                role.add_metric(lv + [r], 1.0 if info.role == r else 0.0)
            for s in ("HEALTHY", "DEGRADED", "ERROR", "UNKNOWN"):
                health.add_metric(lv + [s], 1.0 if info.status == s else 0.0)
            failures.add_metric(lv, info.failures_total)
        yield from g.values()
        yield role
        yield health
        yield failures


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
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
