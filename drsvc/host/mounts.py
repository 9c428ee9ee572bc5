"""Mount table parsing (pure) and repeat-safe mount/unmount helpers."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import runner

MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class Mount:
    mount_id: int
    devno: str      # "major:minor"
    root: str       # path inside the source filesystem
    target: str
    options: frozenset
    fstype: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) + 0 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        left, _, right = line.partition(" - ")
        f = left.split()
        r = right.split()
        if len(f) < 6 or len(r) < 2:
            continue
        mounts.append(Mount(int(f[0]), f[2], _unescape(f[3]), _unescape(f[4]),
                            frozenset(f[5].split(",")), r[0], _unescape(r[1])))
    return mounts


def mounts() -> list[Mount]:
    return parse_mountinfo(MOUNTINFO.read_text())


def mounts_at(target: str | Path) -> list[Mount]:
    target = os.path.normpath(str(target))
    return [m for m in mounts() if m.target == target]


def is_mounted(target: str | Path) -> bool:
    return bool(mounts_at(target))


def mountpoints_of_device(device: str) -> list[str]:
    """Mount targets whose source filesystem lives on *device* (block dev path)."""
    st = os.stat(device)
    devno = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    return [m.target for m in mounts() if m.devno == devno]


def mount(source: str, target: str | Path, *, fstype: str | None = None,
          options: list[str] = ()) -> None:
    argv = ["mount"]
    if fstype:
        argv += ["-t", fstype]
    if options:
        argv += ["-o", ",".join(options)]
    runner.run(argv + [source, str(target)], timeout=120)


def bind_mount(source: str, target: str | Path, *, readonly: bool) -> None:
    runner.run(["mount", "--bind", source, str(target)], timeout=60)
    if readonly:
        # a bind mount ignores "ro" until it is remounted
        runner.run(["mount", "-o", "remount,bind,ro", str(target)], timeout=60)


def ensure_unmounted(target: str | Path) -> None:
    """Unmount every mount stacked at *target*; a no-op when nothing is mounted."""
    while is_mounted(target):
        runner.run(["umount", str(target)], timeout=120)
