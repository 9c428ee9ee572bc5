"""A two-site DR lab on one host, for the demo, the tests and the bench.

Each site gets a pool on its own loop-mounted XFS, a redis-server, an sshd on loopback
that lets the peer's dedicated key run only our receiver (forced command), pinned host
keys, and a site config. Processes are started through drsvc.runner; `teardown()` undoes
everything.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from drsvc import store
from drsvc.config import SiteConfig, load
from drsvc.sitectl import COMPONENTS, SiteRun

from .logs import keep_logs
from .net import free_port
from .pools import discard_under, mount_xfs, unmount_under
from .procs import kill, kill_components, kill_if
from .redis_server import spawn_redis
from .sshd import (authorized_line, keygen, kill_logins, kill_sshd, known_hosts_line, start_sshd,
                   write_authorized)


@dataclass
class LabSite:
    name: str
    root: Path
    pool: Path = None
    fs_image: Path = None
    redis_port: int = 0
    redis_pid: int = 0
    sshd_port: int = 0
    sshd_pid: int = 0
    config_path: Path = None
    procs: list = field(default_factory=list)

    @property
    def cfg(self) -> SiteConfig:
        return load(self.config_path)

    @property
    def run(self) -> SiteRun:
        return SiteRun(self.cfg)

    @property
    def endpoint(self) -> str:
        return f"unix://{self.root}/csi.sock"

    @property
    def ssh(self) -> Path:
        return self.root / "ssh"


class Lab:
    def __init__(self, root: Path, names=("a", "b"), *, pool_size: str = "20G",
                 pool_sizes: dict | None = None,
                 redis_password: str | None = None, visibility_timeout: int = 20):
        self.root = Path(root)
        self.sites = {n: LabSite(n, self.root / n) for n in names}
        self.pool_size = pool_size
        self.pool_sizes = dict(pool_sizes or {})    # per-site override, e.g. a small peer to fill up
        self.redis_password = redis_password
        self.visibility_timeout = visibility_timeout

    # -- building blocks -------------------------------------------------------------
    def _mount_pool(self, s: LabSite) -> None:
        s.fs_image, mnt = mount_xfs(s.root, "pool-fs", self.pool_sizes.get(s.name, self.pool_size))
        s.pool = mnt / "pool"

    def _spawn_redis(self, s: LabSite) -> None:
        p = spawn_redis(s.root / "redis", s.redis_port, self.redis_password)
        s.redis_pid = p.pid
        s.procs.append(p)

    def _start_redis(self, s: LabSite) -> None:
        s.redis_port = free_port()
        self._spawn_redis(s)

    def restart_redis(self, name: str) -> None:
        s = self.sites[name]
        kill(s.redis_pid)
        self._spawn_redis(s)
        self.save()

    def _keys(self) -> None:
        """Host keys per site, and one replication key per direction."""
        for s in self.sites.values():
            s.ssh.mkdir(parents=True, exist_ok=True)
            os.chmod(s.ssh, 0o700)
            keygen(s.ssh / "host_ed25519", f"drsvc-host-{s.name}")
            for peer in self.sites:
                if peer != s.name:
                    keygen(s.ssh / f"to-{peer}", f"drsvc-{s.name}-to-{peer}")

    def _authorized(self, s: LabSite, env: dict | None = None) -> list[str]:
        return [authorized_line(s.pool, (peer.ssh / f"to-{s.name}.pub").read_text().strip(), env=env)
                for peer in self.sites.values() if peer.name != s.name]

    def authorize(self, name: str, env: dict | None = None) -> None:
        """Rewrite the site's authorized_keys: the peers' keys run the receiver with *env*
        (e.g. DRSVC_FAILPOINTS); logins made before keep their command (kill_logins)."""
        s = self.sites[name]
        write_authorized(s.ssh / "authorized_keys", self._authorized(s, env))

    def kill_logins(self, name: str) -> int:
        """End every established login at the site's sshd (its listener stays)."""
        return kill_logins(self.sites[name].sshd_pid)

    def _start_sshd(self, s: LabSite) -> None:
        s.sshd_port = s.sshd_port or free_port()
        p = start_sshd(s.ssh, "127.0.0.1", s.sshd_port, self._authorized(s))
        s.sshd_pid = p.pid
        s.procs.append(p)

    def stop_sshd(self, name: str) -> None:
        """An SSH outage at the site: the listener and every established login go down."""
        s = self.sites[name]
        kill_sshd(s.sshd_pid)
        s.sshd_pid = 0

    def start_sshd(self, name: str) -> None:
        self._start_sshd(self.sites[name])
        self.save()

    def _write_config(self, s: LabSite) -> None:
        peers = []
        for peer in self.sites.values():
            if peer.name == s.name:
                continue
            kh = s.ssh / f"{peer.name}.known_hosts"
            kh.write_text(known_hosts_line("127.0.0.1", peer.sshd_port,
                                           (peer.ssh / "host_ed25519.pub").read_text()) + "\n")
            peers.append(f'[peers.{peer.name}]\nhost = "127.0.0.1"\nport = {peer.sshd_port}\nuser = "root"\n'
                         f'known_hosts = "{kh}"\nkey = "{s.ssh / f"to-{peer.name}"}"\n')
        auth = f":{self.redis_password}@" if self.redis_password else ""
        s.config_path = s.root / "site.toml"
        s.config_path.write_text(
            f'site = "{s.name}"\nnode_id = "{s.name}-node"\npool = "{s.pool}"\n'
            f'endpoint = "{s.endpoint}"\nredis_url = "redis://{auth}127.0.0.1:{s.redis_port}/0"\n'
            f'metrics_port = {free_port()}\nvisibility_timeout = {self.visibility_timeout}\n\n'
            + "\n".join(peers))
        os.chmod(s.config_path, 0o600)    # it may carry the Redis password

    # -- whole lab -------------------------------------------------------------------
    def build(self) -> Lab:
        for s in self.sites.values():
            self._mount_pool(s)
            self._start_redis(s)
        self._keys()
        for s in self.sites.values():
            self._start_sshd(s)
        for s in self.sites.values():
            self._write_config(s)
        self.save()
        return self

    # -- a lab left running (`drsvc demo --keep`) is found again from its root -----------
    @property
    def record_path(self) -> Path:
        return self.root / "lab.json"

    def save(self) -> None:
        """Record what this lab started, so another process can tear it down (`demo down`)."""
        store.write_doc(self.record_path, {"sites": {n: {
            "redis_pid": s.redis_pid, "sshd_pid": s.sshd_pid, "redis_port": s.redis_port,
            "sshd_port": s.sshd_port, "config_path": str(s.config_path) if s.config_path else None}
            for n, s in self.sites.items()}})

    @classmethod
    def find(cls, root) -> Lab | None:
        """The lab recorded under *root*, or None."""
        doc = store.read_doc(Path(root) / "lab.json")
        if doc is None:
            return None
        lab = cls(root, names=tuple(doc["sites"]))
        for n, rec in doc["sites"].items():
            s = lab.sites[n]
            s.redis_pid, s.sshd_pid = rec["redis_pid"], rec["sshd_pid"]
            s.redis_port, s.sshd_port = rec["redis_port"], rec["sshd_port"]
            s.config_path = Path(rec["config_path"]) if rec.get("config_path") else None
        return lab

    def up(self, *names, components=("plugin", "worker", "control", "scheduler", "metrics")) -> None:
        for n in names or self.sites:
            self.sites[n].run.up(components)

    def down(self, *names) -> None:
        for n in names or self.sites:
            self.sites[n].run.down()

    def teardown(self) -> None:
        """Remove everything: SIGKILL the sites' processes (nothing of them is kept, so no
        graceful stop is owed; a Celery worker's takes seconds), their redis and sshd, then
        the mounts and loop devices, then the files."""
        for s in self.sites.values():
            if s.config_path and s.config_path.exists():
                try:
                    kill_components(s.run, COMPONENTS)
                except Exception:  # noqa: BLE001 - tear down as much as we can
                    pass
            for p in s.procs:
                kill(p.pid)
            # a lab found again from its record (another process started these)
            kill_if(s.redis_pid, "redis-server")
            kill_if(s.sshd_pid, "sshd")
        keep_logs(self.root)
        discard_under(self.root)
        unmount_under(self.root)          # the pools, and what a test staged beside the sites
        shutil.rmtree(self.root, ignore_errors=True)
