"""A redis-server of the lab's own, on a loopback port."""
from __future__ import annotations

from pathlib import Path

from drsvc import runner

from .net import wait_port


def spawn_redis(d: Path, port: int, password: str | None = None, *, persist: bool = True,
                replica_of: int | None = None):
    """A redis-server on 127.0.0.1:port with its files in *d*. persist: appendonly like
    production (a restarted redis keeps queued tasks and markers); off: nothing on disk.
    *replica_of*: the port of the master it replicates (with *password* as masterauth too)."""
    d.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", port, "--bind", "127.0.0.1", "--dir", d,
            "--appendonly", "yes" if persist else "no", "--save", "", "--daemonize", "no",
            "--logfile", d / "redis.log"]
    if persist:
        argv += ["--appendfsync", "everysec"]
    if password:
        argv += ["--requirepass", password, "--masterauth", password]
    if replica_of is not None:
        argv += ["--replicaof", "127.0.0.1", replica_of]
    # never the caller's stdout: a lab left running (`demo --keep`) must not hold a pipe open
    with open(d / "redis.out", "ab") as out:
        p = runner.spawn(argv, stdout=out, stderr=out)
    wait_port(port, proc=p)
    return p


def spawn_sentinel(d: Path, port: int, master_port: int, service: str, *, quorum: int = 2,
                   password: str | None = None, down_after_ms: int = 1000, failover_timeout_ms: int = 5000):
    """A redis-sentinel on 127.0.0.1:port monitoring the master at *master_port* as *service*,
    its config file in *d* (Sentinel rewrites it as it learns the set). A Sentinel judges the
    master down after *down_after_ms* without an answer; production uses tens of seconds, a
    test a second."""
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "sentinel.conf"
    lines = [f"port {port}", "bind 127.0.0.1", f"dir {d}", f"logfile {d / 'sentinel.log'}",
             f"sentinel monitor {service} 127.0.0.1 {master_port} {quorum}",
             f"sentinel down-after-milliseconds {service} {down_after_ms}",
             f"sentinel failover-timeout {service} {failover_timeout_ms}",
             f"sentinel parallel-syncs {service} 1"]
    if password:
        lines.append(f"sentinel auth-pass {service} {password}")
    conf.write_text("\n".join(lines) + "\n")
    with open(d / "sentinel.out", "ab") as out:
        p = runner.spawn(["redis-sentinel", conf], stdout=out, stderr=out)
    wait_port(port, proc=p)
    return p
