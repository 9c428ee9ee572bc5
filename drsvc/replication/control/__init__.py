"""The site's control plane of replication: requests in the plugin, jobs in the worker.

- ``api``: what the rest of drsvc calls: the Replication RPCs by (kind, id)
  (``ReplicationAPI``) and one site's requests and jobs built whole (``build``);
- ``requests``: the plugin's side: validate, claim the unit, dispatch (``enablement``: the
  rules of EnableVolumeReplication);
- ``jobs``: the worker's side, the bodies of the drsvc.<op> tasks;
- ``relationship``: this site's side of a relationship, as a durable record (control.json);
- ``read_model``: which units replicate here, their role and health, from durable records;
- ``health``: a secondary's health from its receive records; the scheduler's next runs;
- ``peers``: a [peers.<name>] table -> a transport.Peer;
- ``takeover``: a promote: the received images become the acked base;
- ``consistency``: a replica's content judged against the primary's (ResyncVolume);
- ``scrub``: a verify of the replica held here, in windows, against the receiver's block maps
  and the primary's (``scrub_plan``: its pure parts; ``verify_record``: verify.json and what
  the status makes of it);
- ``shipped_snapshots``: the CSI snapshots a primary ships as recovery points.

May import every room.
"""
from __future__ import annotations

from ..common.exports import lazy_exports

_EXPORTS = {
    "ReplicationAPI": "api", "Replication": "api", "build": "api",
    "KNOWN_PARAMETERS": "requests", "PROMOTE_ALL_WAIT_S": "requests",
    "ReplicationStatus": "read_model", "Info": "read_model", "Unit": "read_model",
    "list_schedules": "read_model", "schedule_of": "read_model", "list_verify_schedules": "read_model",
    "verify_schedule_of": "read_model",
    "is_enabled": "read_model",
    "find_control": "relationship", "Control": "relationship", "save_control": "relationship",
    "next_sync": "health", "next_runs": "health", "write_next_runs": "health",
    "connect": "peers", "seed_base": "takeover",
    "JOB_MODULES": "jobs", "plan_windows": "scrub_plan", "VERIFY_WINDOW_BYTES": "scrub_plan:WINDOW_BYTES",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
