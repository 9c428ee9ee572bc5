"""The receiver never applies into an image that is attached read-write.

Real loop devices and a real ext4 stage mount at the peer, syncs through the real
sshd and forced-command receiver: a delta or compare sync at an attached replica is
refused with ImageInUse (typed across the wire), the replica's bytes and state stay
as they were, and once detached the next sync goes through."""
import os
import subprocess

import pytest

from drsvc.errors import ImageInUse
from drsvc.host import loop
from drsvc.layout import PoolLayout
from drsvc.replication import sync_unit
from drsvc.replication.receiver import wait_for_applies
from drsvc.replication.receiver.image_guard import writable_holders
from drsvc.replication.common.unit_state import get_state
from tests.fixtures.xfs import need

from ..conftest import make_image, new_sites, sha, write_at

MiB = 1 << 20


@pytest.fixture
def site(xfs_mod, sshd_factory):
    need("losetup", "mkfs.ext4")
    a, b = new_sites(xfs_mod)
    s = sshd_factory(b)
    s.primary = a
    img = a / "images" / "v.img"
    make_image(img, 32 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    sync_unit(a, "v", ["v"], s.peer())
    wait_for_applies(PoolLayout(b))      # the replica exists once applied, after the answer
    return s


def _refused(site, **kw):
    a, b = site.primary, site.pool
    write_at(a / "images" / "v.img", 20 * MiB, os.urandom(256 << 10))
    before, gen = sha(b / "images" / "v.img"), get_state(b, "v").generation
    with pytest.raises(ImageInUse) as e:
        sync_unit(a, "v", ["v"], site.peer(), **kw)
    assert getattr(e.value, "remote", False), "the refusal comes from the receiver, typed"
    assert sha(b / "images" / "v.img") == before
    assert get_state(b, "v").generation == gen
    assert not (b / "replication" / "v" / "journal" / "commit.json").exists()
    return e.value


def _converges(site, **kw):
    a, b = site.primary, site.pool
    sync_unit(a, "v", ["v"], site.peer(), **kw)
    assert sha(b / "images" / "v.img") == sha(a / "images" / "v.img")


@pytest.mark.parametrize("mode", ["delta", "compare"])
def test_refused_while_a_loop_device_holds_the_replica(site, mode):
    img = site.pool / "images" / "v.img"
    dev = loop.attach(img)
    try:
        assert writable_holders(img) == [dev]
        err = _refused(site, mode=mode)
        assert dev in err.message and "read-write" in err.message
    finally:
        loop.detach_image(img)
    assert writable_holders(img) == []
    _converges(site)


def test_refused_while_staged_ext4_is_mounted(site, tmp_path):
    """NodeStage's state: a loop device with ext4 mounted read-write at the staging path."""
    img = site.pool / "images" / "v.img"
    dev = loop.attach(img)
    mnt = tmp_path / "staging"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "ext4", dev, str(mnt)], check=True)
    try:
        err = _refused(site)
        assert str(mnt) in err.message
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
        loop.detach_image(img)
    # the mount itself wrote the replica (superblock at unmount): only a compare sync repairs that
    _converges(site, mode="compare")


def test_another_path_to_the_same_file_is_matched(site, tmp_path):
    """The loop device is matched by inode, not by the path it was attached with."""
    img = site.pool / "images" / "v.img"
    alias = site.pool / "alias.img"
    os.link(img, alias)
    dev = loop.attach(alias)
    try:
        assert writable_holders(img) == [dev]
        _refused(site)
    finally:
        loop.detach_image(alias)
        alias.unlink()
    _converges(site)
