"""drsvc_lab: the lab harness of drsvc, outside the product package.

The one home for loop-mounted pools, lab sshds (keys, forced-command authorized_keys,
config), lab redis-servers, two-site and multi-node labs, free ports and waits, and the
scans and kills that leave nothing behind. The demo, the tests and the bench use it;
`drsvc/` never imports it. Every process it starts goes through drsvc.runner.

    pools         loop-mounted XFS (and ext4/btrfs) filesystems; unmount_under
    sshd          keygen, receiver_command, authorized_line, sshd_config, start_sshd, pool_sshd
    redis_server  spawn_redis, spawn_sentinel
    procs         kill, kill_if, alive, children, leftovers
    net           free_port, wait_port, wait_until
    sites         Lab, LabSite: two (or more) sites of one node each
    nodes         NodesLab: sites of several storage nodes
"""
from .net import WaitTimeout, free_port, listening, wait_port, wait_until
from .nodes import NodesLab
from .pools import backing_file, detach_loops, loop_fs, loops_backing, mount_fs, mount_xfs, mounts_under, unmount_under
from .procs import alive, kill, leftovers
from .redis_server import spawn_redis, spawn_sentinel
from .sites import Lab, LabSite
from .sshd import PoolSshd, authorized_line, keygen, pool_sshd, receiver_command, start_sshd

__all__ = ["Lab", "LabSite", "NodesLab", "PoolSshd", "WaitTimeout", "alive", "authorized_line", "backing_file",
           "detach_loops", "free_port", "keygen", "kill", "leftovers", "listening", "loop_fs", "loops_backing",
           "mount_fs", "mount_xfs",
           "mounts_under", "pool_sshd", "receiver_command", "spawn_redis", "spawn_sentinel", "start_sshd", "unmount_under",
           "wait_port", "wait_until"]
