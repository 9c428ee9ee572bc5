"""The fault suite's running count, printed as one line at the end of the run.

Registered from tests/conftest.py (pytest_plugins), so the line appears however
the fault tests were selected (-m faults, a path, -k ...). Under pytest-xdist each
worker sends its counts to the controller, which prints their sum.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import pytest


@dataclass
class Tally:
    faults: int = 0      # kills, cuts, restarts, outages injected
    verified: int = 0    # replica checksums compared against a complete generation
    torn: int = 0        # a replica equal to no complete generation of the primary
    lost: int = 0        # an acknowledged generation missing from the replica
    maps_exact: int = 0  # replicas whose kept block maps were checked against their images
    maps_wrong: int = 0  # block maps claiming to describe a replica they do not

    def line(self) -> str:
        return (f"faults injected: {self.faults}, replicas verified: {self.verified}, "
                f"torn: {self.torn}, lost: {self.lost}, "
                f"block maps checked: {self.maps_exact}, wrong: {self.maps_wrong}")


TALLY = Tally()
FUZZ_CASES: dict = {}    # "service/method" -> cases run, printed after the run
_ran = {"faults": False}


def fault(n: int = 1) -> None:
    TALLY.faults += n


def pytest_runtest_setup(item):
    if item.get_closest_marker("faults") or item.get_closest_marker("soak"):
        _ran["faults"] = True


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)       # an xdist worker: report to the controller
    if out is not None:
        out["drsvc_tally"] = {"tally": asdict(TALLY), "fuzz": dict(FUZZ_CASES), "faults_ran": _ran["faults"]}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    got = getattr(node, "workeroutput", {}).get("drsvc_tally")
    if not got:
        return
    for f in fields(Tally):
        setattr(TALLY, f.name, getattr(TALLY, f.name) + got["tally"][f.name])
    for k, v in got["fuzz"].items():
        FUZZ_CASES[k] = FUZZ_CASES.get(k, 0) + v
    _ran["faults"] = _ran["faults"] or got["faults_ran"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if FUZZ_CASES:
        terminalreporter.write_line(f"fuzz cases per method ({sum(FUZZ_CASES.values())} in all): " + ", ".join(
            f"{k} {v}" for k, v in sorted(FUZZ_CASES.items())))
    if _ran["faults"]:
        terminalreporter.write_line(TALLY.line())
