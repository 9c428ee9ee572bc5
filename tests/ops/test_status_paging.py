"""`drsvc status` of every unit, paged: the Admin service's ListReplications answers a page
of units in id order with the token of the next (the last id of the page), as CSI's List
calls do; the CLI walks the pages (each answer bounded) or shows one with
--limit/--continue.

Real parts: the CLI's main, its gRPC client, a grpc server on a unix socket serving the
real Admin servicer over a pool whose units are written as EnableVolumeReplication and a
received replica leave them.
"""
from __future__ import annotations

import json
import time
from concurrent import futures

import grpc
import pytest

from csi_plugin.admin_servicer import Admin
from csi_plugin.gen import admin_pb2, admin_pb2_grpc
from drsvc.replication.common import unit_state
from drsvc.replication.control import ReplicationStatus
from drsvc.replication.control.relationship import Control, save_control
from drsvc_cli.client import DrClient
from drsvc_cli.main import main as cli

pytestmark = pytest.mark.fast
UNITS = sorted(f"vol-{i:024x}" for i in (7, 3, 25, 1, 12, 9, 30, 2, 18, 4, 21, 5))


@pytest.fixture
def endpoint(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    for i, u in enumerate(UNITS):
        role = "primary" if i % 3 else "secondary"     # a replica received here lists too
        st = unit_state.ensure_unit(pool, u, [u], kind="volume", role=role, peer="b")
        if role == "secondary":                        # the primary's site, as its syncs carry it
            st.origin = {"site": "b", "interval": 300}
            unit_state.save_state(pool, st)
        else:
            save_control(pool, Control(unit_id=u, kind="volume", members=[u], peer="b", interval=300,
                                       enabled_at=time.time()))
    (pool / "replication" / "not-a-unit-yet").mkdir()   # a directory with no records: not listed
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    admin_pb2_grpc.add_AdminServicer_to_server(Admin(None, None, ReplicationStatus("a", pool, None, None)), server)
    sock = tmp_path / "csi.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        yield str(sock)
    finally:
        server.stop(None)


def test_pages_cover_every_unit_once_in_id_order(endpoint):
    with DrClient(endpoint, timeout=10) as c:
        seen, tokens = [], []
        for rows, token in c.status_pages(page=5):
            assert len(rows) <= 5
            seen += [r["unit_id"] for r in rows]
            tokens.append(token)
        assert seen == UNITS                       # each once, in order
        assert tokens[-1] == "" and all(tokens[:-1]) and len(tokens) == 3
        assert [r["unit_id"] for r in c.statuses()] == UNITS
        rows, token = c.status_page(0)             # 0: all at once
        assert [r["unit_id"] for r in rows] == UNITS and token == ""
        rows, token = c.status_page(4, UNITS[-2])  # the page after a token holds the units after it
        assert [r["unit_id"] for r in rows] == UNITS[-1:] and token == ""


def test_a_bad_token_is_aborted_and_a_negative_limit_invalid(endpoint):
    """CSI's code for a starting_token the plugin cannot use is ABORTED (csi.proto,
    ListVolumes' errors), and the Admin service follows it."""
    with grpc.insecure_channel(f"unix://{endpoint}") as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ListReplications(admin_pb2.ListReplicationsRequest(max_entries=2, starting_token="../x"))
        assert e.value.code() == grpc.StatusCode.ABORTED and "invalid starting token" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.ListReplications(admin_pb2.ListReplicationsRequest(max_entries=-1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cli_limit_and_continue(endpoint, capsys):
    assert cli(["status", "--endpoint", endpoint, "--limit", "5", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert [r["unit_id"] for r in first["result"]] == UNITS[:5] and first["next_token"] == UNITS[4]
    assert cli(["status", "--endpoint", endpoint, "--limit", "5", "--continue", first["next_token"], "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert [r["unit_id"] for r in second["result"]] == UNITS[5:10]
    assert cli(["status", "--endpoint", endpoint, "--json"]) == 0          # no --limit: every page
    assert [r["unit_id"] for r in json.loads(capsys.readouterr().out)["result"]] == UNITS
    assert cli(["status", "--endpoint", endpoint, "--limit", "5"]) == 0     # plain: the next command shown
    assert f"--continue {UNITS[4]}" in capsys.readouterr().out
