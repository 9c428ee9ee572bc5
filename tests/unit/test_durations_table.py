"""tests/durations.json orders the modules handed to the xdist workers (longest first,
tests/conftest.py). A module renamed or removed since the table was written would only
lose its place; this keeps the table naming the modules that exist."""
import json
import types
from pathlib import Path

import pytest

from tests.conftest import module_seconds

pytestmark = pytest.mark.fast
ROOT = Path(__file__).resolve().parents[2]


def test_the_table_names_existing_modules_longest_first():
    table = module_seconds()
    assert len(table) >= 50, "tests/durations.json is missing or nearly empty"
    assert [m for m in table if not (ROOT / m).is_file()] == []
    assert list(table.values()) == sorted(table.values(), reverse=True)


def test_the_script_sums_a_junit_report_by_module(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite>'
                      '<testcase classname="tests.faults.test_x" name="a" time="2.5"/>'
                      '<testcase classname="tests.faults.test_x.TestY" name="b" time="1.5"/>'
                      '<testcase classname="tests.unit.test_z" name="c" time="0.25"/>'
                      '</testsuite></testsuites>')
    table = tmp_path / "durations.json"
    table.write_text(json.dumps({"tests/unit/test_old.py": 3.0}))
    script = types.ModuleType("test_durations_script")
    script.__file__ = str(ROOT / "scripts" / "test-durations")
    exec(compile((ROOT / "scripts" / "test-durations").read_text(), "test-durations", "exec"), script.__dict__)
    script.OUT = table
    script.main([str(report)])
    assert json.loads(table.read_text()) == {"tests/faults/test_x.py": 4.0, "tests/unit/test_old.py": 3.0,
                                             "tests/unit/test_z.py": 0.2}
    assert list(json.loads(table.read_text())) == ["tests/faults/test_x.py", "tests/unit/test_old.py",
                                                   "tests/unit/test_z.py"]     # longest first
