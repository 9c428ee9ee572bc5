"""Prometheus /metrics for one site, from the pool's durable state: each unit's records as of
the scrape (read again only when they changed), the clock's series computed at the scrape."""
from __future__ import annotations

import argparse
import gzip
import logging
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.utils import floatToGoString

from drsvc.config import SiteConfig, load
from drsvc.errors import UnitNotFound
from drsvc.replication.control import Info
from drsvc.signals import wait_for_stop
from drsvc.site import Site

from .titles import set_title

log = logging.getLogger("workers.metrics")
PREFIX = "drsvc_replication"


BACKSLASH, NEWLINE = "\\", "\n"
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


# Families in the order of the page: the gauges above, then these (name -> type, help).
FAMILIES = {**{name: ("gauge", doc) for name, (doc, _) in GAUGES.items()},
            "role": ("gauge", "1 for the role this site holds"),
            "health": ("gauge", "1 for the current health status"),
            "sync_failures": ("counter", "Failed syncs"),
            "syncs": ("counter", "Syncs this site ran as the sender, by result"),
            "sent_bytes": ("counter", "Bytes on the wire of this site's successful syncs"),
            "changed_bytes": ("counter", "Data bytes this site's successful syncs changed at the peer"),
            "points": ("gauge", "Recovery points kept at this site"),
            "points_bytes": ("gauge", "Bytes kept for the recovery points alone (the sum of their unique bytes)"),
            "dr_bytes": ("gauge", "Bytes the unit takes at this site: the replica plus its recovery points")}
ROLES = ("primary", "secondary")
HEALTH = ("HEALTHY", "DEGRADED", "ERROR", "UNKNOWN", "VERIFY_FAILED")
# What changes with the clock or the replica's allocation, not with the unit's records:
# rendered on every scrape. The rest of a unit's lines are kept until its records change.
NOW_FIELDS = ("lag_seconds", "missed_intervals", "status", "status_message")
NOW_FAMILIES = ("lag_seconds", "data_age_seconds", "missed_intervals", "health", "points", "points_bytes",
                "dr_bytes")
KEPT_FIELDS = tuple(f for f in Info.__dataclass_fields__ if f not in NOW_FIELDS)


def series_name(family: str) -> str:
    kind = FAMILIES[family][0]
    return f"{PREFIX}_{family}_total" if kind == "counter" else f"{PREFIX}_{family}"


def header(family: str) -> str:
    """A family's HELP and TYPE lines, as prometheus_client writes the text format."""
    kind, doc = FAMILIES[family]
    name = series_name(family)
    return f"# HELP {name} {doc.replace(BACKSLASH, BACKSLASH * 2).replace(NEWLINE, BACKSLASH + 'n')}\n# TYPE {name} {kind}\n"


def label_value(v: str) -> str:
    """A label's value escaped as the format asks: backslash, newline, double quote."""
    return str(v).replace(BACKSLASH, BACKSLASH * 2).replace(NEWLINE, BACKSLASH + "n").replace('"', BACKSLASH + '"')


class UnitLines:
    """One unit's samples: its label set (in the format's sorted order) and line makers. The
    lines of the scrape-time series are kept by value too (health, missed intervals and
    points change seldom; only the lag is formatted at every scrape)."""

    def __init__(self, site: str, unit_id: str, kind: str, peer: str):
        labels = {"kind": kind, "peer": peer, "site": site, "unit": unit_id}
        # the unit's labels escaped once: a unit's page has ~30 lines, each of them all four
        self._pairs = sorted((k, f'{k}="{label_value(v)}"') for k, v in labels.items())
        self._body = ",".join(text for _, text in self._pairs)
        self._by_value: dict[tuple, str] = {}

    def name_labels(self, family: str, extra: tuple[str, str] | None = None) -> str:
        if extra is None:
            body = self._body
        else:
            key, value = extra
            pairs = sorted([*(p for p in self._pairs if p[0] != key), (key, f'{key}="{label_value(value)}"')])
            body = ",".join(text for _, text in pairs)
        return f"{series_name(family)}{{{body}}}"

    def line(self, family: str, value, extra: tuple[str, str] | None = None) -> str:
        return f"{self.name_labels(family, extra)} {floatToGoString(value)}\n"

    def kept(self, info: Info) -> dict[str, str]:
        """The lines that change only with the unit's records, by family."""
        out = {}
        for name, (_, value) in GAUGES.items():
            if name not in NOW_FAMILIES and (v := value(info)) is not None:
                out[name] = self.line(name, v)
        out["role"] = "".join(self.line("role", 1.0 if info.role == r else 0.0, ("role", r)) for r in ROLES)
        out["sync_failures"] = self.line("sync_failures", info.failures_total)
        out["syncs"] = (self.line("syncs", info.syncs_total, ("result", "success"))
                        + self.line("syncs", info.failures_total, ("result", "failure")))
        out["sent_bytes"] = self.line("sent_bytes", info.sent_bytes_total)
        out["changed_bytes"] = self.line("changed_bytes", info.changed_bytes_total)
        return out

    def _memo(self, key: tuple, make) -> str:
        text = self._by_value.get(key)
        if text is None:
            if len(self._by_value) > 64:            # values seen long ago
                self._by_value.clear()
            text = self._by_value[key] = make()
        return text

    def now(self, info: Info, points: tuple[int, int, int] | None) -> list[tuple[str, str]]:
        """The lines rendered at each scrape, as (family, text)."""
        out = []
        for name in ("lag_seconds", "data_age_seconds"):
            if (v := GAUGES[name][1](info)) is not None:
                out.append((name, self._memo((name,), lambda n=name: self.name_labels(n)) + f" {floatToGoString(v)}\n"))
        out.append(("missed_intervals", self._memo(("missed_intervals", info.missed_intervals),
                                                   lambda: self.line("missed_intervals", info.missed_intervals))))
        out.append(("health", self._memo(("health", info.status), lambda: "".join(
            self.line("health", 1.0 if info.status == st else 0.0, ("status", st)) for st in HEALTH))))
        if points is not None:
            for name, v in zip(("points", "points_bytes", "dr_bytes"), points, strict=True):
                out.append((name, self._memo((name, v), lambda n=name, v=v: self.line(n, v))))
        return out


