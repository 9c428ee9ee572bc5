"""The sync driver: steps as objects, and a new plan after a lost connection.

The shape follows zrepl's replication driver (internal/replication/driver/
replication_driver.go): each attempt plans afresh from the state at both ends,
and only connectivity errors lead to another attempt. The fast tests run the
driver alone on fakes of its interfaces (planner, session opener and session,
steps), as zrepl's driver_test.go does; the others run it on XFS with a real
receiver."""
import json
import os
import threading

import pytest

from drsvc.errors import PeerUnreachable, ReplicationConflict
from drsvc.replication import peer_status, sync_unit
from drsvc.replication.sender import reconcile as planner
from drsvc.replication.sender.driver import Attempt, Job, Refused, drive
from drsvc.replication.sender import steps as steps_mod
from drsvc.replication.sender.generation import Planning, Prepared
from drsvc.layout import PoolLayout
from drsvc.replication.sender.reports import SyncReport
from drsvc.replication.common.unit_state import UnitState
from drsvc.replication.sender.steps import STEPS, Ship, plan_steps
from drsvc.transport.local import LocalPeer

from ..conftest import make_image, new_sites, same_images, write_at

MiB = 1 << 20


class FailingOnce(LocalPeer):
    """A real local receiver that SIGKILLs itself at *point* on its first connection."""

    def __init__(self, pool, point):
        super().__init__(pool)
        self.points = [point]

    def open(self, verb, *args):
        self.env = ({**os.environ, "DRSVC_FAILPOINTS": self.points.pop()} if self.points
                    else None)
        return super().open(verb, *args)


def test_every_planned_step_name_has_a_class():
    names = set()
    for acked, pending, peer in [(0, None, {}), (1, planner.Pending(2, "t", ("v",)),
                                                 {"generation": 2, "txid": "t", "exists": True}),
                                 (1, planner.Pending(2, "t", ("v",)), {"generation": 1, "exists": True})]:
        names.update(planner.reconcile("u", acked, pending, peer, ["v"]))
    names.update(planner.reconcile("u", 1, None, {"generation": 3}, ["v"], "compare"))
    assert names == {"sync", "finalize", "resume", "compare"}
    assert names <= set(STEPS) and "discard" in STEPS
    steps = plan_steps(["finalize", "sync"])
    assert [s.name for s in steps] == ["finalize", "sync", "ship"] and isinstance(steps[-1], Ship)
    assert [s.name for s in plan_steps(["discard"])] == ["discard"]


@pytest.mark.parametrize("point, second", [("receiver.before_commit", ["resume"]),
                                           ("receiver.after_commit_marker", ["finalize", "sync"])])
def test_driver_plans_again_after_a_lost_connection(xfs_mod, point, second):
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 16 * MiB, [(0, os.urandom(4 * MiB))])
    sync_unit(a, "v", ["v"], LocalPeer(b))
    write_at(img, MiB, os.urandom(MiB))
    write_at(img, 9 * MiB, os.urandom(64 << 10))
    # one attempt: the receiver dies, the error is the caller's, the generation stays pending
    with pytest.raises(PeerUnreachable):
        sync_unit(a, "v", ["v"], FailingOnce(b, point))
    assert (PoolLayout(a).snap_dir("v", 2) / "meta.json").exists()
    write_at(img, 12 * MiB, os.urandom(4096))
    # two attempts: the second plans from what both ends hold and completes
    peer = FailingOnce(b, point)
    r = sync_unit(a, "v", ["v"], peer, attempts=2)
    assert [x["error"] is None for x in r.attempts] == [False, True]
    assert r.attempts[1]["steps"] == second and r.steps == second
    st = peer_status(LocalPeer(b), "v")
    assert st["generation"] == r.target_generation == (2 if second == ["resume"] else 4)
    snap = PoolLayout(a).snap_dir("v", r.target_generation)
    if second == ["resume"]:
        assert r.resumed   # the pending generation (without the last write) is what the peer holds
        assert (snap / "v.img").read_bytes() == (b / "images" / "v.img").read_bytes()
        r = sync_unit(a, "v", ["v"], LocalPeer(b))
        assert r.steps == ["sync"] and r.attempts == [{"steps": ["sync"], "error": None}]
    same_images(a, b, ["v"])


