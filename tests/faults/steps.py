"""Shared steps of the fault suite: generations the primary produced, replica checks
that feed the tally, peers built from a site's config, receiver processes on a peer."""
from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from collections import defaultdict
from pathlib import Path

import grpc

from csi_plugin.gen import admin_pb2, admin_pb2_grpc
from drsvc import store
from drsvc.replication.sender import receiver_client
from drsvc.replication import peer_status, sync_unit
from drsvc.replication.receiver import wait_for_apply
from drsvc.layout import PoolLayout
from drsvc.replication.sender.base_store import wait_for_roll
from drsvc.replication.control.peers import link_of
from drsvc.replication.common.unit_state import find_state
from drsvc.transport import ssh
from drsvc.transport.ssh import SshPeer
from tests.dr.helpers import write_random
from tests.fixtures.maps import replica_maps
from tests.fixtures.sites import image_sha

from .tally import TALLY

MiB = 1 << 20
# the receiver's failpoints a peer with ack = "durable" reaches after its answer (the apply,
# the recovery point's undo copy and pruning, the receive record)
AFTER_DURABLE_ANSWER = frozenset({"receiver.mid_apply", "receiver.after_apply", "receiver.after_state",
                                  "points.mid_undo", "points.after_fold", "points.before_index",
                                  "points.after_index"})


