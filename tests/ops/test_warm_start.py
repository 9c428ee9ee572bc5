"""A process's first task, and the plugin's first call, pay no imports.

A DR site's failover Promote is usually the first task its control worker's pool process
ever runs, and the first call its plugin ever dispatches. Measured in the failover bench
(50 ms / 100 Mbit/s), a first Promote took 0.13-0.2 s against 0.03 s warm: ~0.1 s for the
modules ``tasks.jobs_for`` imports (the site, the dispatcher) and ~0.05 s for Celery's result
backend, which the plugin's first ``send_task`` loaded (an import and a scan of the installed
packages' entry points). The worker now imports what its tasks import inside functions
before its pool starts (``workers.main.preload``), and the plugin loads the backend before it
serves (``workers.client.load_result_backend``)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports_in_functions(path: Path, only=None) -> set[str]:
    """Absolute names of the modules imported inside the functions of *path* (of the
    functions named in *only*, when given)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef) or (only and fn.name not in only):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    names = [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
                else:
                    names = [node.module]
                found.update(names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
    return found


def _loaded_after_preload(role: str) -> set[str]:
    code = ("import json, sys\nfrom workers.main import preload\n"
            f"preload({role!r})\nprint(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("role", ["data", "control"])
def test_a_pool_process_has_what_its_tasks_import_before_its_first_task(role):
    """Every module that ``tasks.jobs_for`` and the replication jobs (promote, demote, sync,
    resync, disable) import inside their functions is loaded before the pool forks."""
    want = (_imports_in_functions(ROOT / "workers" / "tasks.py", only={"jobs_for"})
            | _imports_in_functions(ROOT / "drsvc" / "replication" / "control" / "jobs.py"))
    assert "drsvc.site" in want and "drsvc.replication.points.restore" in want   # the scan sees them
    assert not want - _loaded_after_preload(role)


def test_a_storage_nodes_api_worker_has_what_its_calls_import():
    want = _imports_in_functions(ROOT / "workers" / "tasks.py", only={"node_ops_for"})
    assert "drsvc.cluster" in want
    assert not want - _loaded_after_preload("api")


def test_the_plugins_dispatcher_has_its_result_backend_before_its_first_call(redis_port):
    """What ``csi_plugin.server.main`` does before it serves: the result backend's module and
    class are loaded, so the first Promote's ``send_task`` neither imports nor scans."""
    code = ("import sys\nfrom drsvc.config import SiteConfig\nfrom workers.app import make_app\n"
            "from workers.client import load_result_backend\n"
            f"cfg = SiteConfig(site='a', node_id='', pool='/nonexistent', endpoint='unix:///x', "
            f"redis_url='redis://127.0.0.1:{redis_port}/0')\n"
            "app = make_app(cfg)\nassert 'celery.backends.redis' not in sys.modules\n"
            "load_result_backend(app)\nprint('celery.backends.redis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_what_the_preload_loaded_is_frozen_before_the_pool_forks():
    """Celery collects before it forks each pool process: what the preload loaded is in the
    permanent generation by then, so that collection neither walks it nor writes to its pages."""
    code = ("import gc\nfrom workers.main import preload\n"
            "before = gc.get_freeze_count()\npreload('data')\nprint(before, gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    before, after = map(int, out.stdout.split())
    assert before == 0 and after > 10_000, (before, after)