def test_a_local_peer_env_with_its_own_pythonpath(xfs_mod, tmp_path):
    """A LocalPeer's env may carry PYTHONPATH (FailingOnce above copies os.environ, which
    holds one when pytest runs with a plugin path): the receiver starts, without site, and
    the sync completes."""
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", 4 * MiB, [(0, os.urandom(MiB))])
    extra = tmp_path / "extra"
    extra.mkdir()
    peer = LocalPeer(b, env={"PYTHONPATH": str(extra)})
    sync_unit(a, "v", ["v"], peer)
    same_images(a, b, ["v"])
    assert peer.last_proc.args[1:4] == ["-S", "-m", "drsvc.replication.receiver"]


def test_other_errors_are_not_retried(xfs_mod):
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", MiB, [(0, os.urandom(4096))])
    sync_unit(a, "v", ["v"], LocalPeer(b))
    make_image(a / "images" / "w.img", MiB, [(0, os.urandom(4096))])
    sync_unit(a, "w", ["w"], LocalPeer(b))
    # w's peer state moves away from what w acked: a typed conflict, planned once
    from drsvc.errors import ReplicationConflict
    from drsvc.replication import release_peer
    release_peer(LocalPeer(b), "w")
    peer = FailingOnce(b, "receiver.before_commit")
    peer.points = []
    with pytest.raises(ReplicationConflict):
        sync_unit(a, "w", ["w"], peer, attempts=3)


# -- the driver alone, on fakes ---------------------------------------------------------------
class FakeSession:
    """A session whose status exchange fails on demand (``fail`` names the call)."""

    def __init__(self, fail: str | None = None, peer_st: dict | None = None, version: int = 3):
        self.fail, self.peer_st = fail, peer_st or {"generation": 0}
        self.closed = False
        self.bytes_sent = 0
        self.version = version          # 3: every attempt asks for the status first
        self.round_trips = self.channels_opened = 0
        self.asked = 0

    def _maybe_fail(self, call: str) -> None:
        if self.fail == call:
            raise PeerUnreachable(peer="fake", reason=f"cut at {call}")

    def request_status(self) -> None:
        self._maybe_fail("request_status")
        self.asked += 1
        self.round_trips += 1

    def read_status(self) -> dict:
        self._maybe_fail("read_status")
        return dict(self.peer_st)

    def close(self) -> None:
        self.closed = True


class FakeOpener:
    """Hands out one scripted session per attempt; "open" in the script fails the open itself."""

    def __init__(self, *script):
        self.script = list(script)
        self.sessions: list[FakeSession] = []
        self.jobs: list[Job] = []

    def __call__(self, job: Job) -> FakeSession:
        self.jobs.append(job)
        fail = self.script.pop(0) if self.script else None
        if fail == "open":
            raise PeerUnreachable(peer="fake", reason="no route")
        sess = FakeSession(fail)
        self.sessions.append(sess)
        return sess


class FakeStep:
    def __init__(self, name: str, error: BaseException | None = None, reported: bool = True, log=None):
        self.name, self.error, self.reported, self.log = name, error, reported, log

    def run(self, a: Attempt) -> None:
        assert a.session is not None and not a.session.closed
        if self.log is not None:
            self.log.append(self.name)
        if self.error is not None:
            raise self.error


class FakePlanner:
    """Plans one scripted list of steps per attempt (or raises what the script holds)."""

    def __init__(self, *plans, ahead=None, flight=None):
        self.plans = list(plans)
        self.loads = 0
        self.seen_peer: list[dict] = []
        self._ahead = ahead
        self._flight = flight

    def flight(self, a: Attempt):
        return self._flight

    def load(self, job: Job):
        self.loads += 1
        return UnitState(unit_id=job.unit_id, generation=self.loads), None

    def ahead(self, a: Attempt) -> None:
        if self._ahead is not None:
            self._ahead(a)

    def plan(self, a: Attempt):
        self.seen_peer.append(a.peer_st)
        p = self.plans.pop(0)
        if isinstance(p, BaseException):
            raise p
        return p


class FakePeer:
    name = "fake"


def _job(tmp_path) -> Job:
    return Job(PoolLayout(tmp_path), "u", ["u"], FakePeer())


def _cut(where: str) -> PeerUnreachable:
    return PeerUnreachable(peer="fake", reason=f"cut {where}")


@pytest.mark.fast
def test_driver_plans_again_after_peer_unreachable(tmp_path):
    ran: list[str] = []
    planner_ = FakePlanner([FakeStep("sync", log=ran), FakeStep("ship", _cut("mid-stream"), reported=False, log=ran)],
                           [FakeStep("resume", log=ran), FakeStep("ship", reported=False, log=ran)])
    opener = FakeOpener()
    report = SyncReport(unit_id="u")
    drive(_job(tmp_path), planner_, opener, report, attempts=3)
    assert ran == ["sync", "ship", "resume", "ship"]
    assert planner_.loads == 2                       # the second plan starts from the state read again
    assert report.attempts == [{"steps": ["sync"], "error": str(_cut("mid-stream"))},
                               {"steps": ["resume"], "error": None}]
    assert report.steps == ["resume"] and "connect_s" in report.phases
    assert len(opener.sessions) == 2 and all(s.closed for s in opener.sessions)


