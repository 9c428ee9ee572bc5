"""bench.points at tiny sizes: every figure the issue asks for is reported, the restores are
checked against what each generation held, and the space stays within the goal's bound.
It checks what the bench reports, never how fast."""
from __future__ import annotations

import json

import pytest

from bench import points

pytestmark = pytest.mark.bench


def test_points_bench_reports_every_figure(capsys):
    assert points.main(["--size-mib", "16", "--duration", "10", "--interval", "0.2", "--list-points", "12",
                        "--prune-syncs", "2", "--promote-mib", "16", "--promote-syncs", "4", "--promote-fixed-mib", "1",
                        "--fs-size", "4G", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    load = r["load"]
    assert load["syncs"] >= 2 and load["points_kept"] >= 2
    assert load["sync_s"]["with_retention"] > 0 and load["sync_s"]["without_retention"] > 0
    costs = load["points_cost_s"]
    assert set(costs) == {"prune_s", "fold_s", "remove_s", "undo_s", "index_s"}
    # the folds and the removal are parts of each sync's pruning, so of its largest too
    assert all(costs[k]["max"] <= costs["prune_s"]["max"] for k in ("fold_s", "remove_s")), costs
    assert 0.95 <= load["space"]["ratio"] <= 1.05, load["space"]
    assert r["many"]["points"] == 12 and r["many"]["list_s"]["median"] > 0
    assert r["many"]["pruned_per_sync"] == 1 and r["many"]["prune_s_per_sync"]["median"] > 0
    assert set(r["promote"]) == {"16MiB_back1", "16MiB_back2", "16MiB_back4"}
    assert r["promote"]["16MiB_back1"]["bytes_changed_since"] == 1 << 20
    assert all(v["verified"] is True and v["restore_s"] > 0 for v in r["promote"].values())
    assert r["loadavg"]["start"] and len(r["goals"]) == 8
