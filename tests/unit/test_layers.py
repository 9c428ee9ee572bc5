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


# -- import circles ---------------------------------------------------------------------------------
# Every module of these trees is a node; every import is an edge, at module level or inside a
# function alike (an import tucked into a function still ties the two modules together).
CIRCLE_ROOTS = ("drsvc", "csi_plugin", "workers", "drsvc_cli", "bench", "playbooks/library",
                "playbooks/module_utils")
# Circles outside the engine that other branches of issue 22 remove. This list must shrink to
# empty: a circle that is gone must leave it, and no circle may join it.
KNOWN_CIRCLES: set[frozenset] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for root in CIRCLE_ROOTS:
        if (ROOT / root).is_dir():
            out.update((_module_name(p), p) for p in _py(root))
    return out


def _resolve(name: str, known) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (an Ansible module's
    ``ansible.module_utils.X`` is playbooks/module_utils/X)."""
    if name.startswith("ansible.module_utils."):
        name = "playbooks.module_utils." + name[len("ansible.module_utils."):]
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def _import_edges(mod: str, path: Path, known) -> set[str]:
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule pkg.sub; ``from mod import name``, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in map(lambda n: _resolve(n, known), targets) if t and t != mod)
    return out


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    mods = _modules()
    graph = {m: _import_edges(m, p, mods) for m, p in mods.items()}
    found = {frozenset(c) for c in _circles(graph)}
    new = [sorted(c) for c in found - KNOWN_CIRCLES]
    gone = [sorted(c) for c in KNOWN_CIRCLES - found]
    assert not new and not gone, (
        "\n".join(f"import circle: {' <-> '.join(c)}" for c in sorted(new))
        + "".join(f"\nno longer a circle, drop it from KNOWN_CIRCLES: {c}" for c in sorted(gone)))


def test_the_circle_finder_sees_imports_inside_functions(tmp_path):
    """The finder itself: a circle closed only by an import inside a function is found,
    relative imports resolve, and a package's __init__ re-exporting a submodule is an edge."""
    pkg = tmp_path / "p"
    (pkg / "q").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "q" / "__init__.py").write_text("from .c import y\n")
    (pkg / "q" / "c.py").write_text("from .. import q\nimport os\n")
    known = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.b": pkg / "b.py",
             "p.q": pkg / "q" / "__init__.py", "p.q.c": pkg / "q" / "c.py"}
    graph = {m: _import_edges(m, p, known) for m, p in known.items()}
    assert graph["p.b"] == {"p.a"} and graph["p.q.c"] == {"p.q"}
    assert sorted(map(sorted, _circles(graph))) == [["p.a", "p.b"], ["p.q", "p.q.c"]]