def file_sha(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Generations:
    """sha256 of the primary's image at every generation the test produced.

    The test is the only writer and never writes while a sync captures, so the
    image right before a sync attempt is exactly what that generation holds."""

    def __init__(self):
        self.known: dict[str, list] = defaultdict(list)

    def record(self, site, volume_id) -> str:
        sha = image_sha(site, volume_id)
        self.known[volume_id].append(sha)
        return sha

    def check_whole(self, site, volume_id) -> str:
        """The replica equals one complete generation, never a mix (torn)."""
        sha = image_sha(site, volume_id)
        TALLY.verified += 1
        if sha not in self.known[volume_id]:
            TALLY.torn += 1
            raise AssertionError(f"replica of {volume_id} at {site.name} is torn: it matches no generation")
        return sha


def check_converged(src, dst, unit_id, volume_ids, *, settle: float = 30.0) -> None:
    """Every generation the primary acked is at the replica: same generation, and the
    bytes of the primary's acked snapshot (the live image may already be newer).

    A sync still in flight (a scheduled one, or a Celery retry) may have committed at the
    replica and not yet been adopted by the primary, for a moment: the replica is then one
    generation ahead. So the check is repeated for up to *settle* seconds before a
    difference counts as lost; a real loss does not go away."""
    replay_committed(src, dst, unit_id)
    deadline = time.monotonic() + settle
    while True:
        acked = find_state(src.pool, unit_id).generation
        st = find_state(dst.pool, unit_id)
        wait_for_roll(PoolLayout(src.pool), unit_id)    # a worker rolls its base after the sync returns
        snap = PoolLayout(src.pool).snap_dir(unit_id, acked)
        try:
            same = st is not None and st.generation == acked and all(
                file_sha(snap / f"{v}.img") == image_sha(dst, v) for v in volume_ids)
        except FileNotFoundError:      # the acked snapshot was just replaced by a newer one
            same = False
        if same or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    TALLY.verified += 1
    if not same:
        TALLY.lost += 1
        raise AssertionError(f"{unit_id}: primary acked generation {acked}, replica holds "
                             f"{st.generation if st else None}" + (" with other data" if st else ""))
    check_maps(dst, unit_id)


def killed_after_answer(site, unit_id) -> bool:
    """After a sync that returned: whether its receiver at *site* died after answering. A
    peer that acknowledges at its commit marker (``ack = "durable"``) applies after the
    answer, under the unit's lock; one killed there keeps the committed journal for the
    next contact to replay."""
    lay = PoolLayout(site.pool)
    return wait_for_apply(lay, unit_id) and lay.journal_commit(unit_id).exists()


def answers_before(ack: str, point: str) -> bool:
    """Whether a peer with *ack* answers a sync before its receiver reaches *point*."""
    return ack == "durable" and point in AFTER_DURABLE_ANSWER


def replay_committed(src, dst, unit_id) -> None:
    """The next contact, where *dst* holds a committed journal: what an acked generation
    whose receiver died before its apply needs before its replica holds it (a promote's
    takeover replays it the same way)."""
    if killed_after_answer(dst, unit_id):
        with peer_of(src, dst.name) as p:
            peer_status(p, unit_id)


def check_maps(site, unit_id) -> None:
    """The block maps the replica keeps, when they claim to describe it, do (a promote
    would build the new primary's base from them)."""
    got = replica_maps(site.pool, unit_id, wait=0)    # a scheduled sync may hold the unit
    if got == "exact":
        TALLY.maps_exact += 1
    elif got not in ("unused", "busy"):
        TALLY.maps_wrong += 1
        raise AssertionError(f"{unit_id} at {site.name}: its block maps are wrong: {got}")


def peer_of(site, name="b", *, port=None, known_hosts=None, io_timeout=30.0) -> SshPeer:
    """The SSH peer exactly as the site's worker builds it (pinned key, dedicated key)."""
    p = site.cfg.peer(name)
    peer = SshPeer(p.host, port=port or p.port, user=p.user, key_file=p.key,
                   known_hosts=known_hosts or p.known_hosts, name=name, io_timeout=io_timeout,
                   connect_timeout=10)
    peer.link = link_of(p)     # the suite's peers stripe every sync (conftest.STRIPES)
    return peer


def engine_volume(lab, name, size=32 * MiB):
    """A volume at A, replicated by the engine straight over the lab's sshd (no schedule:
    the worker never touches it, so the test's loop owns the unit lock); (id, Generations)."""
    sa = lab.sites["a"]
    vol = lab.clients["a"].create_volume(name, size).volume_id
    write_random(sa, vol, count=32, seed=name)
    gens = Generations()
    gens.record(sa, vol)
    with peer_of(sa) as p:
        sync_unit(sa.pool, vol, [vol], p)
    return vol, gens


def write_quiesced(site, unit_id, **kw) -> int:
    """write_random under the unit's lock, like an application quiesced for a snapshot: a
    scheduled capture waits (or is skipped, in progress) instead of landing between two
    writes, so every generation sent is one the test recorded."""
    with store.file_lock(PoolLayout(site.pool).lock_path(unit_id), key=unit_id):
        return write_random(site, unit_id, **kw)


def fresh_link() -> None:
    """Drop this process's warm receivers and cached SSH logins, so the next sync opens a
    new connection (through whatever proxy its peer names) from the handshake on."""
    receiver_client.discard_idle()
    ssh.close_all()


def set_receiver_failpoints(lab, name: str, points=()) -> None:
    """Rewrite the site's authorized_keys so the forced command runs the receiver with
    DRSVC_FAILPOINTS set (sshd passes no client environment; this is the lab's own file)."""
    lab.authorize(name, {"DRSVC_FAILPOINTS": ",".join(points)} if points else None)
    # a forced command is fixed at login: end the logins (and warm receivers) made before,
    # and this process's cached ones to them, so the next sync logs in anew under the new
    # failpoints (a sync that picked up a killed cached login failed at its connect, before
    # any capture, and the kill meant for a commit point never happened)
    lab.kill_logins(name)
    fresh_link()


def all_receiver_pids(pool: Path) -> list[int]:
    """Receivers of *pool* (found by their command line), warm idle ones included."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"drsvc.replication.receiver" in argv and str(pool).encode() in argv:
            out.append(int(d.name))
    return out


def receiver_pids(pool: Path) -> list[int]:
    """Receivers of *pool* at work on a unit: holding a unit's lock file open (a warm
    receiver waiting for its next request holds none)."""
    locks = str(Path(pool) / "replication")
    busy = []
    for pid in all_receiver_pids(pool):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(locks) and target.endswith("/.lock"):
                busy.append(pid)
                break
    return busy


def kill_receivers(pool: Path) -> int:
    n = 0
    for pid in receiver_pids(pool):
        try:
            os.kill(pid, signal.SIGKILL)
            n += 1
        except ProcessLookupError:
            pass
    return n


def admin(client):
    return admin_pb2_grpc.AdminStub(client.channel)


def unit_msg(unit_id: str):
    return admin_pb2.Unit(volume_group_id=unit_id) if unit_id.startswith("grp-") \
        else admin_pb2.Unit(volume_id=unit_id)


def status(client, unit_id: str):
    return admin(client).GetReplicationStatus(
        admin_pb2.GetReplicationStatusRequest(unit=unit_msg(unit_id)), timeout=30)


def sync_now(client, unit_id: str, wait: float = 30):
    return admin(client).SyncNow(admin_pb2.SyncNowRequest(unit=unit_msg(unit_id), wait_seconds=wait),
                                 timeout=wait + 30)


TRANSIENT = (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _transient(e: grpc.RpcError) -> bool:
    """In progress, or the server (or its Redis) away. The replication seed's tables have
    no UNAVAILABLE, so a replication RPC that lost this site's Redis (BrokerUnreachable)
    answers UNKNOWN, saying so; the csi-addons controllers requeue on any error
    (internal/controller/replication.storage/volumereplication_controller.go), so a CO
    asks again there too."""
    return e.code() in TRANSIENT or (e.code() == grpc.StatusCode.UNKNOWN
                                     and "Redis is unreachable" in (e.details() or ""))


def reissue(fn, *, timeout=90, what="the RPC"):
    """Repeat an RPC as a CO does after a restart: while it is in progress or the
    server is away. Any other error is the answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except grpc.RpcError as e:
            if not _transient(e) or time.monotonic() > deadline:
                raise AssertionError(f"{what}: {e.code()} {e.details()}") from None
            time.sleep(0.3)


def metric(text: str, name: str, unit_id: str) -> float | None:
    m = re.search(rf'^{name}{{[^}}]*unit="{re.escape(unit_id)}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def intervals_overlap(reports) -> list:
    """Pairs of sync reports whose [started_at, started_at + duration_s] overlap."""
    spans = sorted((r["started_at"], r["started_at"] + r["duration_s"], r.get("txid")) for r in reports)
    return [(a, b) for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1]]
