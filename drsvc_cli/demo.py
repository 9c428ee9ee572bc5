"""`drsvc demo`: two sites on this host, replication, a drill and a planned failover.

Every step goes through the real parts: gRPC to each site's plugin, Celery
workers over Redis, SSH between the sites, and the Ansible playbooks.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from drsvc import runner
from drsvc.lab import Lab

from .client import DrClient

ROOT = Path(__file__).resolve().parent.parent
PLAYBOOKS = ROOT / "playbooks"
INTERVAL = "10s"


class Steps:
    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.results: list[dict] = []
        self.console = None
        if not as_json:
            from rich.console import Console
            self.console = Console()

    def say(self, text: str) -> None:
        if self.console:
            self.console.print(text)

    def run(self, name: str, fn):
        t0 = time.monotonic()
        try:
            detail = fn()
            ok = True
        except Exception as e:  # noqa: BLE001 - the demo reports every step, then fails
            detail, ok = f"{type(e).__name__}: {e}", False
        step = {"step": name, "ok": ok, "seconds": round(time.monotonic() - t0, 2), "detail": detail}
        self.results.append(step)
        if self.console:
            mark = "[green]ok[/green]" if ok else "[red]FAILED[/red]"
            self.console.print(f"{mark} {name} ({step['seconds']}s): {detail if not isinstance(detail, dict) else ''}")
            if isinstance(detail, dict):
                for k, v in detail.items():
                    self.console.print(f"    {k}: {v}")
        if not ok:
            raise _Abort(name)
        return detail


class _Abort(Exception):
    pass


def _files_sha(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and "lost+found" not in p.parts:
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _write_files(root: Path, tag: str, n: int = 4, size: int = 2 << 20) -> None:
    for i in range(n):
        (root / f"{tag}-{i}.bin").write_bytes(os.urandom(size))
    os.sync()


def inventory(lab: Lab, path: Path, scratch: Path) -> Path:
    """The shape of playbooks/inventory.example.yml, for the lab's sites (JSON is YAML)."""
    hosts = {f"site-{n}": {"drsvc_site": n, "drsvc_endpoint": s.endpoint, "drsvc_config": str(s.config_path),
                           "ansible_connection": "local"} for n, s in lab.sites.items()}
    doc = {"all": {"vars": {"ansible_python_interpreter": sys.executable},
                   "hosts": {"localhost": {"ansible_connection": "local"}},
                   "children": {"drsvc_sites": {"vars": {"drsvc_wait": 120, "drsvc_secrets": {},
                                                         "drsvc_drill_scratch": str(scratch)},
                                                "hosts": hosts}}}}
    path.write_text(json.dumps(doc, indent=1))
    return path


