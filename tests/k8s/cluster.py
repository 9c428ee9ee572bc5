"""One site's Kubernetes control plane, run as plain processes inside the site's network
namespace: etcd, kube-apiserver, kube-controller-manager (only its PV binder: there is no
kubelet, no scheduler, no container runtime), the upstream snapshot-controller and
csi-addons manager, and the drsvc controller Deployment's sidecars started with the args
and ServiceAccount of the rendered overlay (tests/k8s/manifests.py).

Every process is started through drsvc.runner, logs to <root>/logs/<name>.log and is
SIGKILLed at teardown."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from drsvc import runner
from drsvc_lab import kill

from . import pki
from .api import Api
from .netns import Netns

APISERVER_PORT = 6443
SERVICE_RANGE = "10.0.0.0/24"
ISSUER = "https://kubernetes.default.svc"
ANSWER = re.compile(r"code = (\w+) desc = [^\n]*?((?:vol|grp)-[0-9a-f]+)")
SA_DIR = "/run/secrets/kubernetes.io/serviceaccount"   # /var/run is /run here
# A pod's view of its service account: a private mount namespace whose /run is a tmpfs
# holding the token directory, at the in-cluster path client-go's rest.InClusterConfig reads
POD_SHELL = ('mount -t tmpfs tmpfs /run && mkdir -p "$2" && mount --bind "$1" "$2" && shift 2 && exec "$@"')


@dataclass
class Cluster:
    site: str
    root: Path
    ns: Netns
    bins: Path
    procs: dict = field(default_factory=dict)
    api: Api = None

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{APISERVER_PORT}"

    @property
    def kubeconfig(self) -> Path:
        return self.pki / "admin.kubeconfig"

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    # -- processes ------------------------------------------------------------------
    def spawn(self, name: str, argv: list, env: dict | None = None) -> subprocess.Popen:
        """Start *argv* in the site's namespace; a process of that name still running is
        an error (the harness would lose track of it)."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise AssertionError(f"{self.site}: {name} is already running (pid {old.pid})")
        self.log(name).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log(name), "ab") as out:
            p = runner.spawn([*self.ns.exec_argv, *argv], env=dict(os.environ, **(env or {})),
                             stdout=out, stderr=out, cwd=self.root)
        self.procs[name] = p
        return p

    def spawn_in_pod(self, name: str, sa_dir: Path, argv: list, env: dict | None = None):
        """Start *argv* as a container would see itself: its service account's token at
        the in-cluster path, KUBERNETES_SERVICE_HOST/PORT naming the apiserver."""
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(APISERVER_PORT), **(env or {})}
        return self.spawn(name, ["unshare", "-m", "--propagation", "private", "sh", "-c", POD_SHELL, name,
                                 sa_dir, SA_DIR, *argv], env)

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def check_alive(self, *names) -> None:
        """Every named process still runs; else fail with the tail of its log."""
        for n in names or list(self.procs):
            p = self.procs.get(n)
            if p is not None and p.poll() is not None:
                tail = self.log(n).read_text(errors="replace")[-3000:]
                raise AssertionError(f"{self.site}: {n} exited with {p.returncode}:\n{tail}")

    def stop(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is not None:
            kill(p.pid)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)

    # -- control plane --------------------------------------------------------------
    def start_control_plane(self) -> None:
        """etcd, apiserver, controller-manager; a restart keeps the PKI and etcd's data."""
        if not (self.pki / "ca.crt").exists():
            pki.make(self.pki)
            pki.kubeconfig(self.pki, self.server)
        self._start_etcd()
        self._start_apiserver()
        self.api = Api(self.ns, APISERVER_PORT, self.pki)
        self.api.wait(f"{self.site}'s apiserver /readyz", self._ready, timeout=120, interval=0.5)
        self.spawn("kube-controller-manager", [
            self.bins / "kube-controller-manager", f"--kubeconfig={self.kubeconfig}",
            "--controllers=persistentvolume-binder-controller", "--leader-elect=false",
            "--bind-address=127.0.0.1", "--secure-port=10257", f"--cert-dir={self.root / 'kcm-certs'}"])

    def _start_etcd(self) -> None:
        peer = "http://127.0.0.1:2380"
        self.spawn("etcd", [
            self.bins / "etcd", "--name", self.site, "--data-dir", self.root / "etcd",
            "--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.site}={peer}", "--unsafe-no-fsync"])

    def _start_apiserver(self) -> None:
        p = self.pki
        self.spawn("kube-apiserver", [
            self.bins / "kube-apiserver", "--etcd-servers=http://127.0.0.1:2379",
            "--bind-address=127.0.0.1", f"--secure-port={APISERVER_PORT}",
            # the kubernetes Service's endpoint may not be a loopback address
            f"--advertise-address={self.ns.addr}", f"--service-cluster-ip-range={SERVICE_RANGE}",
            f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}", f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
            "--authorization-mode=RBAC", "--allow-privileged=true", "--profiling=false",
            f"--audit-policy-file={self._audit_policy()}", f"--audit-log-path={self.audit_log}",
            f"--cert-dir={self.root / 'apiserver-certs'}"])

    @property
    def audit_log(self) -> Path:
        return self.root / "audit.log"

    def _audit_policy(self) -> Path:
        """Every request of a ServiceAccount of the drsvc namespace (the sidecars'), at
        Metadata: a sidecar denied a verb may only log it at a verbosity the manifests do
        not run (the provisioner's missing snapshot finalizer: --v=3), the audit log has it."""
        path = self.root / "audit-policy.yaml"
        path.write_text("apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n"
                        "- level: Metadata\n  userGroups: [\"system:serviceaccounts:drsvc\"]\n- level: None\n")
        return path

    def denials(self) -> list[str]:
        """The requests of the drsvc namespace's ServiceAccounts the apiserver refused (403)."""
        if not self.audit_log.exists():
            return []
        out = []
        for line in self.audit_log.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:          # the line the apiserver is writing
                continue
            if ev.get("responseStatus", {}).get("code") == 403:
                out.append(f"{self.site}: {ev['user']['username']} {ev['verb']} {ev['requestURI']}")
        return out

    def _ready(self) -> bool:
        self.check_alive("etcd", "kube-apiserver")
        try:
            status, _ = self.api.request("GET", "/readyz")
        except OSError:
            return False
        return status == 200

    # -- objects --------------------------------------------------------------------
    def kubectl(self, *args, input: str | None = None, timeout: float = 120) -> str:
        return runner.run([*self.ns.exec_argv, self.bins / "kubectl", f"--kubeconfig={self.kubeconfig}", *args],
                          input=input, timeout=timeout).stdout

    def apply(self, text: str) -> str:
        """Server-side apply, as the admin would: a manifest the apiserver refuses fails
        the suite with the apiserver's own words."""
        return self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text)

    def token(self, sa: str, ns: str, pod: dict | None = None) -> str:
        """A TokenRequest for ServiceAccount *ns/sa*, bound to *pod* as the kubelet binds
        a projected token."""
        spec = {"expirationSeconds": 86400, "audiences": [ISSUER]}
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        doc = self.api.post("ServiceAccount", sa, ns, "token",
                            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        return doc["status"]["token"]

    def sa_dir(self, name: str, token: str, ns: str) -> Path:
        """The files of a pod's service-account volume."""
        d = self.root / "sa" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "token").write_text(token)
        (d / "namespace").write_text(ns)
        (d / "ca.crt").write_bytes((self.pki / "ca.crt").read_bytes())
        return d

    def count(self, name: str, *words: str) -> int:
        """Lines of *name*'s log holding every one of *words* (a controller's retries)."""
        log = self.log(name)
        if not log.exists():
            return 0
        return sum(all(w in line for w in words) for line in log.read_text(errors="replace").splitlines())

    def error_codes(self, name: str) -> dict:
        """{(gRPC code, unit id): count} of the errors *name* (a sidecar) logged for drsvc's
        answers: a code repeated for one unit is a controller requeueing on drsvc's word."""
        log = self.log(name)
        text = log.read_text(errors="replace") if log.exists() else ""
        out = {}
        for code, unit in ANSWER.findall(text):
            out[(code, unit)] = out.get((code, unit), 0) + 1
        return out

    def wait_alive(self, name: str, seconds: float) -> None:
        """*name* keeps running for *seconds* (a sidecar that exits on a bad flag does so at once)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.check_alive(name)
            time.sleep(0.2)
