"""A throwaway PKI for one cluster: its CA, the apiserver's serving certificate (valid for
127.0.0.1 and the in-cluster names, since the sidecars run with in-cluster config), an
admin client certificate (system:masters) and the service-account signing key."""
from __future__ import annotations

from pathlib import Path

from drsvc import runner

SERVER_SANS = ("IP:127.0.0.1", "IP:10.0.0.1", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
               "DNS:kubernetes.default.svc")


def _ssl(*args) -> None:
    runner.run(["openssl", *args], timeout=60)


def _leaf(d: Path, name: str, subj: str, ext: str) -> None:
    _ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", d / f"{name}.key",
         "-out", d / f"{name}.csr", "-subj", subj)
    (d / f"{name}.ext").write_text(ext + "\n")
    _ssl("x509", "-req", "-in", d / f"{name}.csr", "-CA", d / "ca.crt", "-CAkey", d / "ca.key",
         "-CAcreateserial", "-days", "2", "-out", d / f"{name}.crt", "-extfile", d / f"{name}.ext")


def make(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    _ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", d / "ca.key",
         "-out", d / "ca.crt", "-subj", "/CN=drsvc-k8s-ca", "-days", "2")
    _leaf(d, "apiserver", "/CN=kube-apiserver",
          "subjectAltName=" + ",".join(SERVER_SANS) + "\nextendedKeyUsage=serverAuth")
    _leaf(d, "admin", "/O=system:masters/CN=drsvc-k8s-admin", "extendedKeyUsage=clientAuth")
    _ssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", d / "sa.key")
    _ssl("pkey", "-in", d / "sa.key", "-pubout", "-out", d / "sa.pub")
    return d


def kubeconfig(d: Path, server: str) -> Path:
    """The admin's kubeconfig (the harness's own, and the upstream controllers' that are
    not drsvc's to configure: snapshot-controller, csi-addons manager, controller-manager)."""
    path = d / "admin.kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {{server: "{server}", certificate-authority: "{d / 'ca.crt'}"}}
users:
- name: admin
  user: {{client-certificate: "{d / 'admin.crt'}", client-key: "{d / 'admin.key'}"}}
contexts:
- name: c
  context: {{cluster: c, user: admin}}
current-context: c
""")
    return path
