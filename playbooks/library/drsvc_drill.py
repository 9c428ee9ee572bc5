#!/usr/bin/python
"""Ansible module: a DR drill at a secondary site, on clones of the latest replicated generation."""
from __future__ import annotations

DOCUMENTATION = r"""
---
module: drsvc_drill
short_description: Verify a drsvc replica by mounting clones of its latest replicated generation
description:
  - At a site holding the secondary copy of a unit, clones the latest replicated generation
    (every member of a group at the same generation) with the Admin service's CloneReplica,
    stages and publishes each clone read-write under a scratch directory on this host, runs a
    verification command, then unpublishes, unstages and deletes the clones - always, also when
    the verification fails.
  - The replica itself is never staged, published or written, and replication is not paused:
    scheduled syncs keep landing during the drill.
  - Without I(verify_command) the check is a C(sha256sum) of every regular file on each clone
    (C(lost+found) excluded); with I(expected_sha256) those checksums must match.
  - The drill leaves nothing behind, so it reports C(changed=false). Check mode only reads the
    unit's status.
requirements:
  - The target's Python must have drsvc installed (set C(ansible_python_interpreter)).
  - Root on the site's host (stage and publish mount loop devices).
options:
  endpoint:
    description: The secondary site's plugin socket, C(unix:///path/csi.sock) or a bare path.
    type: str
    required: true
  volume_id:
    description: The replicated volume, or a unique prefix of its id (as the CLI takes). Mutually
      exclusive with I(group_id).
    type: str
  group_id:
    description: The replicated volume group, or a unique prefix of its id. Mutually exclusive with
      I(volume_id).
    type: str
  recovery_point:
    description:
      - Drill this recovery point instead of the latest replicated generation - a generation, or
        an RFC 3339 time meaning the newest point at or before it (C(drsvc points) lists them).
    type: str
  verify_command:
    description:
      - A probe as an argv list (never a shell string). The clones' mount paths are appended as
        arguments, in member order. It passes when it exits 0.
      - When omitted, a sha256sum of every file on each clone.
    type: list
    elements: str
  expected_sha256:
    description:
      - For the default verification, the checksums the files must have. Keys are paths relative
        to the volume's root; for a group, C(<source volume id>/<relative path>). Files not named
        here are reported but do not fail the drill.
    type: dict
  require_pass:
    description: Fail the task when the verification fails (the clones are cleaned up either way).
    type: bool
    default: true
  scratch_dir:
    description: Where the clones are staged and published. A fresh directory under it is used and
      removed afterwards. Defaults to the system temporary directory.
    type: path
  prefix:
    description: Name prefix of the clone volumes. Defaults to C(drill-<time>-<random>).
    type: str
  fs_type:
    description: The clones' filesystem type.
    type: str
    default: ext4
  wait:
    description: Seconds to keep repeating a call that answers ABORTED (in progress).
    type: float
    default: 120
  connect_timeout:
    description: Seconds to wait for the endpoint to accept a connection before failing.
    type: float
    default: 10
  secrets:
    description: CSI secrets passed with the node and controller calls. Never logged or returned.
    type: dict
author: drsvc
"""

EXAMPLES = r"""
- name: Checksum every file of the latest replicated generation of the app group at site b
  drsvc_drill:
    endpoint: "{{ sites.b.endpoint }}"
    group_id: "{{ group_id }}"
  register: drill

- name: Run the application's own consistency probe against the clone
  drsvc_drill:
    endpoint: unix:///run/drsvc/csi.sock
    volume_id: vol-0123
    verify_command: [/usr/local/bin/pg-verify, --quiet]
"""

