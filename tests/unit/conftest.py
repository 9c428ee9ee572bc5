"""tests/unit holds pure tests only (no root, no lab, no process): all of it is in the
fast tier (`pytest -m fast`; tests/conftest.py fails a fast test that reaches for more)."""
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.fast)
