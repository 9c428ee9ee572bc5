"""Listings that stay flat as the site grows: a page of ListVolumes, ListSnapshots, `drsvc
status` and `drsvc points` reads the records of its own entries only, and a /metrics scrape
reads again only the records that changed since the last.

The work is counted, never timed: every file the process opens is seen by an audit hook
(``sys.addaudithook``, the interpreter's own "open" event), and a page's opens of the pool's
records are counted at two sizes of the same pool. Real parts: a pool written by the real
services (CreateVolume's and CreateSnapshot's code, a unit's records as
EnableVolumeReplication and a received replica leave them), the real servicers on a grpc
server over a unix socket, the CLI's main, the metrics HTTP server.

A bad starting_token is ABORTED, as csi.proto says for ListVolumes and ListSnapshots and as
kubernetes-csi/csi-test pkg/sanity/controller.go checks ("should fail when an invalid
starting_token is passed"); a walk never lists an entry twice (the same file's pagination
check allows missed entries, never duplicates).
"""
from __future__ import annotations

import contextlib
import gzip
import json
import re
import sys
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from csi_plugin.admin_servicer import Admin
from csi_plugin.csi_servicers import Controller
from csi_plugin.gen import admin_pb2, admin_pb2_grpc, csi_pb2, csi_pb2_grpc
from drsvc.config import load
from drsvc.controller import PoolController
from drsvc.layout import PoolLayout
from drsvc.model import MOUNT, Capability
from drsvc.replication.common import unit_state
from drsvc.replication.control.relationship import Control, save_control, update_control
from drsvc.replication.points.index import Index, Point
from drsvc.site import Site
from drsvc_cli.main import main as cli
from drsvc_lab import free_port
from workers import metrics

pytestmark = pytest.mark.fast
CAP = [Capability(MOUNT, "SINGLE_NODE_WRITER", "ext4")]
_OPENED: list[list[str]] = []


def _audit(event, args):
    if event == "open" and _OPENED and isinstance(args[0], (str, Path)):
        _OPENED[-1].append(str(args[0]))


sys.addaudithook(_audit)


@contextlib.contextmanager
def opened():
    """The paths this process opens inside the block."""
    seen: list[str] = []
    _OPENED.append(seen)
    try:
        yield seen
    finally:
        _OPENED.remove(seen)


def records(paths, pool: Path, kind: str) -> list[str]:
    """The JSON records of *kind* (volumes, snapshots, replication) among *paths*; a running
    sync's progress.json is a live value, read on every row, and counted apart (``live``)."""
    root = str(pool / kind) + "/"
    return [p for p in paths if p.startswith(root) and p.endswith(".json") and not p.endswith("/progress.json")]


def live(paths) -> list[str]:
    return [p for p in paths if p.endswith("/progress.json")]


def grow_volumes(site: Site, count: int, start: int = 0, snapshots: bool = False) -> list[str]:
    out = []
    for i in range(start, start + count):
        vol = site.volumes.create_volume(f"v{i}", required_bytes=1 << 20, capabilities=CAP)
        out.append(vol.volume_id)
        if snapshots:
            out[-1] = site.volumes.create_snapshot(f"s{i}", vol.volume_id).snapshot_id
    return out


@contextlib.contextmanager
def serving(site: Site, sock: Path):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    csi_pb2_grpc.add_ControllerServicer_to_server(Controller(PoolController(site)), server)
    admin_pb2_grpc.add_AdminServicer_to_server(Admin(site, None, site.status), server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            yield csi_pb2_grpc.ControllerStub(ch), admin_pb2_grpc.AdminStub(ch)
    finally:
        server.stop(None)


def walk(call, page: int, pool: Path, kind: str) -> tuple[list[str], list[int]]:
    """Every page of a List call: the ids listed, and each page's opens of *kind*'s records."""
    ids, opens, token = [], [], ""
    while True:
        with opened() as seen:
            resp = call(page, token)
        opens.append(len(records(seen, pool, kind)))
        ids += [e.snapshot.snapshot_id if kind == "snapshots" else e.volume.volume_id for e in resp.entries]
        token = resp.next_token
        if not token:
            return ids, opens


@pytest.mark.parametrize("kind", ["volumes", "snapshots"])
def test_a_page_reads_its_own_records_at_two_sizes(tmp_path, kind):
    site = Site.open(tmp_path / "pool", node_id="n1", site_id="a")
    snaps = kind == "snapshots"
    made = grow_volumes(site, 8, snapshots=snaps)

    with serving(site, tmp_path / "csi.sock") as (ctl, _):
        def call(n, token):
            if snaps:
                return ctl.ListSnapshots(csi_pb2.ListSnapshotsRequest(max_entries=n, starting_token=token))
            return ctl.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=n, starting_token=token))

        small_ids, small = walk(call, 3, site.pool.root, kind)
        made += grow_volumes(site, 32, start=8, snapshots=snaps)
        big_ids, big = walk(call, 3, site.pool.root, kind)

        assert sorted(small_ids) == sorted(made[:8]) and len(set(big_ids)) == len(big_ids) == 40
        assert big_ids == sorted(made)                    # id order
        assert max(small) <= 3 and max(big) <= 3          # the page's records, at 8 and at 40
        assert len(big) == 14 and sum(big) == 40

        with pytest.raises(grpc.RpcError) as e:           # an id of another kind, a number, garbage
            call(3, "99")
        assert e.value.code() == grpc.StatusCode.ABORTED
        for bad in ("invalid-token", "../x", "grp-0123"):
            with pytest.raises(grpc.RpcError) as e:
                call(3, bad)
            assert e.value.code() == grpc.StatusCode.ABORTED, bad


