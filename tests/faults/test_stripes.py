"""Striped transactions (protocol 4) under faults: one stripe's receiver killed in the middle
of the transfer, and the one SSH connection that carries stripes cut while the master's goes
on. After each fault the replica is one complete generation, and the next attempt resumes
after what the master journaled from every stripe instead of starting over.

The suite's peers stripe every sync (``conftest.STRIPES``: 4 channels over 2 connections):
stripe i rides connection (i + 1) % 2, so connection 1 carries stripes 0 and 2 and no master.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from drsvc.errors import DrsvcError
from drsvc.replication import sync_unit
from drsvc.layout import PoolLayout
from tests.dr.helpers import wait_for, write_random

from .steps import (MiB, engine_volume, all_receiver_pids, check_converged, fresh_link, peer_of,
                    receiver_pids)
from .tally import fault
from .test_connection_cuts import _proxy_for


def _volume(lab, name):
    return engine_volume(lab, name, size=64 * MiB)


def _fds(pid: int) -> set[str]:
    try:
        return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return set()


def _stripe_receivers(pool) -> list[int]:
    """Receivers whose stream is in the master's hands right now: the master (it holds the
    unit's lock) holds their input pipe too."""
    masters = receiver_pids(pool)
    held = set().union(*(_fds(m) for m in masters)) if masters else set()
    out = []
    for pid in all_receiver_pids(pool):
        if pid in masters:
            continue
        try:
            stdin = os.readlink(f"/proc/{pid}/fd/0")
        except OSError:
            continue
        if stdin.startswith("pipe:") and stdin in held:
            out.append(pid)
    return out


def stripe_kills(lab, rnd, rounds):
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol, gens = _volume(lab, f"sk-{rnd.randrange(1 << 30)}")
    journal = PoolLayout(sb.pool).journal_dir(vol) / "tx.json"
    landed = 0
    for i in range(rounds):
        write_random(sa, vol, count=rnd.randint(32, 96), size=256 << 10, seed=rnd.random())
        gens.record(sa, vol)
        killed = []

        def killer(killed=killed):
            deadline = time.monotonic() + 20
            while not journal.exists() and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(rnd.uniform(0.0, 0.3))
            pids = _stripe_receivers(sb.pool)
            if pids:
                os.kill(rnd.choice(pids), signal.SIGKILL)
                killed.append(True)
        t = threading.Thread(target=killer)
        t.start()
        try:
            with peer_of(sa) as p:
                sync_unit(sa.pool, vol, [vol], p, bwlimit=16 * MiB)   # 0.5-1.5 s of records: a kill finds them under load too
        except DrsvcError:
            pass
        t.join()
        if killed:
            fault()
            landed += 1
        gens.check_whole(sb, vol)
        if i % 3 == 2:
            with peer_of(sa) as p:
                sync_unit(sa.pool, vol, [vol], p)
            check_converged(sa, sb, vol, [vol])
    with peer_of(sa) as p:
        sync_unit(sa.pool, vol, [vol], p)
    check_converged(sa, sb, vol, [vol])
    assert landed >= rounds // 2, f"only {landed} of {rounds} kills found a stripe at work"


def stripe_connection_cuts(lab, rnd, rounds):
    """The second connection (stripes only) is cut at a random offset; the master's is not."""
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol, gens = _volume(lab, f"sc-{rnd.randrange(1 << 30)}")
    proxy, kh, _ = _proxy_for(lab)
    resumed = []
    try:
        for _ in range(rounds):
            write_random(sa, vol, count=rnd.randint(48, 128), size=256 << 10, seed=rnd.random())
            gens.record(sa, vol)
            cuts = proxy.cuts
            fresh_link()
            proxy.arm(1 << 50, rnd.randrange(64 << 10, 2 * MiB))   # connection 1 only (its stripes may carry little under load)
            try:
                with peer_of(sa, port=proxy.port, known_hosts=kh, io_timeout=15) as p:
                    sync_unit(sa.pool, vol, [vol], p)
            except DrsvcError:
                pass
            proxy.disarm()
            if proxy.cuts > cuts:
                fault()
            wait_for(lambda: not receiver_pids(sb.pool), 20, interval=0.02, what="the master to end")
            gens.check_whole(sb, vol)
            with peer_of(sa, port=proxy.port, known_hosts=kh) as p:
                r = sync_unit(sa.pool, vol, [vol], p)
            resumed += [r] if r.resumed else []
            check_converged(sa, sb, vol, [vol])
    finally:
        proxy.close()
    mid = [r for r in resumed if 0 < r.records_sent < r.records]
    print(f"stripe cuts: {proxy.cuts} cuts, {len(resumed)} resumed ({len(mid)} after a partial stream)")
    assert proxy.cuts >= rounds // 2
    assert mid, "no cut transfer resumed after what had landed"
    assert all(r.stripes > 1 for r in resumed)


@pytest.mark.faults
def test_stripe_receiver_killed_mid_transfer(flab, rnd):
    stripe_kills(flab, rnd, 10)


@pytest.mark.faults
def test_stripe_connection_cut(flab, rnd):
    stripe_connection_cuts(flab, rnd, 8)