@pytest.mark.fast
def test_a_refused_one_flight_is_planned_from_the_status_it_brought(tmp_path):
    """Protocol 4: nothing is asked before a fresh generation's one flight; a refusal carries
    the peer's status, and the attempt plans from it as after a status exchange."""
    ran: list[str] = []
    planner_ = FakePlanner([FakeStep("resume", log=ran), FakeStep("ship", reported=False, log=ran)],
                           flight=[FakeStep("sync", log=ran),
                                   FakeStep("ship", Refused({"generation": 7}), reported=False, log=ran)])
    opener = FakeOpener()
    opener_v4 = lambda job: opener.sessions.append(FakeSession(version=4)) or opener.sessions[-1]  # noqa: E731
    report = SyncReport(unit_id="u")
    drive(_job(tmp_path), planner_, opener_v4, report)
    assert ran == ["sync", "ship", "resume", "ship"]
    assert planner_.seen_peer == [{"generation": 7}] and opener.sessions[0].asked == 0
    assert report.steps == ["resume"] and report.attempts == [{"steps": ["resume"], "error": None}]


@pytest.mark.fast
def test_a_one_flight_sync_asks_nothing_first(tmp_path):
    planner_ = FakePlanner(flight=[FakeStep("sync"), FakeStep("ship", reported=False)])
    sessions = []
    report = SyncReport(unit_id="u")
    drive(_job(tmp_path), planner_, lambda job: sessions.append(FakeSession(version=4)) or sessions[-1], report)
    assert sessions[0].asked == 0 and planner_.seen_peer == [] and report.steps == ["sync"]


@pytest.mark.fast
@pytest.mark.parametrize("where", ["open", "request_status", "read_status"])
def test_driver_retries_a_session_that_fails_while_connecting(tmp_path, where):
    planner_ = FakePlanner([FakeStep("sync")])
    opener = FakeOpener(where)
    report = SyncReport(unit_id="u")
    drive(_job(tmp_path), planner_, opener, report, attempts=2)
    assert [x["error"] is None for x in report.attempts] == [False, True]
    assert report.attempts[0]["steps"] == [] and report.attempts[1]["steps"] == ["sync"]
    assert planner_.seen_peer == [{"generation": 0}]      # planned once: after a status was read
    assert all(s.closed for s in opener.sessions)
    assert len(opener.sessions) == (1 if where == "open" else 2)


@pytest.mark.fast
def test_driver_raises_the_last_error_when_no_attempt_completes(tmp_path):
    planner_ = FakePlanner([FakeStep("sync", _cut("first"))], [FakeStep("sync", _cut("second"))])
    opener = FakeOpener()
    report = SyncReport(unit_id="u")
    with pytest.raises(PeerUnreachable, match="cut second"):
        drive(_job(tmp_path), planner_, opener, report, attempts=2)
    assert report.attempts == [{"steps": ["sync"], "error": str(_cut("first"))},
                                 {"steps": ["sync"], "error": str(_cut("second"))}]
    assert all(s.closed for s in opener.sessions) and len(opener.sessions) == 2


@pytest.mark.fast
@pytest.mark.parametrize("fail_in", ["plan", "step", "bug"])
def test_driver_does_not_retry_a_final_error(tmp_path, fail_in):
    conflict = ReplicationConflict(unit_id="u", reason="peer moved on")
    if fail_in == "plan":
        planner_ = FakePlanner(conflict, [FakeStep("sync")])
    else:
        err = conflict if fail_in == "step" else RuntimeError("a bug")
        planner_ = FakePlanner([FakeStep("finalize"), FakeStep("sync", err)], [FakeStep("sync")])
    opener = FakeOpener()
    report = SyncReport(unit_id="u")
    with pytest.raises(ReplicationConflict if fail_in != "bug" else RuntimeError):
        drive(_job(tmp_path), planner_, opener, report, attempts=3)
    assert planner_.loads == 1 and len(opener.sessions) == 1 and opener.sessions[0].closed
    assert report.attempts == []            # only a retried failure is an attempt of the report


