"""A repair's plan (``prepare.Baseline`` with the peer's repair runs): the base map reads as
unknown over the runs, so the scan sends those blocks whatever they hold, and the runs are
scanned (rounded out to blocks, cut at the image's end) and never cleared."""
from __future__ import annotations

import pytest

from drsvc.errors import ProtocolError
from drsvc.layout import PoolLayout
from drsvc.replication.common.blockmap import DIGEST, BlockMap
from drsvc.replication.common.unit_state import UnitState
from drsvc.replication.sender.changes import MemberScan
from drsvc.replication.sender.prepare import Baseline, RepairedMap, repair_runs

pytestmark = pytest.mark.fast

BS = 4096


def test_the_base_map_reads_unknown_over_the_runs_only(tmp_path):
    with BlockMap.create(tmp_path / "m", BS, 64 * BS) as m:
        m.write(0, bytes([7]) * DIGEST * 64)
    with BlockMap.open(tmp_path / "m") as inner:
        view = RepairedMap(inner, [[3 * BS, BS], [10 * BS + 100, 2 * BS]])   # the second spans 3 blocks
        got = view.read(0, 64)
        slots = [got[i * DIGEST:(i + 1) * DIGEST] for i in range(64)]
        unknown = [i for i, s in enumerate(slots) if s == RepairedMap.UNKNOWN]
        assert unknown == [3, 10, 11, 12]
        assert all(s == bytes([7]) * DIGEST for i, s in enumerate(slots) if i not in unknown)
        assert view.read(11, 2) == RepairedMap.UNKNOWN * 2 and view.read(20, 3) == bytes([7]) * DIGEST * 3


def test_the_runs_are_scanned_and_never_cleared(tmp_path):
    st = UnitState(unit_id="u", members=["v", "w"], generation=3)
    b = Baseline(PoolLayout(tmp_path), st, "delta", BS, None,
                 {"id": "r1", "runs": {"v": [[5 * BS + 1, 10], [60 * BS, 8 * BS]]}})
    ms = MemberScan(scan=[(0, BS)], clear=[(4 * BS, 8 * BS)])
    got = b.changes("v", ms, 62 * BS)
    assert got.scan == [(0, BS), (5 * BS, 6 * BS), (60 * BS, 62 * BS)]
    assert got.clear == [(4 * BS, 5 * BS), (6 * BS, 8 * BS)]
    assert b.changes("w", ms, 62 * BS) is ms
    assert Baseline(PoolLayout(tmp_path), st, "compare", BS, None, {"runs": {"v": [[0, BS]]}}).repair == {}


@pytest.mark.parametrize("bad", [{"runs": {"v": [[0]]}}, {"runs": {"v": [[-4096, 4096]]}}, {"runs": {"v": [[0, 0]]}},
                                 {"runs": ["v"]}, {"runs": {"v": [["x", 1]]}}])
def test_a_malformed_repair_request_is_a_protocol_error(bad):
    with pytest.raises(ProtocolError):
        repair_runs(bad)
    assert repair_runs(None) == {} and repair_runs({"runs": {"v": [[0, 1]]}}) == {"v": [(0, 1)]}
