"""The only module that starts processes.

Commands are argv lists (never a shell), always have a timeout, and failures
raise :class:`~drsvc.errors.CommandFailed` with the tail of stderr.
"""
from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass

from .errors import CommandFailed, CommandTimeout

log = logging.getLogger(__name__)
STDERR_TAIL = 2000
DEFAULT_TIMEOUT = 120.0
PIPE = subprocess.PIPE


@dataclass(frozen=True)
class Result:
    argv: tuple
    rc: int
    stdout: str
    stderr: str


def run(argv, *, timeout: float = DEFAULT_TIMEOUT, check: bool = True,
        ok_codes=(0,), input: str | None = None, env=None) -> Result:
    argv = [str(a) for a in argv]
    log.debug("run %s", argv)
    try:
        p = subprocess.run(argv, input=input, capture_output=True, text=True,
                           timeout=timeout, env=env, close_fds=True)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise CommandTimeout(argv, timeout, err[-STDERR_TAIL:]) from None
    except FileNotFoundError:
        raise CommandFailed(argv, 127, f"{argv[0]}: command not found") from None
    if check and p.returncode not in ok_codes:
        raise CommandFailed(argv, p.returncode, (p.stderr or p.stdout)[-STDERR_TAIL:])
    return Result(tuple(argv), p.returncode, p.stdout, p.stderr)


def spawn(argv, *, env=None, stdin=None, stdout=None, stderr=None, cwd=None) -> subprocess.Popen:
    """Start a long-running process (sshd, redis, workers, a stream fed through stdin=PIPE);
    the caller owns it."""
    argv = [str(a) for a in argv]
    log.debug("spawn %s", argv)
    return subprocess.Popen(argv, env=env, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd,
                            close_fds=True, start_new_session=True)


def module_without_site(module: str, *args, first: str | None = None) -> tuple[list[str], str]:
    """argv running *module* of this tree in this interpreter with ``site`` off (``-S``), and
    the PYTHONPATH that finds what it imports: the caller's *first* (a PYTHONPATH it sets for
    the child, such as another release's tree), then this tree, then the directories ``site``
    would add, without running their ``.pth`` hooks. For the receiver, which starts once per
    channel: hooks such as an editable install's finder are for the lab's own processes, not
    for every channel's."""
    import site
    import sys
    from pathlib import Path

    tree = str(Path(__file__).resolve().parents[1])
    dirs = [d for d in (first or "").split(os.pathsep) if d] + [tree, *site.getsitepackages()]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    dirs += [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d]
    unique = list(dict.fromkeys(dirs))
    return [sys.executable, "-S", "-m", module, *map(str, args)], os.pathsep.join(unique)
