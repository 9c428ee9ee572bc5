"""A site's Redis under Sentinel: one master, one replica and three Sentinels (Debian's
redis-server and redis-sentinel), named by `redis_url = "sentinel://h:p,h:p,h:p/service"`.

The master is killed with SIGKILL while a volume and a group sync every 2 s. Sentinel
promotes the replica, and every client of the site (the Celery broker and result backend of
the plugin, the workers and the scheduler; the scheduler's lease, slots, presence, the
bandwidth buckets) finds the new master through the Sentinels: syncs resume, nothing is
lost or torn (the images are equal after the next syncs), and the units end HEALTHY.
The time from the promotion to the first sync landing after it is printed, not asserted."""
from __future__ import annotations

import time

import redis

from csi_plugin.gen import volumegroup_pb2

from drsvc_lab import free_port, spawn_redis, spawn_sentinel
from drsvc.sitectl import COMPONENTS
from drsvc_lab.procs import kill, kill_components
from tests.dr.helpers import generation, wait_for, write_random
from tests.fixtures.sites import image_sha

SERVICE = "drsvc-a"
INTERVAL = {"schedulingInterval": "2s"}


def _master_port(sentinel_ports) -> int | None:
    for port in sentinel_ports:
        try:
            addr = redis.Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(SERVICE)
        except redis.RedisError:
            continue
        if addr:
            return int(addr[1])
    return None


def _ready(sentinel_ports, replica_port) -> bool:
    """Each Sentinel knows the other two and the replica: a failover can be agreed."""
    for port in sentinel_ports:
        s = redis.Redis(port=port, socket_timeout=1)
        master = s.sentinel_master(SERVICE)
        replicas = s.sentinel_slaves(SERVICE)
        if master["num-other-sentinels"] < 2 or not any(int(r["port"]) == replica_port for r in replicas):
            return False
    return True


def _sentinel_set(lab, root):
    sa = lab.sites["a"]
    replica_port = free_port()
    procs = [spawn_redis(root / "replica", replica_port, lab.redis_password, replica_of=sa.redis_port)]
    ports = [free_port() for _ in range(3)]
    procs += [spawn_sentinel(root / f"sentinel{i}", p, sa.redis_port, SERVICE, password=lab.redis_password)
              for i, p in enumerate(ports)]
    wait_for(lambda: _ready(ports, replica_port), 60, interval=0.5, what="the Sentinels to find each other")
    return procs, ports, replica_port


def _use_sentinels(lab, ports) -> None:
    sa = lab.sites["a"]
    auth = f":{lab.redis_password}@" if lab.redis_password else ""
    url = f"sentinel://{auth}" + ",".join(f"127.0.0.1:{p}" for p in ports) + f"/{SERVICE}/0"
    lines = [ln if not ln.startswith("redis_url") else f'redis_url = "{url}"'
             for ln in sa.config_path.read_text().splitlines()]
    sa.config_path.write_text("\n".join(lines) + "\n")
    sa.run.down()
    sa.run.up()


def _first_sync_after(site, units, since: float, timeout: float) -> float:
    """When every unit has landed a sync that started after *since* (two generations on)."""
    start = {u: generation(site, u) for u in units}
    wait_for(lambda: all(generation(site, u) >= start[u] + 2 for u in units), timeout, interval=0.1,
             what="syncs after the Redis failover")
    return time.time()


def test_the_site_survives_losing_its_redis_master(lab, tmp_path):
    A = lab.clients["a"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    procs, ports, replica_port = _sentinel_set(lab, tmp_path)
    try:
        _use_sentinels(lab, ports)
        vol = A.create_volume("sent", 32 << 20).volume_id
        gid = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name="sentgrp")).volume_group \
            .volume_group_id
        members = [A.create_volume(f"sentgrp-m{i}", 32 << 20, volumeGroup=gid).volume_id for i in range(2)]
        for v in [vol, *members]:
            write_random(sa, v, count=4, seed=len(v))
        A.retry("EnableVolumeReplication", volume_id=vol, parameters=INTERVAL)
        A.retry("EnableVolumeReplication", group_id=gid, parameters=INTERVAL)
        _first_sync_after(sa, [vol, gid], time.time(), 90)

        write_random(sa, vol, count=2, seed=41)
        killed_at = time.time()
        kill(sa.redis_pid)                     # SIGKILL
        wait_for(lambda: _master_port(ports) == replica_port, 60, interval=0.1, what="Sentinel to promote the replica")
        promoted_at = time.time()
        resumed_at = _first_sync_after(sa, [vol, gid], promoted_at, 120)
        print(f"redis master killed: promoted after {promoted_at - killed_at:.1f}s; "
              f"every unit synced again {resumed_at - promoted_at:.1f}s after the promotion")

        for v in [vol, *members]:
            assert image_sha(sa, v) == image_sha(sb, v), v
        for unit in ({"volume_id": vol}, {"group_id": gid}):
            wait_for(lambda u=unit: A.call("GetVolumeReplicationInfo", **u).status
                     == A.call("GetVolumeReplicationInfo", **u).HEALTHY, 60, what=f"{unit} healthy")
    finally:
        # site a's processes know only the Sentinels: stopped gracefully once those are gone, a
        # Celery worker retries its broker until the stop gives up on it. Nothing of them is
        # kept: the lab's heal starts them again on the lab's config
        kill_components(sa.run, COMPONENTS)
        for p in procs:
            p.kill()
            p.wait()
        lab.restart_redis("a")
