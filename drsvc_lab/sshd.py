"""sshd on loopback for a lab: keys, authorized_keys whose replication key may run only
our receiver (forced command), one sshd_config writer, and pool-only sshds for tests and
the bench."""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from drsvc import runner

from .net import free_port, wait_port
from .procs import children, kill, stop

SSHD = "/usr/sbin/sshd"
# bash reads root's ~/.bashrc for sshd-run commands only at shell level 1 (~0.15 s a
# channel); a production receiver account should simply have /bin/sh as its shell
LEAN_SHELL = 'environment="SHLVL=1"'
CIPHERS = "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr"


def keygen(path: Path, comment: str | None = None) -> str:
    """An ed25519 key pair at *path* (kept if there); returns the public key line."""
    if not path.exists():
        runner.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment or path.name, "-f", path])
    return Path(f"{path}.pub").read_text().strip()


def receiver_command(pool: Path, env: dict | None = None) -> str:
    """The forced command: one exec of the interpreter (sshd runs it through the user's
    shell), with *env* set for the receiver (sshd passes no client environment)."""
    # sshd starts the receiver in the account's home with a clean environment: the path names
    # this tree, or a lab run from a second checkout would run the installed checkout's receiver
    env = dict(env or {})
    # a PYTHONPATH of the caller's (another release's tree) comes first
    argv, env["PYTHONPATH"] = runner.module_without_site("drsvc.replication.receiver", "--pool", pool,
                                                         first=env.get("PYTHONPATH"))
    argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    return "exec " + shlex.join(argv)


def authorized_line(pool: Path, pub: str, *, lean_shell: bool = True, env: dict | None = None) -> str:
    """The peer's replication key may run only our receiver, into *pool* (forced command)."""
    return f'command="{receiver_command(pool, env)}",{LEAN_SHELL + "," if lean_shell else ""}restrict {pub}'


def write_authorized(path: Path, lines: list[str]) -> None:
    """Replace an authorized_keys file at once: sshd reads it per login, never half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.chmod(tmp, 0o600)
    os.rename(tmp, path)


def plain_line(pub: str, *, lean_shell: bool = True) -> str:
    """An unrestricted key (the bench's rsync, over the same sshd)."""
    return f"{LEAN_SHELL + ' ' if lean_shell else ''}{pub}"


def sshd_config(k: Path, addr: str, port: int, *, plain_keys: bool = False, forwarding: bool = False,
                log_level: str = "VERBOSE") -> str:
    """The config of a lab sshd whose files are in *k*. Only forced-command keys log in as
    root unless *plain_keys*; *forwarding* turns TCP forwarding and sftp on server-wide, so
    a test can show the key's `restrict` alone refuses them."""
    return "\n".join([
        f"Port {port}", f"ListenAddress {addr}", f"HostKey {k / 'host_ed25519'}",
        f"PidFile {k / 'sshd.pid'}", f"AuthorizedKeysFile {k / 'authorized_keys'}",
        f"PermitRootLogin {'prohibit-password' if plain_keys else 'forced-commands-only'}",
        "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes no", "AllowAgentForwarding no", "X11Forwarding no", "PermitTunnel no",
        *(["AllowTcpForwarding yes", "Subsystem sftp internal-sftp"] if forwarding else
          ["AllowTcpForwarding no", "PermitTTY no"]),
        "PermitUserEnvironment SHLVL", "PrintMotd no", "MaxStartups 200", "MaxSessions 100",
        f"Ciphers {CIPHERS}", f"LogLevel {log_level}", ""])


def start_sshd(k: Path, addr: str, port: int, authorized: list[str], **config):
    """An sshd on addr:port with its host key, config and authorized_keys in *k* (its
    log in k/sshd.log); options as sshd_config's."""
    k.mkdir(parents=True, exist_ok=True)
    os.chmod(k, 0o700)
    keygen(k / "host_ed25519", f"drsvc-host-{addr}-{port}")
    write_authorized(k / "authorized_keys", authorized)
    (k / "sshd_config").write_text(sshd_config(k, addr, port, **config))
    Path("/run/sshd").mkdir(exist_ok=True)
    with open(k / "sshd.log", "ab") as log:      # the child keeps its own descriptor
        p = runner.spawn([SSHD, "-D", "-e", "-f", k / "sshd_config"], stdout=log, stderr=log)
    try:
        wait_port(port, host=addr, proc=p)
    except Exception:
        kill(p.pid)
        raise
    return p


def kill_logins(pid: int) -> int:
    """SIGKILL the connection processes of the sshd *pid* (the listener's children, in
    sessions of their own): every established login ends, as when the peer host restarts
    its SSH service. Returns how many."""
    logins = children(pid) if pid else []
    for c in logins:
        kill(c)
    return len(logins)


def kill_sshd(pid: int) -> None:
    """An SSH outage: the listener and every established login go down."""
    logins = children(pid)
    kill(pid)
    for c in logins:
        kill(c)


def known_hosts_line(addr: str, port: int, host_pub: str) -> str:
    kind, key = host_pub.split()[:2]
    return f"[{addr}]:{port} {kind} {key}"


@dataclass
class PoolSshd:
    """A loopback sshd for one pool: its replication key runs only the receiver."""
    pool: Path
    dir: Path
    port: int
    client_key: Path
    known_hosts: Path
    host_pub: str
    plain_key: Path | None = None
    proc: object = None


@contextlib.contextmanager
def pool_sshd(pool: Path, *, plain_key: bool = False, lean_shell: bool = True, forwarding: bool = False,
              receiver_env: dict | None = None):
    """Start an sshd for *pool* in a temp dir (host key, replication key, pinned
    known_hosts); *plain_key* adds an unrestricted key (rsync in the bench); *receiver_env*
    is set for the forced receiver (e.g. PYTHONPATH of another release's tree)."""
    work = Path(tempfile.mkdtemp(prefix="drsvc-sshd-"))
    proc = None
    try:
        os.chmod(work, 0o700)
        host_pub = keygen(work / "host_ed25519")
        lines = [authorized_line(pool, keygen(work / "repl_ed25519"), lean_shell=lean_shell, env=receiver_env)]
        if plain_key:
            lines.append(plain_line(keygen(work / "plain_ed25519"), lean_shell=lean_shell))
        port = free_port()
        (work / "known_hosts").write_text(known_hosts_line("127.0.0.1", port, host_pub) + "\n")
        proc = start_sshd(work, "127.0.0.1", port, lines, plain_keys=plain_key, forwarding=forwarding,
                          log_level="ERROR")
        yield PoolSshd(Path(pool), work, port, work / "repl_ed25519", work / "known_hosts", host_pub,
                       work / "plain_ed25519" if plain_key else None, proc)
    finally:
        if proc is not None:
            logins = children(proc.pid)
            stop(proc)
            for c in logins:
                kill(c)
        shutil.rmtree(work, ignore_errors=True)
