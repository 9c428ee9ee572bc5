"""The journal's flusher (``journal._Flusher``): payloads are made durable on a thread of
its own while the stream arrives, and a flush that fails is raised to the receiving
thread, since the commit's own fsync on the same open file may not see that error again."""
import errno
import os
import time

import pytest

from drsvc.replication.receiver.journal import _Flusher, _Writer

pytestmark = pytest.mark.fast
WAIT = 10.0       # seconds before a test calls a hang a failure


def _until_failed(f: _Flusher) -> None:
    """Until the flusher's thread has run the flush and failed (quiesce would cancel a
    flush not yet begun: its caller's fsync covers it)."""
    deadline = time.monotonic() + WAIT
    while f.error is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_failed_background_flush_is_raised_by_quiesce():
    r, w = os.pipe()                 # fdatasync of a pipe fails (EINVAL): a flush that failed
    try:
        f = _Flusher()
        f.wrote(w, f.FLUSH_EVERY)
        _until_failed(f)
        with pytest.raises(OSError) as got:
            f.quiesce()
        assert got.value.errno == errno.EINVAL
        with pytest.raises(OSError):
            f.quiesce()              # kept: every later drain fails too
        f.stop()
    finally:
        os.close(r)
        os.close(w)


def test_the_writers_drain_raises_its_flushers_error():
    """What ``Journal.sync`` calls before its fsyncs: a flush that failed on the writer's
    flusher fails the commit."""
    r, w = os.pipe()
    try:
        wr = _Writer()
        wr._flusher.wrote(w, _Flusher.FLUSH_EVERY)
        _until_failed(wr._flusher)
        with pytest.raises(OSError):
            wr.drain()
        wr.stop()
    finally:
        os.close(r)
        os.close(w)


def test_below_the_threshold_nothing_is_flushed(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        f = _Flusher()
        f.wrote(fd, f.FLUSH_EVERY - 1)
        assert f._thread is None
        f.stop()
    finally:
        os.close(fd)
