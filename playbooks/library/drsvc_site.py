#!/usr/bin/python
"""Ansible module: take over every unit a drsvc site holds as secondary (a site failover), or
hand every unit it holds as primary to the peer's copies (a site's failback)."""
from __future__ import annotations

DOCUMENTATION = r"""
---
module: drsvc_site
short_description: Promote every unit a drsvc site holds as secondary, or demote every primary, at once
description:
  - At the surviving site of a pair, promotes every volume and group it holds as a secondary
    copy, concurrently, each with the same PromoteVolume call as M(drsvc_replication) with
    C(state=primary). A group's members go with it.
  - A unit already primary is left as it is, so the task is safe to run again after an
    interrupted run: it promotes only what is left.
  - With C(state=secondary), at the site that comes back after a site failover, demotes every
    unit it holds as primary in one call of the site's Site service (DemoteAll: a batch per
    storage node), each as M(drsvc_replication) with C(state=secondary) would, and with
    C(resync) then resyncs each with force, so the peer ships what diverged.
  - Check mode lists the units that would be promoted (demoted) and changes nothing.
requirements:
  - The target's Python must have drsvc installed (set C(ansible_python_interpreter)).
options:
  endpoint:
    description: The site's plugin socket, C(unix:///path/csi.sock) or a bare path.
    type: str
    required: true
  state:
    description: C(primary) promotes every secondary unit; C(secondary) demotes every primary unit;
      C(status) only lists the secondary units.
    type: str
    choices: [primary, secondary, status]
    default: primary
  force:
    description: Promote without the peer's demotion (the peer site is lost); the new epochs fence it.
    type: bool
    default: false
  resync:
    description: With C(state=secondary), resync each demoted unit with force (discard what diverged).
    type: bool
    default: false
  parallel:
    description: Promotes in flight at once.
    type: int
    default: 16
  wait:
    description: Seconds to keep repeating a promote that answers ABORTED (in progress).
    type: float
    default: 120
  connect_timeout:
    description: Seconds to wait for the endpoint to accept a connection before failing.
    type: float
    default: 10
  secrets:
    description: CSI secrets passed with every call (the site's RPC token). Never logged or returned.
    type: dict
author: drsvc
"""

EXAMPLES = r"""
- name: Site a is lost; take over everything at b
  drsvc_site:
    endpoint: "{{ secondary_endpoint }}"
    state: primary
    force: true
  register: takeover

- name: Site a is back; hand every unit there to b's copies
  drsvc_site:
    endpoint: "{{ primary_endpoint }}"
    state: secondary
    resync: true
"""

RETURN = r"""
units:
  description: The units held as secondary before the task (C(unit_id), C(kind), C(peer), C(generation),
    C(data_age_seconds)).
  returned: always
  type: list
promoted:
  description: How many were promoted.
  returned: unless check mode
  type: int
failed:
  description: How many promotes failed (their results say why); the task fails when any did.
  returned: unless check mode
  type: int
seconds:
  description: Wall time of the whole takeover.
  returned: unless check mode
  type: float
promote_p99_seconds:
  description: The 99th percentile of one unit's promote.
  returned: unless check mode
  type: float
demoted:
  description: C(state=secondary) - how many were demoted.
  returned: unless check mode
  type: int
results:
  description: Per unit, C(result) (promoted, demoted or failed) with C(code) and C(message) when it failed;
    C(state=secondary) - C(final_sync) and C(resync) (ready, requested or failed).
  returned: unless check mode
  type: list
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.drsvc_client import IMPORT_ERROR, UNIT_ARGS, require_client

if IMPORT_ERROR is None:
    import grpc
    from drsvc_cli.client import DrClient, RpcFailed
    from drsvc_cli.site_promote import DEMOTE_COLUMNS, hand_back, take_over


def failback(module, c) -> dict:
    """state=secondary: one DemoteAll (resync as asked); check mode lists the primaries."""
    p = module.params
    try:
        out = hand_back(c, resync=p["resync"], dry_run=module.check_mode, wait=p["wait"])
    except RpcFailed as e:
        module.fail_json(msg=f"demoting the units at {p['endpoint']}: {e.code.name}: {e.message}", code=e.code.name)
    if module.check_mode:
        return {"changed": bool(out["plan"]), "units": out["plan"]}
    out.pop("failed_units")
    units = [{k: r[k] for k in DEMOTE_COLUMNS} for r in out["results"]]
    return {**out, "changed": bool(out["demoted"] or out["resync_requested"]), "units": units}


def run(module) -> dict:
    p = module.params
    with DrClient(p["endpoint"], secrets=p["secrets"] or {}) as c:
        try:
            grpc.channel_ready_future(c.channel).result(timeout=p["connect_timeout"])
        except grpc.FutureTimeoutError:
            module.fail_json(msg=f"endpoint {p['endpoint']} is unreachable (no answer in {p['connect_timeout']}s)",
                             code="UNAVAILABLE")
        if p["state"] == "secondary":
            return failback(module, c)
        listing = p["state"] == "status" or module.check_mode
        try:
            out = take_over(c, force=p["force"], dry_run=listing, wait=p["wait"], parallel=p["parallel"])
        except RpcFailed as e:
            module.fail_json(msg=f"{'listing' if listing else 'promoting'} the units at {p['endpoint']}: "
                                 f"{e.code.name}: {e.message}", code=e.code.name)
        if listing:
            return {"changed": bool(out["plan"]) and p["state"] == "primary", "units": out["plan"]}
    units = [{k: r[k] for k in ("unit_id", "kind", "peer", "generation", "data_age_seconds")} for r in out["results"]]
    return {**out, "changed": out["promoted"] > 0, "units": units}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            {k: v for k, v in UNIT_ARGS.items() if k not in ("volume_id", "group_id")},
            state=dict(type="str", choices=["primary", "secondary", "status"], default="primary"),
            force=dict(type="bool", default=False),
            resync=dict(type="bool", default=False),
            parallel=dict(type="int", default=16),
        ),
        supports_check_mode=True,
    )
    require_client(module)
    result = run(module)
    if result.get("failed"):
        bad = [r for r in result["results"] if r["result"] == "failed" or r.get("resync") == "failed"]
        what = "demotes" if module.params["state"] == "secondary" else "promotes"
        module.fail_json(msg=f"{len(bad)} of {len(result['units'])} {what} failed "
                             f"(first: {bad[0]['unit_id']}: {bad[0].get('code')}: {bad[0].get('message')}); "
                             "run the playbook again to retry them", **{k: v for k, v in result.items() if k != "failed"},
                         failed_units=result["failed"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
