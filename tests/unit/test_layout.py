"""The pool's one layout object: every path stays inside the pool, ids are checked first."""
from pathlib import Path

import pytest

from drsvc.errors import InvalidInput
from drsvc.layout import PoolLayout

ROOT = Path("/srv/pool")
L = PoolLayout(ROOT)
BAD = ["../x", "a/b", "..", ".", "", "x\n", "a" * 200, None, 7]

PATHS = {
    "image": L.image, "volume_meta": L.volume_meta, "snapshot_image": L.snapshot_image,
    "snapshot_meta": L.snapshot_meta, "node_state": L.node_state, "group_meta": L.group_meta,
    "unit_dir": L.unit_dir, "state_path": L.state_path, "control_path": L.control_path,
    "lock_path": L.lock_path, "journal_dir": L.journal_dir, "journal_tx": L.journal_tx,
    "member_image": lambda v: PoolLayout.member_image(L.snap_dir("u", 1), v),
    "journal_staging": lambda v: L.journal_staging("u", v),
}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_paths_stay_in_the_pool(name):
    p = PATHS[name]("vol-1")
    assert p.is_relative_to(ROOT) and ".." not in p.parts and "vol-1" in str(p)


@pytest.mark.parametrize("name", sorted(PATHS))
@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_unsafe_ids_never_become_paths(name, bad):
    with pytest.raises(InvalidInput):
        PATHS[name](bad)


def test_one_layout_for_pool_and_engine(tmp_path):
    from drsvc.pool import Pool
    pool = Pool(tmp_path)
    assert pool.image("v") == pool.layout.image("v") == PoolLayout(tmp_path.resolve()).image("v")
    assert pool.group_meta("g") == tmp_path.resolve() / "groups" / "g.json"
    with pytest.raises(ValueError):
        pool.layout.subdir("../etc")
