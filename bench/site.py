"""Bench-local lab helpers: a loop-mounted XFS and a loopback sshd.

Self-contained (bench/ does not import tests/): processes go through
drsvc.runner. The sshd binds the replication key to our receiver (forced
command) and, for rsync, adds an unrestricted key; both use
``environment="SHLVL=1"`` so bash skips root's ~/.bashrc (~0.15 s a start).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from drsvc import runner
from drsvc.lab import free_port, wait_port

SSHD = "/usr/sbin/sshd"


@contextlib.contextmanager
def loop_mounted_xfs(size: str = "40G"):
    """Yield the mountpoint of a fresh sparse XFS (reflink on) on a loop device."""
    work = Path(tempfile.mkdtemp(prefix="drsvc-bench-xfs-"))
    img, mnt = work / "fs.img", work / "mnt"
    mnt.mkdir()
    try:
        runner.run(["truncate", "-s", size, img])
        runner.run(["mkfs.xfs", "-q", "-m", "reflink=1", img])
        runner.run(["mount", "-o", "loop", img, mnt])
        try:
            yield mnt
        finally:
            runner.run(["umount", "-l", mnt], check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _keygen(path: Path) -> str:
    runner.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", path])
    return Path(str(path) + ".pub").read_text().strip()


@dataclass
class BenchSite:
    pool: Path
    dir: Path
    port: int
    client_key: Path
    known_hosts: Path
    plain_key: Path


@contextlib.contextmanager
def sshd_site(pool: Path):
    """A loopback sshd for *pool*: replication key (forced receiver) + a plain key."""
    Path("/run/sshd").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="drsvc-bench-sshd-"))
    proc = None
    try:
        host_pub = _keygen(work / "host_ed25519")
        repl_pub = _keygen(work / "repl_ed25519")
        plain_pub = _keygen(work / "plain_ed25519")
        cmd = shlex.join([sys.executable, "-m", "drsvc.replication.receiver", "--pool", str(pool)])
        (work / "authorized_keys").write_text(
            f'command="{cmd}",restrict,environment="SHLVL=1" {repl_pub}\n'
            f'environment="SHLVL=1" {plain_pub}\n')
        port = free_port()
        (work / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub}\n")
        (work / "sshd_config").write_text("\n".join([
            f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {work / 'host_ed25519'}",
            f"PidFile {work / 'sshd.pid'}", f"AuthorizedKeysFile {work / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
            "StrictModes no", "PermitUserEnvironment SHLVL", "X11Forwarding no",
            "MaxStartups 200", "MaxSessions 100", "LogLevel ERROR", ""]))
        with open(os.devnull, "wb") as devnull:   # sshd -e logs each probe of wait_port
            proc = runner.spawn([SSHD, "-D", "-e", "-f", work / "sshd_config"], stderr=devnull)
        wait_port(port)
        yield BenchSite(Path(pool), work, port, work / "repl_ed25519", work / "known_hosts",
                        work / "plain_ed25519")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except Exception:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def backing_file(mnt: Path) -> Path:
    """The loop device's backing file of a filesystem made by loop_mounted_xfs."""
    return Path(mnt).parent / "fs.img"


def _syncfs(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        ctypes.CDLL(None, use_errno=True).syncfs(fd)
    finally:
        os.close(fd)


@dataclass
class Cold:
    """Makes the next reads of the bench's data cold.

    mode "files" (default, kind to other users of the machine): sync each bench
    filesystem, evict every file in it (POSIX_FADV_DONTNEED) and then its loop
    device's backing file, whose pages in the host's cache would otherwise serve the
    "cold" reads. XFS's own metadata buffers stay cached. mode "global": `sync; echo
    3 > /proc/sys/vm/drop_caches` (everything, everyone's). mode "off": --warm."""
    roots: list
    backings: list
    mode: str = "files"

    def __call__(self) -> None:
        if self.mode == "off":
            return
        if self.mode == "global":
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return
        for root in self.roots:
            _syncfs(root)
            for d, _, names in os.walk(root):
                drop_file_cache(*(os.path.join(d, n) for n in names), sync=False)
        drop_file_cache(*self.backings)


def drop_file_cache(*paths, sync: bool = True) -> None:
    """Evict the clean page-cache pages of these files (POSIX_FADV_DONTNEED), so a
    tool reads them cold; per file, so other users of the machine keep their cache."""
    for p in paths:
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if sync:
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
