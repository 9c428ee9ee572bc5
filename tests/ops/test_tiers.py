"""The fast tier's guard (tests/tiers.py) fails a fast test that asks for a lab fixture or
starts a process, and lets a pure one pass."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_guard_fails_what_is_not_fast(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_tier="""
        import subprocess
        import pytest

        pytestmark = pytest.mark.fast

        @pytest.fixture
        def lab():
            return "a lab"

        def test_uses_a_lab(lab):
            pass

        def test_starts_a_process():
            subprocess.run(["true"], check=True)

        def test_pure():
            assert sorted([2, 1]) == [1, 2]
    """)
    r = pytester.runpytest_subprocess("-p", "tests.tiers", "-m", "fast", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=1, failed=1, errors=1)
    out = r.stdout.str()
    assert "test_uses_a_lab is marked fast but uses lab" in out, out
    assert "test_starts_a_process is marked fast but starts a process" in out, out
