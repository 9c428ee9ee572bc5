"""The receiver's guard: never write into an image that something holds read-write.

An image held by a writable loop device (published, or only staged with its
filesystem still mounted) is live: applying a delta under it corrupts what the
mount sees, and the stale superblock is written back over the replica at
unstage. So before a transaction writes anything (and again before it touches
the image at commit) every member image is checked here, and the transaction is
refused with ImageInUse.

A loop device is matched by the device and inode of its backing file
(LOOP_GET_STATUS64), so another path to the same file (a bind mount, a symlink)
is matched too; the sysfs ``backing_file`` path is the fallback. A read-only
loop device (``/sys/block/loopN/ro``) does not count: nothing writes through it.
"""
from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

from ...errors import ImageInUse

SYS_BLOCK = Path("/sys/block")
LOOP_GET_STATUS64 = 0x4C05
# struct loop_info64: lo_device u64 | lo_inode u64 | lo_rdevice u64 | lo_offset u64 |
# lo_sizelimit u64 | lo_number u32 | lo_encrypt_type u32 | lo_encrypt_key_size u32 |
# lo_flags u32 | names and key (64 + 64 + 32) | lo_init 2 x u64
_LOOP_INFO64 = struct.Struct("=QQQQQIIII64s64s32s2Q")
LO_FLAGS_READ_ONLY = 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _loop_identity(dev_name: str) -> tuple[int, int, bool] | None:
    """(st_dev, st_ino, read_only) of the file behind /dev/<dev_name>, or None."""
    try:
        fd = os.open(f"/dev/{dev_name}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_LOOP_INFO64.size))
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = _LOOP_INFO64.unpack(raw)
    return fields[0], fields[1], bool(fields[8] & LO_FLAGS_READ_ONLY)


def writable_holders(image: Path) -> list[str]:
    """The loop devices that hold *image* read-write (``/dev/loopN``), sorted."""
    try:
        st = os.stat(image)
    except FileNotFoundError:
        return []
    real = os.path.realpath(image)
    held = []
    for entry in SYS_BLOCK.glob("loop*"):
        backing = _read(entry / "loop" / "backing_file")
        if backing is None:          # not bound
            continue
        ident = _loop_identity(entry.name)
        if ident is not None:
            # the kernel's dev_t encoding is glibc's for majors below 4096
            same = ident[0] == st.st_dev and ident[1] == st.st_ino
            ro = ident[2]
        else:
            same = backing == real
            ro = False
        if not same:
            continue
        if ro or _read(entry / "ro") == "1":
            continue
        held.append(f"/dev/{entry.name}")
    return sorted(held)


def _mount_sources(held: list[str]) -> list[str]:
    """Mount points of the given devices, from /proc/self/mountinfo."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    points = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) > 4 and len(rparts) > 1 and rparts[1] in held:
            points.append(parts[4].replace("\\040", " "))
    return points


def ensure_not_in_use(unit_id: str, image: Path, volume_id: str) -> None:
    """Raise ImageInUse if *image* is attached read-write (by a loop device, mounted or not)."""
    held = writable_holders(image)
    if not held:
        return
    mounts = _mount_sources(held)
    how = ", ".join(held) + (f" mounted at {', '.join(mounts)}" if mounts else "")
    raise ImageInUse(unit_id=unit_id, volume_id=volume_id, holder=how)


def ensure_members_not_in_use(layout, unit_id: str, volume_ids) -> None:
    for vol in volume_ids:
        ensure_not_in_use(unit_id, layout.image(vol), vol)
