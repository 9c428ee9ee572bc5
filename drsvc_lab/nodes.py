"""Sites of several storage nodes on one host (drsvc_lab.NodesLab)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from drsvc.config import SiteConfig, load
from drsvc.errors import DrsvcError
from drsvc.sitectl import SiteRun, node_components
from workers.app import make_app
from workers.client import NodeDispatcher

from .logs import keep_logs
from .net import free_port
from .pools import discard_under, mount_xfs, unmount_under
from .procs import kill, kill_components
from .redis_server import spawn_redis
from .sshd import authorized_line, keygen, kill_sshd, known_hosts_line, start_sshd


class NodesLab:
    """Sites of several storage nodes on this host. Each node has its own loop-mounted XFS
    pool, its own loopback address (127.0.<site>.<node>) with an sshd on it that lets the
    peer site's key run only the receiver into that node's pool, and its own worker, api
    worker and scheduler; each site has one Redis and its controller (no pool). Nodes pair
    by name across the sites (config.NodeConfig.peer_node)."""

    def __init__(self, root: Path, site: str = "a", nodes=("n1", "n2", "n3"), *, sites=None,
                 pool_size: str = "2G", labels: dict | None = None, visibility_timeout: int = 20,
                 node_call_timeout: float = 8.0):
        self.root = Path(root)
        self.sites = tuple(sites or (site,))
        self.site = self.sites[0]
        self.nodes = tuple(nodes)
        self.pool_size = pool_size
        self.labels = dict(labels or {})          # node -> {label: value}
        self.visibility_timeout = visibility_timeout
        self.node_call_timeout = node_call_timeout
        self.redis_ports: dict[str, int] = {}
        self.sshd: dict[tuple, tuple[str, int]] = {}    # (site, node) -> (addr, port)
        self.procs: list = []
        self.redis_procs: dict[str, object] = {}
        self.sshd_procs: dict[tuple, object] = {}

    # -- paths -----------------------------------------------------------------------
    def config_of(self, site: str | None = None) -> Path:
        return self.root / (site or self.site) / "site.toml"

    @property
    def config_path(self) -> Path:
        return self.config_of()

    def endpoint_of(self, site: str | None = None) -> str:
        return f"unix://{self.root / (site or self.site)}/controller.sock"

    @property
    def endpoint(self) -> str:
        return self.endpoint_of()

    def pool(self, node: str, site: str | None = None) -> Path:
        return self.root / (site or self.site) / node / "pool-fs" / "pool"

    def cfg_of(self, site: str | None = None, node: str = "") -> SiteConfig:
        return load(self.config_of(site), node=node)

    @property
    def cfg(self) -> SiteConfig:
        return self.cfg_of()

    def run_of(self, site: str | None = None) -> SiteRun:
        return SiteRun(self.cfg_of(site))

    @property
    def run(self) -> SiteRun:
        return self.run_of()

    def _ssh(self, site: str) -> Path:
        return self.root / site / "ssh"

    # -- build -----------------------------------------------------------------------
    def build(self) -> NodesLab:
        for si, site in enumerate(self.sites):
            for ni, n in enumerate(self.nodes):
                mount_xfs(self.root / site / n, "pool-fs", self.pool_size)
                addr = f"127.0.{si + 1}.{ni + 1}"
                self.sshd[(site, n)] = (addr, free_port(addr))
            self.redis_ports[site] = free_port()
            self.redis_procs[site] = spawn_redis(self.root / site / "redis", self.redis_ports[site])
            k = self._ssh(site)
            k.mkdir(parents=True, exist_ok=True)
            os.chmod(k, 0o700)
            for peer in self.sites:
                if peer != site:
                    keygen(k / f"to-{peer}", f"drsvc-{site}-to-{peer}")
        for site in self.sites:
            for n in self.nodes:
                self._start_sshd(site, n)
        for site in self.sites:
            self._write_config(site)
        return self

    def _start_sshd(self, site: str, node: str) -> None:
        if len(self.sites) < 2:
            return
        addr, port = self.sshd[(site, node)]
        lines = [authorized_line(self.pool(node, site), (self._ssh(peer) / f"to-{site}.pub").read_text().strip())
                 for peer in self.sites if peer != site]
        self.sshd_procs[(site, node)] = start_sshd(self.root / site / node / "ssh", addr, port, lines)

    def stop_sshd(self, site: str, node: str) -> None:
        """An SSH outage at one node: its listener and its logins go down."""
        kill_sshd(self.sshd_procs.pop((site, node)).pid)

    def start_sshd(self, site: str, node: str) -> None:
        self._start_sshd(site, node)

    def stop_redis(self, site: str) -> None:
        """Kill the site's redis-server (SIGKILL)."""
        kill(self.redis_procs.pop(site).pid)

    def start_redis(self, site: str) -> None:
        """Start it again on the same port; appendonly keeps what it had up to the last second."""
        self.redis_procs[site] = spawn_redis(self.root / site / "redis", self.redis_ports[site])

    def restart_redis(self, site: str) -> None:
        self.stop_redis(site)
        self.start_redis(site)

    def _write_config(self, site: str) -> None:
        tables = []
        for n in self.nodes:
            labels = ", ".join(f'"{k}" = "{v}"' for k, v in self.labels.get(n, {}).items())
            tables.append(f'[nodes."{n}"]\npool = "{self.pool(n, site)}"\nlabels = {{ {labels} }}\n')
        for peer in (p for p in self.sites if p != site):
            kh = self._ssh(site) / f"{peer}.known_hosts"
            kh.write_text("\n".join(
                known_hosts_line(*self.sshd[(peer, n)], (self.root / peer / n / "ssh" / "host_ed25519.pub").read_text())
                for n in self.nodes) + "\n")
            first = self.sshd[(peer, self.nodes[0])]
            tables.append(f'[peers.{peer}]\nhost = "{first[0]}"\nport = {first[1]}\nuser = "root"\n'
                          f'known_hosts = "{kh}"\nkey = "{self._ssh(site) / f"to-{peer}"}"\n')
            for n in self.nodes:
                addr, port = self.sshd[(peer, n)]
                tables.append(f'[peers.{peer}.nodes."{n}"]\nhost = "{addr}"\nport = {port}\n')
        path = self.config_of(site)
        path.write_text(
            f'site = "{site}"\nendpoint = "{self.endpoint_of(site)}"\n'
            f'redis_url = "redis://127.0.0.1:{self.redis_ports[site]}/0"\n'
            f'visibility_timeout = {self.visibility_timeout}\nnode_call_timeout = {self.node_call_timeout}\n'
            f'metrics_port = {free_port()}\n\n' + "\n".join(tables))
        os.chmod(path, 0o600)

    # -- processes -------------------------------------------------------------------
    def up(self, *sites) -> None:
        for site in sites or self.sites:
            run = self.run_of(site)
            for c in node_components(run.cfg):
                run.start(c)
        for site in sites or self.sites:
            self.run_of(site).wait_socket()
        for site in sites or self.sites:
            self.wait_nodes(site)

    def wait_nodes(self, site: str, timeout: float = 90.0) -> None:
        """Return once every storage node of *site* answers a call from its controller, as
        a readiness gate would: the plugin's socket is up before the nodes' api workers have
        started, and a node that has not answered yet is left out of placement (a volume asked
        for on it would land on another node)."""
        calls = NodeDispatcher(make_app(self.cfg_of(site)))
        deadline = time.monotonic() + timeout
        waiting = list(self.nodes)
        while waiting:
            answers = calls.call_each(dict.fromkeys(waiting, {}), "probe", wait=2.0)
            waiting = [n for n, r in answers.items() if isinstance(r, DrsvcError)]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"site {site}: node(s) {', '.join(waiting)} did not answer within "
                                   f"{timeout:.0f}s; see their logs in {self.run_of(site).run_dir}")

    def teardown(self) -> None:
        for site in self.sites:
            if self.config_of(site).exists():
                try:
                    run = self.run_of(site)
                    kill_components(run, node_components(run.cfg))
                except Exception:  # noqa: BLE001 - tear down as much as we can
                    pass
        for p in [*self.procs, *self.redis_procs.values(), *self.sshd_procs.values()]:
            kill(p.pid)
        keep_logs(self.root)
        discard_under(self.root)
        unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
