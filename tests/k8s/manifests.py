"""What the suite takes from deploy/ as shipped: the rendered overlay of a site (applied
whole: namespace, ServiceAccounts, RBAC, classes, CSIDriver; its workloads stay inert
objects, nothing runs pods here), and the controller Deployment's sidecar containers,
whose args and ServiceAccount start the upstream binaries.

The pod those sidecars belong to is made the way a Deployment makes one (a ReplicaSet
owned by the Deployment, a Pod owned by the ReplicaSet, on the site's Node), since the
csi-addons sidecar names its CSIAddonsNode after that owner and reaches the manager
through the Pod's status.podIP."""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

from .cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "drsvc"
CONTROLLER = "drsvc-controller"
PLUGIN_CONTAINER = "drsvc"          # the plugin itself: drsvc_lab runs it, from the site's config
SOCKET_DIR = "/csi"                 # the socket-dir volume's mount path in every container
BINARY = {"csi-addons": "csi-addons-sidecar", "liveness-probe": "livenessprobe"}   # container -> binary (else its name)
FIELDS = {"metadata.namespace", "metadata.name", "metadata.uid", "spec.nodeName"}


def render(cluster: Cluster, overlay: str) -> tuple[str, list[dict]]:
    """`kubectl kustomize deploy/overlays/<overlay>`: the text to apply, and its documents."""
    text = cluster.kubectl("kustomize", REPO / "deploy" / "overlays" / overlay)
    return text, [d for d in yaml.safe_load_all(text) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"the render has no {kind} {name}")


def sidecars(deployment: dict) -> list[dict]:
    return [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] != PLUGIN_CONTAINER]


def _field(pod: dict, path: str) -> str:
    first, second = path.split(".")
    return pod[first][second]


def container_env(container: dict, pod: dict) -> dict:
    """The container's env as the kubelet fills it: literal values and the downward API's
    fields of *pod*. Another kind of source is a failure (the harness would guess)."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") in FIELDS:
            env[e["name"]] = _field(pod, e["valueFrom"]["fieldRef"]["fieldPath"])
        else:
            raise AssertionError(f"container {container['name']}: env {e['name']} has a source this harness "
                                 f"cannot give: {e}")
    return env


def container_args(container: dict, env: dict, socket: Path) -> list[str]:
    """The args with $(VAR) expanded (as the kubelet does) and the socket directory's
    mount path replaced by the site's socket directory (the lab's socket is csi.sock too)."""
    assert socket.name == "csi.sock", socket
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    if SOCKET_DIR not in mounts:
        raise AssertionError(f"container {container['name']} does not mount the socket dir at {SOCKET_DIR}")
    out = []
    for a in container.get("args", []):
        for k, v in env.items():
            a = a.replace(f"$({k})", v)
        if "$(" in a:
            raise AssertionError(f"container {container['name']}: arg {a!r} names a variable its env lacks")
        out.append(a.replace(f"{SOCKET_DIR}/", f"{socket.parent}/"))
    return out


def owned_pod(cluster: Cluster, deployment: dict, node: str) -> dict:
    """A ReplicaSet owned by *deployment* and a running Pod of its template owned by the
    ReplicaSet, on *node*, with the site's loopback as its podIP."""
    api, meta = cluster.api, deployment["metadata"]
    dep = api.get("Deployment", meta["name"], meta["namespace"])
    template = copy.deepcopy(deployment["spec"]["template"])
    rs = api.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                     "metadata": {"name": f"{meta['name']}-k8s", "namespace": meta["namespace"],
                                  "ownerReferences": [_owner(dep, "apps/v1")]},
                     "spec": {"replicas": 1, "selector": deployment["spec"]["selector"], "template": template}})
    spec = {**template["spec"], "nodeName": node}
    pod = api.create({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": f"{meta['name']}-k8s-0", "namespace": meta["namespace"],
                                   "labels": template["metadata"]["labels"],
                                   "ownerReferences": [_owner(rs, "apps/v1")]},
                      "spec": spec})
    status = {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}], "hostIP": cluster.ns.addr,
              "conditions": [{"type": "Ready", "status": "True"}]}
    return api.patch("Pod", pod["metadata"]["name"], meta["namespace"], {"status": status}, sub="status")


def _owner(obj: dict, api_version: str) -> dict:
    return {"apiVersion": api_version, "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def start_sidecars(cluster: Cluster, deployment: dict, pod: dict, socket: Path) -> list[str]:
    """Each sidecar of the rendered Deployment, as the binary of its name, with its args,
    env and the Deployment's ServiceAccount token (bound to the pod). Returns their names."""
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    ns = deployment["metadata"]["namespace"]
    sa_dir = cluster.sa_dir(sa, cluster.token(sa, ns, pod), ns)
    names = []
    for c in sidecars(deployment):
        env = container_env(c, pod)
        binary = cluster.bins / BINARY.get(c["name"], c["name"])
        cluster.spawn_in_pod(c["name"], sa_dir, [binary, *container_args(c, env, socket)], env)
        names.append(c["name"])
    return names
