"""A two-site DR lab on one host, for the demo and the tests.

Each site gets a pool on its own loop-mounted XFS, a redis-server (unless one
is given), an sshd on loopback that lets the peer's dedicated key run only our
receiver (forced command), pinned host keys, and a site config. Processes are
started through drsvc.runner; `teardown()` undoes everything.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import runner
from .config import SiteConfig, load
from .errors import Unavailable
from .sitectl import SiteRun

SSHD = "/usr/sbin/sshd"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise Unavailable(f"nothing is listening on {host}:{port} after {timeout}s")


def mount_xfs(root: Path, name: str, size: str) -> tuple[Path, Path]:
    """A loop-mounted XFS with reflinks at root/name (repeat-safe): its image, its mount point."""
    root.mkdir(parents=True, exist_ok=True)
    image, mnt = root / f"{name}.img", root / name
    mnt.mkdir(exist_ok=True)
    if not any(line.split()[1] == str(mnt) for line in Path("/proc/mounts").read_text().splitlines()):
        runner.run(["truncate", "-s", size, image])
        runner.run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", image], timeout=120)
        runner.run(["mount", "-o", "loop", image, mnt])
    return image, mnt


def spawn_redis(d: Path, port: int, password: str | None = None):
    """A redis-server on 127.0.0.1:port with its files in d, appendonly like production."""
    d.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", port, "--bind", "127.0.0.1", "--dir", d,
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
            "--logfile", d / "redis.log"]
    if password:
        argv += ["--requirepass", password]
    # never the caller's stdout: a lab left running (`demo --keep`) must not hold a pipe open
    with open(d / "redis.out", "ab") as out:
        p = runner.spawn(argv, stdout=out, stderr=out)
    wait_port(port)
    return p


def authorized_line(pool: Path, pub: str) -> str:
    """The peer's replication key may run only our receiver, into *pool* (forced command)."""
    # SHLVL=1: bash then skips root's .bashrc (0.15 s per channel); a production receiver
    # account should simply have a non-interactive /bin/sh as its shell
    return f'command="{receiver_command(pool)}",environment="SHLVL=1",restrict {pub}'


def start_sshd(k: Path, addr: str, port: int, authorized: list[str]):
    """An sshd on addr:port with its host key, config and authorized_keys in *k*."""
    k.mkdir(parents=True, exist_ok=True)
    os.chmod(k, 0o700)
    if not (k / "host_ed25519").exists():
        runner.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"drsvc-host-{addr}-{port}",
                    "-f", k / "host_ed25519"])
    (k / "authorized_keys").write_text("\n".join(authorized) + "\n")
    os.chmod(k / "authorized_keys", 0o600)
    (k / "sshd_config").write_text("\n".join([
        f"Port {port}", f"ListenAddress {addr}", f"HostKey {k / 'host_ed25519'}",
        f"PidFile {k / 'sshd.pid'}", f"AuthorizedKeysFile {k / 'authorized_keys'}",
        "PermitRootLogin forced-commands-only", "PubkeyAuthentication yes",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        "StrictModes no", "AllowTcpForwarding no", "AllowAgentForwarding no", "X11Forwarding no",
        "PermitTTY no", "PermitTunnel no", "PermitUserEnvironment SHLVL", "PrintMotd no",
        "Ciphers aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr",
        "LogLevel VERBOSE", ""]))
    Path("/run/sshd").mkdir(exist_ok=True)
    with open(k / "sshd.log", "ab") as log:      # the child keeps its own descriptor
        p = runner.spawn([SSHD, "-D", "-e", "-f", k / "sshd_config"], stdout=log, stderr=log)
    wait_port(port, host=addr)
    return p


