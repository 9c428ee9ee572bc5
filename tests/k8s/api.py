"""A small REST client of one cluster's apiserver, as admin: one kept-alive HTTPS
connection opened inside the site's network namespace, so a poll of a VR's status costs
milliseconds and the measured time from a spec change to Completed is the controllers'."""
from __future__ import annotations

import http.client
import json
import ssl
import time
from pathlib import Path

from .netns import Netns

REPL = "apis/replication.storage.openshift.io/v1alpha1"
# kind -> (API prefix, resource, namespaced)
RESOURCES = {
    "Namespace": ("api/v1", "namespaces", False),
    "Node": ("api/v1", "nodes", False),
    "Pod": ("api/v1", "pods", True),
    "Secret": ("api/v1", "secrets", True),
    "ServiceAccount": ("api/v1", "serviceaccounts", True),
    "Event": ("api/v1", "events", True),
    "PersistentVolume": ("api/v1", "persistentvolumes", False),
    "PersistentVolumeClaim": ("api/v1", "persistentvolumeclaims", True),
    "ReplicaSet": ("apis/apps/v1", "replicasets", True),
    "Deployment": ("apis/apps/v1", "deployments", True),
    "CSINode": ("apis/storage.k8s.io/v1", "csinodes", False),
    "Lease": ("apis/coordination.k8s.io/v1", "leases", True),
    "VolumeSnapshot": ("apis/snapshot.storage.k8s.io/v1", "volumesnapshots", True),
    "VolumeSnapshotContent": ("apis/snapshot.storage.k8s.io/v1", "volumesnapshotcontents", False),
    "CSIAddonsNode": ("apis/csiaddons.openshift.io/v1alpha1", "csiaddonsnodes", True),
    "VolumeReplication": (REPL, "volumereplications", True),
    "VolumeGroupReplication": (REPL, "volumegroupreplications", True),
    "VolumeGroupReplicationContent": (REPL, "volumegroupreplicationcontents", False),
}


class ApiError(AssertionError):
    def __init__(self, method, path, status, body):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status


def path(kind: str, name: str | None = None, ns: str | None = None, sub: str | None = None) -> str:
    prefix, plural, namespaced = RESOURCES[kind]
    p = f"/{prefix}/" + (f"namespaces/{ns}/" if namespaced and ns else "") + plural
    return p + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


class Api:
    def __init__(self, ns: Netns, port: int, pki: Path):
        self.ns, self.port = ns, port
        self.ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self._conn = None

    def _connect(self) -> http.client.HTTPSConnection:
        with self.ns.entered():       # the socket belongs to the namespace it was made in
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx, timeout=60)
            conn.connect()
        return conn

    def request(self, method: str, p: str, body=None, ctype: str = "application/json"):
        """(status, document); a dropped kept-alive connection is opened again once."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(2):
            conn = self._conn or self._connect()
            try:
                conn.request(method, p, body=data, headers={"Content-Type": ctype, "Accept": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, OSError):
                self._conn = None
                conn.close()
                if attempt:
                    raise
                continue
            self._conn = conn
            if "json" not in (resp.getheader("Content-Type") or ""):
                return resp.status, {"text": raw.decode(errors="replace")}     # /readyz answers text
            return resp.status, (json.loads(raw) if raw else {})
        raise AssertionError("unreachable")

    def _ok(self, method, p, body=None, ctype="application/json"):
        status, doc = self.request(method, p, body, ctype)
        if status >= 300:
            raise ApiError(method, p, status, json.dumps(doc))
        return doc

    def get(self, kind, name=None, ns=None, sub=None):
        """The object (or list), or None when it does not exist."""
        status, doc = self.request("GET", path(kind, name, ns, sub))
        if status == 404:
            return None
        if status >= 300:
            raise ApiError("GET", path(kind, name, ns, sub), status, json.dumps(doc))
        return doc

    def create(self, doc: dict, sub: str | None = None, name: str | None = None):
        ns = doc.get("metadata", {}).get("namespace")
        return self._ok("POST", path(doc["kind"], name, ns, sub), doc)

    def post(self, kind, name, ns, sub, body):
        return self._ok("POST", path(kind, name, ns, sub), body)

    def patch(self, kind, name, ns, body, sub=None):
        return self._ok("PATCH", path(kind, name, ns, sub), body, "application/merge-patch+json")

    def delete(self, kind, name, ns=None):
        status, doc = self.request("DELETE", path(kind, name, ns))
        if status not in (200, 202, 404):
            raise ApiError("DELETE", path(kind, name, ns), status, json.dumps(doc))

    def wait(self, what: str, pred, timeout: float = 120, interval: float = 0.05):
        """Poll *pred()* until truthy; return (value, seconds waited)."""
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < timeout:
            last = pred()
            if last:
                return last, time.monotonic() - t0
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