def test_a_walk_continues_past_deleted_entries_and_never_lists_one_twice(tmp_path):
    """The first page's volumes deleted, volumes created: the token still continues (it is
    compared, not looked up), every volume that sorts after it is listed once, and a new one
    that sorts before it is not (csi-test's pagination check: missing is allowed, twice never)."""
    site = Site.open(tmp_path / "pool", node_id="n1", site_id="a")
    made = grow_volumes(site, 5)
    with serving(site, tmp_path / "csi.sock") as (ctl, _):
        first = ctl.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=2))
        listed = [e.volume.volume_id for e in first.entries]
        assert listed == sorted(made)[:2] and first.next_token == listed[-1]
        for vid in listed:
            site.volumes.delete_volume(vid)
        late = grow_volumes(site, 4, start=5)
        rest = [e.volume.volume_id for e in ctl.ListVolumes(
            csi_pb2.ListVolumesRequest(starting_token=first.next_token)).entries]
        assert rest == sorted(v for v in made + late if v not in listed and v > first.next_token)
        assert not set(rest) & set(listed)
        one = ctl.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id="snap-missing"))
        assert list(one.entries) == []


# -- the replication read model: drsvc status, drsvc points, /metrics -------------------------
def make_units(pool: Path, count: int, start: int = 0) -> list[str]:
    """Units as EnableVolumeReplication (primary) and a received replica (secondary) leave
    their records, a third of them secondaries with recovery points."""
    out, now = [], time.time()
    for i in range(start, start + count):
        u = f"vol-{i:024x}"
        role = "secondary" if i % 3 == 0 else "primary"
        st = unit_state.ensure_unit(pool, u, [u], kind="volume", role=role, peer="b")
        if role == "secondary":
            st.origin = {"site": "b", "interval": 300}
            st.generation = 5
            st.add_received({"generation": 5, "txid": "t5", "received_at": now - 20, "duration_s": 0.2,
                             "bytes": 4096, "captured_at": now - 21})
            unit_state.save_state(pool, st)
            Index(u, [Point(generation=g, time=now - 300 * (6 - g), members={u: 1 << 20}, unique_bytes=4096)
                      for g in range(1, 6)]).save(PoolLayout(pool))
        else:
            save_control(pool, Control(unit_id=u, kind="volume", members=[u], peer="b", interval=300,
                                       enabled_at=now - 900, last_sync_time=now - 30, last_sync_duration=0.5,
                                       last_sync_bytes=8192, syncs_total=3, sent_bytes_total=24576))
        out.append(u)
    return out


def test_status_pages_stay_flat_and_a_second_walk_reads_no_record(tmp_path):
    pool = tmp_path / "pool"
    site = Site.open(pool, node_id="n1", site_id="a")
    make_units(pool, 9)
    with serving(site, tmp_path / "csi.sock") as (_, admin):
        def walk_status():
            per_page, token, ids = [], "", []
            while True:
                with opened() as seen:
                    r = admin.ListReplications(admin_pb2.ListReplicationsRequest(max_entries=3, starting_token=token))
                per_page.append(len(records(seen, pool, "replication")))
                assert len(live(seen)) == len(r.replications)     # the live progress: one look a row
                ids += [s.unit_id for s in r.replications]
                if not (token := r.next_token):
                    return ids, per_page

        ids, small = walk_status()
        assert len(ids) == 9 and max(small) <= 3 * 2        # a unit: its state.json and control.json
        make_units(pool, 27, start=9)
        ids, big = walk_status()
        assert len(ids) == 36 and max(big) <= 3 * 2 and sum(big) == 27 * 2 - 9   # the new units' only
        _, again = walk_status()
        assert sum(again) == 0                              # nothing changed: nothing parsed
        update_control(pool, ids[7], lambda c: setattr(c, "syncs_total", c.syncs_total + 1))
        _, after = walk_status()
        assert sum(after) == 1


