#!/usr/bin/python
"""Ansible module: drive one drsvc replication unit (a volume or a volume group) at one site."""
from __future__ import annotations

DOCUMENTATION = r"""
---
module: drsvc_replication
short_description: Enable, disable, promote, demote, resync or sync a drsvc replication unit
description:
  - Talks to one drsvc site's plugin socket (CSI-Addons replication and the drsvc Admin service)
    through C(drsvc_cli.client.DrClient).
  - Reads the unit's replication status first, so C(changed) is only reported when the call
    changes something, and check mode reports what would change without changing it.
  - Every mutating call is repeated while the plugin answers ABORTED (operation in progress),
    as a container orchestrator does, for up to I(wait) seconds.
  - Run it on the site's own host (or with C(connection=local) where the socket is local):
    the endpoint is a unix socket.
requirements:
  - The target's Python must have drsvc installed (set C(ansible_python_interpreter)).
options:
  endpoint:
    description: The site's plugin socket, C(unix:///path/csi.sock) or a bare path.
    type: str
    required: true
  volume_id:
    description: The volume to act on, or a unique prefix of its id (as the CLI takes). Mutually
      exclusive with I(group_id).
    type: str
  group_id:
    description: The volume group to act on, or a unique prefix of its id. Mutually exclusive with
      I(volume_id).
    type: str
  state:
    description:
      - C(enabled) replication from this site (the primary) to I(peer) every I(interval).
      - C(disabled) stops replication; the peer's copy stays as a standalone volume.
      - C(primary) promotes this site's copy. Without I(force) the peer must have demoted.
      - C(secondary) demotes this site's copy (a final sync when the peer is reachable;
        otherwise the copy is marked diverged and needs C(resynced)).
      - C(resynced) asks a demoted, diverged copy to follow the primary again; returns
        C(ready=false) until the primary's next sync overwrote the divergence. Loop with C(until).
      - C(synced) runs a sync now at the primary and waits for it.
      - C(status) only reads the status.
    type: str
    choices: [enabled, disabled, primary, secondary, resynced, synced, status]
    default: status
  force:
    description:
      - With C(state=primary), promote even though the peer is unreachable or has not
        demoted. The old primary is fenced by the new epoch.
      - With C(state=resynced), discard this copy's own writes that the primary does not hold
        (ResyncVolume force). Without it such a copy stays C(ready=false) and keeps its data.
    type: bool
    default: false
  recovery_point:
    description:
      - With C(state=primary) at a secondary, take over at this recovery point (PromoteVolume's
        C(drsvc.io/recoveryPoint)) - a generation, or an RFC 3339 time meaning the newest point
        at or before it (C(drsvc points) lists them). Its data becomes the volumes'; the newer
        points stay, pinned for a day. Ignored where the unit is primary already.
    type: str
  interval:
    description: With C(state=enabled), the scheduling interval, e.g. C(10s), C(5m), C(1h).
    type: str
  peer:
    description: With C(state=enabled), the peer site's name from the site config.
    type: str
  wait:
    description: Seconds to keep repeating a call that answers ABORTED (in progress).
    type: float
    default: 120
  connect_timeout:
    description: Seconds to wait for the endpoint to accept a connection before failing.
    type: float
    default: 10
  secrets:
    description: CSI secrets passed with every replication call. Never logged or returned.
    type: dict
author: drsvc
"""

EXAMPLES = r"""
- name: Replicate the database volume to site b every 10 s
  drsvc_replication:
    endpoint: unix:///run/drsvc/csi.sock
    volume_id: vol-0123
    state: enabled
    peer: b
    interval: 10s

- name: Planned failover, step 1 - demote the primary (final sync)
  drsvc_replication:
    endpoint: "{{ sites.a.endpoint }}"
    group_id: "{{ group_id }}"
    state: secondary

- name: Forced failover - site a is gone
  drsvc_replication:
    endpoint: "{{ sites.b.endpoint }}"
    volume_id: vol-0123
    state: primary
    force: true
  register: promoted

- name: Resync a diverged copy until it follows the primary
  drsvc_replication:
    endpoint: "{{ sites.a.endpoint }}"
    volume_id: vol-0123
    state: resynced
  register: rs
  until: rs.ready
  retries: 60
  delay: 2
"""

RETURN = r"""
unit_id:
  description: The unit acted on (the whole id, when a prefix was given).
  returned: always
  type: str
action:
  description: What was done (or, in check mode, would be done), e.g. C(promote), C(demote), C(none).
  returned: always
  type: str
enabled:
  description: Whether replication exists for the unit at this site after the task.
  returned: always
  type: bool
before:
  description: The status read before acting (null when replication was not enabled).
  returned: always
  type: dict
status:
  description: The status after acting (role, epoch, generation, peer, interval_seconds,
    last_sync_time, last_sync_bytes, status, status_message, lag_seconds, ...); null when disabled.
  returned: always
  type: dict
role:
  description: The unit's role at this site after the task.
  returned: when enabled
  type: str
epoch:
  description: The unit's epoch at this site after the task.
  returned: when enabled
  type: int
ready:
  description: With C(state=resynced), whether the copy is consistent with the primary again.
  returned: when state is resynced
  type: bool
sync:
  description: With C(state=synced), the sync's generations and byte counts.
  returned: when state is synced and not in check mode
  type: dict
"""


