"""deploy/: every overlay renders with `kubectl kustomize`, every object validates against the
Kubernetes schemas, and the rendered manifests keep their promises.

The RBAC each sidecar needs is read from the sidecars' own RBAC files upstream (at the
versions deploy/base/kustomization.yaml pins):
- csi-provisioner v5/v6: kubernetes-csi/external-provisioner deploy/kubernetes/rbac.yaml
  (v5 lists csinodes and volumeattachments where v1 listed csinodeinfos, and leases where v1
  used endpoints for leader election; `update` on volumesnapshots for the finalizer that
  protects a restore's source snapshot, pkg/controller/controller.go);
- csi-snapshotter v8: kubernetes-csi/external-snapshotter
  deploy/kubernetes/csi-snapshotter/rbac-csi-snapshotter.yaml, group snapshots included
  (groupsnapshot.storage.k8s.io volumegroupsnapshotclasses, volumegroupsnapshotcontents and
  their status);
- csi-resizer v1.12: kubernetes-csi/external-resizer deploy/kubernetes/rbac.yaml, plus
  volumeattributesclasses for --feature-gates=VolumeAttributesClass;
- csi-snapshot-metadata: kubernetes-csi/external-snapshot-metadata
  deploy/snapshot-metadata-cluster-role.yaml;
- the csi-addons sidecar: csi-addons/kubernetes-csi-addons
  sidecar/internal/csiaddonsnode/csiaddonsnode.go (it POSTs its CSIAddonsNode, owned by its pod).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = sorted(p.name for p in (DEPLOY / "components").iterdir() if (p / "kustomization.yaml").exists())
K8S_VERSION = "1.34.0"      # VolumeAttributesClass is storage.k8s.io/v1 from 1.34 on
# kinds of CRDs the prerequisites install: no schema in kubernetes-validate, skipped by name
CRD_KINDS = {"VolumeSnapshotClass", "VolumeGroupSnapshotClass", "VolumeReplicationClass",
             "VolumeGroupReplicationClass", "Issuer", "Certificate", "SnapshotMetadataService", "PrometheusRule"}

# (apiGroup, resource, verbs) each sidecar's upstream RBAC file asks for (docstring)
LEASES = ("coordination.k8s.io", "leases", {"get", "watch", "list", "delete", "update", "create"})
NEEDS = {
    "csi-provisioner": [("", "persistentvolumes", {"get", "list", "watch", "create", "delete"}),
                        ("", "persistentvolumeclaims", {"get", "list", "watch", "update"}),
                        ("storage.k8s.io", "storageclasses", {"get", "list", "watch"}),
                        ("", "events", {"list", "watch", "create", "update", "patch"}),
                        ("snapshot.storage.k8s.io", "volumesnapshots", {"get", "list", "update"}),
                        ("snapshot.storage.k8s.io", "volumesnapshotcontents", {"get", "list"}),
                        ("storage.k8s.io", "csinodes", {"get", "list", "watch"}),
                        ("", "nodes", {"get", "list", "watch"}),
                        ("storage.k8s.io", "volumeattachments", {"get", "list", "watch"}), LEASES],
    "csi-snapshotter": [("", "events", {"list", "watch", "create", "update", "patch"}),
                        ("snapshot.storage.k8s.io", "volumesnapshotclasses", {"get", "list", "watch"}),
                        ("snapshot.storage.k8s.io", "volumesnapshotcontents",
                         {"create", "get", "list", "watch", "update", "patch"}),
                        ("snapshot.storage.k8s.io", "volumesnapshotcontents/status", {"update", "patch"}),
                        ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses", {"get", "list", "watch"}),
                        ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents",
                         {"get", "list", "watch", "update", "patch"}),
                        ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents/status", {"update", "patch"}),
                        LEASES],
    "csi-resizer": [("", "persistentvolumes", {"get", "list", "watch", "patch"}),
                    ("", "persistentvolumeclaims", {"get", "list", "watch"}),
                    ("", "persistentvolumeclaims/status", {"patch"}),
                    ("", "events", {"list", "watch", "create", "update", "patch"}),
                    ("storage.k8s.io", "volumeattributesclasses", {"get", "list", "watch"}), LEASES],
    "csi-snapshot-metadata": [("cbt.storage.k8s.io", "snapshotmetadataservices", {"get", "list", "watch"}),
                              ("authentication.k8s.io", "tokenreviews", {"create"}),
                              ("authorization.k8s.io", "subjectaccessreviews", {"create"}),
                              ("snapshot.storage.k8s.io", "volumesnapshots", {"get", "list"}),
                              ("snapshot.storage.k8s.io", "volumesnapshotcontents", {"get", "list"})],
    "csi-addons": [("csiaddons.openshift.io", "csiaddonsnodes", {"create"}),
                   ("", "pods", {"get"}), ("apps", "replicasets", {"get"}), ("apps", "deployments", {"get"}),
                   LEASES],
}


def kubectl() -> str:
    path = shutil.which("kubectl")
    assert path, "kubectl is missing: run scripts/setup.sh (Debian's kubernetes-client)"
    p = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    minor = int(json.loads(p.stdout)["clientVersion"]["minor"].rstrip("+")) if p.returncode == 0 else 0
    assert minor >= 21, (f"{path} is kubectl 1.{minor}, whose kustomize (v2) has no components: deploy/ needs "
                         "kubectl 1.21+ (kustomize v4+)")
    return path


def render(path: Path) -> list[dict]:
    p = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"kubectl kustomize {path}: {p.stderr}"
    return [d for d in yaml.safe_load_all(p.stdout) if d]


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> dict[str, list[dict]]:
    """Every overlay, and site-a with each optional component (a throw-away overlay)."""
    out = {name: render(DEPLOY / "overlays" / name) for name in OVERLAYS}
    for comp in COMPONENTS:
        if comp in ("multinode", "versions"):
            continue                      # overlays/multinode-site-a is multinode's; versions is in every one
        d = tmp_path_factory.mktemp(f"site-a-{comp}")
        (d / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(DEPLOY / "overlays" / "site-a", d)],     # kustomize wants
            "components": [os.path.relpath(DEPLOY / "components" / c, d)       # relative paths
                           for c in (comp, "versions")]}))
        out[f"site-a+{comp}"] = render(d)
    return out


def pods(objs):
    """(workload, pod spec) of every Deployment, DaemonSet and StatefulSet."""
    return [(o, o["spec"]["template"]["spec"]) for o in objs if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def site_config(objs) -> dict:
    [cm] = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("drsvc-site")]
    return tomllib.loads(cm["data"]["site.toml"])


def test_every_overlay_renders(renders):
    assert {"site-a", "site-b", "multinode-site-a"} <= set(renders)
    assert {"snapshot-metadata", "multinode", "volume-attributes", "versions"} <= set(COMPONENTS)
    counts = {name: len(objs) for name, objs in renders.items()}
    print("rendered objects per overlay:", counts)
    assert all(counts.values()), counts
    a, b = site_config(renders["site-a"]), site_config(renders["site-b"])
    assert (a["site"], list(a["peers"]), b["site"], list(b["peers"])) == ("a", ["b"], "b", ["a"])
    assert a["zone"] == b["zone"]      # the topology value is the pair's, at both sites


def test_every_object_validates(renders):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    skipped, invalid = set(), []
    for name, objs in renders.items():
        for o in objs:
            try:
                kubernetes_validate.validate(o, K8S_VERSION, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                skipped.add(o["kind"])
            except kubernetes_validate.ValidationError as e:
                invalid.append(f"{name}: {o['kind']} {o['metadata']['name']}: {e.message} at {list(e.path)}")
    print(f"validated against Kubernetes {K8S_VERSION}; CRD kinds skipped: {sorted(skipped)}")
    assert not invalid, "\n".join(invalid)
    assert skipped <= CRD_KINDS, f"no schema for {sorted(skipped - CRD_KINDS)}: not a known CRD kind"


def test_sidecars_talk_to_the_plugins_socket(renders):
    for name, objs in renders.items():
        cfg = site_config(objs)
        sock = cfg["endpoint"].removeprefix("unix://")
        for wl, spec in pods(objs):
            mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
                      for c in spec["containers"]}
            plugin = next((c for c in spec["containers"] if "csi_plugin" in c.get("command", [])), None)
            if plugin is None:
                continue
            # the plugin reads the config it is given, and serves the socket the config names
            cfg_arg = plugin["command"][plugin["command"].index("--config") + 1]
            assert cfg_arg in mounts[plugin["name"]].values(), (name, wl["metadata"]["name"])
            sock_vol = next(v for v, p in mounts[plugin["name"]].items() if sock.startswith(p + "/"))
            for c in spec["containers"]:
                args = c.get("args", [])
                addr = [a.split("=", 1)[1] for a in args if a.startswith(("--csi-address=", "--csi-addons-address="))]
                if not addr:
                    continue
                assert [a.removeprefix("unix://") for a in addr] == [sock], (name, c["name"], addr)
                assert mounts[c["name"]].get(sock_vol) == mounts[plugin["name"]][sock_vol], (name, c["name"])
                if c["name"] == "liveness-probe":     # the plugin's healthz port is the probe's
                    port = next(a.split("=")[1] for a in args if a.startswith("--health-port="))
                    assert {"name": "healthz", "containerPort": int(port), "protocol": "TCP"} in plugin["ports"]
                if c["name"] == "node-driver-registrar":   # kubelet finds the socket on the host
                    reg = next(a.split("=")[1] for a in args if a.startswith("--kubelet-registration-path="))
                    host = next(v["hostPath"]["path"] for v in spec["volumes"] if v["name"] == sock_vol)
                    assert reg == f"{host}/{Path(sock).name}", (name, reg, host)


def _rules_of(objs, sa: str) -> list[dict]:
    roles = {(o["kind"], o["metadata"]["name"]): o.get("rules", []) for o in objs if o["kind"] in ("Role", "ClusterRole")}
    out = []
    for b in objs:
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding") and any(
                s["kind"] == "ServiceAccount" and s["name"] == sa for s in b.get("subjects", [])):
            out += roles.get((b["roleRef"]["kind"], b["roleRef"]["name"]), [])
    return out


def _allows(rules, group: str, resource: str, verbs: set) -> set:
    """The verbs of *verbs* the rules do not grant on group/resource."""
    granted = set()
    for r in rules:
        if group in r.get("apiGroups", []) and resource in r.get("resources", []):
            granted |= set(r.get("verbs", []))
    return set() if "*" in granted else verbs - granted


def test_service_accounts_cover_their_sidecars(renders):
    seen = set()
    for name, objs in renders.items():
        for _wl, spec in pods(objs):
            sa = spec.get("serviceAccountName", "default")
            rules = _rules_of(objs, sa)
            for c in spec["containers"]:
                for need in NEEDS.get(c["name"], []):
                    missing = _allows(rules, *need)
                    assert not missing, f"{name}: {sa} ({c['name']}) lacks {sorted(missing)} on {need[:2]}"
                    seen.add(c["name"])
    assert seen == set(NEEDS), f"sidecars never rendered: {set(NEEDS) - seen}"


def test_referenced_secrets_and_configmaps_are_in_the_render(renders):
    for name, objs in renders.items():
        have = {(o["kind"], o["metadata"]["name"]) for o in objs}
        # a cert-manager Certificate in the render makes its Secret
        have |= {("Secret", o["spec"]["secretName"]) for o in objs if o["kind"] == "Certificate"}
        for wl, spec in pods(objs):
            refs = [("Secret", v["secret"]["secretName"]) for v in spec.get("volumes", []) if "secret" in v]
            refs += [("ConfigMap", v["configMap"]["name"]) for v in spec.get("volumes", []) if "configMap" in v]
            for c in spec["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {})
                    if "secretKeyRef" in ref:
                        refs.append(("Secret", ref["secretKeyRef"]["name"]))
                    if "configMapKeyRef" in ref:
                        refs.append(("ConfigMap", ref["configMapKeyRef"]["name"]))
            missing = [r for r in refs if r not in have]
            assert not missing, f"{name}: {wl['metadata']['name']} refers to {missing}, not in the render"


def test_one_version_per_image_and_probes_and_requests(renders):
    tags: dict[str, set] = {}
    for name, objs in renders.items():
        for wl, spec in pods(objs):
            containers = spec["containers"]
            assert any("livenessProbe" in c or "readinessProbe" in c for c in containers), \
                f"{name}: {wl['metadata']['name']} has no probe"
            for c in containers:
                assert c.get("resources", {}).get("requests"), f"{name}: {c['name']} has no resource requests"
                image, _, tag = c["image"].rpartition(":")
                assert image and tag, f"{name}: {c['name']} image {c['image']} has no tag"
                tags.setdefault(image, set()).add(tag)
                if c["image"].split(":")[0].endswith("/drsvc"):     # our processes: each has a liveness probe
                    assert "livenessProbe" in c, f"{name}: {wl['metadata']['name']}/{c['name']}"
    assert all(len(t) == 1 for t in tags.values()), {i: t for i, t in tags.items() if len(t) > 1}


def test_redis_password_is_given_once(renders):
    """Only in the Secret drsvc-redis: site.toml's redis_url has none, every process that talks
    to Redis reads it through DRSVC_REDIS_PASSWORD, and redis-server from the same key."""
    for name, objs in renders.items():
        cfg = site_config(objs)
        assert "@" not in cfg["redis_url"], (name, cfg["redis_url"])
        for _wl, spec in pods(objs):
            for c in spec["containers"]:
                cmd = " ".join(c.get("command", []))
                talks = any(w in cmd for w in ("csi_plugin", "drsvc worker", "drsvc scheduler", "redis-server"))
                if not talks:
                    continue
                env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in c.get("env", [])}
                key = "REDIS_PASSWORD" if "redis-server" in cmd else "DRSVC_REDIS_PASSWORD"
                assert env.get(key) == {"name": "drsvc-redis", "key": "password"}, (name, c["name"], env)


def test_components_change_what_they_say(renders):
    ctl = {n: next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "drsvc-controller")
           for n, objs in renders.items()}

    def containers(n):
        return {c["name"]: c for c in ctl[n]["spec"]["template"]["spec"]["containers"]}
    assert "csi-snapshot-metadata" not in containers("site-a")
    assert "csi-snapshot-metadata" in containers("site-a+snapshot-metadata")
    assert "--feature-gates=VolumeAttributesClass=true" in containers("site-a+volume-attributes")["csi-resizer"]["args"]
    assert [o["metadata"]["name"] for o in renders["site-a+monitoring"] if o["kind"] == "PrometheusRule"] == ["drsvc"]
    m = renders["multinode-site-a"]
    assert containers("multinode-site-a")["drsvc"]["command"][-2:] == ["--role", "controller"]
    assert not {"drsvc-worker", "drsvc-metrics"} & {o["metadata"]["name"] for o in m if o["kind"] == "Deployment"}
    node = next(o for o in m if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert {"worker", "control", "api", "scheduler", "metrics"} <= {c["name"] for c in node["containers"]}
    assert site_config(m)["nodes"]


# the prefixed class parameters the csi-addons controller reads its secret from
# (kubernetes-csi-addons internal/controller/replication.storage/parameters.go)
CLASS_SECRET_KEYS = {
    "VolumeReplicationClass": "replication.storage.openshift.io/replication-secret-",
    "VolumeGroupReplicationClass": "replication.storage.openshift.io/group-replication-secret-",
}


def test_replication_classes_name_a_secret_in_the_render(renders):
    """The csi-addons sidecar gets the class's Secret before every call, unconditionally
    (kubernetes-csi-addons sidecar/internal/service/replication.go: every ReplicationServer
    method calls kube.GetSecret with the request's secret name and namespace and answers
    Internal when it fails), so a class without the secret lines fails every call before drsvc is asked:
    each replication class names a Secret that each overlay renders."""
    for name, objs in renders.items():
        secrets = {(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs if o["kind"] == "Secret"}
        classes = [o for o in objs if o["kind"] in CLASS_SECRET_KEYS]
        assert {o["kind"] for o in classes} == set(CLASS_SECRET_KEYS), name
        for o in classes:
            params, prefix = o["spec"]["parameters"], CLASS_SECRET_KEYS[o["kind"]]
            ref = (params.get(prefix + "namespace"), params.get(prefix + "name"))
            assert all(ref), f"{name}: {o['kind']} {o['metadata']['name']} names no secret"
            assert ref in secrets, f"{name}: {o['kind']} {o['metadata']['name']} names {ref}, not in the render"


def test_group_snapshot_class_uses_the_served_v1_api(renders):
    """Kubernetes 1.36 with external-snapshotter v8.6 serves groupsnapshot.storage.k8s.io/v1
    and reports v1beta1 as deprecated (client/config/crd of external-snapshotter)."""
    for name, objs in renders.items():
        versions = {o["apiVersion"] for o in objs if o["kind"].startswith("VolumeGroupSnapshot")}
        assert versions == {"groupsnapshot.storage.k8s.io/v1"}, f"{name}: {versions}"