class Exporter:
    """The page of one site's units, from the read model's cached records: a unit's lines are
    rendered again only when its records changed (``rendered`` counts those), and only the
    clock's series (lag, missed intervals, health) and the space series on every scrape. The
    counters are counted in the sync outcome record (control.json), so they survive a restart
    of this process and never go backwards."""

    def __init__(self, cfg: SiteConfig):
        self.cfg = cfg
        self.service = Site.from_config(cfg).status      # the read model: no dispatcher
        self._kept: dict[str, tuple] = {}                # unit -> (key, UnitLines, kept lines)
        self._lock = threading.Lock()
        self.rendered = 0

    def _unit(self, unit_id: str, parts: dict[str, list]) -> None:
        info, kind, members = self.service.row(unit_id)
        key = (kind, info.peer, *(getattr(info, f) for f in KEPT_FIELDS))
        hit = self._kept.get(unit_id)
        if hit is None or hit[0] != key:
            lines = UnitLines(self.cfg.site, unit_id, kind, info.peer)
            hit = key, lines, lines.kept(info)
            self._kept[unit_id] = hit
            self.rendered += 1
        try:
            points = self.service.points_summary(unit_id, members)
        except Exception as e:  # noqa: BLE001 - one bad unit must not blank the page
            log.warning("unit %s points: %s", unit_id, e)
            points = None
        for family, text in (*hit[2].items(), *hit[1].now(info, points)):
            parts[family].append(text)

    def render(self) -> str:
        """The units' families, in the text format as prometheus_client's generate_latest writes it."""
        with self._lock:
            parts: dict[str, list] = {name: [] for name in FAMILIES}
            units = self.service.units()
            for unit_id in units:
                try:
                    self._unit(unit_id, parts)
                except UnitNotFound:        # a unit being enabled or torn down: no records (now)
                    continue
                except Exception as e:  # noqa: BLE001 - one bad unit must not blank the page
                    log.warning("unit %s: %s", unit_id, e)
            for gone in self._kept.keys() - set(units):
                del self._kept[gone]
                self.service.records.forget(gone)
            return "".join(header(name) + "".join(parts[name]) for name in FAMILIES)

    def page(self) -> bytes:
        """/metrics: the process's own collectors (prometheus_client's), the units, the site."""
        site = CollectorRegistry()
        site.register(SiteCollector(self.cfg))
        return generate_latest(REGISTRY) + self.render().encode() + generate_latest(site)


class SiteCollector:
    def __init__(self, cfg: SiteConfig):
        self.cfg = cfg

    def collect(self):
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


class MetricsHandler(BaseHTTPRequestHandler):
    exporter: Exporter

    def do_GET(self):  # noqa: N802 - http.server's name
        body = self.exporter.page()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        if "gzip" in (self.headers.get("Accept-Encoding") or ""):
            body = gzip.compress(body, compresslevel=1)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.address_string(), *args)


def serve(cfg: SiteConfig, port: int | None = None, address: str = "127.0.0.1") -> ThreadingHTTPServer:
    """/metrics on *address*:*port* in a thread of its own; returns the server."""
    exporter = Exporter(cfg)
    handler = type("Handler", (MetricsHandler,), {"exporter": exporter})
    server = ThreadingHTTPServer((address, port or cfg.metrics_port), handler)
    server.daemon_threads = True
    # the first page parses every unit's records: made now, so that the first scrape (which
    # waits for it on the exporter's lock) does not run into the scraper's timeout
    threading.Thread(target=exporter.render, name="metrics-warm", daemon=True).start()
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


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
