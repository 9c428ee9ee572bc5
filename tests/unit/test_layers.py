"""Layers point one way: the core imports no edge library, and only named modules
start processes or speak SSH."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EDGE_LIBS = {"grpc", "celery", "apscheduler", "kombu", "redis", "prometheus_client", "flower", "rich"}
EDGE_PKGS = {"csi_plugin", "workers", "drsvc_cli", "drsvc_lab"}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node.lineno


def _py(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


def test_core_imports_no_edge():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in _py("drsvc")
           for mod, line in _imports(p) if mod in EDGE_LIBS | EDGE_PKGS]
    assert not bad, "\n".join(bad)


def test_only_the_transport_imports_paramiko():
    users = {str(p.relative_to(ROOT)) for pkg in ("drsvc", "csi_plugin", "workers", "drsvc_cli")
             for p in _py(pkg) for mod, _ in _imports(p) if mod == "paramiko"}
    assert users <= {"drsvc/transport/ssh.py"}, users


_STARTERS = {("subprocess", n) for n in ("run", "Popen", "call", "check_call", "check_output", "getoutput")} | \
    {("os", n) for n in ("system", "popen", "fork", "execv", "execvp", "execve", "spawnv", "posix_spawn")}


def test_only_the_runner_starts_processes():
    users = set()
    for pkg in ("drsvc", "csi_plugin", "workers", "drsvc_cli", "drsvc_lab"):
        for p in _py(pkg):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in _STARTERS:
                    users.add(str(p.relative_to(ROOT)))
    assert users <= {"drsvc/runner.py"}, users


def test_no_shell_and_no_unpinned_host_keys():
    for pkg in ("drsvc", "csi_plugin", "workers", "drsvc_cli", "playbooks"):
        for p in _py(pkg):
            text = p.read_text()
            # spelled in pieces so a grep for them finds real uses, not this test
            for banned in ("shell" + "=True", "AutoAdd" + "Policy", "Warning" + "Policy",
                           "StrictHostKeyChecking" + "=no"):
                assert banned not in text, f"{p.relative_to(ROOT)} uses {banned}"
