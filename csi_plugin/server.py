"""The plugin server: CSI (and CSI-Addons) over a unix socket."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drsvc.site import Site

from . import csi_servicers
from .gen import csi_pb2, csi_pb2_grpc
from .interceptors import LoggingInterceptor

log = logging.getLogger("csi_plugin")


def socket_path(endpoint: str) -> Path:
    for prefix in ("unix://", "unix:"):
        if endpoint.startswith(prefix):
            return Path(endpoint[len(prefix):])
    if endpoint.startswith("/"):
        return Path(endpoint)
    raise SystemExit(f"unsupported endpoint {endpoint!r}: use unix:///path/to/csi.sock")


def build_server(site: Site, sock: Path, *, max_workers: int = 16) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=[LoggingInterceptor()])
    csi_pb2_grpc.add_IdentityServicer_to_server(csi_servicers.Identity(site), server)
    csi_pb2_grpc.add_ControllerServicer_to_server(csi_servicers.Controller(site), server)
    csi_pb2_grpc.add_NodeServicer_to_server(csi_servicers.Node(site), server)
    names = [csi_pb2.DESCRIPTOR.services_by_name[s].full_name for s in ("Identity", "Controller", "Node")]
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for n in names + [""]:
        health_servicer.set(n, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    sock.parent.mkdir(parents=True, exist_ok=True)
    sock.unlink(missing_ok=True)
    old = os.umask(0o077)          # the socket is created 0600: root's CO only
    try:
        server.add_insecure_port(f"unix://{sock}")
    finally:
        os.umask(old)
    return server


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="drsvc-csi", description="drsvc CSI plugin")
    ap.add_argument("--endpoint", default=os.environ.get("CSI_ENDPOINT"),
                    help="unix:///path/csi.sock (default: $CSI_ENDPOINT)")
    ap.add_argument("--pool", required=True, help="pool directory (initialised when empty)")
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--site", default=os.environ.get("DRSVC_SITE", "local"), help="site name (topology)")
    ap.add_argument("--log-level", default=os.environ.get("DRSVC_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    if not args.endpoint:
        ap.error("--endpoint or CSI_ENDPOINT is required")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = socket_path(args.endpoint)
    site = Site.open(Path(args.pool), node_id=args.node_id, site_id=args.site)
    server = build_server(site, sock)
    server.start()
    log.info("serving CSI on unix://%s (pool %s, node %s, site %s)", sock, site.pool.root,
             args.node_id, args.site)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    server.stop(grace=10).wait()
    sock.unlink(missing_ok=True)
    return 0