RETURN = r"""
unit_id:
  description: The unit drilled.
  returned: always
  type: str
generation:
  description: The replicated generation the clones were taken at (the recovery point's, with I(recovery_point)).
  returned: always
  type: int
passed:
  description: Whether the verification passed.
  returned: unless check mode
  type: bool
clones:
  description: For each member, C(source) volume id, C(clone) volume id and the C(mount) path used.
  returned: unless check mode
  type: list
rc:
  description: The probe's exit status (the worst of the per-clone sha256sum runs by default).
  returned: unless check mode
  type: int
stdout:
  description: The probe's output (truncated to 64 KiB).
  returned: unless check mode
  type: str
stderr:
  description: The probe's error output (truncated to 64 KiB).
  returned: unless check mode
  type: str
checksums:
  description: With the default verification, path -> sha256 of every file on the clones.
  returned: with the default verification
  type: dict
mismatches:
  description: With I(expected_sha256), the paths whose checksum differs or that are missing.
  returned: with the default verification
  type: list
error:
  description: Why the drill stopped before its verification ran (a clone could not be mounted).
  returned: when that happened
  type: str
cleaned_up:
  description: Whether every clone was unpublished, unstaged and deleted.
  returned: unless check mode
  type: bool
"""

import os
import shutil
import secrets as _random
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule

# The probe forks sha256sum (or the user's command) while a gRPC channel is open. With gRPC's
# fork support on, its at-fork handlers restart the event engine in the child, which then
# trips over the descriptors the spawn closes: seen as SIGABRT (rc -6) or a probe with no
# output. The child only execs, so it needs none of that. Set before grpc is imported.
# Upstream: grpc/grpc#43055 (EBADF after subprocess.Popen since grpcio 1.81; workaround as #13873).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from ansible.module_utils.drsvc_client import UNIT_ARGS, UNIT_EXCLUSIVE, Failed, SiteUnit, require_client

LIMIT = 64 << 10
CHUNK = 256          # files per sha256sum run: stays far below ARG_MAX


def files_under(root):
    """Regular files below *root*, relative, sorted; lost+found is the filesystem's, not the app's."""
    out = []
    for d, dirs, names in os.walk(root):
        if d == root and "lost+found" in dirs:
            dirs.remove("lost+found")
        dirs.sort()
        for n in names:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(os.path.relpath(p, root))
    return sorted(out)


def parse_sha256sum(text):
    sums = {}
    for line in text.splitlines():
        if not line:
            continue
        escaped = line.startswith("\\")      # sha256sum escapes names holding \ or newline
        digest, _, name = line.lstrip("\\").partition("  ")
        if escaped:
            name = name.replace("\\n", "\n").replace("\\\\", "\\")
        sums[name] = digest
    return sums


