"""bench.scale's code paths with tiny sizes: a real two-site, three-node lab, a growth run of
two sizes, and the growth table's figures checked for shape and sense, never speed; then the
site failover: site a killed, every unit promoted at b with force by one PromoteAll at its
controller (a batch per node), each exactly once, and the sampled replicas equal to a's image
of the generation they hold; then the failback: site a back, each unit demoted and resynced
there with force until ready, and a's copies equal to b's."""
from __future__ import annotations

import json

import pytest

from bench import scale

pytestmark = pytest.mark.bench


def test_growth_run_reports_a_row_per_size(capsys):
    assert scale.main(["--growth", "3,6", "--mib", "4", "--interval", "4", "--warmup", "10",
                       "--growth-duration", "12", "--duration", "12", "--sample-every", "2",
                       "--failovers", "0", "--creates-under-load", "2", "--pool-size", "1G",
                       "--page", "2", "--listing-gap", "1", "--site-failover", "--verify", "4",
                       "--promote-all", "--failback", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert [st["volumes"] for st in out["stages"]] == [3, 6]
    assert sum(1 for line in lines if line.startswith("| 3 |") or line.startswith("| 6 |")) == 2
    for st in out["stages"]:
        n = st["volumes"]
        assert st["syncs"] > 0 and st["redis_cmds_per_sync"] > 0
        assert st["drift_s"]["n"] > 0 and st["drift_s"]["p50"] >= 0
        assert st["status_all"]["rows"] == n                      # every enabled unit, once
        assert st["status_all"]["pages"] >= n // 2                # pages of two
        assert st["metrics_scrape"]["bytes"] > 0 and st["metrics_scrape"]["s"] > 0 and st["metrics_scrape"]["first_s"] > 0
        assert st["status_all"]["first_s"] > 0
        assert st["redis_a_memory_bytes"] > 0 and st["redis_a_keys"] > 0
        assert st["create_under_load_ms"]["n"] == 2
        assert st["cpu_s_per_sync"]["scheduler"] is not None and st["cpu_s_per_sync"]["worker"] > 0
        assert st["rss_peak_mib"]["scheduler"] > 0 and st["rss_peak_mib"]["worker"] > 0
    sf = out["site_failover"]
    assert sf["units"] == 6 and sf["promoted"] == 6 and sf["failed"] == 0, sf
    assert sf["primary_at_b"] == 6 and sf["not_primary"] == 0 and sf["promoted_twice"] == 0, sf
    ck = sf["checksummed"]
    assert ck["differ"] == 0 and ck["behind_acked"] == 0 and ck["same_as_a"] >= 1, sf
    assert sf["promote_ms"]["p99"] >= sf["promote_ms"]["p50"] > 0, sf
    assert any(line.startswith("site failover of 6 units") for line in lines)
    fb = out["failback"]
    assert fb["units"] == 6 and fb["ready"] == 6 and fb["failed"] == 0, fb
    assert fb["checksummed"]["same"] == fb["checksummed"]["of"] >= 1, fb
    assert fb["bytes_on_wire"] < fb["bytes_of_units"], fb      # what diverged, not the units whole
