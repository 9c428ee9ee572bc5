"""A redis-server of the lab's own, on a loopback port."""
from __future__ import annotations

from pathlib import Path

from drsvc import runner

from .net import wait_port


def spawn_redis(d: Path, port: int, password: str | None = None, *, persist: bool = True):
    """A redis-server on 127.0.0.1:port with its files in *d*. persist: appendonly like
    production (a restarted redis keeps queued tasks and markers); off: nothing on disk."""
    d.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", port, "--bind", "127.0.0.1", "--dir", d,
            "--appendonly", "yes" if persist else "no", "--save", "", "--daemonize", "no",
            "--logfile", d / "redis.log"]
    if persist:
        argv += ["--appendfsync", "everysec"]
    if password:
        argv += ["--requirepass", password]
    # never the caller's stdout: a lab left running (`demo --keep`) must not hold a pipe open
    with open(d / "redis.out", "ab") as out:
        p = runner.spawn(argv, stdout=out, stderr=out)
    wait_port(port, proc=p)
    return p
