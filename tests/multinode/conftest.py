"""A multi-node site with one storage node's plugin running beside its controller: what a CO
sees of the site (the controller's endpoint for Controller calls, n1's for Node calls)."""
from __future__ import annotations

import grpc
import pytest

from csi_plugin.gen import csi_pb2_grpc
from drsvc_lab import NodesLab
from tests.fixtures.csi import Plugin
from tests.fixtures.xfs import need


@pytest.fixture(scope="module")
def site_n1(tmp_path_factory):
    """NodesLab (n1, n2, n3: a loop XFS pool and a worker each, one Redis, the controller)
    and n1's plugin (`python -m csi_plugin --config site.toml --node n1`). Yields the lab
    with .controller_sock, .n1 (tests.fixtures.csi.Plugin) and controller/identity stubs."""
    need("losetup", "mkfs.ext4", "mkfs.xfs", "mount", "umount", "blkid", "redis-server")
    lab = NodesLab(tmp_path_factory.mktemp("n1site"), nodes=("n1", "n2", "n3"), pool_size="2G")
    n1 = ch = None
    try:
        lab.build()
        lab.up()
        lab.controller_sock = lab.root / "controller.sock"
        ch = grpc.insecure_channel(lab.endpoint)
        grpc.channel_ready_future(ch).result(timeout=30)
        lab.controller = csi_pb2_grpc.ControllerStub(ch)
        lab.identity = csi_pb2_grpc.IdentityStub(ch)
        lab.group_controller = csi_pb2_grpc.GroupControllerStub(ch)
        n1 = Plugin(pool=lab.pool("n1"), sock=lab.root / "n1.sock", log_path=lab.root / "n1-plugin.log",
                    node_id="n1", extra=["--config", str(lab.config_path), "--node", "n1"])
        n1.start()
        lab.n1 = n1
        yield lab
    finally:
        if n1 is not None:
            n1.stop()
        if ch is not None:
            ch.close()
        lab.teardown()
