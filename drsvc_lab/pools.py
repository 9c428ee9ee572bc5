"""Pools on loop-mounted filesystems (XFS with reflinks, as in production), and the
cleanup of whatever a lab or a test mounted or attached below a directory."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from drsvc import runner
from drsvc.host import loop, mounts

MKFS = {"xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], "ext4": ["mkfs.ext4", "-q", "-F"],
        "btrfs": ["mkfs.btrfs", "-q", "-f"]}


def mount_fs(image: Path, mnt: Path, size: str, fstype: str = "xfs") -> tuple[Path, Path]:
    """A sparse *size* image of *fstype* at *image*, loop-mounted on *mnt* (repeat-safe:
    a mounted *mnt* is left as it is)."""
    mnt.mkdir(parents=True, exist_ok=True)
    if not mounts.is_mounted(mnt):
        runner.run(["truncate", "-s", size, image])
        runner.run([*MKFS[fstype], image], timeout=120)
        runner.run(["mount", "-o", "loop", image, mnt])
    return image, mnt


def mount_xfs(root: Path, name: str, size: str) -> tuple[Path, Path]:
    """A loop-mounted XFS with reflinks at root/name (repeat-safe): its image, its mount point."""
    root.mkdir(parents=True, exist_ok=True)
    return mount_fs(root / f"{name}.img", root / name, size)


@contextlib.contextmanager
def loop_fs(size: str = "20G", fstype: str = "xfs", prefix: str = "drsvc-fs-"):
    """Yield the mount point of a fresh sparse *fstype* filesystem on a loop device, in a
    temp dir of its own (its image: backing_file(mnt)); unmounted and removed after."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        _, mnt = mount_fs(work / "fs.img", work / "mnt", size, fstype)
        try:
            yield mnt
        finally:
            unmount_under(mnt)
            discard_under(work)
            runner.run(["umount", "-l", mnt], check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def backing_file(mnt: Path) -> Path:
    """The image behind a filesystem made by loop_fs."""
    return Path(mnt).parent / "fs.img"


def mounts_under(*roots) -> list[str]:
    """Mount points strictly below any of *roots*, deepest first."""
    roots = [str(Path(r).resolve()) for r in roots]
    hits = {m.target for m in mounts.mounts() if any(m.target.startswith(r + "/") for r in roots)}
    return sorted(hits, key=len, reverse=True)


def loops_backing(directory) -> list[str]:
    """Loop devices whose backing file lives under *directory*."""
    prefix = str(Path(directory).resolve()) + "/"
    return [f"/dev/{e.name}" for e in Path("/sys/block").glob("loop*")
            if (loop.backing_of(f"/dev/{e.name}") or "").startswith(prefix)]


def _empty(directory: Path) -> None:
    """Remove what *directory* holds, without crossing into other mounts."""
    for entry in os.scandir(directory):
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            if not os.path.ismount(path):
                _empty(path)
                path.rmdir()
        else:
            path.unlink()


def discard_under(*roots) -> None:
    """Empty the loop filesystems below *roots* whose images live there too, before they
    are unmounted for good, and trim them: the loop device punches the freed ranges out of
    its image, dropping their dirty pages, which the unmount's flush would otherwise write
    back (seconds for a pool a test filled, on a loaded disk)."""
    devices = {dev for r in roots for dev in loops_backing(r)}
    for target in mounts_under(*roots):
        if any(m.source in devices for m in mounts.mounts_at(target)):
            try:
                _empty(Path(target))
            except OSError:
                pass                 # what stays is written back at the unmount, no worse
            runner.run(["fstrim", target], check=False)


def detach_loops(*roots) -> None:
    """Detach the loop devices backed by files under *roots* (one still mounted goes when
    it is unmounted: autoclear)."""
    for r in roots:
        for dev in loops_backing(r):
            runner.run(["losetup", "-d", dev], check=False)


def unmount_under(*roots) -> None:
    """Unmount everything strictly below *roots* and detach the loop devices backed from
    there: deepest first, in passes (stacked mounts, and a pool's filesystem that its
    volumes' loop devices keep busy until they are detached), lazily at last."""
    for _ in range(5):
        targets = mounts_under(*roots)
        if not targets:
            break
        for t in targets:
            runner.run(["umount", t], check=False)
        detach_loops(*roots)
    for t in mounts_under(*roots):
        runner.run(["umount", "-l", t], check=False)
    detach_loops(*roots)
