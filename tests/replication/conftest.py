import hashlib
import itertools
import os
from pathlib import Path

import pytest

from drsvc.layout import PoolLayout
from drsvc.replication.receiver import wait_for_applies
from tests.fixtures.xfs import loop_mounted_fs

_ids = itertools.count()


@pytest.fixture(scope="module")
def xfs_mod():
    """One loop-mounted XFS per test module (hypothesis examples share it, each in its own dir)."""
    with loop_mounted_fs("20G") as mnt:
        yield mnt


def new_sites(root: Path):
    """Two pools (primary a, peer b) in a fresh directory under *root*."""
    d = Path(root) / f"case{next(_ids)}"
    a, b = d / "a", d / "b"
    for p in (a, b):
        (p / "images").mkdir(parents=True)
    return a, b


def sha(path) -> str:
    """A digest of the content of an image: holes and zero blocks hash alike, and
    holes are never read (so an 8 GiB thin image is cheap to compare). An image of a pool
    that receives is read once the peer's apply is done, as every reader there waits for it."""
    from drsvc.replication.common.blockmap import ZERO, hash_image
    pool = Path(path).parent.parent
    if Path(path).parent.name == "images" and (pool / "replication").is_dir():
        wait_for_applies(PoolLayout(pool))
    blocks = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for first, digests in hash_image(fd, size, 65536):
            for i in range(0, len(digests), 16):
                d = digests[i:i + 16]
                if d != ZERO:
                    blocks[first + i // 16] = d
    finally:
        os.close(fd)
    h = hashlib.sha256(str(size).encode())
    for k in sorted(blocks):
        h.update(k.to_bytes(8, "big") + blocks[k])
    return h.hexdigest()


def write_at(path, offset, data):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def make_image(path, size, extents=()):
    with open(path, "wb") as f:
        f.truncate(size)
    for off, data in extents:
        write_at(path, off, data)


def same_images(a: Path, b: Path, vols) -> None:
    """*b*'s replicas equal *a*'s images. A peer answers at its commit marker and applies
    after the answer, holding the unit's lock: the comparison first waits for that apply,
    as every reader of a replica at the peer does."""
    wait_for_applies(PoolLayout(b))
    for v in vols:
        pa, pb = a / "images" / f"{v}.img", b / "images" / f"{v}.img"
        assert os.path.getsize(pa) == os.path.getsize(pb), v
        if os.path.getsize(pa) <= 64 << 20:
            assert pa.read_bytes() == pb.read_bytes(), v
        else:
            assert sha(pa) == sha(pb), v