def test_a_warmed_read_model_answers_its_first_walk_from_the_cache(tmp_path):
    """The plugin warms its read model when it starts (csi_plugin.server), so the first
    `drsvc status` after a restart parses nothing more than the next."""
    pool = tmp_path / "pool"
    make_units(pool, 6)
    site = Site.open(pool, node_id="n1", site_id="a")
    assert site.status.warm() == 6 and site.status.records.reads == 6 + 4    # 2 secondaries: no control
    with serving(site, tmp_path / "csi.sock") as (_, admin), opened() as seen:
        r = admin.ListReplications(admin_pb2.ListReplicationsRequest())
    assert len(r.replications) == 6 and records(seen, pool, "replication") == []


def test_points_page_with_limit_and_continue(tmp_path, capsys):
    pool = tmp_path / "pool"
    site = Site.open(pool, node_id="n1", site_id="a")
    vid = grow_volumes(site, 3)[1]
    st = unit_state.ensure_unit(pool, vid, [vid], kind="volume", role="secondary", peer="b")
    st.origin = {"site": "b", "interval": 60}
    unit_state.save_state(pool, st)
    now = time.time()
    Index(vid, [Point(generation=g, time=now - 60 * (30 - g), members={vid: 1 << 20}, unique_bytes=g)
                for g in range(1, 26)]).save(PoolLayout(pool))
    sock = tmp_path / "csi.sock"
    with serving(site, sock) as (_, admin):
        ep = str(sock)
        assert cli(["points", "--endpoint", ep, "--volume", vid, "--limit", "10", "--json"]) == 0
        first = json.loads(capsys.readouterr().out)
        assert [p["generation"] for p in first["result"]] == list(range(1, 11)) and first["next_token"] == "10"
        assert cli(["points", "--endpoint", ep, "--volume", vid, "--limit", "10", "--continue", "20", "--json"]) == 0
        last = json.loads(capsys.readouterr().out)
        assert [p["generation"] for p in last["result"]] == list(range(21, 26)) and last["next_token"] == ""
        assert cli(["points", "--endpoint", ep, "--volume", vid, "--json"]) == 0      # no --limit: every page
        assert [p["generation"] for p in json.loads(capsys.readouterr().out)["result"]] == list(range(1, 26))
        assert cli(["points", "--endpoint", ep, "--volume", vid, "--limit", "10"]) == 0
        assert f"--volume {vid} --limit 10 --continue 10" in capsys.readouterr().out
        with opened() as seen:                               # a whole id: no listing of the site
            assert cli(["points", "--endpoint", ep, "--volume", vid, "--limit", "2", "--json"]) == 0
        capsys.readouterr()
        assert set(records(seen, pool, "volumes")) == {str(pool / "volumes" / f"{vid}.json")}
        with pytest.raises(grpc.RpcError) as e:
            admin.ListRecoveryPoints(admin_pb2.ListRecoveryPointsRequest(
                unit=admin_pb2.Unit(volume_id=vid), max_entries=5, starting_token="gen-3"))
        assert e.value.code() == grpc.StatusCode.ABORTED


def site_config(tmp_path: Path) -> Path:
    path = tmp_path / "site.toml"
    path.write_text(f'site = "a"\nnode_id = "n1"\npool = "{tmp_path / "pool"}"\n'
                    f'endpoint = "unix://{tmp_path / "csi.sock"}"\nredis_url = "redis://127.0.0.1:1/0"\n'
                    f'metrics_port = {free_port()}\n\n[peers.b]\ntransport = "local"\npool = "{tmp_path / "b"}"\n')
    return path


def test_a_scrape_renders_again_only_the_unit_that_changed(tmp_path):
    cfg = load(site_config(tmp_path))
    pool = cfg.pool
    units = make_units(pool, 12)
    (pool / "replication" / "vol-being-enabled").mkdir()     # no records yet: not on the page
    ex = metrics.Exporter(cfg)
    with opened() as seen:
        page = ex.render()
    assert ex.rendered == 12 and len(records(seen, pool, "replication")) > 12 and "vol-being-enabled" not in page
    with opened() as seen:
        again = ex.render()
    assert ex.rendered == 12 and records(seen, pool, "replication") == []
    assert _without_clock(again) == _without_clock(page)
    update_control(pool, units[1], lambda c: setattr(c, "syncs_total", 41))
    with opened() as seen:
        after = ex.render()
    assert ex.rendered == 13
    assert records(seen, pool, "replication") == [str(PoolLayout(pool).control_path(units[1]))]
    assert f'drsvc_replication_syncs_total{{kind="volume",peer="b",result="success",site="a",unit="{units[1]}"}} 41.0' \
        in after.splitlines()