class Drill(SiteUnit):
    """The unit (a whole id or a unique prefix) at the secondary site, and its drill."""

    # -- verification -------------------------------------------------------------------------
    def probe(self, mounts, sources):
        cmd = self.p["verify_command"]
        if cmd:
            rc, out, err = self.module.run_command(list(cmd) + mounts)
            return {"rc": rc, "stdout": out[-LIMIT:], "stderr": err[-LIMIT:], "passed": rc == 0}
        group = "group_id" in self.sel
        rc, outs, errs, sums = 0, [], [], {}
        for mnt, src in zip(mounts, sources, strict=True):
            names = files_under(mnt)
            for i in range(0, len(names), CHUNK):
                # cwd at the mount: the listing names files relative to the volume's root
                r, out, err = self.module.run_command(["sha256sum", "--"] + names[i:i + CHUNK], cwd=mnt)
                rc = max(rc, r)
                outs.append(out)
                errs.append(err)
                for name, digest in parse_sha256sum(out).items():
                    sums[f"{src}/{name}" if group else name] = digest
        expected = self.p["expected_sha256"] or {}
        mismatches = sorted(k for k, v in expected.items() if sums.get(k) != str(v).lower())
        return {"rc": rc, "stdout": "".join(outs)[-LIMIT:], "stderr": "".join(errs)[-LIMIT:],
                "checksums": sums, "mismatches": mismatches, "passed": rc == 0 and not mismatches}

    def run(self):
        before = self.status()
        if before["role"] != "secondary":
            raise Failed(f"{self.kind} {self.name} is {before['role']} at {self.endpoint}; a drill runs at "
                         "the site holding the secondary copy", code="FAILED_PRECONDITION")
        cmd = self.p["verify_command"]
        probe = cmd[0] if cmd else "sha256sum"
        if not shutil.which(probe):
            # found out before cloning: nothing to clean up
            raise Failed(f"verification command {probe!r} is not an executable on this host", code="NOT_FOUND")
        if self.module.check_mode:
            return {"changed": False, "unit_id": before["unit_id"], "generation": before["generation"],
                    "msg": "check mode: would clone, mount and verify the latest replicated generation"}
        prefix = self.p["prefix"] or f"drill-{int(time.time())}-{_random.token_hex(3)}"
        scratch = tempfile.mkdtemp(prefix="drsvc-drill-", dir=self.p["scratch_dir"])
        cloned = self.retry(f"CloneReplica of {self.kind} {self.name}",
                            lambda: self.client.clone_replica(prefix, point=self.p["recovery_point"] or "",
                                                              **self.sel))
        # CloneReplica answers in member order, as status lists the members
        sources = before["members"] or [self.name]
        clones = [{"source": src, "clone": v["volume_id"],
                   "staging": os.path.join(scratch, v["volume_id"], "staging"),
                   "mount": os.path.join(scratch, v["volume_id"], "mount")}
                  for src, v in zip(sources, cloned["volumes"], strict=True)]
        result = {"changed": False, "unit_id": before["unit_id"], "generation": cloned["generation"],
                  "passed": False, "rc": None, "stdout": "", "stderr": ""}
        staged = []
        try:
            for c in clones:
                staged.append(c)        # before mounting: a half-done stage is undone too
                self.retry(f"mounting clone {c['clone']}", lambda c=c: self.client.mount(
                    c["clone"], c["staging"], c["mount"], fs_type=self.p["fs_type"]))
            result.update(self.probe([c["mount"] for c in clones], [c["source"] for c in clones]))
        except Failed as e:
            result["error"] = e.msg
        finally:
            problems = self.cleanup(staged, [c["clone"] for c in clones], scratch)
        result["clones"] = [{k: c[k] for k in ("source", "clone", "mount")} for c in clones]
        result["cleaned_up"] = not problems
        if problems:
            raise Failed("drill clean-up left things behind: " + "; ".join(problems), code="INTERNAL",
                         **{k: v for k, v in result.items() if k != "changed"})
        return result

    def cleanup(self, staged, clone_ids, scratch):
        problems = []
        for c in reversed(staged):
            try:
                self.retry(f"unmounting clone {c['clone']}",
                           lambda c=c: self.client.unmount(c["clone"], c["staging"], c["mount"]))
            except Failed as e:
                problems.append(e.msg)
        unmounted = not problems
        for vid in clone_ids:
            if not unmounted:
                problems.append(f"clone {vid} kept: it may still be mounted")
                continue
            try:
                self.retry(f"deleting clone {vid}", lambda vid=vid: self.client.delete_volume(vid))
            except Failed as e:
                problems.append(e.msg)
        if unmounted:
            # rmdir only, bottom-up: never a recursive delete over what might be a mount
            for d, _, _ in sorted(os.walk(scratch), key=lambda w: len(w[0]), reverse=True):
                try:
                    os.rmdir(d)
                except OSError as e:
                    problems.append(f"scratch directory {d}: {e.strerror}")
        return problems


def main():
    module = AnsibleModule(
        argument_spec=dict(
            UNIT_ARGS,
            recovery_point=dict(type="str"),
            verify_command=dict(type="list", elements="str"),
            expected_sha256=dict(type="dict"),
            # a flag, not a secret (its name only looks like one to Ansible's no_log check)
            require_pass=dict(type="bool", default=True, no_log=False),
            scratch_dir=dict(type="path"),
            prefix=dict(type="str"),
            fs_type=dict(type="str", default="ext4"),
        ),
        mutually_exclusive=UNIT_EXCLUSIVE + [("verify_command", "expected_sha256")],
        required_one_of=UNIT_EXCLUSIVE,
        supports_check_mode=True,
    )
    require_client(module)
    drill = None
    try:
        drill = Drill(module)
        result = drill.run()
    except Failed as e:
        module.fail_json(msg=e.msg, code=e.code, **e.extra)
    finally:
        if drill is not None:
            drill.close()
    if "passed" in result and not result["passed"] and module.params["require_pass"]:
        why = result.get("error") or f"rc={result['rc']}" + (
            f", mismatched: {', '.join(result['mismatches'])}" if result.get("mismatches") else "")
        module.fail_json(msg=f"drill of {result['unit_id']} at generation {result['generation']} failed "
                             f"verification ({why}); the clones were cleaned up", **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
