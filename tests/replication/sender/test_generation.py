"""The plan feed (``generation.PlanFeed``, ``Planning``) and the stream reading it
(``delta.stream_records(entries=...)``): records leave while the plan is still being
written, in plan order, and a plan that fails, or a reader that stops, ends the other
side cleanly."""
import os
import threading

import pytest
import xxhash

from drsvc.replication.sender.records import stream_records
from drsvc.replication.sender.generation import PlanCancelled, PlanFeed, Planning
from drsvc.replication.wire.frames import ManifestChain

pytestmark = pytest.mark.fast
WAIT = 10.0       # seconds before a test calls a hang a failure


def _entries(data: bytes, n: int, size: int = 4096):
    return [(0, False, i * size, size, xxhash.xxh3_64_intdigest(data[i * size:(i + 1) * size]))
            for i in range(n)]


def _plan_that_waits(tmp_path, n: int, ready: threading.Event):
    """An image of *n* 4 KiB records, and a plan that gives the first, waits for *ready*,
    then gives the rest: (path, entries, planning)."""
    data = os.urandom(n * 4096)
    path = tmp_path / "img"
    path.write_bytes(data)
    entries = _entries(data, n)

    def run(feed):
        feed.put(entries[0])
        if not ready.wait(WAIT):
            raise TimeoutError("the plan waited in vain")
        for e in entries[1:]:
            feed.put(e)
    return path, entries, Planning(run, "plan-test")


def test_entries_come_in_order_then_end():
    planning = Planning(lambda feed: [feed.put((0, False, i, 1, i)) for i in range(5000)], "plan-test")
    got = [e for e in planning.feed if e is not None]
    planning.join()
    assert got == [(0, False, i, 1, i) for i in range(5000)]


def test_a_failed_plan_raises_at_the_reader_and_at_join():
    def run(feed):
        feed.put((0, False, 0, 1, 0))
        raise OSError("disk gone")
    planning = Planning(run, "plan-test")
    with pytest.raises(OSError, match="disk gone"):
        list(planning.feed)
    with pytest.raises(OSError, match="disk gone"):
        planning.join()


def test_a_detached_reader_stops_waiting_and_the_plan_goes_on():
    feed = PlanFeed()
    release = threading.Event()
    done = []

    def run(feed):
        feed.put((0, False, 0, 1, 0))
        assert release.wait(WAIT)
        for i in range(1, 100):
            feed.put((0, False, i, 1, i))      # no reader: dropped, not kept in memory
        done.append(True)
    planning = Planning(run, "plan-test")
    feed = planning.feed
    it = iter(feed)
    assert next(it) == (0, False, 0, 1, 0)
    threading.Timer(0.05, feed.detach).start()
    with pytest.raises(PlanCancelled):
        for _ in it:
            pass
    release.set()
    planning.join()
    assert done and not feed._items


def test_a_cancelled_plan_stops_at_its_next_entry():
    started = threading.Event()

    def run(feed):
        started.set()
        while True:
            feed.put((0, False, 0, 1, 0))
    planning = Planning(run, "plan-test")
    assert started.wait(WAIT)
    planning.stop()
    assert isinstance(planning.error, PlanCancelled)


def test_records_leave_while_the_plan_is_still_being_written(tmp_path):
    """The plan gives its first record and then waits until that record was written to the
    channel: a stream that waited for the whole plan (or for a full batch) never sends it,
    and the plan gives up."""
    first_written = threading.Event()
    path, entries, planning = _plan_that_waits(tmp_path, 64, first_written)
    out = bytearray()

    def write(b):
        out.extend(b)
        first_written.set()
    fd = os.open(path, os.O_RDONLY)
    try:
        sent, chain = stream_records(None, [fd], write, entries=planning.feed, compress="off")
    finally:
        os.close(fd)
    planning.join()
    want = ManifestChain()
    for e in entries:
        want.update(*e)
    assert sent == 64 and chain.hexdigest() == want.hexdigest()
    assert len(out) > 64 * 4096      # headers and every payload


def test_a_stream_that_stops_detaches_from_a_plan_still_running(tmp_path):
    release = threading.Event()
    path, _, planning = _plan_that_waits(tmp_path, 8, release)

    def write(b):
        raise ConnectionResetError("cut")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ConnectionResetError):
            stream_records(None, [fd], write, entries=planning.feed, compress="off")
    finally:
        os.close(fd)
    assert planning.feed.detached
    release.set()
    planning.join()          # the plan itself finished: a resume needs its file


def test_read_buffers_are_made_as_big_records_need_them():
    """``records._Buffers``: no 1 MiB buffer is made before a big record needs one (made up
    front, they cost every stream ~7 ms of page-zeroing under the GIL before its first
    record); at most *cap* are made, then the reader waits for one handed back."""
    from drsvc.replication.sender.records import CHUNK, _Buffers
    bufs = _Buffers(2)
    assert bufs.made == 0
    a, b = bufs.get(), bufs.get()
    assert bufs.made == 2 and len(a) == len(b) == CHUNK
    got = []
    t = threading.Thread(target=lambda: got.append(bufs.get()))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got, "a third buffer was made past the cap"
    bufs.put(a)
    t.join(WAIT)
    assert got == [a] and got[0] is a and bufs.made == 2

