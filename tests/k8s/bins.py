"""The binaries of the k8s suite, found through DRSVC_K8S_BIN alone (as controller-runtime's
envtest finds its assets through KUBEBUILDER_ASSETS), and the versions they report.

Nothing here builds or fetches them: the suite runs what the directory holds, and fails,
never skips, when something is missing, so a run that proves nothing cannot look green."""
from __future__ import annotations

import os
import re
from pathlib import Path

from drsvc import runner

ENV = "DRSVC_K8S_BIN"

# binary -> the version this suite was last run with for real (deploy/README.md)
TESTED = {
    "etcd": "3.5.1",
    "kube-apiserver": "v1.36.2",
    "kube-controller-manager": "v1.36.2",
    "kubectl": "v1.36.2",
    "csi-provisioner": "v6.3.0",
    "csi-snapshotter": "v8.6.0",
    "snapshot-controller": "v8.6.0",
    "csi-resizer": "v2.1.0",
    "livenessprobe": "v2.19.0",          # has no --version: named by the source it was built from
    "csi-addons-manager": "v0.14.0",
    "csi-addons-sidecar": "v0.14.0",
}
CRD_DIR = "crd"   # the upstream CRDs: external-snapshotter client/config/crd, kubernetes-csi-addons config/crd/bases
CRDS = (
    "snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
    "snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
    "snapshot.storage.k8s.io_volumesnapshots.yaml",
    "groupsnapshot.storage.k8s.io_volumegroupsnapshotclasses.yaml",
    "groupsnapshot.storage.k8s.io_volumegroupsnapshotcontents.yaml",
    "groupsnapshot.storage.k8s.io_volumegroupsnapshots.yaml",
    "csiaddons.openshift.io_csiaddonsnodes.yaml",
    # the manager starts a controller for each kind it knows, and exits when one's CRD is missing
    "csiaddons.openshift.io_reclaimspacejobs.yaml",
    "csiaddons.openshift.io_reclaimspacecronjobs.yaml",
    "csiaddons.openshift.io_networkfences.yaml",
    "csiaddons.openshift.io_networkfenceclasses.yaml",
    "csiaddons.openshift.io_encryptionkeyrotationjobs.yaml",
    "csiaddons.openshift.io_encryptionkeyrotationcronjobs.yaml",
    "replication.storage.openshift.io_volumereplicationclasses.yaml",
    "replication.storage.openshift.io_volumereplications.yaml",
    "replication.storage.openshift.io_volumegroupreplicationclasses.yaml",
    "replication.storage.openshift.io_volumegroupreplications.yaml",
    "replication.storage.openshift.io_volumegroupreplicationcontents.yaml",
)
VERSION_ARG = {"etcd": ["--version"], "kubectl": ["version", "--client"]}
UNREPORTED = frozenset({"livenessprobe"})     # its main has no version flag nor variable
UNREPORTED_VERSION = "(not reported by the binary)"
VERSION_RE = re.compile(r"v?\d+\.\d+\.\d+[\w.+-]*")


class MissingBinaries(AssertionError):
    """The suite was asked to run without what it needs: a failure, never a skip."""


def bin_dir() -> Path:
    """DRSVC_K8S_BIN, checked to hold every binary and CRD the suite runs."""
    d = os.environ.get(ENV)
    if not d:
        raise MissingBinaries(f"{ENV} is not set: it must name a directory holding {', '.join(TESTED)} "
                              f"and {CRD_DIR}/ with {', '.join(CRDS)}")
    root = Path(d)
    missing = [b for b in TESTED if not os.access(root / b, os.X_OK)]
    missing += [f"{CRD_DIR}/{c}" for c in CRDS if not (root / CRD_DIR / c).is_file()]
    if missing:
        raise MissingBinaries(f"{ENV}={d} lacks: {', '.join(missing)}")
    return root


def version(root: Path, name: str) -> str:
    """The version *name* reports (its --version), e.g. v1.36.2."""
    if name in UNREPORTED:
        return UNREPORTED_VERSION
    out = runner.run([root / name, *VERSION_ARG.get(name, ["--version"])], timeout=30, check=False)
    text = out.stdout + out.stderr
    if name == "etcd":
        text = text.split("etcd Version:", 1)[-1]
    m = VERSION_RE.search(text)
    if not m:
        raise MissingBinaries(f"{root / name} --version said nothing like a version: {text[:200]!r}")
    return m.group(0)


def versions(root: Path) -> dict:
    return {name: version(root, name) for name in TESTED}


def untested(found: dict) -> dict:
    """{binary: (tested, found)} for each binary whose release differs from the tested one
    (a build ahead of its tag, v6.3.0-56-g..., is that release)."""
    return {n: (TESTED[n], v) for n, v in found.items()
            if n not in UNREPORTED and not v.lstrip("v").startswith(TESTED[n].lstrip("v"))}
