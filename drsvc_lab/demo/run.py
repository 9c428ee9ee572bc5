"""`drsvc demo`: two sites on this host, a database-like workload replicated by block
deltas (with rsync's cost for the same changes), a drill and a planned failover.

Every step goes through the real parts: gRPC to each site's plugin, Celery
workers over Redis, SSH between the sites, and the Ansible playbooks. Results are
kept as plain data (`--json`); ``view`` prints them for people.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from drsvc import runner, store
from drsvc.layout import PoolLayout
from drsvc_lab import Lab

from drsvc_cli import humanize as H
from drsvc_cli.client import DrClient

from . import view as demo_view
from .workload import DbFiles, RsyncMirror

ROOT = Path(__file__).resolve().parents[2]      # the checkout: playbooks/ beside drsvc_lab/
PLAYBOOKS = ROOT / "playbooks"
MiB, GiB = 1 << 20, 1 << 30
VOLUME_SIZE = 1 * GiB          # every volume; sparse, so only written blocks cost anything
INTERVAL = "10s"               # the group's schedule: scheduled syncs land while the demo runs
DB_INTERVAL = "5m"             # the database volume's; the demo syncs it on demand after each burst
DB_PAGES = 128 * MiB           # the database's page file
# (label, bytes appended to the write-ahead log, 8 KiB pages rewritten at random)
ROUNDS = (("commits", 4 * MiB, 512), ("commits", 4 * MiB, 512), ("checkpoint", 1 * MiB, 2048))


class Steps:
    """Runs the demo's steps, keeps each result as plain data, and prints it for people."""

    def __init__(self, as_json: bool):
        self.results: list[dict] = []
        self.console = None if as_json else demo_view.make_console()

    def say(self, renderable) -> None:
        if self.console:
            self.console.print(renderable)

    def run(self, name: str, fn, show=None):
        from rich.markup import escape
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
            self.console.print(f"{mark} {escape(name)} ({step['seconds']:.1f}s)")
            if not ok:
                self.console.print(f"    {escape(str(detail))}")
            elif show is not None:
                self.console.print(show(detail))
            elif isinstance(detail, dict) and detail:
                self.console.print(demo_view.pairs(detail, self.console.width))
        if not ok:
            raise _Abort(name)
        return detail


class _Abort(Exception):
    pass


