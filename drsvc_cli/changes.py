"""What a state-changing command did, as a sentence: `site a: vol-… promoted; primary at epoch 2
(was secondary)`, `site a: vol-… is already primary (epoch 2); nothing changed`.

"changed" is judged from the unit's durable state read through the Admin API just before and
just after the call: role, epoch, generation, peer and interval. Those records are what the
operator cares about, and every caller reads the same ones, so the answer is true whatever else
runs at the same time. Operations on one unit are serialised by the plugin's in-flight claim (a
different concurrent operation answers ABORTED, which the CLI waits out), so between the two
reads only the same operation can have run: when another caller's identical promote landed in
between, the state moved, and "promoted" is what happened to the unit."""
from __future__ import annotations

from . import humanize as H


def state(st: dict | None) -> tuple | None:
    if st is None:
        return None
    return st["role"], st["epoch"], st["peer"], st["interval_seconds"]


def name(unit: dict) -> str:
    return unit.get("volume_id") or unit.get("group_id")


def enable_line(site: str, u: str, before, after) -> tuple[bool, str]:
    every = f"to {after['peer']} every {H.duration(after['interval_seconds'])}"
    if after["role"] == "secondary":
        return False, (f"site {site}: {u} is a secondary here (it replicates from {after['peer']}); "
                       "nothing changed")
    if before is None:
        return True, f"site {site}: replication of {u} enabled {every}; the initial sync is queued"
    if state(before) == state(after):
        return False, f"site {site}: {u} already replicates {every}; nothing changed"
    return True, (f"site {site}: replication of {u} now {every} (was to {before['peer']} every "
                  f"{H.duration(before['interval_seconds'])})")


def disable_line(site: str, u: str, before) -> tuple[bool, str]:
    if before is None:
        return False, f"site {site}: replication of {u} is not enabled here; nothing changed"
    if before["role"] == "primary":
        return True, (f"site {site}: replication of {u} to {before['peer']} ended; the copy at "
                      f"{before['peer']} stays as a standalone volume (or a secondary until that site disables)")
    return True, f"site {site}: replication of {u} from {before['peer']} ended; this copy stays as a standalone volume"


def role_line(site: str, u: str, verb: str, role: str, before, after) -> tuple[bool, str]:
    """promote / demote: what moved, or that nothing did."""
    if state(before) == state(after) and before["role"] == role:
        return False, f"site {site}: {u} is already {role} (epoch {after['epoch']}); nothing changed"
    was = f" (was {before['role']}" + (f", epoch {before['epoch']})" if before["epoch"] != after["epoch"] else ")")
    line = f"site {site}: {u} {verb}; {after['role']} at epoch {after['epoch']}{was}"
    if verb == "demoted" and after["status_message"]:
        line += f"; {after['status_message']}"
    return True, line


def resync_line(site: str, u: str, ready: bool, before, force: bool) -> tuple[bool, str]:
    was_ready = before is not None and before["status"] == "HEALTHY"
    if ready and was_ready:
        return False, (f"site {site}: {u} is consistent with the primary (generation {before['generation']}); "
                       "nothing changed")
    if ready:
        return True, f"site {site}: {u} resynced; consistent with the primary again"
    if force:
        return True, (f"site {site}: {u} resync requested; the primary's next sync overwrites the blocks that "
                      "differ (not consistent yet)")
    return False, (f"site {site}: {u} is not consistent with the primary; nothing changed (it keeps its own "
                   "writes: --force discards them)")


def sync_line(site: str, u: str, r: dict) -> tuple[bool, str]:
    return True, (f"site {site}: {u} synced, generation {r['base_generation']} -> {r['target_generation']}: "
                  f"{H.size(r['bytes_changed'])} changed, {H.size(r['bytes_on_wire'])} on the wire in "
                  f"{H.duration(r['duration_seconds'])}")
