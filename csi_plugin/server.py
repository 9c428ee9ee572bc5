"""The plugin server: CSI (and CSI-Addons) over a unix socket."""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drsvc.cluster import ClusterController, ClusterReplication
from drsvc.controller import PoolController
from drsvc.replication.control import ReplicationAPI
from drsvc.signals import wait_for_stop
from drsvc.site import Site

from drsvc.config import load as load_config, socket_path

from . import addons_servicers, admin_servicer, csi_servicers, group_servicer, snapshot_metadata_servicer
from .gen import admin_pb2_grpc, csi_pb2, csi_pb2_grpc, identity_pb2_grpc, replication_pb2_grpc, volumegroup_pb2_grpc
from .interceptors import LoggingInterceptor

log = logging.getLogger("csi_plugin")
HANDLER_THREADS = 16


def handler_pool(max_workers: int, thread_init: Callable[[], None] | None = None) -> futures.ThreadPoolExecutor:
    """The gRPC handler threads. With *thread_init*, all of them are started now and each
    runs it once, before the server takes a call: Celery keeps a result backend per thread,
    and a thread making its own on a call's path added 17-20 ms to that call (a DR site's
    first Promote may be its first call)."""
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, initializer=thread_init)
    if thread_init is not None:
        start_threads(pool, max_workers)
    return pool


def start_threads(pool: futures.ThreadPoolExecutor, n: int, *, timeout: float = 10.0) -> None:
    """Make *pool* start *n* threads now: n tasks that each wait until all n run (a pool
    adds a thread for a task while none is idle). A thread whose initializer fails breaks
    the pool, as it would at its first call."""
    barrier = threading.Barrier(n)

    def hold() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout)

    futures.wait([pool.submit(hold) for _ in range(n)])