@pytest.mark.fast
def test_driver_works_ahead_while_the_session_opens_and_drops_what_was_not_shipped(tmp_path):
    """The planner's work ahead (the early capture) runs while the session opens, and
    what it left unshipped is removed when the attempt ends, on success or failure."""
    opening, working = threading.Event(), threading.Event()
    early_dirs = []

    def ahead(a: Attempt) -> None:
        working.set()
        assert opening.wait(10), "the session was not being opened meanwhile"
        d = tmp_path / f"tmp-{len(early_dirs)}"
        d.mkdir()
        early_dirs.append(d)
        a.early = Prepared(d, {})

    class SlowOpener(FakeOpener):
        def __call__(self, job):
            opening.set()
            assert working.wait(10), "the planner was not working ahead meanwhile"
            return super().__call__(job)

    planner_ = FakePlanner([FakeStep("sync", _cut("x"))], [FakeStep("finalize")], ahead=ahead)
    opener = SlowOpener()
    drive(_job(tmp_path), planner_, opener, SyncReport(unit_id="u"), attempts=2)
    assert len(early_dirs) == 2 and not any(d.exists() for d in early_dirs)
    assert all(s.closed for s in opener.sessions)


def _planning_attempt(tmp_path, release: threading.Event):
    """An attempt holding a generation whose intent is recorded (snap/1) while its plan waits
    for *release*, then gives one entry (which a cancelled plan cannot) and completes its
    meta.json, as ``prepare`` does for a first copy."""
    layout = PoolLayout(tmp_path)
    layout.snap_root("u").mkdir(parents=True)
    d = layout.snap_dir("u", 1)
    d.mkdir()
    meta = {"txid": "t1", "generation": 1, "base_generation": 0, "mode": "delta", "members": [],
            "replan": True}
    (d / "meta.json").write_text(json.dumps(meta))

    def run(feed):
        assert release.wait(10)
        feed.put((0, False, 0, 4096, 0))
        (d / "meta.json").write_text(json.dumps({**meta, "complete": True}))
    a = Attempt(Job(layout, "u", ["u"], FakePeer()), UnitState(unit_id="u"), SyncReport(unit_id="u"),
                session=FakeSession(version=4), one_flight=True)
    a.prepared = Prepared(d, meta, Planning(run, "plan-test"))
    return a, layout


@pytest.mark.fast
@pytest.mark.parametrize("error, planned", [(PeerUnreachable(peer="fake", reason="cut"), True),
                                            (ReplicationConflict(unit_id="u", reason="bad"), False)])
def test_a_stream_cut_while_its_plan_reads_leaves_the_generation_resumable(tmp_path, monkeypatch, error,
                                                                           planned):
    """A one flight sends records while its plan is still written (a first copy), its intent
    (snap/1) recorded first. When the connection is lost mid-plan, what landed at the peer is
    journaled for this txid: Ship lets the plan finish, so the next attempt resumes at once.
    Any other error stops the plan; the intent stays, incomplete, for the next sync to plan
    again (``prepare.replan``) and resume."""
    release = threading.Event()
    a, layout = _planning_attempt(tmp_path, release)

    def stream(session, prepared, report, **kw):
        threading.Timer(0.1, release.set).start()
        raise error
    monkeypatch.setattr(steps_mod, "stream", stream)
    with pytest.raises(type(error)):
        Ship().run(a)
    meta = json.loads((layout.snap_dir("u", 1) / "meta.json").read_text())
    assert bool(meta.get("complete")) is planned and meta["replan"] and a.prepared.planning is None


@pytest.mark.fast
@pytest.mark.parametrize("protocol, impl", [
    ("Session", "drsvc.replication.sender.receiver_client:ApplySession"),
    ("Planner", "drsvc.replication.sender.sync:SyncPlanner"),
    ("Step", "drsvc.replication.sender.steps:Ship"),
])
def test_the_engine_implements_the_driver_interfaces(protocol, impl):
    """Every method of the driver's Protocol exists on its implementation with the same
    parameters (a typing.Protocol is not checked at run time: this is that check)."""
    import importlib
    import inspect

    from drsvc.replication.sender import driver
    proto = getattr(driver, protocol)
    mod, name = impl.split(":")
    cls = getattr(importlib.import_module(mod), name)
    for attr, want in vars(proto).items():
        if attr.startswith("_"):
            continue
        assert hasattr(cls, attr), f"{name} lacks {attr}"
        if inspect.isfunction(want):
            have = getattr(cls, attr)
            assert list(inspect.signature(have).parameters) == list(inspect.signature(want).parameters), attr
    for attr in getattr(proto, "__annotations__", {}):
        assert hasattr(cls, attr), f"{name} lacks {attr}"