def test_the_page_is_the_text_format_prometheus_client_writes(tmp_path):
    """Every family, sample and value as prometheus_client's generate_latest writes the same
    series (families built from the read model's rows); the clock's values within a minute."""
    cfg = load(site_config(tmp_path))
    make_units(cfg.pool, 9)
    ex = metrics.Exporter(cfg)
    ours = ex.render().splitlines()
    theirs = generate_latest(_reference(ex)).decode().splitlines()
    assert len(ours) == len(theirs) > 9 * 20
    clock = re.compile(r"^drsvc_replication_(lag_seconds|data_age_seconds)\{")
    for a, b in zip(ours, theirs, strict=True):
        if clock.match(a):
            assert a.rpartition(" ")[0] == b.rpartition(" ")[0] and abs(float(a.split()[-1]) - float(b.split()[-1])) < 60
        else:
            assert a == b


def test_the_http_page(tmp_path):
    cfg = load(site_config(tmp_path))
    unit = make_units(cfg.pool, 3)[0]
    server = metrics.serve(cfg)
    try:
        url = f"http://127.0.0.1:{cfg.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            plain = r.read().decode()
            assert r.headers["Content-Type"] == CONTENT_TYPE_LATEST     # prometheus_client's text format
        req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Encoding"] == "gzip"
            zipped = gzip.decompress(r.read()).decode()
    finally:
        server.shutdown()
        server.server_close()
    for text in (plain, zipped):
        assert f'drsvc_replication_role{{kind="volume",peer="b",role="secondary",site="a",unit="{unit}"}} 1.0' in text
        assert "drsvc_pool_free_bytes{" in text and "process_cpu_seconds_total" in text


def _without_clock(text: str) -> list[str]:
    return [line for line in text.splitlines() if not re.match(r"drsvc_replication_(lag|data_age)_seconds\{", line)]


def _reference(ex) -> CollectorRegistry:
    """The units' families as prometheus_client objects, from the read model's rows."""
    status = ex.service

    class Reference:
        def collect(self):
            fam = {name: (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"{metrics.PREFIX}_{name}", doc, labels=["site", "unit", "kind", "peer"]
                + (["role"] if name == "role" else ["status"] if name == "health" else
                   ["result"] if name == "syncs" else []))
                for name, (kind, doc) in metrics.FAMILIES.items()}
            for u in status.units():
                info, kind, members = status.row(u)
                lv = [ex.cfg.site, u, kind, info.peer]
                for name, (_, value) in metrics.GAUGES.items():
                    if (v := value(info)) is not None:
                        fam[name].add_metric(lv, v)
                for r in metrics.ROLES:
                    fam["role"].add_metric(lv + [r], 1.0 if info.role == r else 0.0)
                for h in metrics.HEALTH:
                    fam["health"].add_metric(lv + [h], 1.0 if info.status == h else 0.0)
                fam["sync_failures"].add_metric(lv, info.failures_total)
                fam["syncs"].add_metric(lv + ["success"], info.syncs_total)
                fam["syncs"].add_metric(lv + ["failure"], info.failures_total)
                fam["sent_bytes"].add_metric(lv, info.sent_bytes_total)
                fam["changed_bytes"].add_metric(lv, info.changed_bytes_total)
                n, kept, total = status.points_summary(u, members)
                for name, v in (("points", n), ("points_bytes", kept), ("dr_bytes", total)):
                    fam[name].add_metric(lv, v)
            yield from fam.values()

    reg = CollectorRegistry()
    reg.register(Reference())
    return reg


def test_bench_listing_reports_each_size(capsys):
    """bench.listing's code paths at tiny sizes: a row per size, every listing whole."""
    from bench import listing
    assert listing.main(["--sizes", "6,12", "--page", "3", "--rounds", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["units"] for row in out["sizes"]] == [6, 12]
    for row in out["sizes"]:
        assert row["scrape_cold"]["bytes"] > 0 and row["scrape_warm"]["bytes"] > 0
        assert row["status_all_cold"]["result"] == row["status_all_warm"]["result"] == row["units"]
        n = row["units"]
        assert {k: v["result"] for k, v in row["list_volumes_page"].items()} == {
            "start": 3, "middle": min(3, n - n // 2 - 1), "end": 3}
        assert row["floor_stat_records"]["result"] == 2 * row["units"]