def _serve(server: grpc.Server, names: list[str], sock: Path) -> grpc.Server:
    """Health for every service, reflection, and the unix socket (0600: root's CO only)."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for n in names + [""]:
        health_servicer.set(n, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    sock.parent.mkdir(parents=True, exist_ok=True)
    sock.unlink(missing_ok=True)
    old = os.umask(0o077)
    try:
        server.add_insecure_port(f"unix://{sock}")
    finally:
        os.umask(old)
    return server


def build_controller_server(ctl: ClusterController, sock: Path, *, max_workers: int = HANDLER_THREADS,
                            thread_init: Callable[[], None] | None = None) -> grpc.Server:
    """A multi-node site's controller: CSI Identity, Controller and GroupController,
    CSI-Addons Identity, VolumeGroup and Replication, each call sent to the node of the
    object (or to every node holding a part of it). Node services run where the pools are."""
    server = grpc.server(handler_pool(max_workers, thread_init),
                         interceptors=[LoggingInterceptor()])
    csi_pb2_grpc.add_IdentityServicer_to_server(
        csi_servicers.Identity(ctl, csi_servicers.CLUSTER_SERVICES), server)
    csi_pb2_grpc.add_ControllerServicer_to_server(csi_servicers.Controller(ctl), server)
    csi_pb2_grpc.add_GroupControllerServicer_to_server(group_servicer.GroupController(ctl), server)
    names = [csi_pb2.DESCRIPTOR.services_by_name[s].full_name for s in ("Identity", "Controller", "GroupController")]
    replicating = bool(ctl.cfg.peers)
    identity_pb2_grpc.add_IdentityServicer_to_server(addons_servicers.AddonsIdentity(ctl, replicating), server)
    volumegroup_pb2_grpc.add_ControllerServicer_to_server(
        addons_servicers.VolumeGroupController(ctl, ctl.cfg.check_secrets), server)
    names += ["identity.Identity", "volumegroup.Controller"]
    if replicating:
        cluster = ClusterReplication(ctl.router)
        replication_pb2_grpc.add_ControllerServicer_to_server(
            addons_servicers.ReplicationController(cluster, ctl.cfg.check_secrets), server)
        admin_pb2_grpc.add_SiteServicer_to_server(admin_servicer.Site(cluster, ctl.cfg.check_secrets), server)
        names += ["replication.Controller", "drsvc.admin.v1.Site"]
    return _serve(server, names, sock)


def _node_server(server: grpc.Server, site: Site, ctl: PoolController, sock: Path) -> grpc.Server:
    """One storage node of a multi-node site: CSI Identity (speaking for the site's plugin:
    the controller's services) and Node, and the Admin service for its own units. Controller
    calls go to the site controller's endpoint, which claims names and places volumes; a
    node answering them over its own pool would bypass both, so it does not serve them."""
    csi_pb2_grpc.add_IdentityServicer_to_server(csi_servicers.Identity(ctl, csi_servicers.CLUSTER_SERVICES), server)
    csi_pb2_grpc.add_NodeServicer_to_server(csi_servicers.Node(site), server)
    names = [csi_pb2.DESCRIPTOR.services_by_name[s].full_name for s in ("Identity", "Node")]
    if site.replication is not None:
        admin_pb2_grpc.add_AdminServicer_to_server(
            admin_servicer.Admin(site, site.replication.requests, site.status), server)
        names.append("drsvc.admin.v1.Admin")
    return _serve(server, names, sock)


def build_server(site: Site, sock: Path, *, max_workers: int = HANDLER_THREADS, block_metadata: str = "variable",
                 thread_init: Callable[[], None] | None = None) -> grpc.Server:
    server = grpc.server(handler_pool(max_workers, thread_init),
                         interceptors=[LoggingInterceptor()])
    ctl = PoolController(site)
    if site.config is not None and site.config.multinode:
        return _node_server(server, site, ctl, sock)
    csi_pb2_grpc.add_IdentityServicer_to_server(csi_servicers.Identity(ctl), server)
    csi_pb2_grpc.add_ControllerServicer_to_server(csi_servicers.Controller(ctl), server)
    csi_pb2_grpc.add_NodeServicer_to_server(csi_servicers.Node(site), server)
    csi_pb2_grpc.add_GroupControllerServicer_to_server(group_servicer.GroupController(ctl), server)
    csi_pb2_grpc.add_SnapshotMetadataServicer_to_server(
        snapshot_metadata_servicer.SnapshotMetadata(site, block_metadata), server)
    names = [csi_pb2.DESCRIPTOR.services_by_name[s].full_name
             for s in ("Identity", "Controller", "Node", "GroupController", "SnapshotMetadata")]
    replicating = site.replication is not None
    identity_pb2_grpc.add_IdentityServicer_to_server(addons_servicers.AddonsIdentity(ctl, replicating), server)
    volumegroup_pb2_grpc.add_ControllerServicer_to_server(addons_servicers.VolumeGroupController(ctl, site.check_secrets), server)
    names += ["identity.Identity", "volumegroup.Controller"]
    if replicating:
        api = ReplicationAPI(site.status, site.replication.requests)
        replication_pb2_grpc.add_ControllerServicer_to_server(
            addons_servicers.ReplicationController(api, site.check_secrets), server)
        admin_pb2_grpc.add_AdminServicer_to_server(
            admin_servicer.Admin(site, site.replication.requests, site.status), server)
        admin_pb2_grpc.add_SiteServicer_to_server(admin_servicer.Site(api, site.check_secrets), server)
        names += ["replication.Controller", "drsvc.admin.v1.Admin", "drsvc.admin.v1.Site"]
    return _serve(server, names, sock)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="drsvc-csi", description="drsvc CSI plugin")
    ap.add_argument("--endpoint", default=os.environ.get("CSI_ENDPOINT"),
                    help="unix:///path/csi.sock (default: $CSI_ENDPOINT, or the site config's)")
    ap.add_argument("--pool", help="pool directory (initialised when empty)")
    ap.add_argument("--node-id")
    ap.add_argument("--site", default=os.environ.get("DRSVC_SITE", "local"), help="site name (topology)")
    ap.add_argument("--config", default=os.environ.get("DRSVC_CONFIG"),
                    help="site config (TOML); enables replication through the site's Celery workers")
    ap.add_argument("--block-metadata", choices=sorted(snapshot_metadata_servicer.STYLES),
                    default=os.environ.get("DRSVC_BLOCK_METADATA", "variable"),
                    help="SnapshotMetadata stream style: variable (merged extents) or fixed (4 KiB blocks)")
    ap.add_argument("--role", choices=("plugin", "controller"), default=os.environ.get("DRSVC_ROLE", "plugin"),
                    help="plugin: every service over a pool (a one-node site, or one storage node with "
                         "--node); controller: a multi-node site's controller, which holds no pool")
    ap.add_argument("--node", default=os.environ.get("DRSVC_NODE", ""),
                    help="this storage node's name in the site config's [nodes] (default: $DRSVC_NODE)")
    ap.add_argument("--log-level", default=os.environ.get("DRSVC_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role == "controller":
        return _serve_controller(ap, args)
    if args.config:
        cfg = load_config(Path(args.config), node=args.node)
        from workers.app import make_app
        from workers.client import CeleryDispatcher, load_result_backend
        from workers.titles import set_title
        set_title("plugin", cfg)
        app = make_app(cfg)
        thread_init = functools.partial(load_result_backend, app)
        site = Site.from_config(cfg, dispatcher=CeleryDispatcher(app))
        endpoint = args.endpoint or cfg.endpoint
    else:
        if not (args.pool and args.node_id):
            ap.error("--pool and --node-id are required without --config")
        site = Site.open(Path(args.pool), node_id=args.node_id, site_id=args.site)
        thread_init = None
        endpoint = args.endpoint
    if not endpoint:
        ap.error("--endpoint or CSI_ENDPOINT is required")
    sock = socket_path(endpoint)
    server = build_server(site, sock, block_metadata=args.block_metadata, thread_init=thread_init)
    server.start()
    # the read model's first listing would parse every unit's records: done now, beside serving
    threading.Thread(target=site.status.warm, name="status-warm", daemon=True).start()
    if site.replication is None:
        log.warning("%s", addons_servicers.NO_REPLICATION)
    log.info("serving CSI on unix://%s (pool %s, node %s, site %s%s)", sock, site.pool.root,
             site.node_id, site.pool.site, ", replication on" if site.replication else "")
    return _run(server, sock)


def _serve_controller(ap, args) -> int:
    if not args.config:
        ap.error("--role controller needs --config (the site's nodes)")
    cfg = load_config(Path(args.config))
    if not cfg.multinode:
        ap.error(f"{args.config} lists no [nodes]: a one-node site's plugin is its controller")
    from workers.app import make_app
    from workers.client import NodeDispatcher, load_result_backend
    from workers.titles import set_title
    set_title("controller", cfg)
    app = make_app(cfg)
    ctl = ClusterController(cfg, NodeDispatcher(app))
    endpoint = args.endpoint or cfg.endpoint
    if not endpoint:
        ap.error("--endpoint or CSI_ENDPOINT is required")
    sock = socket_path(endpoint)
    server = build_controller_server(ctl, sock, thread_init=functools.partial(load_result_backend, app))
    server.start()
    log.info("serving the CSI controller of site %s on unix://%s (nodes %s)", cfg.site, sock,
             ", ".join(sorted(cfg.nodes)))
    return _run(server, sock)


def _run(server: grpc.Server, sock: Path) -> int:
    wait_for_stop()
    log.info("shutting down")
    server.stop(grace=10).wait()
    sock.unlink(missing_ok=True)
    return 0