def receiver_command(pool: Path) -> str:
    # sshd runs this through the user's shell: one exec of the interpreter, no extras
    return f"exec {sys.executable} -m drsvc.replication.receiver --pool {pool}"


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
        # appendonly: a restarted redis keeps queued tasks and markers, as in production
        p = spawn_redis(s.root / "redis", s.redis_port, self.redis_password)
        s.redis_pid = p.pid
        s.procs.append(p)

    def _start_redis(self, s: LabSite) -> None:
        s.redis_port = free_port()
        self._spawn_redis(s)

    def restart_redis(self, name: str) -> None:
        s = self.sites[name]
        _kill(s.redis_pid)
        self._spawn_redis(s)
        self.save()

    def _keys(self) -> None:
        """Host keys per site, and one replication key per direction."""
        for s in self.sites.values():
            k = s.root / "ssh"
            k.mkdir(parents=True, exist_ok=True)
            os.chmod(k, 0o700)
            if not (k / "host_ed25519").exists():
                runner.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"drsvc-host-{s.name}",
                            "-f", k / "host_ed25519"])
            for peer in self.sites:
                if peer != s.name and not (k / f"to-{peer}").exists():
                    runner.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"drsvc-{s.name}-to-{peer}",
                                "-f", k / f"to-{peer}"])

    def _start_sshd(self, s: LabSite) -> None:
        s.sshd_port = s.sshd_port or free_port()
        lines = [authorized_line(s.pool, (peer.root / "ssh" / f"to-{s.name}.pub").read_text().strip())
                 for peer in self.sites.values() if peer.name != s.name]
        p = start_sshd(s.root / "ssh", "127.0.0.1", s.sshd_port, lines)
        s.sshd_pid = p.pid
        s.procs.append(p)

    def stop_sshd(self, name: str) -> None:
        """An SSH outage at the site: the listener and every established login (whose
        processes sshd starts in sessions of their own) go down."""
        s = self.sites[name]
        conns = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _ppid(d) == s.sshd_pid]
        _kill(s.sshd_pid)
        for pid in conns:
            _kill(pid)
        s.sshd_pid = 0

    def start_sshd(self, name: str) -> None:
        self._start_sshd(self.sites[name])
        self.save()

    def _write_config(self, s: LabSite) -> None:
        peers = []
        for peer in self.sites.values():
            if peer.name == s.name:
                continue
            host_pub = (peer.root / "ssh" / "host_ed25519.pub").read_text().split()
            kh = s.root / "ssh" / f"{peer.name}.known_hosts"
            kh.write_text(f"[127.0.0.1]:{peer.sshd_port} {host_pub[0]} {host_pub[1]}\n")
            peers.append(f'[peers.{peer.name}]\nhost = "127.0.0.1"\nport = {peer.sshd_port}\nuser = "root"\n'
                         f'known_hosts = "{kh}"\nkey = "{s.root / "ssh" / f"to-{peer.name}"}"\n')
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
        from . import store
        store.write_doc(self.record_path, {"sites": {n: {
            "redis_pid": s.redis_pid, "sshd_pid": s.sshd_pid, "redis_port": s.redis_port,
            "sshd_port": s.sshd_port, "config_path": str(s.config_path) if s.config_path else None}
            for n, s in self.sites.items()}})

    @classmethod
    def find(cls, root) -> Lab | None:
        """The lab recorded under *root*, or None."""
        from . import store
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
        for s in self.sites.values():
            if s.config_path and s.config_path.exists():
                try:
                    s.run.down()
                except Exception:  # noqa: BLE001 - tear down as much as we can
                    pass
            for p in s.procs:
                _kill(p.pid)
            # a lab found again from its record (another process started these)
            _kill_if(s.redis_pid, "redis-server")
            _kill_if(s.sshd_pid, "sshd")
            _unmount_under(s.root)
        shutil.rmtree(self.root, ignore_errors=True)


def _ppid(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _kill(pid: int) -> None:
    if not pid:
        return
    import signal
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def leftovers(root) -> dict:
    """What still refers to *root*: processes (by command line), mounts and loop devices."""
    from .host import loop, mounts
    root = str(Path(root).resolve())
    procs = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if root + "/" in cmd:
                procs.append({"pid": int(d.name), "cmdline": cmd.strip()})
    mnts = [m.target for m in mounts.mounts() if m.target.startswith(root + "/") or m.target == root]
    loops = [f"/dev/{e.name}" for e in Path("/sys/block").glob("loop*")
             if (loop.backing_of(f"/dev/{e.name}") or "").startswith(root + "/")]
    return {"processes": procs, "mounts": mnts, "loop_devices": loops}


def _kill_if(pid: int, name: str) -> None:
    """Kill *pid* only if it still runs *name* (a recorded pid may have been reused)."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return
    if pid and name in os.path.basename(argv0):
        _kill(pid)


def _unmount_under(root: Path) -> None:
    """Unmount everything below *root* (deepest first) and detach its loop devices."""
    from .host import loop, mounts
    root = str(Path(root).resolve())
    targets = sorted({m.target for m in mounts.mounts() if m.target.startswith(root + "/")},
                     key=len, reverse=True)
    for t in targets:
        runner.run(["umount", "-l", t], check=False)
    for entry in Path("/sys/block").glob("loop*"):
        backing = loop.backing_of(f"/dev/{entry.name}") or ""
        if backing.startswith(root + "/"):
            runner.run(["losetup", "-d", f"/dev/{entry.name}"], check=False)


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
                if peer != site and not (k / f"to-{peer}").exists():
                    runner.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"drsvc-{site}-to-{peer}",
                                "-f", k / f"to-{peer}"])
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
        p = self.sshd_procs.pop((site, node))
        conns = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _ppid(d) == p.pid]
        for pid in (p.pid, *conns):
            _kill(pid)

    def start_sshd(self, site: str, node: str) -> None:
        self._start_sshd(site, node)

    def stop_redis(self, site: str) -> None:
        """Kill the site's redis-server (SIGKILL)."""
        _kill(self.redis_procs.pop(site).pid)

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
            lines = []
            for n in self.nodes:
                addr, port = self.sshd[(peer, n)]
                pub = (self.root / peer / n / "ssh" / "host_ed25519.pub").read_text().split()
                lines.append(f"[{addr}]:{port} {pub[0]} {pub[1]}")
            kh.write_text("\n".join(lines) + "\n")
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
        from .sitectl import node_components
        for site in sites or self.sites:
            run = self.run_of(site)
            for c in node_components(run.cfg):
                run.start(c)
        for site in sites or self.sites:
            self.run_of(site).wait_socket()

    def teardown(self) -> None:
        from .sitectl import node_components
        for site in self.sites:
            if self.config_of(site).exists():
                try:
                    run = self.run_of(site)
                    run.down(node_components(run.cfg))
                except Exception:  # noqa: BLE001 - tear down as much as we can
                    pass
        for p in [*self.procs, *self.redis_procs.values(), *self.sshd_procs.values()]:
            _kill(p.pid)
        _unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
