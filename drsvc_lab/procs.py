"""Processes of a lab: kills, and the scan for what still refers to a lab's root."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from drsvc.host import loop, mounts


def ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """The live processes whose parent is *pid* (an sshd's logins, which it starts in
    sessions of their own)."""
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and ppid(int(d.name)) == pid]


def alive(pid: int) -> bool:
    """Running: it exists and has not exited (a zombie waits for its parent or init to
    reap it and holds no port, file or mount)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill(pid: int) -> None:
    """SIGKILL *pid*'s process group (or *pid* alone), and reap it if it is our child."""
    if not pid:
        return
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


def kill_if(pid: int, name: str) -> None:
    """Kill *pid* only if it still runs *name* (a recorded pid may have been reused)."""
    if not pid:
        return
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return
    if name in os.path.basename(argv0):
        kill(pid)


def kill_components(run, components) -> None:
    """SIGKILL a site's components (drsvc.sitectl.SiteRun), last started first: for a lab
    that is removed, so no graceful stop is owed (a Celery worker's takes seconds)."""
    for c in reversed(components):
        run.stop(c, sig=signal.SIGKILL)


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM a process we started, SIGKILL if it lingers; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def leftovers(root) -> dict:
    """What still refers to *root*: processes (by command line), mounts and loop devices."""
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
