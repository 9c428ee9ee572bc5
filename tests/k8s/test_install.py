"""The install as shipped, under a real control plane: the binaries the suite runs, the
rendered overlays' sidecars running with their own ServiceAccount and RBAC, the
csi-addons sidecar connected to the manager, the provisioner binding a PVC."""
from __future__ import annotations

import urllib.request

import pytest

from . import bins, dr

pytestmark = pytest.mark.k8s


def test_binaries_are_the_tested_releases(bin_dir):
    """Each binary's --version: the suite names what it was run with (bins.TESTED)."""
    found = bins.versions(bin_dir)
    print("\n".join(f"{n}: {v}" for n, v in found.items()))
    assert not bins.untested(found), f"releases this suite was not run with (tested, found): {bins.untested(found)}"


def test_sidecars_hold_their_leases(sites):
    """The sidecars' --leader-election (args of deploy/base/controller.yaml) takes a Lease
    in the drsvc namespace under the Role drsvc-leader-election: a missing verb or a wrong
    namespace there leaves a lease unheld. Upstream callers: external-provisioner
    cmd/csi-provisioner/csi-provisioner.go, external-snapshotter cmd/csi-snapshotter/main.go,
    external-resizer cmd/csi-resizer/main.go, kubernetes-csi-addons sidecar/main.go (leaderelection)."""
    for s in sites.values():
        names, _ = s.api.wait(f"{s.name}: four leases held", lambda s=s: len(held(s)) >= 4 and held(s), 90,
                              interval=0.5)
        print(s.name, names)


def held(site) -> list[str]:
    leases = site.api.get("Lease", ns="drsvc")["items"]
    return [x["metadata"]["name"] for x in leases if x["spec"].get("holderIdentity")]


def connected(site) -> list[dict]:
    items = site.api.get("CSIAddonsNode", ns="drsvc")["items"]
    return [n for n in items if n.get("status", {}).get("state") == "Connected"]


def test_csiaddons_node_connected(sites):
    """The csi-addons sidecar registers a CSIAddonsNode named after the pod's owner (the
    Deployment, through its ReplicaSet), and the manager connects to it at status.podIP
    with TLS and its token, which the sidecar reviews (kubernetes-csi-addons
    sidecar/internal/csiaddonsnode/csiaddonsnode.go, internal/controller/csiaddons/csiaddonsnode_controller.go)."""
    for s in sites.values():
        nodes, secs = s.api.wait(f"{s.name}: CSIAddonsNode Connected", lambda s=s: connected(s), 120, interval=0.2)
        assert nodes[0]["spec"]["driver"]["name"] == "csi.drsvc.io"
        print(s.name, nodes[0]["metadata"]["name"], f"connected after {secs:.1f}s")


def test_livenessprobe_answers(sites):
    """The liveness-probe sidecar (kubernetes-csi/livenessprobe cmd/livenessprobe/main.go) probes
    the plugin through the socket: /healthz on --health-port answers 200."""
    for s in sites.values():
        with s.cluster.ns.entered(), urllib.request.urlopen("http://127.0.0.1:9808/healthz", timeout=10) as r:
            assert r.status == 200


def test_pvc_provisioned(sites):
    """A PVC of the shipped StorageClass is provisioned by csi-provisioner (CreateVolume,
    external-provisioner pkg/controller/controller.go) and bound by the PV binder."""
    a = sites["a"]
    dr.create_pvc(a, "install-probe")
    pv, secs = dr.wait_bound(a, "install-probe")
    assert dr.image(a, dr.handle(pv)).exists()
    print(f"Bound after {secs:.2f}s")
