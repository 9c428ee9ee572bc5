"""Loop devices. Attach is one `losetup --find --show` call (no find-then-attach race)."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .. import runner
from ..errors import CommandFailed

SYS_BLOCK = Path("/sys/block")
BLKFLSBUF = 0x1261


def _backing_file(dev_name: str) -> str | None:
    try:
        text = (SYS_BLOCK / dev_name / "loop" / "backing_file").read_text().strip()
    except OSError:
        return None
    return text


def _is_readonly(dev_name: str) -> bool:
    try:
        return (SYS_BLOCK / dev_name / "ro").read_text().strip() == "1"
    except OSError:
        return False


def find_attached(image: Path, *, readonly: bool | None = None) -> str | None:
    """Return /dev/loopN backing *image* (by path), or None.

    *readonly* None matches any device; True/False only read-only/writable ones.
    """
    image = os.path.realpath(image)
    for entry in sorted(SYS_BLOCK.glob("loop*")):
        if _backing_file(entry.name) == image and (readonly is None or _is_readonly(entry.name) == readonly):
            return f"/dev/{entry.name}"
    return None


def attached_devices(image: Path, *, readonly: bool | None = None) -> list[str]:
    """Every /dev/loopN backing *image* (by path); *readonly* filters as in find_attached."""
    image = os.path.realpath(image)
    return [f"/dev/{e.name}" for e in sorted(SYS_BLOCK.glob("loop*"))
            if _backing_file(e.name) == image and (readonly is None or _is_readonly(e.name) == readonly)]


def backing_of(device: str) -> str | None:
    return _backing_file(Path(device).name)


def attach(image: Path, *, readonly: bool = False) -> str:
    existing = find_attached(image, readonly=readonly)
    if existing:
        return existing
    argv = ["losetup", "--find", "--show", "--direct-io=off"]
    if readonly:
        argv.append("--read-only")
    device = runner.run(argv + [os.path.realpath(image)], timeout=60).stdout.strip()
    drop_buffers(device)
    return device


def drop_buffers(device: str) -> None:
    """Drop the device's buffer cache: a reused /dev/loopN must not serve blocks
    cached from the file it backed before."""
    fd = os.open(device, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, BLKFLSBUF, 0)
    finally:
        os.close(fd)


def detach_image(image: Path) -> None:
    """Detach every loop device backing *image*; a no-op when none does. A device that went
    between the look and the detach (autoclear after an unmount completes asynchronously)
    is detached, not a failure; one that still backs *image* after a failed detach is."""
    while (dev := find_attached(image)) is not None:
        r = runner.run(["losetup", "--detach", dev], timeout=60, check=False)
        if r.rc != 0 and backing_of(dev) == os.path.realpath(image):
            raise CommandFailed(r.argv, r.rc, (r.stderr or r.stdout)[-runner.STDERR_TAIL:])


def refresh_capacity(device: str) -> None:
    runner.run(["losetup", "--set-capacity", device], timeout=60)


def size_bytes(device: str) -> int:
    sectors = int((SYS_BLOCK / Path(device).name / "size").read_text())
    return sectors * 512