def playbook(lab: Lab, name: str, extra: dict, work: Path) -> dict:
    (work / "drill").mkdir(exist_ok=True)
    inv = inventory(lab, work / "inventory.yml", work / "drill")
    env = dict(os.environ, ANSIBLE_LIBRARY=str(PLAYBOOKS / "library"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(work / "ansible-tmp"), ANSIBLE_REMOTE_TEMP=str(work / "ansible-tmp"),
               ANSIBLE_RETRY_FILES_ENABLED="0", ANSIBLE_STDOUT_CALLBACK="default")
    r = runner.run(["ansible-playbook", "-i", inv, PLAYBOOKS / name, "-e", json.dumps(extra)],
                   timeout=600, env=env)
    recap = [ln for ln in r.stdout.splitlines() if "ok=" in ln and "failed=" in ln]
    said = [ln.strip().strip('"').removeprefix('"msg": "') for ln in r.stdout.splitlines()
            if '"msg":' in ln]
    return {"playbook": name, "recap": " ".join(recap[-1].split()) if recap else "", "report": said}


def run_demo(*, keep: bool = False, as_json: bool = False, root: str | None = None) -> int:
    steps = Steps(as_json)
    work = Path(root or tempfile.mkdtemp(prefix="drsvc-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    lab = Lab(work / "sites")
    checks: dict = {}
    ids: dict = {}
    t_start = time.monotonic()
    try:
        steps.say(f"[bold]drsvc demo[/bold]: two sites under {work}")
        steps.run("build two sites (XFS pools, redis, sshd with pinned keys)", lambda: {
            n: {"pool": str(s.pool), "sshd": f"127.0.0.1:{s.sshd_port}", "redis": f"127.0.0.1:{s.redis_port}"}
            for n, s in lab.build().sites.items()})
        steps.run("start plugins, workers, schedulers, /metrics", lambda: (lab.up(), {
            n: {"socket": s.endpoint, "metrics": f"http://127.0.0.1:{s.cfg.metrics_port}/metrics"}
            for n, s in lab.sites.items()})[1])
        a = DrClient(lab.sites["a"].endpoint)
        b = DrClient(lab.sites["b"].endpoint)
        mnt = work / "mnt"

        def create():
            ids["volume"] = a.create_volume("demo-db", 256 << 20)["volume_id"]
            ids["group"] = a.create_group("demo-app")["group_id"]
            ids["members"] = [a.create_volume(f"demo-app-{i}", 128 << 20, group_id=ids["group"])["volume_id"]
                              for i in range(3)]
            return {"volume": ids["volume"], "group": ids["group"], "members": ids["members"]}
        steps.run("create a volume and a 3-volume group at site a", create)

        def write():
            sums = {}
            for vid in [ids["volume"]] + ids["members"]:
                stg, tgt = mnt / f"a-{vid}-stg", mnt / f"a-{vid}"
                stg.mkdir(parents=True, exist_ok=True)
                a.mount(vid, str(stg), str(tgt))
                _write_files(tgt, "v1")
                sums[vid] = _files_sha(tgt)
                a.unmount(vid, str(stg), str(tgt))
            checks["a"] = sums
            return {vid: f"{len(s)} files" for vid, s in sums.items()}
        steps.run("stage, publish and write data at site a", write)

        def enable():
            a.until_done(lambda: a.replication("EnableVolumeReplication", volume_id=ids["volume"],
                                               parameters={"schedulingInterval": INTERVAL}), wait=60)
            a.until_done(lambda: a.replication("EnableVolumeReplication", group_id=ids["group"],
                                               parameters={"schedulingInterval": INTERVAL}), wait=60)
            return {"interval": INTERVAL}
        steps.run(f"enable replication every {INTERVAL}", enable)

        def watch():
            seen = {}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for key, unit in (("volume", {"volume_id": ids["volume"]}), ("group", {"group_id": ids["group"]})):
                    st = a.status(**unit)
                    if st["generation"] >= 2:
                        seen[key] = {"generation": st["generation"], "last_sync_bytes": st["last_sync_bytes"],
                                     "last_sync_duration_s": round(st["last_sync_duration"], 3),
                                     "health": st["status"]}
                if len(seen) == 2:
                    return seen
                time.sleep(1)
            raise TimeoutError(f"scheduled syncs did not land in 60s: {seen}")
        steps.run("watch scheduled syncs land (initial + scheduled)", watch)

        steps.run("drill at site b (playbooks/drill.yml)", lambda: playbook(
            lab, "drill.yml", {"primary_site": "a", "secondary_site": "b", "group_id": ids["group"]}, work))
        steps.run("planned failover of the group and the volume (playbooks/planned-failover.yml)", lambda: [
            playbook(lab, "planned-failover.yml", {"primary_site": "a", "secondary_site": "b", **unit}, work)
            for unit in ({"group_id": ids["group"]}, {"volume_id": ids["volume"]})])

        def verify():
            sums = {}
            for vid in [ids["volume"]] + ids["members"]:
                stg, tgt = mnt / f"b-{vid}-stg", mnt / f"b-{vid}"
                stg.mkdir(parents=True, exist_ok=True)
                b.mount(vid, str(stg), str(tgt))
                sums[vid] = _files_sha(tgt)
                b.unmount(vid, str(stg), str(tgt))
            checks["b"] = sums
            bad = [vid for vid in sums if sums[vid] != checks["a"][vid]]
            if bad:
                raise AssertionError(f"checksums differ at site b for {bad}")
            roles = {"a": a.status(group_id=ids["group"])["role"], "b": b.status(group_id=ids["group"])["role"]}
            return {"volumes compared": len(sums), "files compared": sum(len(s) for s in sums.values()),
                    "roles": roles}
        steps.run("verify checksums at site b (now primary)", verify)
        ok = True
    except _Abort:
        ok = False
    finally:
        if not keep:
            lab.teardown()
    summary = {"ok": ok and all(s["ok"] for s in steps.results), "seconds": round(time.monotonic() - t_start, 1),
               "steps": steps.results, "checksums": checks, "ids": ids, "kept": keep,
               "sites": {n: str(s.config_path) for n, s in lab.sites.items()} if keep else {},
               "down": f"drsvc demo down --root {shlex.quote(str(work))}" if keep else None}
    if as_json:
        print(json.dumps(summary, sort_keys=True, default=str))
    else:
        steps.console.print()
        rows = [{"step": s["step"], "result": "ok" if s["ok"] else "FAILED", "seconds": s["seconds"]}
                for s in steps.results]
        from rich.table import Table
        t = Table(title=f"drsvc demo: {'PASSED' if summary['ok'] else 'FAILED'} in {summary['seconds']}s")
        for c in ("step", "result", "seconds"):
            t.add_column(c)
        for r in rows:
            t.add_row(r["step"], r["result"], str(r["seconds"]))
        steps.console.print(t)
        if keep:
            steps.console.print("sites left running; configs: " + ", ".join(summary["sites"].values()))
            steps.console.print(f"remove them with: [bold]{summary['down']}[/bold]")
    return 0 if summary["ok"] else 1


def demo_down(root, *, as_json: bool = False) -> int:
    """Remove what `drsvc demo --keep` left under *root*: each site's plugin, worker, scheduler
    and /metrics, its redis-server and sshd, the pools' mounts and loop devices, and the files."""
    from drsvc.lab import _unmount_under, leftovers
    work = Path(root).resolve()
    if not work.exists():
        print(json.dumps({"ok": True, "root": str(work), "removed": False}) if as_json else f"nothing at {work}")
        return 0
    lab = Lab.find(work / "sites")
    if lab is not None:
        lab.teardown()
    _unmount_under(work)
    left = leftovers(work)
    if not any(left.values()):
        shutil.rmtree(work, ignore_errors=True)
    ok = not any(left.values())
    if as_json:
        print(json.dumps({"ok": ok, "root": str(work), "removed": ok, "left": left}, sort_keys=True))
    else:
        print(f"removed the demo under {work}" if ok else f"could not remove everything under {work}: {left}")
    return 0 if ok else 1
