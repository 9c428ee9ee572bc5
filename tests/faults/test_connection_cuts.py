"""The SSH connection to the peer cut mid-stream, at random byte offsets, by a proxy in
front of the peer's sshd. After each cut the replica is one complete generation; the
next attempt resumes after what the receiver journaled instead of starting over."""
from __future__ import annotations

import re
import threading

import pytest

from drsvc.errors import DrsvcError
from drsvc.replication import sync_unit
from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import generation, wait_for, write_random

from .proxy import CuttingProxy
from .steps import MiB, Generations, check_converged, fresh_link, peer_of, receiver_pids, sync_now
from .tally import fault


def _proxy_for(lab, src="a", dst="b"):
    """A proxy before dst's sshd, and a known_hosts pinning dst's key under its address."""
    s, d = lab.sites[src], lab.sites[dst]
    proxy = CuttingProxy(d.sshd_port)
    key = " ".join((d.root / "ssh" / "host_ed25519.pub").read_text().split()[:2])
    kh = s.root / "ssh" / f"{dst}-via-proxy.known_hosts"
    kh.write_text(f"[127.0.0.1]:{proxy.port} {key}\n")
    return proxy, kh, key


def _receivers_gone(pool, timeout=60):
    wait_for(lambda: not receiver_pids(pool), timeout, interval=0.02, what="the cut receiver to exit")


def random_cuts(lab, rnd, rounds):
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = lab.clients["a"].create_volume(f"cut-{rnd.randrange(1 << 30)}", 32 * MiB).volume_id
    write_random(sa, vol, count=64, seed=vol)
    gens = Generations()
    gens.record(sa, vol)
    with peer_of(sa) as p:
        sync_unit(sa.pool, vol, [vol], p)
    proxy, kh, _ = _proxy_for(lab)
    resumed = []
    try:
        for i in range(rounds):
            delta = rnd.randint(4, 48) * (64 << 10)
            write_random(sa, vol, count=delta // (64 << 10), seed=rnd.random())
            gens.record(sa, vol)
            cuts = proxy.cuts
            # anywhere from inside the SSH handshake to the end of the records: a new login.
            # The suite stripes every sync over 2 connections (conftest.STRIPES), and the proxy
            # cuts the first, which carries about half of the records
            fresh_link()
            proxy.arm(rnd.randrange(500, delta // 2))
            try:
                with peer_of(sa, port=proxy.port, known_hosts=kh, io_timeout=15) as p:
                    r = sync_unit(sa.pool, vol, [vol], p)
                resumed += [r] if r.resumed else []
            except DrsvcError:
                pass
            proxy.disarm()
            if proxy.cuts > cuts:
                fault()
            _receivers_gone(sb.pool)
            gens.check_whole(sb, vol)
            if i % 5 == 4:
                with peer_of(sa, port=proxy.port, known_hosts=kh) as p:
                    r = sync_unit(sa.pool, vol, [vol], p)
                resumed += [r] if r.resumed else []
                check_converged(sa, sb, vol, [vol])
        with peer_of(sa) as p:
            sync_unit(sa.pool, vol, [vol], p)
        check_converged(sa, sb, vol, [vol])
    finally:
        proxy.close()
    mid = [r for r in resumed if 0 < r.records_sent < r.records]
    print(f"random cuts: {proxy.cuts} cuts, {len(resumed)} resumed syncs ({len(mid)} after a partial stream)")
    assert proxy.cuts >= rounds * 3 // 4
    assert len(mid) >= 2, "no interrupted transfer resumed"
    assert all(r.bytes_on_wire < r.bytes_changed for r in mid if r.bytes_changed > 1 * MiB)


def cuts_under_the_worker(lab, rnd, rounds):
    """Site a's worker talks to b through the proxy (its site.toml names the proxy's port);
    a cut mid-transfer fails the task, Celery retries it, the retry resumes."""
    A = lab.clients["a"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    proxy, _, key = _proxy_for(lab)
    try:
        text = sa.config_path.read_text()
        sa.config_path.write_text(re.sub(r"(\[peers\.b\][^\[]*?port = )\d+", rf"\g<1>{proxy.port}", text))
        kh = sa.cfg.peer("b").known_hosts
        kh.write_text(kh.read_text() + f"[127.0.0.1]:{proxy.port} {key}\n")
        sa.run.stop("worker")
        sa.run.start("worker")
        vol = A.create_volume(f"wcut-{rnd.randrange(1 << 30)}", 64 * MiB).volume_id
        write_random(sa, vol, count=16, seed=vol)
        gens = Generations()
        gens.record(sa, vol)
        # throttled so the cut lands mid-stream
        A.retry("EnableVolumeReplication", volume_id=vol,
                parameters={"schedulingInterval": "1h", "bandwidthLimit": str(24 * MiB)})
        wait_for(lambda: generation(sa, vol) >= 1, 60, what="initial sync through the proxy")
        assert proxy.connections >= 1
        good = partial = 0
        for _ in range(rounds):
            delta = rnd.randint(24, 48) * (256 << 10)
            write_random(sa, vol, count=delta // (256 << 10), size=256 << 10, seed=rnd.random())
            gens.record(sa, vol)
            target = generation(sa, vol) + 1
            cuts = proxy.cuts
            # the worker keeps its SSH session warm between syncs: cut that link mid-stream
            proxy.arm_live(rnd.randrange(delta // 3, delta * 2 // 3))
            threading.Thread(target=_quiet, args=(sync_now, A, vol, 2), daemon=True).start()
            wait_for(lambda target=target: generation(sa, vol) >= target, 90, what="the retried sync")
            assert proxy.cuts > cuts
            fault()
            _receivers_gone(sb.pool)
            gens.check_whole(sb, vol)
            check_converged(sa, sb, vol, [vol])
            r = find_state(sa.pool, vol).reports[-1]
            if r["resumed"]:
                good += 1
                # a resume whose peer journal held nothing resends every record
                if r["records_sent"] < r["records"]:
                    partial += 1
                    assert r["bytes_on_wire"] < r["bytes_changed"], r
        print(f"worker cuts: {good} of {rounds} retries resumed, {partial} after a partial stream")
        assert good >= rounds // 2, f"only {good} of {rounds} cut transfers resumed"
        assert partial >= 1, "no retried sync skipped the records the peer already held"
    finally:
        proxy.close()


def _quiet(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the first attempt is meant to fail
        pass


@pytest.mark.faults
def test_connection_cut_at_random_offsets(flab, rnd):
    random_cuts(flab, rnd, 64)


@pytest.mark.faults
def test_connection_cut_under_the_worker(flab, rnd):
    cuts_under_the_worker(flab, rnd, 4)


@pytest.mark.soak
def test_soak_connection_cuts(flab, rnd):
    random_cuts(flab, rnd, 300)
    cuts_under_the_worker(flab, rnd, 15)
