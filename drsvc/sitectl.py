"""Start, stop and inspect one site's processes: plugin, workers (data, control), scheduler.

`drsvc site up` uses this. Each process writes a log and a pid file under the
site's run directory, so `down` and `status` work from another shell.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import runner
from .config import SiteConfig, socket_path

COMPONENTS = ("plugin", "worker", "control", "scheduler", "metrics")


NODE_COMPONENTS = ("worker", "api", "scheduler")


def node_components(cfg: SiteConfig) -> tuple[str, ...]:
    """A multi-node site on one host (the lab): per node its worker (data and control
    queues), its api worker (the controller's calls) and its scheduler; then the controller."""
    return (*(f"{c}@{n}" for n in sorted(cfg.nodes) for c in NODE_COMPONENTS), "controller")


def _argv(component: str, cfg: SiteConfig) -> list[str]:
    py = sys.executable
    if component == "controller":        # a multi-node site's controller: no pool
        return [py, "-m", "csi_plugin", "--config", str(cfg.path), "--role", "controller"]
    if "@" in component:                 # one storage node's: component@node
        what, _, node = component.partition("@")
        if what == "scheduler":
            return [py, "-m", "workers.scheduler", "--config", str(cfg.path), "--node", node]
        role = {"worker": "data", "api": "api"}[what]
        return [py, "-c", "import sys; from workers.main import worker_main; sys.exit(worker_main())",
                "--config", str(cfg.path), "--role", role, "--node", node,
                "--hostname", f"{cfg.site}-{node}-{what}@%h"]
    if component == "plugin":
        return [py, "-m", "csi_plugin", "--config", str(cfg.path)]
    if component == "worker":
        return [py, "-c", "import sys; from workers.main import worker_main; sys.exit(worker_main())",
                "--config", str(cfg.path), "--hostname", f"{cfg.site}@%h"]
    if component == "control":          # the control queue's own worker: never behind syncs
        return [py, "-c", "import sys; from workers.main import worker_main; sys.exit(worker_main())",
                "--config", str(cfg.path), "--role", "control", "--hostname", f"{cfg.site}-control@%h"]
    if component == "scheduler":
        return [py, "-m", "workers.scheduler", "--config", str(cfg.path)]
    if component == "metrics":
        return [py, "-m", "workers.metrics", "--config", str(cfg.path)]
    raise ValueError(component)


def _zombie(pid: int) -> bool:
    """Exited, not yet reaped: when another process started it (`drsvc site down` from a
    new shell), init reaps it on its own schedule; it is not running."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


@dataclass
class SiteRun:
    cfg: SiteConfig

    @property
    def run_dir(self) -> Path:
        # next to the pool; a multi-node site's controller has none: next to the config
        d = (Path(self.cfg.pool) if self.cfg.pool else Path(self.cfg.path)).parent / f"run-{self.cfg.site}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def pid_file(self, component: str) -> Path:
        return self.run_dir / f"{component}.pid"

    def log_file(self, component: str) -> Path:
        return self.run_dir / f"{component}.log"

    def pid(self, component: str) -> int | None:
        try:
            pid = int(self.pid_file(component).read_text())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return None if _zombie(pid) else pid

    def start(self, component: str, extra_env: dict | None = None) -> int:
        if (pid := self.pid(component)) is not None:
            return pid
        env = dict(os.environ, DRSVC_CONFIG=str(self.cfg.path), PYTHONUNBUFFERED="1", **(extra_env or {}))
        with open(self.log_file(component), "ab") as log:  # the child keeps its own copy of the fd
            proc = runner.spawn(_argv(component, self.cfg), env=env, stdout=log, stderr=log)
        self.pid_file(component).write_text(str(proc.pid))
        return proc.pid

    def stop(self, component: str, *, sig=signal.SIGTERM, timeout: float = 20) -> None:
        pid = self.pid(component)
        if pid is None:
            self.pid_file(component).unlink(missing_ok=True)
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.pid(component) is not None:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)
        if self.pid(component) is not None:
            os.killpg(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.pid_file(component).unlink(missing_ok=True)

    def up(self, components=COMPONENTS) -> None:
        for c in components:
            if c == "metrics" and not self.cfg.metrics_port:
                continue
            self.start(c)
        self.wait_socket()

    def down(self, components=COMPONENTS) -> None:
        for c in reversed(components):
            self.stop(c)

    def status(self) -> dict:
        return {c: self.pid(c) for c in COMPONENTS}

    def wait_socket(self, timeout: float = 30) -> None:
        """Until the plugin accepts a connection on its socket: the file alone may be one a
        killed plugin left behind, with nobody listening yet."""
        sock = socket_path(self.cfg.endpoint)
        deadline = time.monotonic() + timeout
        while not _accepts(sock):
            if time.monotonic() > deadline:
                raise TimeoutError(f"plugin socket {sock} does not accept connections; see {self.log_file('plugin')}")
            time.sleep(0.1)


def _accepts(path: Path) -> bool:
    """Whether something listens on the unix socket at *path*."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()
