"""A Demote's final sync (``ReplicationJobs._final_sync``): what it waits through, and what not."""
from types import SimpleNamespace

import pytest

from drsvc.errors import NotGroupConsistent, OperationInProgress, PeerUnreachable
from drsvc.replication.control.jobs import ReplicationJobs

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so


def _jobs(tmp_path, outcomes, visibility_timeout=4.0):
    """Jobs whose sync gives *outcomes* in turn (an exception is raised); the calls are counted."""
    jobs = ReplicationJobs(SimpleNamespace(visibility_timeout=visibility_timeout), tmp_path, volumes=None,
                           groups=None, node=None, peers=None, dispatcher=None)
    calls = []

    def sync(c, *, demote):
        assert demote
        calls.append(c.unit_id)
        out = outcomes[min(len(calls), len(outcomes)) - 1]
        if isinstance(out, Exception):
            raise out
        return out
    jobs._sync = sync
    return jobs, calls


def test_a_cut_not_met_is_tried_again_until_the_parts_meet(tmp_path):
    """A spanning group's part whose cut was not met cut nothing: it tries again, as the
    other part does, instead of demoting without a final sync (CI at load 13 saw a Demote
    degrade that way while one node's part waited for its own running sync)."""
    missed = NotGroupConsistent(reason="not every node of group g froze its members within 5s; nothing was cut")
    jobs, calls = _jobs(tmp_path, [missed, OperationInProgress(key="g"), missed, {"target_generation": 8}])
    assert jobs._final_sync(SimpleNamespace(unit_id="g")) == {"target_generation": 8}
    assert len(calls) == 4


def test_a_cut_never_met_gives_up_at_the_deadline(tmp_path):
    missed = NotGroupConsistent(reason="nothing was cut")
    jobs, calls = _jobs(tmp_path, [missed], visibility_timeout=0.0)
    with pytest.raises(NotGroupConsistent):
        jobs._final_sync(SimpleNamespace(unit_id="g"))
    assert len(calls) == 1


def test_other_failures_are_not_retried_here(tmp_path):
    jobs, calls = _jobs(tmp_path, [PeerUnreachable(peer="b", reason="connection refused"), {}])
    with pytest.raises(PeerUnreachable):
        jobs._final_sync(SimpleNamespace(unit_id="g"))
    assert len(calls) == 1
