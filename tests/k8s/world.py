"""Two sites, each a cluster over a drsvc site, as a DR pair: site a renders
deploy/overlays/site-a, site b deploy/overlays/site-b; both run in network namespaces of
their own joined by a veth pair."""
from __future__ import annotations

import base64
import copy
import os
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from csi_plugin.gen import csi_pb2, csi_pb2_grpc
from drsvc_lab import LabSite, kill

from . import bins, manifests, netns
from .cluster import Cluster
from .sites import NetLab

ADDONS_NS = "csi-addons-system"
ADDONS_SA = "csi-addons-controller-manager"
LAB_COMPONENTS = ("plugin", "worker", "control", "scheduler")
STARTUP_GRACE = 5      # seconds a sidecar must keep running: a bad flag or a forbidden call exits sooner


@dataclass
class K8sSite:
    name: str
    cluster: Cluster
    lab_site: LabSite
    render: list = field(default_factory=list)
    sidecars: list = field(default_factory=list)
    pod: dict = None

    @property
    def api(self):
        return self.cluster.api

    @property
    def socket(self) -> Path:
        return self.lab_site.root / "csi.sock"

    @property
    def node(self) -> str:
        return self.lab_site.cfg.node_id


def node_info(socket: Path) -> csi_pb2.NodeGetInfoResponse:
    """What the plugin tells a kubelet about its node (node-driver-registrar's question)."""
    with grpc.insecure_channel(f"unix://{socket}") as ch:
        return csi_pb2_grpc.NodeStub(ch).NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=30)


def register_node(site: K8sSite) -> None:
    """The Node and CSINode a kubelet and the node-driver-registrar would publish, from
    the plugin's own NodeGetInfo, so the provisioner's topology is the plugin's."""
    info = node_info(site.socket)
    segments = dict(info.accessible_topology.segments)
    site.api.create({"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": site.node, "labels": {"kubernetes.io/hostname": site.node,
                                                                "drsvc.io/storage-node": "true", **segments}}})
    site.api.create({"apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
                     "metadata": {"name": site.node},
                     "spec": {"drivers": [{"name": "csi.drsvc.io", "nodeID": info.node_id,
                                           "topologyKeys": sorted(segments)}]}})


def apply_deploy(site: K8sSite, token: str) -> None:
    """The upstream CRDs, then the overlay's render as shipped, then the one Secret whose
    placeholder must be the site's real value (the RPC token the plugin requires)."""
    crd = site.cluster.bins / bins.CRD_DIR
    site.cluster.apply("\n---\n".join((crd / c).read_text() for c in bins.CRDS))
    site.cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                         *(f"crd/{c.split('_', 1)[1].removesuffix('.yaml')}.{c.split('_', 1)[0]}" for c in bins.CRDS))
    text, site.render = manifests.render(site.cluster, f"site-{site.name}")
    site.cluster.apply(text)
    site.api.patch("Secret", "drsvc-rpc-token", manifests.NAMESPACE,
                   {"data": {"token": base64.b64encode(token.encode()).decode()}})
    for kind, name in (("VolumeReplicationClass", "drsvc"), ("VolumeGroupReplicationClass", "drsvc-group")):
        site.cluster.apply(yaml.safe_dump(fast_class(manifests.find(site.render, kind, name))))


FAST = "30s"


def fast_class(shipped: dict) -> dict:
    """The shipped class with schedulingInterval 30s (its only change), named <name>-30s:
    the controller asks for a primary's last sync every interval (halved from 2 min up), so
    the shipped 5m would make each check of lastSyncTime a wait of minutes."""
    doc = copy.deepcopy(shipped)
    doc["metadata"] = {"name": f"{shipped['metadata']['name']}-{FAST}", "labels": shipped["metadata"].get("labels", {})}
    doc["spec"]["parameters"]["schedulingInterval"] = FAST
    return doc


def addons_identity(site: K8sSite) -> None:
    """The manager's namespace and ServiceAccount: the manager works through the admin's
    kubeconfig, and shows the sidecar its own service-account token, which the sidecar
    reviews (TokenReview)."""
    c = site.cluster
    site.api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ADDONS_NS}})
    site.api.create({"apiVersion": "v1", "kind": "ServiceAccount",
                     "metadata": {"name": ADDONS_SA, "namespace": ADDONS_NS}})
    c.sa_dir(ADDONS_SA, c.token(ADDONS_SA, ADDONS_NS), ADDONS_NS)


def start_controllers(site: K8sSite) -> None:
    """The cluster-wide controllers that are not drsvc's manifests, with upstream defaults."""
    c = site.cluster
    c.spawn("snapshot-controller", [c.bins / "snapshot-controller", f"--kubeconfig={c.kubeconfig}"])
    c.spawn_in_pod("csi-addons-manager", c.root / "sa" / ADDONS_SA,
                   [c.bins / "csi-addons-manager", f"--namespace={ADDONS_NS}",
                    "--health-probe-bind-address=127.0.0.1:8081"], {"KUBECONFIG": str(c.kubeconfig)})


def start_site_cluster(site: K8sSite, token: str) -> None:
    site.cluster.start_control_plane()
    apply_deploy(site, token)
    register_node(site)
    addons_identity(site)
    start_controllers(site)
    dep = manifests.find(site.render, "Deployment", manifests.CONTROLLER)
    site.pod = manifests.owned_pod(site.cluster, dep, site.node)
    start_sidecars(site)


def start_sidecars(site: K8sSite) -> None:
    dep = manifests.find(site.render, "Deployment", manifests.CONTROLLER)
    site.sidecars = manifests.start_sidecars(site.cluster, dep, site.pod, site.socket)
    site.cluster.wait_alive(site.sidecars[0], STARTUP_GRACE)
    site.cluster.check_alive()


@dataclass
class World:
    root: Path
    bin_dir: Path
    spaces: dict
    lab: NetLab
    sites: dict

    def kill_site(self, name: str) -> None:
        """Site *name* lost: every process of its cluster and of its drsvc site SIGKILLed
        (its disks, etcd's data and the pool, stay)."""
        site, lab_site = self.sites[name], self.lab.sites[name]
        site.cluster.stop_all()
        for c in LAB_COMPONENTS:
            lab_site.run.stop(c, sig=signal.SIGKILL)
        self.lab.stop_sshd(name)
        kill(lab_site.redis_pid)

    def restart_site(self, name: str) -> None:
        """Site *name* back: its drsvc site, then its cluster from etcd's data, its
        controllers and sidecars with the tokens they had."""
        site = self.sites[name]
        self.lab.restart_redis(name)
        self.lab.start_sshd(name)
        self.lab.up(name)
        site.cluster.start_control_plane()
        start_controllers(site)
        start_sidecars(site)

    def teardown(self) -> None:
        for s in self.sites.values():
            s.cluster.stop_all()
        self.lab.teardown()
        netns.delete(self.spaces)


def build(bin_dir: Path) -> World:
    root = Path(tempfile.mkdtemp(prefix="drsvc-k8s-"))
    prefix = f"drsvck8s{os.getpid()}"
    spaces = netns.create_pair(prefix)
    lab = NetLab(root / "lab", spaces)
    world = World(root, bin_dir, spaces, lab, {})
    try:
        lab.build()
        lab.up()
        for n, ns in spaces.items():
            world.sites[n] = K8sSite(n, Cluster(n, root / f"k8s-{n}", ns, bin_dir), lab.sites[n])
        for n, s in world.sites.items():
            start_site_cluster(s, lab.tokens[n])
    except BaseException:
        world.teardown()
        raise
    return world
