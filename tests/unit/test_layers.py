"""Layers point one way: the core imports no edge library, and only named modules
start processes or speak SSH."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EDGE_LIBS = {"grpc", "celery", "kombu", "redis", "prometheus_client", "flower", "rich"}
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
# Known circles outside the engine, to be removed. This list must shrink to
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


# -- size ------------------------------------------------------------------------------------------
SIZE_ROOTS = ("drsvc", "csi_plugin", "workers", "drsvc_cli", "drsvc_lab", "bench", "playbooks", "scripts")
MAX_FUNCTION_LINES = 60


def _long_functions(paths, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} is {lines} lines")
    return out


def test_no_function_over_60_lines_outside_tests():
    """A function longer than a screen does several jobs; split it into named steps."""
    paths = [p for root in SIZE_ROOTS for p in _py(root) if "gen" not in p.relative_to(ROOT).parts]
    assert len(paths) > 100
    long = _long_functions(paths)
    assert not long, "\n".join(long)


def test_the_size_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    f = tmp_path / "m.py"
    f.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert [s.split()[1] for s in _long_functions([f])] == ["long"]
    finally:
        ROOT = saved


# -- the engine's rooms ----------------------------------------------------------------------------
# Each room of drsvc/replication and the rooms it may import (docs/design/README.md, "Room map").
ENGINE = "drsvc.replication"
ROOMS = {
    "common": set(),
    "wire": {"common"},
    "points": {"common"},
    "sender": {"common", "wire"},
    "receiver": {"common", "wire", "points"},
    "control": {"common", "wire", "points", "sender", "receiver"},
}
# Outside the engine, code imports the engine's public surface only: the engine package and
# each room's package (its __init__ names the room's public names and loads them lazily).
PUBLIC = {ENGINE} | {f"{ENGINE}.{room}" for room in ROOMS}
# How many of those modules outside code imports: a room that outside code starts to use (or
# stops using) changes the engine's surface, and this number with it.
ENGINE_MODULES_IMPORTED_FROM_OUTSIDE = 6
OUTSIDE_ROOTS = ("drsvc", "csi_plugin", "workers", "drsvc_cli", "drsvc_lab", "bench", "playbooks")


def _room(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if mod.startswith(ENGINE + ".") else None


def _graph(roots) -> tuple[dict, dict]:
    mods = {}
    for root in roots:
        if (ROOT / root).is_dir():
            mods.update((_module_name(p), p) for p in _py(root))
    return mods, {m: _import_edges(m, p, mods) for m, p in mods.items()}


def test_every_engine_module_lives_in_a_room():
    mods, _ = _graph(("drsvc",))
    homeless = [m for m in mods if m.startswith(ENGINE + ".") and _room(m) not in ROOMS]
    assert not homeless, homeless
    assert sorted({_room(m) for m in mods if m.startswith(ENGINE + ".")}) == sorted(ROOMS)


def test_rooms_import_only_the_rooms_they_may():
    """common imports nothing of the engine, the receiver never the sender, points neither
    side, and nothing inside the engine imports the engine's own package."""
    _, graph = _graph(("drsvc",))
    bad = []
    for mod, targets in graph.items():
        room = _room(mod)
        if room is None:
            continue
        for t in targets:
            if t == ENGINE:
                bad.append(f"{mod} imports the engine package")
            elif (other := _room(t)) is not None and other != room and other not in ROOMS[room]:
                bad.append(f"{mod} ({room}) imports {t} ({other})")
    assert not bad, "\n".join(bad)


def _engine_imports_from_outside() -> dict[str, set[str]]:
    _, graph = _graph(OUTSIDE_ROOTS)
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        if mod == ENGINE or mod.startswith(ENGINE + "."):
            continue
        for t in targets:
            if t == ENGINE or t.startswith(ENGINE + "."):
                out.setdefault(t, set()).add(mod)
    return out


def test_outside_code_imports_only_the_engines_public_surface():
    used = _engine_imports_from_outside()
    inner = {t: sorted(users) for t, users in used.items() if t not in PUBLIC}
    assert not inner, f"outside code imports engine internals: {inner}"
    assert len(used) == ENGINE_MODULES_IMPORTED_FROM_OUTSIDE, sorted(used)


def test_each_rooms_public_names_resolve():
    """Every name a room's __init__ lists imports and exists (a lazy table can go stale)."""
    import importlib
    for pkg in sorted(PUBLIC):
        mod = importlib.import_module(pkg)
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{pkg}.{name}"


# -- private names ---------------------------------------------------------------------------------
PRIVATE_ROOTS = ("drsvc", "csi_plugin", "workers", "drsvc_cli", "drsvc_lab", "bench", "playbooks")


def _private_uses(path: Path, mod: str, known) -> list[str]:
    """``from ours import _x`` and ``ours._x``, where *ours* is a module of this repository."""
    tree = ast.parse(path.read_text(), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    bound: set[str] = set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if _resolve(base, known) is None:
                continue
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound.add(a.asname or a.name)
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {base}.{a.name}")
        elif isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names if _resolve(a.name, known))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    return out


def test_no_private_name_is_used_across_modules():
    mods = {}
    for root in PRIVATE_ROOTS:
        mods.update((_module_name(p), p) for p in _py(root) if "gen" not in p.relative_to(ROOT).parts)
    bad = [use for m, p in mods.items() for use in _private_uses(p, m, mods)]
    assert not bad, "\n".join(bad)


def test_the_private_name_check_sees_both_forms(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _hidden():\n    pass\n")
    (pkg / "b.py").write_text("from . import a\nfrom .a import _hidden\na._hidden()\n")
    known = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.b": pkg / "b.py"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        uses = _private_uses(pkg / "b.py", "p.b", known)
    finally:
        ROOT = saved
    assert [u.split(" ", 1)[1] for u in uses] == ["imports p.a._hidden", "uses a._hidden"]
