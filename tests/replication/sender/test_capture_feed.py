"""The early plan's bookkeeping (``capture_feed``): which ranges were planned again
(``Moved``, what the stream's check of a record read changed relies on), and the windows the
first pass plans in (every range once, in order, each clear range in one window)."""
import pytest

from drsvc.replication.sender.capture_feed import WINDOW, Moved, _windows
from drsvc.replication.sender.changes import MemberScan

pytestmark = pytest.mark.fast


def test_moved_covers_only_what_was_planned_again():
    m = Moved()
    m.add(1, MemberScan(scan=[(0, 4096), (8192, 16384)], clear=[(16384, 20480)]))
    assert m(1, 0, 4096) and m(1, 8192, 4096) and m(1, 8192, 12288)
    assert m(1, 12288, 8192)                    # across a scan range and the clear range after it
    assert not m(1, 0, 8192)                    # [4096, 8192) was not planned again
    assert not m(1, 20480, 4096) and not m(0, 0, 4096)
    assert not Moved()(0, 0, 1)


def test_windows_plan_every_range_once_and_in_order():
    scan = [(i * 8192, i * 8192 + 4096) for i in range(3 * WINDOW + 5)]
    clear = [(i * 8192 + 4096, i * 8192 + 8192) for i in range(0, 3 * WINDOW + 5, 7)]
    parts = list(_windows(MemberScan(scan=scan, clear=clear)))
    assert len(parts) == 4
    assert [r for _reach, p in parts for r in p.scan] == scan
    assert sorted(r for _reach, p in parts for r in p.clear) == clear
    for reach, p in parts:
        assert reach == p.scan[-1][1]           # the clones must reach the window's last range
    assert list(_windows(MemberScan())) == [(0, MemberScan())]