from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.drsvc_client import UNIT_ARGS, UNIT_EXCLUSIVE, Failed, SiteUnit, require_client


def parse_interval(text):
    """'30s', '5m', '1h30m' or a bare number -> seconds; the plugin's own parser when importable."""
    try:
        from drsvc.schedule import parse_interval as parse
        from drsvc.errors import DrsvcError
    except ImportError:
        return None          # let the plugin validate it
    try:
        return parse(text)
    except DrsvcError as e:
        raise Failed(f"interval {text!r}: {e}", code="INVALID_ARGUMENT") from e


class Unit(SiteUnit):
    def __init__(self, module):
        super().__init__(module)
        self.check = module.check_mode
        self.wait = module.params["wait"]

    def need(self, before, what):
        if before is None:
            raise Failed(f"replication is not enabled for {self.kind} {self.name} at {self.endpoint}; "
                         f"cannot {what}", code="FAILED_PRECONDITION")

    # -- one function per state: (changed, action, extra results) -------------------------------
    def enabled(self, before):
        p = self.module.params
        want_interval = parse_interval(p["interval"]) if p["interval"] else None
        if before is not None:
            differs = [k for k, want, have in (("interval", want_interval, before["interval_seconds"]),
                                                ("peer", p["peer"], before["peer"]))
                       if want is not None and want != have]
            if not differs:
                return False, "none", {}
            if before["role"] != "primary":
                # the schedule belongs to the primary; a secondary cannot re-enable it
                raise Failed(f"{self.kind} {self.name} is a secondary at {self.endpoint}; change "
                             f"{', '.join(differs)} at the primary", code="FAILED_PRECONDITION")
        params = {}
        if p["interval"]:
            params["schedulingInterval"] = p["interval"]
        if p["peer"]:
            params["peer"] = p["peer"]
        action = "enable" if before is None else "reconfigure"
        if not self.check:
            self.call("EnableVolumeReplication", parameters=params)
        return True, action, {}

    def disabled(self, before):
        if before is None:
            return False, "none", {}
        if not self.check:
            self.call("DisableVolumeReplication")
        return True, "disable", {}

    def primary(self, before):
        self.need(before, "promote")
        if before["role"] == "primary":
            return False, "none", {}
        point = self.module.params["recovery_point"]
        if not self.check:
            self.call("PromoteVolume", force=self.module.params["force"],
                      parameters={"drsvc.io/recoveryPoint": point} if point else {})
        return True, "force-promote" if self.module.params["force"] else "promote", \
            ({"recovery_point": point} if point else {})

    def secondary(self, before):
        self.need(before, "demote")
        if before["role"] == "secondary":
            return False, "none", {}
        if not self.check:
            self.call("DemoteVolume")
        return True, "demote", {}

    def resynced(self, before):
        self.need(before, "resync")
        if before["role"] != "secondary":
            raise Failed(f"{self.kind} {self.name} is primary at {self.endpoint}; only a demoted copy "
                         "resyncs (state=secondary first)", code="FAILED_PRECONDITION")
        consistent = before["status"] == "HEALTHY"
        if self.check:
            return not consistent, "none" if consistent else "resync", {"ready": consistent}
        ready = bool(self.call("ResyncVolume", force=self.module.params["force"]).ready)
        # a copy that was already consistent needed nothing; otherwise a resync was requested or finished
        return not consistent, "none" if consistent else "resync", {"ready": ready}

    def synced(self, before):
        self.need(before, "sync")
        if before["role"] != "primary":
            raise Failed(f"{self.kind} {self.name} is a secondary at {self.endpoint}; syncs run at the primary",
                         code="FAILED_PRECONDITION")
        if self.check:
            return True, "sync", {}
        out = self.retry(f"sync of {self.kind} {self.name}", lambda: self.client.sync_now(**self.sel, wait=self.wait))
        return not out["skipped"], "sync", {"sync": out}

    def status_only(self, before):
        return False, "none", {}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            UNIT_ARGS,
            state=dict(type="str", default="status",
                       choices=["enabled", "disabled", "primary", "secondary", "resynced", "synced", "status"]),
            force=dict(type="bool", default=False),
            recovery_point=dict(type="str"),
            interval=dict(type="str"),
            peer=dict(type="str"),
        ),
        mutually_exclusive=UNIT_EXCLUSIVE,
        required_one_of=UNIT_EXCLUSIVE,
        supports_check_mode=True,
    )
    require_client(module)
    state = module.params["state"]
    unit = None
    try:
        unit = Unit(module)
        before = unit.status_or_none()
        handler = {"status": unit.status_only}.get(state) or getattr(unit, state)
        changed, action, extra = handler(before)
        # in check mode nothing changed, so what is true now is still "before"
        after = before if module.check_mode or not changed else unit.status_or_none()
    except Failed as e:
        module.fail_json(msg=e.msg, code=e.code, **e.extra)
    finally:
        if unit is not None:
            unit.close()
    result = dict(changed=changed, action=action, unit_id=(after or before or {}).get("unit_id", unit.name),
                  enabled=after is not None, before=before, status=after, **extra)
    if after is not None:
        result.update(role=after["role"], epoch=after["epoch"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