def _files_sha(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and "lost+found" not in p.parts:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(4 << 20):
                    h.update(chunk)
            out[str(p.relative_to(root))] = h.hexdigest()
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


_MSG = re.compile(r'^\s*"msg":\s*(".*")\s*$')


def playbook(lab: Lab, name: str, extra: dict, work: Path) -> dict:
    """Run one playbook against the lab; its recap line and what its tasks said (`msg`)."""
    (work / "drill").mkdir(exist_ok=True)
    inv = inventory(lab, work / "inventory.yml", work / "drill")
    env = dict(os.environ, ANSIBLE_LIBRARY=str(PLAYBOOKS / "library"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(work / "ansible-tmp"), ANSIBLE_REMOTE_TEMP=str(work / "ansible-tmp"),
               ANSIBLE_RETRY_FILES_ENABLED="0", ANSIBLE_STDOUT_CALLBACK="default")
    r = runner.run(["ansible-playbook", "-i", inv, PLAYBOOKS / name, "-e", json.dumps(extra)],
                   timeout=600, env=env)
    recap = [ln for ln in r.stdout.splitlines() if "ok=" in ln and "failed=" in ln]
    said = [json.loads(m.group(1)) for ln in r.stdout.splitlines() if (m := _MSG.match(ln))]
    return {"playbook": name, "recap": " ".join(recap[-1].split()[2:]) if recap else "", "said": said}


def cli(*args) -> dict:
    """One `drsvc` runbook command, as an operator would type it; what it said (it says what
    changed, and where)."""
    r = runner.run([sys.executable, "-m", "drsvc_cli.main", *args], timeout=300,
                   env=dict(os.environ, COLUMNS="200"))
    return {"line": " ".join(r.stdout.split())}


def _wait(what: str, fn, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := fn():
            return got
        time.sleep(0.5)
    raise TimeoutError(f"{what} not within {timeout:.0f}s")


def _database_syncs(a: DrClient, volume_id: str, db: DbFiles, mirror: RsyncMirror | None) -> list[dict]:
    """Load the database, then a few bursts of writes; after each, one sync (sync-now --wait),
    and rsync's cost for the same change of the image.

    The volume keeps its schedule, so a scheduled sync may land during a burst and carry part
    of it (sync-now then waits for it, and runs its own). Each row is therefore read from the
    unit's counters around the burst: it covers every sync since the row before."""
    out = []
    bursts = [(f"load: {H.size(DB_PAGES)} of pages", db.create)] + [
        (f"{label}: +{H.size(log)} log, {pages} pages", lambda log=log, pages=pages: db.round(log_bytes=log,
                                                                                                pages=pages))
        for label, log, pages in ROUNDS]
    before = a.status(volume_id=volume_id)
    for label, write in bursts:
        wrote = write()
        r = a.until_done(lambda: a.sync_now(volume_id=volume_id, wait=240), wait=120)
        if r["skipped"]:
            raise RuntimeError(f"sync skipped: {r['skipped']}")
        after = a.status(volume_id=volume_id)
        out.append({"label": label, "app_bytes": wrote, "generation": r["target_generation"],
                    "syncs": after["syncs_total"] - before["syncs_total"],
                    "bytes_changed": after["changed_bytes_total"] - before["changed_bytes_total"],
                    "bytes_on_wire": after["sent_bytes_total"] - before["sent_bytes_total"],
                    "seconds": round(r["duration_seconds"], 3),
                    "rsync": mirror.measure() if mirror else None})
        before = after
    return out


class Demo:
    """The demo's steps over one lab, each a method that returns what it shows."""

    def __init__(self, steps: Steps, work: Path):
        self.steps, self.work = steps, work
        self.lab = Lab(work / "sites")
        self.checks: dict = {"a": {}}
        self.ids: dict = {}
        self.syncs: list = []
        self.mnt = work / "mnt"
        self.a = self.b = None

    def run(self) -> None:
        run = self.steps.run
        run("build two sites (XFS pools, redis, sshd with pinned keys)", lambda: {
            f"site {n}": f"pool {s.pool}, sshd 127.0.0.1:{s.sshd_port}, redis 127.0.0.1:{s.redis_port}"
            for n, s in self.lab.build().sites.items()})
        run("start plugins, workers, schedulers, /metrics", self.start)
        run("create a database volume and a 3-volume group at site a", self.create)
        run("stage, publish and write at site a", self.write)
        run("enable replication to site b", self.enable)
        run("a database at site a: write, then sync (sync-now --wait), and rsync for the same change",
            self.database, show=lambda rows: demo_view.sync_table(rows, rsync=any(r["rsync"] for r in rows)))
        self.steps.say(demo_view.SYNC_NOTE)
        run("stop the database at site a (a planned failover needs no writers)", self.stop_database)
        run(f"check the group's scheduled syncs (every {INTERVAL}) at site a", self.watch)
        run("drill at site b (playbooks/drill.yml)", lambda: playbook(
            self.lab, "drill.yml", {"primary_site": "a", "secondary_site": "b", "group_id": self.ids["group"]},
            self.work), show=lambda d: demo_view.pairs({"recap": d["recap"], "result": "\n".join(d["said"])},
                                                       self.steps.console.width))
        run("planned failover: the group with playbooks/planned-failover.yml, the volume with the CLI",
            self.failover)
        run("verify checksums at site b (now primary)", self.verify)

    def start(self) -> dict:
        self.lab.up()
        self.a = DrClient(self.lab.sites["a"].endpoint, timeout=300)
        self.b = DrClient(self.lab.sites["b"].endpoint, timeout=300)
        return {f"site {n}": f"{s.endpoint}, http://127.0.0.1:{s.cfg.metrics_port}/metrics"
                for n, s in self.lab.sites.items()}

    def create(self) -> dict:
        a, ids = self.a, self.ids
        ids["volume"] = a.create_volume("demo-db", VOLUME_SIZE)["volume_id"]
        ids["group"] = a.create_group("demo-app")["group_id"]
        ids["members"] = [a.create_volume(f"demo-app-{i}", VOLUME_SIZE, group_id=ids["group"])["volume_id"]
                          for i in range(3)]
        return {"database volume": f"{ids['volume']} ({H.size(VOLUME_SIZE)})",
                "group": ids["group"], "members": f"{', '.join(ids['members'])} ({H.size(VOLUME_SIZE)} each)"}

    def write(self) -> dict:
        said = {}
        for vid in self.ids["members"]:
            stg, tgt = self.mnt / f"a-{vid}-stg", self.mnt / f"a-{vid}"
            stg.mkdir(parents=True, exist_ok=True)
            self.a.mount(vid, str(stg), str(tgt))
            _write_files(tgt, "v1")
            self.checks["a"][vid] = _files_sha(tgt)
            self.a.unmount(vid, str(stg), str(tgt))
            said[vid] = f"{len(self.checks['a'][vid])} files of 2.0 MiB written, unpublished"
        stg, tgt = self.mnt / "a-db-stg", self.mnt / "a-db"
        stg.mkdir(parents=True, exist_ok=True)
        self.a.mount(self.ids["volume"], str(stg), str(tgt))
        self.ids["db_mount"] = str(tgt)
        said[self.ids["volume"]] = f"staged and published at {tgt} (the database runs here)"
        return said

    def enable(self) -> dict:
        a, ids = self.a, self.ids
        a.until_done(lambda: a.replication("EnableVolumeReplication", volume_id=ids["volume"],
                                           parameters={"schedulingInterval": DB_INTERVAL}), wait=60)
        a.until_done(lambda: a.replication("EnableVolumeReplication", group_id=ids["group"],
                                           parameters={"schedulingInterval": INTERVAL}), wait=60)
        st = _wait("the database volume's initial sync",
                   lambda: (s := a.status(volume_id=ids["volume"]))["generation"] >= 1 and s, 120)
        return {"group": f"every {INTERVAL}",
                "database volume": f"every {DB_INTERVAL}; initial sync of the empty ext4: "
                                   f"{H.size(st['last_sync_bytes'])} on the wire in "
                                   f"{H.duration(st['last_sync_duration'])}"}

    def database(self) -> list:
        pool = self.lab.sites["a"].pool
        mirror = RsyncMirror(PoolLayout(pool).image(self.ids["volume"]), pool.parent / "demo-rsync")
        if mirror.available():
            mirror.start()
        else:
            mirror = None
        self.syncs.extend(_database_syncs(self.a, self.ids["volume"],
                                          DbFiles(Path(self.ids["db_mount"]), pages_bytes=DB_PAGES), mirror))
        return self.syncs

    def stop_database(self) -> dict:
        vid, tgt = self.ids["volume"], Path(self.ids["db_mount"])
        self.checks["a"][vid] = _files_sha(tgt)
        self.a.unmount(vid, str(self.mnt / "a-db-stg"), str(tgt))
        return {vid: f"{len(self.checks['a'][vid])} files checksummed, unpublished"}

    def watch(self) -> dict:
        st = _wait("a scheduled sync of the group",
                   lambda: (s := self.a.status(group_id=self.ids["group"]))["generation"] >= 2 and s, 60)
        return {"unit": st["unit_id"], "generation": st["generation"], "health": st["status"],
                "last sync": f"{H.size(st['last_sync_bytes'])} on the wire in {H.duration(st['last_sync_duration'])}"}

    def failover(self) -> dict:
        ids, a, b = self.ids, self.a, self.b
        run = playbook(self.lab, "planned-failover.yml", {"primary_site": "a", "secondary_site": "b",
                                                          "group_id": ids["group"]}, self.work)
        out = {"group (Ansible)": " / ".join(run["said"]) or run["recap"]}
        # the volume through the runbook CLI, as the README's planned failover reads
        vid = ids["volume"]
        said = [cli(verb, "--config", self.lab.sites[site].config_path, "--volume", vid)
                for site, verb in (("a", "demote"), ("b", "promote"))]
        sa, sb = a.status(volume_id=vid), b.status(volume_id=vid)
        out["volume (CLI)"] = (f"drsvc demote --config a.toml --volume {vid}; drsvc promote --config b.toml "
                               f"--volume {vid}\n" + "\n".join(d.get("line", "") for d in said) +
                               f"\nvolume {vid}: b is {sb['role']} at epoch {sb['epoch']} ({sb['status']}), "
                               f"a is {sa['role']}")
        for unit in ({"group_id": ids["group"]}, {"volume_id": vid}):
            st = b.status(**unit)
            if st["role"] != "primary" or st["status"] != "HEALTHY":
                raise AssertionError(f"after the failover, b reports {st['role']} {st['status']}: "
                                     f"{st['status_message']}")
        return out

    def verify(self) -> dict:
        sums = {}
        for vid in [self.ids["volume"]] + self.ids["members"]:
            stg, tgt = self.mnt / f"b-{vid}-stg", self.mnt / f"b-{vid}"
            stg.mkdir(parents=True, exist_ok=True)
            self.b.mount(vid, str(stg), str(tgt))
            sums[vid] = _files_sha(tgt)
            self.b.unmount(vid, str(stg), str(tgt))
        self.checks["b"] = sums
        bad = [vid for vid in sums if sums[vid] != self.checks["a"][vid]]
        if bad:
            raise AssertionError(f"checksums differ at site b for {bad}")
        return {"volumes compared": len(sums), "files compared": sum(len(s) for s in sums.values()),
                "roles now": f"a {self.a.status(group_id=self.ids['group'])['role']}, "
                             f"b {self.b.status(group_id=self.ids['group'])['role']}"}

    def next_commands(self) -> dict:
        """Ready to paste, for sites left running (`--keep`): after the failover b is primary."""
        cfg = {n: shlex.quote(str(s.config_path)) for n, s in self.lab.sites.items()}
        inv = shlex.quote(str(self.work / "inventory.yml"))
        unit = f"-e group_id={self.ids['group']}" if self.ids.get("group") else ""
        return {
            "status": f"drsvc status --config {cfg['a']}; drsvc status --config {cfg['b']}",
            "drill": (f"ANSIBLE_LIBRARY={shlex.quote(str(PLAYBOOKS / 'library'))} ansible-playbook -i {inv} "
                      f"{shlex.quote(str(PLAYBOOKS / 'drill.yml'))} -e primary_site=b -e secondary_site=a {unit}"),
            "flower": f"FLOWER_UNAUTHENTICATED_API=true drsvc flower --config {cfg['b']} --port 5555",
            "metrics": " ".join(f"curl -s http://127.0.0.1:{s.cfg.metrics_port}/metrics"
                                for s in self.lab.sites.values() if s.config_path) or "-",
            "logs": f"drsvc site status --config {cfg['a']}",
            "teardown": f"drsvc demo down --root {shlex.quote(str(self.work))}",
        }

    def summary(self, ok: bool, seconds: float, keep: bool) -> dict:
        lab = self.lab
        return {"ok": ok and all(s["ok"] for s in self.steps.results), "seconds": round(seconds, 1),
                "steps": self.steps.results, "checksums": self.checks, "ids": self.ids, "syncs": self.syncs,
                "kept": keep,
                "sites": {n: {"config": str(s.config_path), "redis_pid": s.redis_pid, "redis_port": s.redis_port,
                              "sshd_pid": s.sshd_pid, "sshd_port": s.sshd_port}
                          for n, s in lab.sites.items()} if keep else {},
                "next": self.next_commands() if keep else {},
                "down": f"drsvc demo down --root {shlex.quote(str(self.work))}" if keep else None}


def run_demo(*, keep: bool = False, as_json: bool = False, root: str | None = None) -> int:
    steps = Steps(as_json)
    work = Path(root or tempfile.mkdtemp(prefix="drsvc-demo-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    demo = Demo(steps, work)
    t_start = time.monotonic()
    ok = False
    try:
        steps.say(f"drsvc demo: two sites under {work}")
        demo.run()
        ok = True
    except _Abort:
        pass
    finally:
        if not keep:
            demo.lab.teardown()
    summary = demo.summary(ok, time.monotonic() - t_start, keep)
    if keep:    # beside the kept sites, for scripts that read what the human output showed
        store.atomic_write_bytes(work / "demo.json", json.dumps(summary, sort_keys=True, default=str).encode(),
                                 durable=False)
    if as_json:
        print(json.dumps(summary, sort_keys=True, default=str))
    else:
        steps.console.print()
        steps.console.print(demo_view.summary_title(summary))
        steps.console.print(demo_view.summary_table(summary))
        if keep:
            steps.console.print(demo_view.next_steps(summary["next"]))
    return 0 if summary["ok"] else 1


def demo_down(root, *, as_json: bool = False) -> int:
    """Remove what `drsvc demo --keep` left under *root*: each site's plugin, worker, scheduler
    and /metrics, its redis-server and sshd, the pools' mounts and loop devices, and the files."""
    from drsvc_lab import leftovers, unmount_under
    work = Path(root).resolve()
    if not work.exists():
        print(json.dumps({"ok": True, "root": str(work), "removed": False}) if as_json else f"nothing at {work}")
        return 0
    lab = Lab.find(work / "sites")
    if lab is not None:
        lab.teardown()
    unmount_under(work)
    left = leftovers(work)
    if not any(left.values()):
        shutil.rmtree(work, ignore_errors=True)
    ok = not any(left.values())
    if as_json:
        print(json.dumps({"ok": ok, "root": str(work), "removed": ok, "left": left}, sort_keys=True))
    else:
        print(f"removed the demo under {work}" if ok else f"could not remove everything under {work}: {left}")
    return 0 if ok else 1
